//! `cargo xtask cuda-emu`: builds the CUDA emulator (`kernels/cuda/emu/build.sh`: the driver API
//! on the CPU with every kernel of `kernels/cuda/*.cu` compiled by g++) into `target/cuda-emu/`,
//! where `--device cuda-emu` and the `cuda-emu` verify cases find it. Incremental: a second run
//! rebuilds only what changed. `verify` builds it itself when it runs an emulated case.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

/// Where the emulator's `libcuda.so.1` is built: `target/cuda-emu` of the workspace.
pub fn dir() -> PathBuf {
    crate::gpu_archive::workspace_root()
        .unwrap_or_else(|_| PathBuf::from("."))
        .join("target")
        .join("cuda-emu")
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
    eprintln!("cuda-emu: building the CUDA emulator in {}", out.display());
    let status = Command::new("bash")
        .arg(&script)
        .arg(&out)
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
