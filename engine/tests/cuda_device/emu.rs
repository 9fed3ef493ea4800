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
crate::suite::backend_ops_tests!(device(), model(), 2);
crate::suite::cuda_tests!(device());

/// The emulator's device-memory high-water mark (`plumblineEmuMemoryPeak`; `reset` starts a new
/// one at the bytes in use now).
fn memory_peak(reset: bool) -> usize {
    type PeakFn = unsafe extern "C" fn(i32) -> usize;
    let lib = driver::probe(&search())
        .unwrap_or_else(|e| panic!("{e}"))
        .path;
    // SAFETY: opening the emulator (already loaded by the backend) runs no new initializer.
    let lib = unsafe { libloading::Library::new(&lib) }.unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: the emulator's C signature, `size_t plumblineEmuMemoryPeak(int reset)`.
    let f =
        unsafe { lib.get::<PeakFn>(b"plumblineEmuMemoryPeak") }.unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: no pointers; the emulator locks its allocation table.
    unsafe { f(i32::from(reset)) }
}

/// Attention allocates nothing that grows with tokens × cells: 128 queries × 16 heads over 1024
/// cells would need 8 MiB of scores (a 16384-token prompt with 32 heads, 34 GB); the device
/// memory in use during the call may grow only by its inputs' metadata.
#[test]
fn attention_memory_does_not_grow_with_tokens_times_cells() {
    use engine::runtime::{AttnMeta, Backend, CellMeta, KvDtype, KvSource, Mask, QueryMeta};
    let Some(g) = device() else { return };
    let (n_tok, n_head, n_cells, d) = (128usize, 16usize, 1024usize, 8usize);
    let queries: Vec<QueryMeta> = (0..n_tok)
        .map(|i| QueryMeta {
            pos: (n_cells - n_tok + i) as u32,
            seq: 0,
        })
        .collect();
    let cells: Vec<CellMeta> = (0..n_cells)
        .map(|j| CellMeta {
            pos: j as u32,
            seq: 0,
            batch: CellMeta::COMMITTED,
        })
        .collect();
    let ok = |r: Result<(), engine::runtime::RuntimeError>| r.unwrap_or_else(|e| panic!("{e}"));
    let mut kv = g
        .kv_new(d, d, KvDtype::F16)
        .unwrap_or_else(|e| panic!("{e}"));
    ok(g.kv_reserve(&mut kv, n_cells));
    let all: Vec<u32> = (0..n_cells as u32).collect();
    let rows = g
        .upload(&vec![0.5; n_cells * d])
        .unwrap_or_else(|e| panic!("{e}"));
    ok(g.kv_write(&mut kv, &all, &rows, &rows));
    let q = g
        .upload(&vec![0.25; n_tok * n_head * d])
        .unwrap_or_else(|e| panic!("{e}"));
    let mut out = g
        .alloc(n_tok * n_head * d)
        .unwrap_or_else(|e| panic!("{e}"));
    let meta = AttnMeta {
        n_head,
        n_head_kv: 1,
        head_dim_k: d,
        head_dim_v: d,
        scale: 0.3,
        mask: Mask::CAUSAL,
        queries: &queries,
        cells: &cells,
        ancestors: &[],
        anc_words: 0,
    };
    let before = memory_peak(true);
    ok(g.attention(&q, KvSource::Cache(&kv), &meta, &mut out));
    let grown = memory_peak(false) - before;
    let scores = n_tok * n_head * n_cells * 4;
    // Positions, sequences and batch indices of the queries and cells: ~13 KiB here.
    let metadata = (2 * n_tok + 3 * n_cells) * 4;
    assert!(
        grown <= 2 * metadata,
        "attention grew device memory by {grown} bytes (scores would be {scores}, its \
         metadata is {metadata})"
    );
    let mut host = Vec::new();
    g.download(&out, &mut host)
        .unwrap_or_else(|e| panic!("{e}"));
    // Every value row is 0.5: every output is 0.5, whatever the weights.
    assert!(
        host.iter().all(|&v| (v - 0.5).abs() < 1e-6),
        "{:?}",
        &host[..8]
    );
}

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
