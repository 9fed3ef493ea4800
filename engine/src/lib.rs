//! The plumbline inference engine library (the `plumbline` command lives in the `cli` crate,
//! so this library carries none of its dependencies: no clap, anyhow, tracing-subscriber or
//! serde_json).
//!
//! - [`gguf`]: reading (memory-mapped, validated, split sets) and writing GGUF files.
//! - [`model`]: configuration from metadata, checked weight handles ([`model::Weight`], with
//!   block-aligned shard views), and the forward pass of every architecture.
//! - [`runtime`]: the core every device, rank, tree and batch runs on (below).
//! - [`spec`]: tree speculative decoding (proposers, DDTree trees, verify, target-only
//!   acceptance, KV compaction, budget policy).
//! - [`tokenizer`], [`sampling`], [`taps`], [`faults`], [`capabilities()`].
//!
//! # The core
//!
//! ```text
//!   Model ──prepare (once)──▶ Engine<B> ──forward(&mut KvCache<B>, &Batch, taps)──▶ Logits
//! ```
//!
//! - **Backend-owned tensors.** [`runtime::Backend`] has associated types for activations
//!   (`Buf`), indices (`Ids`), prepared weights (`Mat<'w>`, which may borrow the file's map) and
//!   cache layers (`Kv`). [`runtime::Engine::new`] prepares every weight once
//!   ([`runtime::Backend::prepare`]: the CPU borrows or repacks, a GPU uploads). Every op is
//!   fallible. The forward pass (`model/forward.rs`) only calls ops: embedding gather
//!   (`embed`), biases (`add_row`), MLA split/expand (`copy_strided`, `kv_read_k`), MoE routing
//!   (`route`: gating, bias, top-k, normalization, scaling), grouped expert products
//!   (`matmul_experts`) and their combination (`moe_combine`), logits row selection
//!   (`gather_rows`). Data reaches the host only through `download`: the logits, and taps when
//!   an observer is attached. A new backend (CUDA) implements this one trait; the CPU backend
//!   ([`runtime::CpuBackend`]) is its twin for every op.
//! - **Explicit positions and masks.** A [`runtime::Batch`] gives every token its position,
//!   sequence and (for a draft tree) parent. Attention's [`runtime::Mask`] is a value —
//!   causal, sliding window, tree ancestors, in any combination — applied by sequence and
//!   position distance to the cache's cells, never by row index. RoPE takes per-token positions.
//! - **KV cache** ([`runtime::KvCache`]): cells shared by all sequences, tagged with sequence and
//!   position. A forward's cells are pending until [`runtime::KvCache::commit`],
//!   [`runtime::KvCache::rollback`] or [`runtime::KvCache::compact`] (keep an accepted tree path,
//!   moved into the lowest free cells). Storage f32 or f16 ([`runtime::KvDtype`]). MLA caches the
//!   latent row (normed compressed kv + roped shared key) and expands it in attention.
//! - **Ragged batches.** One forward may hold several sequences at different positions with
//!   different token counts; each attends only to its own cells. A batching server and the tree
//!   verifier both build batches; [`runtime::Session`] is the one-sequence convenience.
//! - **Shard views.** [`model::Weight::shard`] cuts rows and/or block-aligned columns of every
//!   matrix of a tensor; a cut through a quantized block is [`model::ShardError::CutsBlock`]
//!   (tensor, type, offset). Tensor parallelism prepares only its views.
//!
//! Architecture invariants:
//! - The engine never depends on `reference`, `harness` or `golden`. Verification observes the
//!   engine through taps; the engine does not know it is being checked.
//! - There is one GGUF reader in the engine, [`gguf`]. Block formats come from `kernels::quant`.
//! - Bad input gets a typed error naming the file, field or tensor and the offset; never a panic,
//!   never an allocation sized by an untrusted count.
//!
//! Start reading at `runtime/backend.rs`, then `model/forward.rs`.

mod capabilities;
pub mod exec;
pub mod faults;
pub mod gguf;
pub mod model;
pub mod runtime;
pub mod spec;
pub mod taps;
#[doc(hidden)]
pub mod testing;
pub mod tokenizer;
pub mod tp;

pub use capabilities::{capabilities, Capabilities, CudaDevice};

/// Token sampling; lives in the runtime, re-exported here as `engine::sampling`.
pub use runtime::sampling;
