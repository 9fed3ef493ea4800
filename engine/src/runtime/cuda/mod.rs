//! The CUDA backend and everything it stands on (feature `cuda`; nothing CUDA is linked at
//! build time, so the workspace builds and tests on machines without CUDA).
//!
//! - [`libs`]: finding `libcuda.so.1` and `libnvrtc.so.12` ([`LibrarySearch`] is a value, so
//!   tests point it at a directory with a missing, broken or wrong-version library).
//! - [`nvrtc`]: NVRTC at run time: version, supported architectures, compilation of a kernel
//!   file to a cubin for one exact architecture with the ptxas report.
//! - [`cubin`]: the architecture in a cubin's ELF header; the ptxas report parser.
//! - [`cache`]: cubins on disk, keyed by (source hash, architecture, NVRTC version).
//! - [`sources`]: the `.cu` files of `kernels/cuda/`, built into the binary.
//! - [`driver`]: the driver's version and devices, probed without a context.
//! - [`arch`]: the architecture matrix and why the backend targets CUDA 12.
//!
//! Why cubins and not PTX: PTX from an NVRTC newer than the driver does not load (the driver
//! JIT-compiles PTX and rejects a newer PTX ISA), while a CUDA 12 cubin loads on any driver of
//! CUDA 12.0 or later, CUDA 13 drivers included.

pub mod arch;
pub mod backend;
pub mod cache;
pub mod cubin;
pub mod driver;
mod error;
pub mod libs;
pub mod nvrtc;
pub mod report;
pub mod sources;

#[cfg(test)]
mod tests;

pub use arch::{CUDA_MAJOR, TARGET_ARCHS};
pub use backend::{CudaBackend, CudaKv, CudaMat, Dev, CUDA_TYPES};
pub use cache::{KernelCache, Origin};
pub use cubin::{cubin_arch, parse_ptxas, KernelStats};
pub use driver::{DeviceInfo, DriverInfo};
pub use error::{CudaError, LibraryError};
pub use libs::LibrarySearch;
pub use nvrtc::{Compiled, Nvrtc};
pub use report::{compile_all, compile_one, FileReport};
pub use sources::{KernelFile, FILES};
