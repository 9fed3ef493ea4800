//! `cargo xtask cuda-emu`: builds the CUDA emulator (`kernels/cuda/emu/build.sh`: the driver API
//! on the CPU with every kernel of `kernels/cuda/*.cu` compiled by g++) into `target/cuda-emu/`,
//! where `--device cuda-emu` and the `cuda-emu` verify cases find it. Incremental: a second run
//! rebuilds only what changed. `verify` builds it itself when it runs an emulated case.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// Where the emulator's `libcuda.so.1` is built: `target/cuda-emu` of the workspace, or, in a
/// fault-injection build whose active fault is planted in the kernel sources
/// ([`engine::faults::Fault::cuda_define`]), `target/faults/cuda-emu/<fault>`: an emulator
/// whose host-compiled kernels carry that fault, as the cubins NVRTC compiles for it do. The
/// clean emulator is never built with a fault.
pub fn dir() -> PathBuf {
    let target = crate::gpu_archive::workspace_root()
        .unwrap_or_else(|_| PathBuf::from("."))
        .join("target");
    match engine::faults::active_cuda_source_fault() {
        Some(f) => target.join("faults").join("cuda-emu").join(f.name()),
        None => target.join("cuda-emu"),
    }
}

/// Build (or bring up to date) the emulator; its folder.
pub fn build() -> Result<PathBuf> {
    let out = dir();
    let script = crate::gpu_archive::workspace_root()?.join("kernels/cuda/emu/build.sh");
    if !script.is_file() {
        bail!(
            "{} is missing: this checkout has no CUDA emulator",
            script.display()
        );
    }
    let mut cmd = Command::new("bash");
    cmd.arg(&script).arg(&out);
    if let Some(fault) = engine::faults::active_cuda_source_fault() {
        seed_fault_dir(&script, &out)?;
        let define = fault.cuda_define().unwrap_or_default();
        // The entry point the engine adds to the fault's NVRTC program (a fault cubin on a
        // clean emulator, or the reverse, fails to load instead of running the wrong code).
        let marker = out.join("fault_marker.cu");
        let source = engine::runtime::cuda::sources::fault_marker_source(fault);
        if std::fs::read_to_string(&marker).ok().as_deref() != Some(source.as_str()) {
            std::fs::write(&marker, source)
                .with_context(|| format!("writing {}", marker.display()))?;
        }
        cmd.arg(format!("--define={define}")).arg(&marker);
        eprintln!(
            "cuda-emu: building the CUDA emulator with fault {fault} ({define}) in {}",
            out.display()
        );
    } else {
        eprintln!("cuda-emu: building the CUDA emulator in {}", out.display());
    }
    let status = cmd
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!(
            "{} {} failed with {status} (it needs g++)",
            script.display(),
            out.display()
        );
    }
    let lib = out.join("libcuda.so.1");
    if !lib.is_file() {
        bail!("the emulator build finished without {}", lib.display());
    }
    Ok(out)
}

/// A fault's emulator folder starts as a copy of the clean one (built first if needed, and
/// copied with its timestamps), so that only the kernels whose sources mention the fault's
/// symbol are compiled again.
fn seed_fault_dir(script: &std::path::Path, out: &std::path::Path) -> Result<()> {
    if out.join("obj").is_dir() {
        return Ok(());
    }
    let clean = crate::gpu_archive::workspace_root()?
        .join("target")
        .join("cuda-emu");
    let status = Command::new("bash")
        .arg(script)
        .arg(&clean)
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("building the clean emulator in {} failed", clean.display());
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let status = Command::new("cp")
        .arg("-a")
        .arg(clean.join("obj"))
        .arg(clean.join("gen"))
        .arg(out)
        .status()
        .context("running cp -a")?;
    if !status.success() {
        bail!("copying {} to {}", clean.display(), out.display());
    }
    Ok(())
}

/// Why the emulated cases cannot run here (`None`: they can): the build failed, or NVRTC (which
/// still compiles every kernel, as for a GPU) is missing.
pub fn missing() -> Option<String> {
    let nvrtc =
        engine::runtime::cuda::Nvrtc::load(&engine::runtime::cuda::LibrarySearch::from_env());
    if let Err(e) = nvrtc {
        return Some(format!("no NVRTC for the emulated CUDA backend: {e}"));
    }
    match build() {
        Ok(_) => None,
        Err(e) => Some(format!("the CUDA emulator could not be built: {e:#}")),
    }
}

pub fn run() -> Result<()> {
    let out = build()?;
    println!("{}", out.join("libcuda.so.1").display());
    Ok(())
}
