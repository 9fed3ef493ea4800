//! Compiling every kernel file for a set of architectures and collecting the ptxas report:
//! what `cargo xtask kernels` prints and what `plumbline doctor` repeats for the local device.

use std::time::Instant;

use super::cache::check_cubin;
use super::cubin::{parse_ptxas, KernelStats};
use super::error::CudaError;
use super::nvrtc::Nvrtc;
use super::sources::KernelFile;

/// One kernel file compiled for one architecture.
#[derive(Debug)]
pub struct FileReport {
    pub file: &'static str,
    pub arch: u32,
    /// Each entry point's registers, spills and shared memory; or the compile error.
    pub result: Result<Vec<KernelStats>, CudaError>,
    pub cubin_bytes: usize,
    pub seconds: f64,
}

impl FileReport {
    /// Entry points that spill registers to local memory.
    pub fn spills(&self) -> Vec<&KernelStats> {
        match &self.result {
            Ok(k) => k
                .iter()
                .filter(|s| s.spill_stores > 0 || s.spill_loads > 0)
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// Compile every file in `files` for every arch in `archs` on `threads` threads (NVRTC
/// programs are independent, so they compile in parallel), checking each cubin's ELF header
/// names the requested architecture. Results come back in (file, arch) order.
pub fn compile_all(
    nvrtc: &Nvrtc,
    files: &[KernelFile],
    archs: &[u32],
    threads: usize,
) -> Vec<FileReport> {
    let jobs: Vec<(KernelFile, u32)> = files
        .iter()
        .flat_map(|f| archs.iter().map(move |&a| (*f, a)))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::with_capacity(jobs.len()));
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&(file, arch)) = jobs.get(i) else {
                    break;
                };
                let r = compile_one(nvrtc, &file, arch);
                if let Ok(mut v) = results.lock() {
                    v.push((i, r));
                }
            });
        }
    });
    let mut v = results.into_inner().unwrap_or_default();
    v.sort_by_key(|(i, _)| *i);
    v.into_iter().map(|(_, r)| r).collect()
}

/// One file for one architecture.
pub fn compile_one(nvrtc: &Nvrtc, file: &KernelFile, arch: u32) -> FileReport {
    let t = Instant::now();
    let mut cubin_bytes = 0;
    let result = nvrtc
        .compile(file.name, &file.program(), arch)
        .and_then(|c| {
            check_cubin(file.name, &c.cubin, arch)?;
            cubin_bytes = c.cubin.len();
            let stats = parse_ptxas(&c.log);
            if stats.is_empty() {
                return Err(CudaError::BadCubin {
                    kernel: file.name.to_string(),
                    reason: "the ptxas report lists no entry point".into(),
                });
            }
            Ok(stats)
        });
    FileReport {
        file: file.name,
        arch,
        result,
        cubin_bytes,
        seconds: t.elapsed().as_secs_f64(),
    }
}
