//! [`capabilities()`]: what this machine and this build of the engine can run. The
//! verification matrix reads it instead of guessing the machine.

use kernels::cpu::Isa;

/// One CUDA device the engine could run on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability as `major × 10 + minor` (90 for sm_90).
    pub arch: u32,
    pub memory_bytes: u64,
}

/// What this machine can run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// CPU instruction sets the CPU backend can use here, narrowest first.
    pub cpu_isas: Vec<Isa>,
    /// Hardware threads available to this process.
    pub cpu_threads: usize,
    /// CUDA devices the NVIDIA driver reports (empty without a driver, without a device, or
    /// in a build without the `cuda` feature). The CUDA emulator's device is never one of them.
    pub cuda_devices: Vec<CudaDevice>,
    /// Whether the engine has a CUDA backend compiled in.
    pub cuda_backend: bool,
    /// Whether tensor-parallel execution is implemented.
    pub tensor_parallel: bool,
    /// Whether speculative decoding is implemented.
    pub speculative: bool,
    /// KV cache storage types the backends support.
    pub kv_dtypes: Vec<crate::runtime::KvDtype>,
}

impl Capabilities {
    pub fn has_isa(&self, isa: Isa) -> bool {
        self.cpu_isas.contains(&isa)
    }
}

/// Detect what this machine can run: CPU feature detection, and the CUDA driver's devices
/// (probed without creating a context; no kernel is compiled).
pub fn capabilities() -> Capabilities {
    Capabilities {
        cpu_isas: Isa::available(),
        cpu_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cuda_devices: cuda_devices(),
        cuda_backend: cfg!(feature = "cuda"),
        // CPU ranks over `shm` (crate::tp); CUDA/NCCL communicators are not built yet.
        tensor_parallel: true,
        speculative: true,
        kv_dtypes: vec![crate::runtime::KvDtype::F32, crate::runtime::KvDtype::F16],
    }
}

/// The NVIDIA driver's devices through the default library search without the emulator (a set
/// `$PLUMBLINE_CUDA_EMU` must not turn the emulated device into a GPU case).
#[cfg(feature = "cuda")]
fn cuda_devices() -> Vec<CudaDevice> {
    use crate::runtime::cuda::{driver, LibrarySearch};
    let mut search = LibrarySearch::from_env();
    if let Some(emu) = std::env::var_os(crate::runtime::cuda::libs::EMULATOR_ENV) {
        let emu = std::path::PathBuf::from(emu);
        search.dirs.retain(|d| d != &emu);
    }
    match driver::probe(&search) {
        Ok(info) if !info.emulated => info
            .devices
            .unwrap_or_default()
            .into_iter()
            .map(|d| CudaDevice {
                ordinal: d.ordinal,
                name: d.name,
                arch: d.arch,
                memory_bytes: d.memory_bytes,
            })
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> Vec<CudaDevice> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_is_always_available_and_matches_the_kernels() {
        let c = capabilities();
        assert!(c.has_isa(Isa::Scalar));
        assert_eq!(c.cpu_isas, Isa::available());
        assert!(c.cpu_threads >= 1);
        assert!(c.cuda_devices.is_empty() || c.cuda_backend);
        assert_eq!(c.cuda_backend, cfg!(feature = "cuda"));
    }
}
