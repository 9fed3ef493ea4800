//! plumbline's verification harness: judges an engine run against the reference, golden outputs
//! and baselines, and writes the verdict.
//!
//! **Architecture invariant:** the harness works on plain data — taps as `(name, shape, f32 data)`,
//! token ids, logit rows, figures — and never depends on `engine` or `reference`, so one harness
//! judges both and neither can bend it. It holds the *one* tolerance policy of the project
//! ([`tolerance`]).
//!
//! Where to start reading, in the order `cargo xtask verify` uses it:
//! [`cases`] (the matrix, names, filters, skip reasons) → [`compare::compare_taps`] with a
//! [`tolerance::TolerancePolicy`] (first divergent tap) → [`coherence`] and [`throughput`] gates
//! ([`gate::GateResult`]) → [`report`] (console, JSON, JUnit, markdown + SVG plots).

pub mod cases;
pub mod coherence;
pub mod compare;
pub mod error;
pub(crate) mod float;
pub mod gate;
pub mod report;
pub mod tap;
pub mod throughput;
pub mod tolerance;

pub use cases::{Case, Filter, MachineCaps, Matrix, ModelEntry};
pub use compare::{compare_taps, Comparison};
pub use error::HarnessError;
pub use gate::GateResult;
pub use report::{CaseResult, Report, Verdict};
pub use tap::{Tap, TapKind};
pub use tolerance::{CaseContext, TolerancePolicy};
