//! The runtime: backends (the operations a forward pass is made of, on tensors they own), the
//! engine (a model prepared on a backend), batches, the KV cache and sessions.
//!
//! - [`Backend`]: buffers, prepared weights and cache layers are the backend's associated
//!   types; every op (matmul, grouped expert matmul, routing, gather, norms, RoPE at per-token
//!   positions, attention under a [`Mask`], copies) is fallible. [`CpuBackend`] implements it
//!   on `kernels::cpu` with its own rayon pool and an ISA chosen at construction.
//! - [`Engine`]: a model whose weights were prepared once on a backend;
//!   [`Engine::forward`] runs a [`Batch`] (several sequences at their own positions, chains or
//!   draft trees) against a [`KvCache`].
//! - [`KvCache`]: cells tagged with sequence and position; pending cells of a forward are
//!   committed, rolled back or compacted (tree speculation keeps the accepted path).
//! - [`BatchEngine`]: the batching loop's view of an engine, whole or tensor-parallel.
//! - [`Session`]: one sequence with its own cache (prefill, decode, logits for the last token
//!   or for all, taps on request).

mod backend;
mod batch;
mod counters;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod kv_cache;
mod logits;
pub mod params;
pub mod sampling;
mod shared;

pub use backend::{
    AttnMeta, Backend, CellMeta, KvDtype, KvSource, Mask, QueryMeta, SeqId, Strided, WeightData,
    SELECTED_NONE,
};
pub use batch::Batch;
pub use counters::{AtomicCounters, DeviceCounters};
pub use cpu::{CpuBackend, CpuKv, CpuMat};
pub use error::RuntimeError;
pub use kv_cache::{KvCache, KvLayout, SeqCache};
pub use logits::Logits;
pub use shared::Shared;
