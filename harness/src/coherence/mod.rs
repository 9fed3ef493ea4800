//! Coherence: does the output make sense? Three views, from strongest to weakest evidence.
//!
//! * [`greedy`]: the engine's greedy continuation equals the golden one for the first N tokens.
//! * [`logits`]: over teacher-forced logits of a fixed text, KL divergence of the engine from the
//!   reference, same-top-1 rate and perplexity ratio (the statistics of llama.cpp's
//!   `llama-perplexity --kl-divergence`).
//! * [`degeneracy`]: with no reference at all, signs of "fluent garbage": pathological repetition
//!   loops, collapsed entropy, NaN/Inf or constant logits, token-id collapse.

pub mod degeneracy;
pub mod greedy;
pub mod logits;

pub use degeneracy::{detect_degeneracy, DegeneracyParams};
pub use greedy::{greedy_prefix, greedy_prefix_or_tie, GreedyRows};
pub use logits::{logit_agreement, LogitAccumulator, LogitStats, LogitThresholds};
