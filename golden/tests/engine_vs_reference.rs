//! Engine against reference on every fixture: the place for it.
//!
//! When the engine's forward pass (`engine::model`, `engine::runtime`) can run a fixture with a tap
//! observer attached, the tests here do, for every `golden::fixtures::all()` fixture and every
//! backend this machine has:
//!
//! 1. write the fixture (`golden::fixtures::write`) to a temp dir;
//! 2. run `reference::ReferenceModel` (f64) and the engine on `golden::vocab::sample_tokens()`,
//!    teacher-forced, collecting every tap of docs/TAPS.md from both;
//! 3. compare tap by tap in forward order with `harness`'s tolerance policy (keyed by tap kind and
//!    weight type), and report the first divergent tap by name;
//! 4. check greedy agreement of the logits and NaN/Inf parity.
//!
//! The reference side is ready (see `tests/reference_fixtures.rs` for how it is driven); the engine
//! side is written by whoever lands the engine's forward pass.
