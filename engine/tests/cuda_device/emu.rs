//! The device suite ([`crate::suite`]) on the CUDA emulator (kernels/cuda/emu): the backend
//! unchanged — NVRTC compiles every kernel to a real sm_90 cubin, cudarc loads it and launches
//! by name — with the driver being the emulator's `libcuda.so.1`, found through
//! [`LibrarySearch::emulator`]. Runs on every machine with g++; without the NVRTC wheel each test
//! prints "skipped: …" and returns, as the NVRTC tests do.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use engine::model::Model;
use engine::runtime::cuda::{driver, CudaBackend, KernelCache, LibrarySearch, Nvrtc};

/// Builds the emulator (incremental; once per process) into `<target>/tmp/cuda-emu`, the
/// folder the kernels crate's emulator tests use too.
fn emulator_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-emu");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels/cuda/emu/build.sh");
        let o = std::process::Command::new("bash")
            .arg(&script)
            .arg(&out)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        assert!(
            o.status.success(),
            "{} {} failed:\n{}",
            script.display(),
            out.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        out
    })
    .clone()
}

/// The emulator built here, or the one `$PLUMBLINE_CUDA_EMU` names (e.g. an AddressSanitizer
/// build: `build.sh DIR --asan`, with the test binary run under `LD_PRELOAD=libasan.so`).
fn search() -> LibrarySearch {
    match std::env::var_os(engine::runtime::cuda::libs::EMULATOR_ENV).filter(|v| !v.is_empty()) {
        Some(dir) => LibrarySearch::emulator(PathBuf::from(dir)),
        None => LibrarySearch::emulator(emulator_dir()),
    }
}

fn device() -> Option<CudaBackend> {
    let search = search();
    if let Err(e) = Nvrtc::load(&search) {
        println!("skipped: NVRTC not installed (pip install nvidia-cuda-nvrtc-cu12): {e}");
        return None;
    }
    Some(
        CudaBackend::new(0, &search, &KernelCache::new(KernelCache::default_dir()))
            .unwrap_or_else(|e| panic!("the CUDA backend on the emulator: {e}")),
    )
}

fn model() -> Option<Model> {
    let path = crate::suite::real_model_path();
    if !path.is_file() {
        println!(
            "skipped: {} is not there (cargo xtask fetch-model)",
            path.display()
        );
        return None;
    }
    Some(Model::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

// Two decode steps of the real model: each costs a few seconds on the emulator (the 262144-row
// output head dominates).
crate::suite::suite_tests!(device(), model(), 2);

#[test]
fn the_driver_probe_names_the_emulator() {
    let info = driver::probe(&search()).unwrap_or_else(|e| panic!("{e}"));
    let devices = info.devices.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(devices.len(), 1);
    assert!(
        devices[0].name.contains("plumbline CUDA emulator"),
        "{:?}",
        devices[0]
    );
    assert_eq!(devices[0].arch, 90);
    assert_eq!(info.version, 12090);
    assert!(
        info.path.ends_with("libcuda.so.1"),
        "{}",
        info.path.display()
    );
}
