//! Fixture models and golden outputs for plumbline's verification harness.
//!
//! - [`fixtures`]: tiny deterministic GGUF models, one per architecture × weight-type mix
//!   ([`fixtures::all`], [`fixtures::write`]). Same spec, same bytes: `tests/fixtures.rs` pins
//!   a SHA-256 of each, so a change to a fixture (or to the quantizer or writer under it) is a
//!   reviewed decision, never an accident.
//! - [`vocab`]: the fixtures' SentencePiece-style tokenizer section and the standard
//!   teacher-forced test sequence ([`vocab::sample_tokens`]).
//! - [`split`]: a fixture (or any file) written as a split set by layer.
//! - [`rng`]: the only randomness, splitmix64 seeded per tensor.
//! - [`snapshot`]: golden summaries (taps, greedy continuation, top-5) of the reference on each
//!   fixture and the real model, pinned by `tests/golden_snapshots.rs` and reviewed with
//!   `cargo insta review` (`cargo xtask golden` regenerates them).
//!
//! Architecture invariants:
//! - `golden` may use the engine's GGUF writer and the kernels' quantizers to *write* fixtures,
//!   but the `reference` crate it checks against must never depend on either (see `reference`'s
//!   crate docs); `golden` depends on `reference`, never the other way round.
//! - The engine never depends on `golden`.
//!
//! Tests: `tests/reference_fixtures.rs` runs the reference on every fixture (taps, finiteness,
//! f32 vs f64); `tests/engine_vs_reference.rs` is where the engine-against-reference comparison on
//! every fixture goes.

pub mod fixtures;
pub mod rng;
pub mod snapshot;
pub mod split;
pub mod vocab;

pub use fixtures::{all, by_name, write, Arch, FixtureError, FixtureSpec};
