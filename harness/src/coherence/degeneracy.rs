//! A degeneracy detector for "fluent garbage", needing no reference: pathological repetition
//! loops, token-id collapse, collapsed entropy, NaN/Inf logits, constant logits.
//!
//! # Calibration
//!
//! Small base models repeat themselves under greedy decoding: a 270M model will happily cycle
//! through the same sentence. That is the model, not a broken engine, and must not fail a case.
//! What a broken engine produces instead is a *short* cycle that owns the whole tail ("the the the",
//! "\n\n\n", two ids alternating) or distributions that collapsed to one-hot or went flat. So:
//!
//! * the repetition check only fires for a cycle of period ≤ [`DegeneracyParams::max_loop_period`]
//!   (4 tokens: shorter than any sentence) covering ≥ 90% of the generated tail; longer cycles are
//!   reported in the detail but pass;
//! * token-id collapse fires when one id is ≥ 60% of the tail: a repeated sentence of n distinct
//!   tokens puts its most common id at ~1/n; counting lists ("1, 2, 3, …") put "," at 50%;
//! * collapsed entropy fires when the mean next-token entropy is below 1e-3 nats, i.e. the top token
//!   has p ≳ 0.9999 at every position on average. Next-token entropies of language models on text
//!   are of order 1 nat, and even a confidently looping model keeps some mass off its top token;
//!   near-zero entropy everywhere means logits blown up (a missing soft-cap or a doubled scale).
//!
//! All checks need at least [`DegeneracyParams::min_tail`] tokens to judge (16: below that a
//! period-4 cycle is only four repeats and ordinary text can look like it).

use serde::{Deserialize, Serialize};

use crate::error::{HarnessError, Result};
use crate::float::fmt_sig;
use crate::gate::GateResult;

/// Parameters of [`detect_degeneracy`]; the defaults are documented in the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DegeneracyParams {
    /// Longest cycle (in tokens) that counts as a pathological loop.
    pub max_loop_period: usize,
    /// Fraction of the tail a pathological loop must cover.
    pub min_loop_coverage: f64,
    /// Longest cycle searched for the informational detail.
    pub max_reported_period: usize,
    /// Fewest generated tokens the token checks judge.
    pub min_tail: usize,
    /// Largest admitted share of the tail held by one token id.
    pub max_top_token_share: f64,
    /// Smallest admitted mean next-token entropy, nats.
    pub min_mean_entropy: f64,
    /// A logit row whose standard deviation is at most this × max(1, mean |logit|) is constant.
    pub constant_rel_std: f64,
}

impl Default for DegeneracyParams {
    fn default() -> Self {
        DegeneracyParams {
            max_loop_period: 4,
            min_loop_coverage: 0.9,
            max_reported_period: 32,
            min_tail: 16,
            max_top_token_share: 0.6,
            min_mean_entropy: 1e-3,
            // f32 has 24 bits of mantissa (6e-8): a row that differs only in rounding noise.
            constant_rel_std: 1e-6,
        }
    }
}

/// Length of the longest suffix of `tokens` that repeats with period `p`, counting only suffixes
/// with at least two full cycles; 0 when there is none.
pub fn periodic_suffix(tokens: &[u32], p: usize) -> usize {
    if p == 0 || tokens.len() < 2 * p {
        return 0;
    }
    let n = tokens.len();
    let matching = (0..n - p)
        .rev()
        .take_while(|&j| tokens[j] == tokens[j + p])
        .count();
    if matching >= p {
        matching + p
    } else {
        0
    }
}

/// The cycle of period ≤ `max_period` covering the largest part of `tokens` (shortest period on
/// ties): `(period, covered length)`.
pub fn best_cycle(tokens: &[u32], max_period: usize) -> Option<(usize, usize)> {
    (1..=max_period)
        .map(|p| (p, periodic_suffix(tokens, p)))
        .filter(|&(_, len)| len > 0)
        .fold(None, |best: Option<(usize, usize)>, c| match best {
            Some(b) if b.1 >= c.1 => Some(b),
            _ => Some(c),
        })
}

/// Entropy in nats of softmax(`row`), in f64.
pub fn entropy(row: &[f32]) -> f64 {
    let lp = super::logits::log_softmax(row);
    -lp.iter()
        .map(|&l| {
            let p = l.exp();
            if p == 0.0 {
                0.0
            } else {
                p * l
            }
        })
        .sum::<f64>()
}

/// Judge a generation: `generated` are the generated ids (prompt excluded), `logits` the
/// `[rows, n_vocab]` distributions they were drawn from (may be empty when not recorded).
/// Returns the gates `repetition_loop`, `token_collapse`, `entropy_collapse`, `nonfinite_logits`,
/// `constant_logits`.
pub fn detect_degeneracy(
    generated: &[u32],
    logits: &[f32],
    n_vocab: usize,
    params: &DegeneracyParams,
) -> Result<Vec<GateResult>> {
    if n_vocab == 0 {
        return Err(HarnessError::Parameter {
            name: "n_vocab",
            why: "expected at least 1, found 0".into(),
        });
    }
    if !logits.len().is_multiple_of(n_vocab) {
        return Err(HarnessError::Length {
            what: format!("logits as rows of {n_vocab}"),
            expected: logits.len() / n_vocab * n_vocab,
            found: logits.len(),
        });
    }
    let p = params;
    let n = generated.len();
    let judged = n >= p.min_tail;
    let too_short = || format!("{n} tokens: too short to judge (need {})", p.min_tail);

    // Repetition loop.
    let loop_gate = if !judged {
        GateResult::at_most("repetition_loop", 0.0, p.min_loop_coverage, too_short())
    } else {
        let short = best_cycle(generated, p.max_loop_period);
        let coverage = short.map_or(0.0, |(_, len)| len as f64 / n as f64);
        let detail = match (short, best_cycle(generated, p.max_reported_period)) {
            (Some((period, len)), _) if coverage >= p.min_loop_coverage => format!(
                "a {period}-token cycle covers the last {len} of {n} tokens: {:?}",
                &generated[n - period..]
            ),
            (_, Some((period, len))) if period > p.max_loop_period => format!(
                "longest cycle: period {period} over the last {len} of {n} tokens \
                 (longer than {} tokens, not judged pathological)",
                p.max_loop_period
            ),
            (_, Some((period, len))) => {
                format!("longest cycle: period {period} over the last {len} of {n} tokens")
            }
            (_, None) => "no repeated cycle at the end".into(),
        };
        GateResult {
            gate: "repetition_loop",
            passed: coverage < p.min_loop_coverage,
            value: coverage,
            threshold: p.min_loop_coverage,
            detail,
            judged: true,
        }
    };

    // Token-id collapse.
    let collapse_gate = if !judged {
        GateResult::at_most("token_collapse", 0.0, p.max_top_token_share, too_short())
    } else {
        let mut counts = std::collections::HashMap::new();
        for &t in generated {
            *counts.entry(t).or_insert(0usize) += 1;
        }
        let (top, count) = counts
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map_or((0, 0), |(&t, &c)| (t, c));
        GateResult::at_most(
            "token_collapse",
            count as f64 / n as f64,
            p.max_top_token_share,
            format!(
                "id {top} is {count} of {n} tokens; {} distinct ids",
                counts.len()
            ),
        )
    };

    let rows: Vec<&[f32]> = logits.chunks_exact(n_vocab).collect();
    let no_logits = "no logits recorded".to_owned();

    // Non-finite logits: counted over all rows.
    let mut nonfinite = 0usize;
    let mut first_bad: Option<(usize, usize)> = None;
    for (r, row) in rows.iter().enumerate() {
        for (c, x) in row.iter().enumerate() {
            if !x.is_finite() {
                nonfinite += 1;
                first_bad.get_or_insert((r, c));
            }
        }
    }
    let nonfinite_gate = GateResult::at_most(
        "nonfinite_logits",
        nonfinite as f64,
        0.0,
        match first_bad {
            Some((r, c)) => format!("first at row {r}, token id {c}"),
            None if rows.is_empty() => no_logits.clone(),
            None => format!("all {} logits finite", logits.len()),
        },
    );

    // Constant rows.
    let constant: Vec<usize> = rows
        .iter()
        .enumerate()
        .filter(|(_, row)| {
            let m = row.iter().map(|&x| x as f64).sum::<f64>() / n_vocab as f64;
            let var = row.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / n_vocab as f64;
            let scale =
                (row.iter().map(|&x| (x as f64).abs()).sum::<f64>() / n_vocab as f64).max(1.0);
            n_vocab > 1
                && row.iter().all(|x| x.is_finite())
                && var.sqrt() <= p.constant_rel_std * scale
        })
        .map(|(r, _)| r)
        .collect();
    let constant_gate = GateResult::at_most(
        "constant_logits",
        constant.len() as f64,
        0.0,
        match constant.first() {
            Some(r) => format!(
                "{} of {} rows constant, first row {r}",
                constant.len(),
                rows.len()
            ),
            None if rows.is_empty() => no_logits.clone(),
            None => format!("{} rows vary", rows.len()),
        },
    );

    // Entropy over the finite rows.
    let finite_rows: Vec<&&[f32]> = rows
        .iter()
        .filter(|r| r.iter().all(|x| x.is_finite()))
        .collect();
    let entropy_gate = if finite_rows.is_empty() {
        GateResult::at_least(
            "entropy_collapse",
            f64::INFINITY,
            p.min_mean_entropy,
            no_logits,
        )
    } else {
        let mean = finite_rows.iter().map(|r| entropy(r)).sum::<f64>() / finite_rows.len() as f64;
        GateResult::at_least(
            "entropy_collapse",
            mean,
            p.min_mean_entropy,
            format!(
                "mean next-token entropy {} nats over {} rows (uniform: {})",
                fmt_sig(mean),
                finite_rows.len(),
                fmt_sig((n_vocab as f64).ln())
            ),
        )
    };

    Ok(vec![
        loop_gate,
        collapse_gate,
        entropy_gate,
        nonfinite_gate,
        constant_gate,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gates(tokens: &[u32], logits: &[f32], n_vocab: usize) -> Vec<GateResult> {
        match detect_degeneracy(tokens, logits, n_vocab, &DegeneracyParams::default()) {
            Ok(g) => g,
            Err(e) => panic!("{e}"),
        }
    }

    fn failed(tokens: &[u32], logits: &[f32], n_vocab: usize) -> Vec<&'static str> {
        gates(tokens, logits, n_vocab)
            .into_iter()
            .filter(|g| !g.passed)
            .map(|g| g.gate)
            .collect()
    }

    /// Logit rows with a moderate spread: entropy well above the floor.
    fn healthy_logits(rows: usize, n_vocab: usize) -> Vec<f32> {
        (0..rows * n_vocab)
            .map(|i| ((i * 7919) % 13) as f32 * 0.3)
            .collect()
    }

    /// A varied prefix of 8 ids followed by `cycle` repeated to `len` tokens.
    fn looped(cycle: &[u32], len: usize) -> Vec<u32> {
        let mut v: Vec<u32> = (100..108).collect();
        v.extend(cycle.iter().cycle().take(len - 8));
        v
    }

    #[test]
    fn periodic_suffix_by_hand() {
        assert_eq!(periodic_suffix(&[9, 1, 2, 1, 2, 1, 2], 2), 6);
        assert_eq!(periodic_suffix(&[1, 2, 3, 1, 2, 3], 3), 6);
        assert_eq!(periodic_suffix(&[1, 2, 3, 4], 2), 0);
        // One repeat plus a partial one is not two full cycles.
        assert_eq!(periodic_suffix(&[5, 1, 2, 3, 2, 3], 2), 4);
        assert_eq!(periodic_suffix(&[1, 2, 3, 9, 2, 3], 3), 0);
        assert_eq!(periodic_suffix(&[], 1), 0);
    }

    #[test]
    fn a_repeated_sentence_is_not_degenerate() {
        // A 9-token phrase looped for the whole tail: what a 270M base model does under greedy.
        let tokens = looped(&[11, 12, 13, 14, 15, 16, 17, 18, 19], 64);
        assert_eq!(
            failed(&tokens, &healthy_logits(64, 32), 32),
            Vec::<&str>::new()
        );
        let g = gates(&tokens, &[], 32);
        assert!(g[0].detail.contains("period 9"), "{}", g[0].detail);
    }

    #[test]
    fn a_short_cycle_owning_the_tail_is_a_loop() {
        for cycle in [&[7u32][..], &[7, 8], &[7, 8, 9, 10]] {
            let tokens = looped(cycle, 96);
            let f = failed(&tokens, &healthy_logits(96, 32), 32);
            assert!(f.contains(&"repetition_loop"), "{cycle:?}: {f:?}");
        }
        // A 4-token cycle has its top id at 25%: only the loop check fires.
        assert_eq!(
            failed(&looped(&[7, 8, 9, 10], 96), &[], 32),
            ["repetition_loop"]
        );
    }

    #[test]
    fn a_short_cycle_over_half_the_tail_is_not_a_loop() {
        let mut tokens: Vec<u32> = (0..32).collect();
        tokens.extend([5, 6].iter().cycle().take(32));
        let g = gates(&tokens, &[], 8);
        assert!(
            g[0].passed && (g[0].value - 0.5).abs() < 1e-12,
            "{:?}",
            g[0]
        );
    }

    #[test]
    fn token_collapse_without_a_cycle() {
        let tokens: Vec<u32> = (0..40).map(|i| if i % 3 == 2 { i } else { 1 }).collect();
        assert_eq!(failed(&tokens, &[], 64), ["token_collapse"]);
    }

    #[test]
    fn short_generations_are_not_judged() {
        assert_eq!(failed(&[1; 10], &[], 4), Vec::<&str>::new());
    }

    #[test]
    fn logit_pathologies() {
        let tokens: Vec<u32> = (0..20).collect();
        let mut logits = healthy_logits(4, 8);
        logits[13] = f32::NAN;
        assert_eq!(failed(&tokens, &logits, 8), ["nonfinite_logits"]);
        let mut logits = healthy_logits(4, 8);
        logits[8..16].fill(3.25);
        assert_eq!(failed(&tokens, &logits, 8), ["constant_logits"]);
        // One-hot at every row: logit gap of 100 nats.
        let onehot: Vec<f32> = (0..32)
            .map(|i| if i % 8 == 0 { 100.0 } else { 0.0 })
            .collect();
        assert_eq!(failed(&tokens, &onehot, 8), ["entropy_collapse"]);
    }

    #[test]
    fn entropy_by_hand() {
        assert!((entropy(&[0.0; 4]) - 4f64.ln()).abs() < 1e-12);
        assert!(entropy(&[0.0, -1e4]).abs() < 1e-12);
    }

    #[test]
    fn rejects_ragged_logits() {
        assert!(detect_degeneracy(&[], &[0.0; 5], 2, &DegeneracyParams::default()).is_err());
        assert!(detect_degeneracy(&[], &[], 0, &DegeneracyParams::default()).is_err());
    }
}

#[cfg(test)]
mod props {
    use super::{best_cycle, periodic_suffix};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_repeated_cycle_is_found(
            prefix in proptest::collection::vec(1000u32..2000, 0..10),
            cycle in proptest::collection::vec(0u32..50, 1..6),
            repeats in 2usize..8,
        ) {
            let mut t = prefix;
            for _ in 0..repeats {
                t.extend(&cycle);
            }
            // Prefix ids never occur in the cycle, so the loop is exactly the repeated part.
            prop_assert_eq!(periodic_suffix(&t, cycle.len()), cycle.len() * repeats);
            let best = best_cycle(&t, 8);
            prop_assert!(best.is_some_and(|(p, len)| p <= cycle.len() && len == cycle.len() * repeats));
        }
    }
}
