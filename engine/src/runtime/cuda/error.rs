//! Errors of the CUDA layer: each names the root cause (which library, where it was looked
//! for, which version, which architecture) and, where there is one, the fix.

use std::path::PathBuf;

use thiserror::Error;

/// Why a CUDA library could not be used.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LibraryError {
    #[error("{soname} not found (searched: {searched}){hint}", searched = join_dirs(.searched), hint = hint_for(.soname, .other_majors))]
    NotFound {
        soname: String,
        searched: Vec<PathBuf>,
        /// Other major versions of the same library that were found (e.g. `libnvrtc.so.13`
        /// while the backend needs `libnvrtc.so.12`).
        other_majors: Vec<PathBuf>,
    },

    #[error("{path} could not be loaded: {reason}")]
    Load { path: PathBuf, reason: String },

    #[error(
        "{path} lacks the symbol {symbol}: {reason} (not a {library} library, or one too old)"
    )]
    Symbol {
        path: PathBuf,
        library: &'static str,
        symbol: &'static str,
        reason: String,
    },

    #[error("{path} is {library} {found}, but the backend targets CUDA {expected_major}: install the CUDA {expected_major} build ({fix})")]
    MajorMismatch {
        path: PathBuf,
        library: &'static str,
        found: String,
        expected_major: u32,
        fix: &'static str,
    },
}

fn join_dirs(dirs: &[PathBuf]) -> String {
    if dirs.is_empty() {
        return "no directories".into();
    }
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn hint_for(soname: &str, other: &[PathBuf]) -> String {
    let mut s = String::new();
    if !other.is_empty() {
        s.push_str(&format!(
            "; found another major version instead: {} (a library major-version mismatch)",
            join_dirs(other)
        ));
    }
    if soname.starts_with("libnvrtc") {
        s.push_str(
            ": install nvidia-cuda-nvrtc-cu12 (pip) or set PLUMBLINE_CUDA_LIB_PATH / LD_LIBRARY_PATH",
        );
    } else if soname.starts_with("libcuda") {
        s.push_str(
            ": install the NVIDIA driver (libcuda.so.1 ships with it, not with the toolkit)",
        );
    }
    s
}

/// Errors of NVRTC compilation, the kernel cache and the CUDA backend.
#[derive(Debug, Error)]
pub enum CudaError {
    #[error(transparent)]
    Library(#[from] LibraryError),

    #[error("NVRTC {major}.{minor} cannot target sm_{arch} (it supports {supported}){needs}", supported = arch_list(.supported), needs = needs_for(*.arch))]
    ArchUnsupported {
        major: u32,
        minor: u32,
        arch: u32,
        supported: Vec<u32>,
    },

    #[error("NVRTC {call} failed for {kernel}: {message}")]
    Nvrtc {
        call: &'static str,
        kernel: String,
        message: String,
    },

    #[error("compiling {kernel} for sm_{arch} failed:\n{log}")]
    Compile {
        kernel: String,
        arch: u32,
        log: String,
    },

    #[error("cubin of {kernel}: {reason}")]
    BadCubin { kernel: String, reason: String },

    #[error("kernel cache {path}: {reason}")]
    Cache { path: PathBuf, reason: String },

    #[error("CUDA driver: {0}")]
    Driver(String),

    #[error("the CUDA driver supports CUDA {driver_major}.{driver_minor}, older than the kernels' CUDA {cubin_major}.{cubin_minor}{fix}", fix = driver_fix(*.driver_major, *.cubin_major))]
    DriverTooOld {
        driver_major: u32,
        driver_minor: u32,
        cubin_major: u32,
        cubin_minor: u32,
    },

    #[error("no CUDA device (the driver reports {0} devices)")]
    NoDevice(usize),

    #[error("CUDA: {0}")]
    Unsupported(String),
}

fn arch_list(archs: &[u32]) -> String {
    archs
        .iter()
        .map(|a| format!("sm_{a}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn needs_for(arch: u32) -> String {
    match super::arch::min_nvrtc_for(arch) {
        Some((ma, mi)) => {
            format!(" (needs NVRTC >= {ma}.{mi}: pip install -U nvidia-cuda-nvrtc-cu12)")
        }
        None => String::new(),
    }
}

fn driver_fix(driver_major: u32, cubin_major: u32) -> &'static str {
    if driver_major < cubin_major {
        ": a cubin of a newer CUDA major version never loads; update the NVIDIA driver"
    } else {
        ": update the NVIDIA driver"
    }
}
