//! `cargo xtask gpu-archive [--out DIR] [--no-cubins]`: everything a GPU runner with no Rust
//! toolchain needs to run the GPU tests (the `gpu` modules) and write JUnit:
//!
//! - `plumbline-gpu-tests.tar.zst`: a nextest archive of the engine's test binary (built with
//!   the `cuda` feature; the kernel sources are compiled into it);
//! - `cargo-nextest`: the nextest binary that runs the archive;
//! - `nextest.toml`: the workspace's nextest configuration (the `gpu` profile: GPU tests only,
//!   one at a time, JUnit);
//! - `kernel-cache/`: the cubins of every kernel file for every target architecture, keyed as
//!   the engine's cache keys them, so a runner without NVRTC loads them as they are;
//! - `kernels/cuda/`: the kernel sources, for reading;
//! - `run.sh`: the one command to run there (`./run.sh`; JUnit lands in `./junit.xml`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use engine::runtime::cuda::{self, KernelCache, LibrarySearch, Nvrtc};

#[derive(clap::Args)]
pub struct Args {
    /// Output directory
    #[arg(long, default_value = "target/gpu-archive")]
    out: PathBuf,
    /// Do not prebuild the cubins (the runner then needs NVRTC)
    #[arg(long)]
    no_cubins: bool,
}

const RUN_SH: &str = r#"#!/bin/sh
# Run plumbline's GPU tests from this directory on a machine with an NVIDIA GPU and driver (no
# Rust needed). Every test fails when no device can be opened. The real-model test reads
# $PLUMBLINE_MODELS/gemma-3-270m-q4_k_m.gguf (default ~/.cache/plumbline/models).
# Extra arguments go to nextest (e.g. a filter: ./run.sh -E 'test(attention)').
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
export PLUMBLINE_KERNEL_CACHE="${PLUMBLINE_KERNEL_CACHE:-$here/kernel-cache}"
mkdir -p "$here/extracted"
rc=0
"$here/cargo-nextest" nextest run \
  --archive-file "$here/plumbline-gpu-tests.tar.zst" \
  --extract-to "$here/extracted" --extract-overwrite \
  --workspace-remap "$here" \
  --config-file "$here/nextest.toml" \
  --profile gpu "$@" || rc=$?
cp "$here/target/nextest/gpu/junit.xml" "$here/junit.xml" 2>/dev/null || true
exit $rc
"#;

pub fn run(args: Args) -> Result<()> {
    let root = workspace_root()?;
    let out = if args.out.is_absolute() {
        args.out.clone()
    } else {
        root.join(&args.out)
    };
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("clearing {}", out.display()))?;
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;

    eprintln!("building the nextest archive of the engine tests (feature cuda)");
    let archive = out.join("plumbline-gpu-tests.tar.zst");
    let status = Command::new("cargo")
        .current_dir(&root)
        .args([
            "nextest",
            "archive",
            "-p",
            "engine",
            "--test",
            "cuda_device",
            "--features",
            "cuda",
            "--archive-file",
        ])
        .arg(&archive)
        .status()
        .context("running cargo nextest archive (cargo install cargo-nextest)")?;
    if !status.success() {
        bail!("cargo nextest archive failed ({status})");
    }

    let nextest = which("cargo-nextest").context("finding the cargo-nextest binary on PATH")?;
    copy(&nextest, &out.join("cargo-nextest"))?;
    copy(
        &root.join(".config/nextest.toml"),
        &out.join("nextest.toml"),
    )?;
    let src_dir = out.join("kernels/cuda");
    std::fs::create_dir_all(&src_dir)?;
    for e in std::fs::read_dir(root.join("kernels/cuda")).context("reading kernels/cuda")? {
        let p = e?.path();
        if let Some(name) = p.file_name() {
            copy(&p, &src_dir.join(name))?;
        }
    }
    // nextest's --workspace-remap wants a workspace root (a Cargo.toml) and the package folder
    // the tests run in; the tests read nothing from either (the kernel sources are compiled in).
    std::fs::write(out.join("Cargo.toml"), "[workspace]\n")
        .context("writing the placeholder Cargo.toml")?;
    std::fs::create_dir_all(out.join("engine")).context("creating engine/")?;
    let run_sh = out.join("run.sh");
    std::fs::write(&run_sh, RUN_SH).with_context(|| format!("writing {}", run_sh.display()))?;
    set_executable(&run_sh)?;
    set_executable(&out.join("cargo-nextest"))?;

    if !args.no_cubins {
        let nvrtc = Nvrtc::load(&LibrarySearch::from_env())
            .context("loading NVRTC to prebuild the cubins (pip install nvidia-cuda-nvrtc-cu12, or pass --no-cubins)")?;
        let cache = KernelCache::new(out.join("kernel-cache"));
        for arch in cuda::TARGET_ARCHS {
            for f in &cuda::FILES {
                cache
                    .get(&nvrtc, f, arch)
                    .with_context(|| format!("compiling {} for sm_{arch}", f.name))?;
            }
        }
        eprintln!(
            "prebuilt {} cubins (NVRTC {}.{})",
            cuda::TARGET_ARCHS.len() * cuda::FILES.len(),
            nvrtc.version().0,
            nvrtc.version().1
        );
    }
    let size: u64 = walk(&out)?
        .iter()
        .filter_map(|p| p.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "{} ({:.1} MiB): copy it to the GPU runner and run ./run.sh there",
        out.display(),
        size as f64 / (1 << 20) as f64
    );
    Ok(())
}

pub fn workspace_root() -> Result<PathBuf> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent()
        .map(Path::to_path_buf)
        .context("the xtask crate has no parent directory")
}

fn which(bin: &str) -> Result<PathBuf> {
    let path = std::env::var_os("PATH").context("PATH is not set")?;
    std::env::split_paths(&path)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
        .with_context(|| format!("{bin} is not on PATH"))
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn set_executable(p: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut perm = std::fs::metadata(p)
        .with_context(|| format!("reading {}", p.display()))?
        .permissions();
    perm.set_mode(0o755);
    std::fs::set_permissions(p, perm).with_context(|| format!("chmod {}", p.display()))
}

fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            out.extend(walk(&p)?);
        } else {
            out.push(p);
        }
    }
    Ok(out)
}
