//! The plumbline inference engine.
//!
//! - [`gguf`]: reading (memory-mapped, validated, split sets) and writing GGUF files.
//!
//! Architecture invariants:
//! - The engine never depends on `reference`, `harness` or `golden`. Verification observes the
//!   engine through taps; the engine does not know it is being checked.
//! - There is one GGUF reader in the engine, [`gguf`]. Block formats come from `kernels::quant`.
//! - Bad input gets a typed error naming the file, field or tensor and the offset; never a panic,
//!   never an allocation sized by an untrusted count.
//!
//! Start reading at `gguf/mod.rs`.

pub mod faults;
pub mod gguf;
pub mod model;
pub mod runtime;
pub mod taps;
pub mod tokenizer;

/// Token sampling; lives in the runtime, re-exported here as `engine::sampling`.
pub use runtime::sampling;
