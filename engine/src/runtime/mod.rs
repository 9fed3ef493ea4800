//! The runtime: backends (the operations a forward pass is made of) and sessions (a sequence
//! with its KV cache).
//!
//! - [`Backend`]: matmul, RMSNorm, RoPE, attention, elementwise ops; [`CpuBackend`] implements
//!   it on `kernels::cpu` with its own rayon pool and an ISA chosen at construction. A CUDA
//!   backend will implement the same trait.
//! - [`Session`]: batched prefill and incremental decode over a [`KvCache`], logits for the last
//!   token or for all, taps on request.

mod backend;
mod cpu;
mod error;
mod kv_cache;
pub mod sampling;
mod session;

pub use backend::{AttnParams, Backend, MatRef};
pub use cpu::CpuBackend;
pub use error::RuntimeError;
pub use kv_cache::KvCache;
pub use session::{Logits, Session};
