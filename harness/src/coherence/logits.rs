//! Teacher-forced logit agreement: KL divergence, same-top-1 rate, perplexity.
//!
//! The statistics are those llama.cpp's `llama-perplexity --kl-divergence` prints: per position
//! KL(P_reference ‖ P_engine) = Σᵢ pᵢ (log pᵢ − log qᵢ) from log-softmax of the two logit rows; the
//! mean and the 99th percentile over positions; the fraction of positions where both sides have the
//! same most likely token; and perplexity exp(−mean log p(target)) of each side. Everything is
//! computed in f64.

use serde::{Deserialize, Serialize};

use crate::error::{HarnessError, Result};
use crate::float::fmt_sig;
use crate::gate::GateResult;
use crate::tolerance::WeightClass;

/// Agreement of the engine's logits with the reference's over one teacher-forced text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogitStats {
    pub positions: usize,
    #[serde(with = "crate::float")]
    pub kld_mean: f64,
    /// 99th percentile, linear interpolation between order statistics.
    #[serde(with = "crate::float")]
    pub kld_p99: f64,
    #[serde(with = "crate::float")]
    pub kld_max: f64,
    /// Position of `kld_max`.
    pub kld_max_position: usize,
    #[serde(with = "crate::float")]
    pub same_top1_rate: f64,
    /// First position whose top-1 tokens differ.
    pub first_top1_mismatch: Option<usize>,
    #[serde(with = "crate::float")]
    pub ppl_engine: f64,
    #[serde(with = "crate::float")]
    pub ppl_reference: f64,
    /// `ppl_engine / ppl_reference`.
    #[serde(with = "crate::float")]
    pub ppl_ratio: f64,
    /// Standard error of `ln ppl_ratio`: the sample standard deviation of the per-position
    /// differences `−log q(target) + log p(target)`, over √positions. Rounding noise makes each
    /// position's difference scatter; a mean over n positions scatters by this much.
    #[serde(with = "crate::float")]
    pub ln_ppl_ratio_se: f64,
}

/// Sample standard deviation over √n: the standard error of the mean of `values` (0 for fewer
/// than two values).
fn standard_error(values: &[f64]) -> f64 {
    let n = values.len();
    if n < 2 {
        return 0.0;
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (var / n as f64).sqrt()
}

/// log-softmax of one row, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// Index of the largest value (the first on ties), `None` for an empty row.
pub fn argmax(row: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in row.iter().enumerate() {
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i)
}

/// KL(P ‖ Q) from log-probabilities; terms with p = 0 contribute nothing.
pub fn kl_divergence(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| {
            let p = lp.exp();
            if p == 0.0 {
                0.0
            } else {
                p * (lp - lq)
            }
        })
        .sum()
}

/// The `q`-quantile (0 ≤ q ≤ 1) of `values` by linear interpolation between order statistics
/// (NaN sorts last). `None` for no values.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    Some(v[lo] + (v[hi] - v[lo]) * (pos - lo as f64))
}

/// Compare `engine` logits with `reference` logits, both `[positions, n_vocab]` row-major;
/// `targets[t]` is the token position `t` predicts (the next token of the text).
pub fn logit_agreement(
    reference: &[f32],
    engine: &[f32],
    n_vocab: usize,
    targets: &[u32],
) -> Result<LogitStats> {
    let mut acc = LogitAccumulator::new(n_vocab)?;
    if targets.is_empty() {
        return acc.finish();
    }
    acc.push(reference, engine, targets)?;
    acc.finish()
}

/// [`logit_agreement`] over positions that arrive a few rows at a time, so that a long text's
/// logits (640 positions of a 262144-word vocabulary: 671 MB a side) are never held whole. Keeps
/// two numbers per position; [`Self::finish`] equals `logit_agreement` over all rows pushed.
#[derive(Debug, Clone)]
pub struct LogitAccumulator {
    n_vocab: usize,
    klds: Vec<f64>,
    nll_diffs: Vec<f64>,
    nll_ref: f64,
    nll_eng: f64,
    same: usize,
    first_top1_mismatch: Option<usize>,
}

impl LogitAccumulator {
    pub fn new(n_vocab: usize) -> Result<LogitAccumulator> {
        if n_vocab == 0 {
            return Err(HarnessError::Parameter {
                name: "n_vocab",
                why: "expected at least 1, found 0".into(),
            });
        }
        Ok(LogitAccumulator {
            n_vocab,
            klds: Vec::new(),
            nll_diffs: Vec::new(),
            nll_ref: 0.0,
            nll_eng: 0.0,
            same: 0,
            first_top1_mismatch: None,
        })
    }

    /// The next positions: `reference` and `engine` rows `[targets.len(), n_vocab]`.
    pub fn push(&mut self, reference: &[f32], engine: &[f32], targets: &[u32]) -> Result<()> {
        let (positions, n_vocab) = (targets.len(), self.n_vocab);
        for (what, logits) in [("reference logits", reference), ("engine logits", engine)] {
            if logits.len() != positions * n_vocab {
                return Err(HarnessError::Length {
                    what: format!("{what} for {positions} positions × {n_vocab} vocab"),
                    expected: positions * n_vocab,
                    found: logits.len(),
                });
            }
        }
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(HarnessError::Parameter {
                name: "targets",
                why: format!("expected token ids below n_vocab {n_vocab}, found {bad}"),
            });
        }
        for (&target, (r, e)) in targets.iter().zip(
            reference
                .chunks_exact(n_vocab)
                .zip(engine.chunks_exact(n_vocab)),
        ) {
            let t = self.klds.len();
            let (lr, le) = (log_softmax(r), log_softmax(e));
            self.klds.push(kl_divergence(&lr, &le));
            let target = target as usize;
            self.nll_ref -= lr[target];
            self.nll_eng -= le[target];
            self.nll_diffs.push(lr[target] - le[target]);
            if argmax(r) == argmax(e) {
                self.same += 1;
            } else {
                self.first_top1_mismatch.get_or_insert(t);
            }
        }
        Ok(())
    }

    /// The statistics over every position pushed (an error if none was).
    pub fn finish(&self) -> Result<LogitStats> {
        let positions = self.klds.len();
        if positions == 0 {
            return Err(HarnessError::TooFew {
                what: "teacher-forced positions".into(),
                expected: 1,
                found: 0,
            });
        }
        let klds = &self.klds;
        let n = positions as f64;
        let kld_mean = klds.iter().sum::<f64>() / n;
        let (kld_max_position, kld_max) = klds
            .iter()
            .copied()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((0, f64::NAN));
        let ppl_engine = (self.nll_eng / n).exp();
        let ppl_reference = (self.nll_ref / n).exp();
        Ok(LogitStats {
            positions,
            kld_mean,
            kld_p99: quantile(klds, 0.99).unwrap_or(f64::NAN),
            kld_max,
            kld_max_position,
            same_top1_rate: self.same as f64 / n,
            first_top1_mismatch: self.first_top1_mismatch,
            ppl_engine,
            ppl_reference,
            ppl_ratio: ppl_engine / ppl_reference,
            ln_ppl_ratio_se: standard_error(&self.nll_diffs),
        })
    }
}

/// Bounds for [`LogitStats::gates`].
///
/// Anchor: llama.cpp's published `--kl-divergence` runs put Q8_0 *weights* against f16 at a mean
/// KLD of order 1e-3 with ~98–99% same top token. Our engine and reference share the dequantized
/// weights; on quantized cases the only systematic difference is Q8 activation rounding, which is
/// of the same kind as Q8_0 weight rounding, so that is the expected scale. Measured on the real
/// model it is larger (Q8 rounding of every activation of 18 layers, not of the weights once), so
/// the quantized bound is set from that measurement (see below). Float cases differ by rounding only: for small independent logit errors of
/// variance σ², KL ≈ σ²/2, and the tap tolerances put f32/f16 logits NMSE below 1e-4 and bf16 below
/// 5e-3.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LogitThresholds {
    pub kld_mean_max: f64,
    pub kld_p99_max: f64,
    pub same_top1_min: f64,
    /// Largest admitted |ppl_engine/ppl_reference − 1| (two-sided: "better" is also a deviation).
    pub ppl_ratio_tolerance: f64,
}

impl LogitThresholds {
    pub fn for_weights(class: WeightClass) -> LogitThresholds {
        match class {
            WeightClass::F32 | WeightClass::F16 => LogitThresholds {
                kld_mean_max: 1e-4,
                kld_p99_max: 1e-3,
                same_top1_min: 0.99,
                ppl_ratio_tolerance: 0.002,
            },
            WeightClass::Bf16 => LogitThresholds {
                kld_mean_max: 1e-3,
                kld_p99_max: 1e-2,
                same_top1_min: 0.98,
                ppl_ratio_tolerance: 0.01,
            },
            // These are floors: on every case the verifier widens them to admit the rounding
            // noise of the exact-numerics reference (LogitThresholds::admitting), measured on
            // the same positions in the same run. On Gemma 3 270M that noise is mean KL 0.0072,
            // same-top-1 0.952 and a perplexity ratio of 1.05 over 63 positions, so ±0.02 on the
            // ratio alone was one standard error (0.019) and failed correct engines at random.
            // Measured: Gemma 3 270M Q4_K_M, engine (Q8 activations) vs reference (f32
            // activations), 63 teacher-forced positions of golden/data: mean KL 0.0071, p99
            // 0.025, same-top-1 0.952 while every tap stays within its NMSE bound and greedy
            // output matches. The 5e-3 first derived here came from Q8_0 *weight* KL reports, a
            // different comparison; 1e-2 keeps ~1.4x room over the measurement.
            // Same-top-1 measured 0.937 (scalar) and 0.952 (AVX2): 4 and 3 flips of 63, each on
            // a near-tie; 0.90 admits 6.
            // p99 over 63 positions is the largest single KL. A near-tie position whose Q8
            // activation rounding flips moves it by a few hundredths (0.025 to 0.053 measured
            // across ISAs and summation orders), so 0.05 was inside that noise; 0.1 is twice
            // the largest, and a bug confined to a few positions (a window off by one past
            // 512) costs far more there than a rounding flip.
            WeightClass::Quantized => LogitThresholds {
                kld_mean_max: 1e-2,
                kld_p99_max: 1e-1,
                same_top1_min: 0.90,
                ppl_ratio_tolerance: 0.02,
            },
        }
    }
}

/// How many standard errors of sampling noise a mean over the text's positions is allowed.
/// Four keeps the false-alarm rate of each gate below 1e-4 for a correct engine, whatever the
/// number of positions; a bug that shifts a statistic by more than the noise still fails.
pub const NOISE_Z: f64 = 4.0;

impl LogitThresholds {
    /// Widen the bounds to admit `noise`: the same statistics of a second, independent
    /// implementation of the engine's arithmetic against the same reference (on quantized
    /// models, the reference with ggml's activation rounding, `reference::Precision::Exact`,
    /// against the plain f32 reference). A correct engine is another draw of that noise, so:
    /// mean KL up to twice the noise's (two draws of a mean over the same positions differ by
    /// their sampling spread, well under 2× at 30+ positions; a bug that doubles the KL still
    /// fails), and a same-top-1 rate down to the noise's rate less [`NOISE_Z`] binomial
    /// standard errors. The fixed bounds stay the floor: noise never tightens them.
    pub fn admitting(mut self, noise: &LogitStats) -> LogitThresholds {
        self.kld_mean_max = self.kld_mean_max.max(2.0 * noise.kld_mean);
        let n = noise.positions.max(1) as f64;
        let p = noise.same_top1_rate;
        let se = (p * (1.0 - p)).max(1.0 / n).sqrt() / n.sqrt();
        self.same_top1_min = self.same_top1_min.min(p - NOISE_Z * se);
        self
    }
}

impl LogitStats {
    /// Gates `kld_mean`, `kld_p99`, `same_top1`, `ppl_ratio`. The perplexity bound is the
    /// tolerance (the admitted systematic bias) plus [`NOISE_Z`] standard errors of
    /// `ln ppl_ratio` (the sampling noise of a mean over this many positions).
    pub fn gates(&self, th: &LogitThresholds) -> Vec<GateResult> {
        let ratio_dev = self.ppl_ratio.ln().abs();
        let ratio_bound = (1.0 + th.ppl_ratio_tolerance).ln() + NOISE_Z * self.ln_ppl_ratio_se;
        vec![
            GateResult::at_most(
                "kld_mean",
                self.kld_mean,
                th.kld_mean_max,
                format!(
                    "over {} positions; max {} at position {}",
                    self.positions,
                    fmt_sig(self.kld_max),
                    self.kld_max_position
                ),
            ),
            GateResult::at_most("kld_p99", self.kld_p99, th.kld_p99_max, String::new()),
            GateResult::at_least(
                "same_top1",
                self.same_top1_rate,
                th.same_top1_min,
                match self.first_top1_mismatch {
                    Some(p) => format!("first differing top-1 at position {p}"),
                    None => "top-1 equal at every position".into(),
                },
            ),
            GateResult {
                gate: "ppl_ratio",
                passed: ratio_dev <= ratio_bound,
                value: self.ppl_ratio,
                threshold: ratio_bound.exp(),
                detail: format!(
                    "ppl engine {} / reference {}; bound is two-sided ×/÷{} (tolerance {} \
                     and {NOISE_Z} standard errors of {} over {} positions)",
                    fmt_sig(self.ppl_engine),
                    fmt_sig(self.ppl_reference),
                    fmt_sig(ratio_bound.exp()),
                    fmt_sig(th.ppl_ratio_tolerance),
                    fmt_sig(self.ln_ppl_ratio_se),
                    self.positions
                ),
                judged: true,
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulated_rows_equal_the_whole_text() {
        let n_vocab = 3;
        let r = [
            0.1f32, 2.0, -1.0, 1.0, 0.0, 0.5, 3.0, 1.0, 2.9, -2.0, 0.0, 1.0,
        ];
        let e = [
            0.0f32, 2.1, -1.0, 1.0, 0.2, 0.5, 2.9, 1.0, 3.0, -2.0, 0.1, 1.0,
        ];
        let targets = [1u32, 0, 2, 2];
        let whole = logit_agreement(&r, &e, n_vocab, &targets).ok();
        let mut acc = LogitAccumulator::new(n_vocab).ok();
        for (rows, (ra, ea)) in [(0..1, (0..3, 0..3)), (1..4, (3..12, 3..12))] {
            if let Some(a) = acc.as_mut() {
                assert!(a.push(&r[ra], &e[ea], &targets[rows]).is_ok());
            }
        }
        let pieces = acc.and_then(|a| a.finish().ok());
        assert!(whole.is_some());
        assert_eq!(pieces, whole);
        // Rows of the wrong length, and nothing pushed at all, are errors.
        let mut a = LogitAccumulator::new(n_vocab).ok();
        assert!(a
            .as_mut()
            .is_some_and(|a| a.push(&r[..2], &e[..3], &targets[..1]).is_err()));
        assert!(a.is_some_and(|a| a.finish().is_err()));
        assert!(LogitAccumulator::new(0).is_err());
    }

    fn stats(reference: &[f32], engine: &[f32], n_vocab: usize, targets: &[u32]) -> LogitStats {
        match logit_agreement(reference, engine, n_vocab, targets) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn identical_logits_agree_perfectly() {
        let r = [1.0, 2.0, 3.0, 0.5, 0.5, 4.0];
        let s = stats(&r, &r, 3, &[2, 0]);
        assert_eq!(
            (s.kld_mean, s.kld_max, s.same_top1_rate, s.ppl_ratio),
            (0.0, 0.0, 1.0, 1.0)
        );
        assert!(s
            .gates(&LogitThresholds::for_weights(WeightClass::F32))
            .iter()
            .all(|g| g.passed));
    }

    #[test]
    fn kl_and_perplexity_by_hand() {
        // Reference: uniform over 2 tokens. Engine: logits (ln 3, 0) → q = (3/4, 1/4).
        // KL(p‖q) = ½ ln(½ / ¾) + ½ ln(½ / ¼) = ½ ln(4/3) = 0.143841.
        let s = stats(&[0.0, 0.0], &[3f32.ln(), 0.0], 2, &[1]);
        assert!(
            (s.kld_mean - 0.5 * (4.0f64 / 3.0).ln()).abs() < 1e-7,
            "{}",
            s.kld_mean
        );
        // Target 1: p = ½ → ppl 2; q = ¼ → ppl 4.
        assert!((s.ppl_reference - 2.0).abs() < 1e-9);
        assert!((s.ppl_engine - 4.0).abs() < 1e-6);
        assert!((s.ppl_ratio - 2.0).abs() < 1e-6);
        // Ties: reference argmax is token 0 (first), engine's is token 0.
        assert_eq!(s.same_top1_rate, 1.0);
    }

    #[test]
    fn kl_is_invariant_to_a_constant_logit_shift() {
        let r = [0.1, -2.0, 1.5, 0.7];
        let e: Vec<f32> = r.iter().map(|x| x + 100.0).collect();
        assert!(stats(&r, &e, 4, &[1]).kld_mean.abs() < 1e-9);
    }

    #[test]
    fn top1_mismatch_and_percentiles() {
        // 4 positions; position 2 flips its top token.
        let r = [2.0, 0.0, 2.0, 0.0, 2.0, 0.0, 2.0, 0.0];
        let e = [2.0, 0.0, 2.0, 0.0, 0.0, 2.0, 2.0, 0.0];
        let s = stats(&r, &e, 2, &[0, 0, 0, 0]);
        assert_eq!(s.same_top1_rate, 0.75);
        assert_eq!(s.first_top1_mismatch, Some(2));
        assert_eq!(s.kld_max_position, 2);
        let gates = s.gates(&LogitThresholds::for_weights(WeightClass::Quantized));
        let failed: Vec<&str> = gates.iter().filter(|g| !g.passed).map(|g| g.gate).collect();
        // One position in four carries the whole perplexity difference: within the sampling
        // noise of a mean over four positions, so the ratio alone does not fail.
        assert_eq!(failed, ["kld_mean", "kld_p99", "same_top1"]);
    }

    #[test]
    fn a_bias_at_every_position_fails_the_perplexity_gate() {
        // 64 positions, the engine's target probability lower everywhere by about the same
        // amount (a systematic shift, not noise): tiny standard error, ratio 1.08.
        let (mut r, mut e) = (Vec::new(), Vec::new());
        for t in 0..64 {
            let jitter = 1e-3 * (t % 3) as f32;
            r.extend([1.0, 0.0]);
            e.extend([1.0 - 0.2 - jitter, 0.0]);
        }
        let s = stats(&r, &e, 2, &[0; 64]);
        assert!(s.ln_ppl_ratio_se < 1e-3, "se {}", s.ln_ppl_ratio_se);
        let th = LogitThresholds::for_weights(WeightClass::Quantized);
        let ppl = s.gates(&th).into_iter().find(|g| g.gate == "ppl_ratio");
        assert!(ppl.is_some_and(|g| !g.passed && g.value > 1.02));
    }

    #[test]
    fn admitting_noise_only_widens() {
        let th = LogitThresholds::for_weights(WeightClass::Quantized);
        let mut noise = stats(&[1.0, 0.0], &[1.0, 0.0], 2, &[0]);
        noise.positions = 63;
        // Quiet noise: the fixed bounds stay.
        assert_eq!(th.admitting(&noise), th);
        // Loud noise: mean KL up to twice the noise's, same-top-1 down by four binomial
        // standard errors of the noise's rate.
        noise.kld_mean = 0.0075;
        noise.same_top1_rate = 0.95;
        let wide = th.admitting(&noise);
        assert!((wide.kld_mean_max - 0.015).abs() < 1e-12);
        let se = (0.95f64 * 0.05 / 63.0).sqrt();
        assert!((wide.same_top1_min - (0.95 - 4.0 * se).min(th.same_top1_min)).abs() < 1e-12);
        assert_eq!(wide.ppl_ratio_tolerance, th.ppl_ratio_tolerance);
    }

    #[test]
    fn quantile_interpolates() {
        let v = [4.0, 1.0, 3.0, 2.0, 5.0];
        assert_eq!(quantile(&v, 0.5), Some(3.0));
        assert_eq!(quantile(&v, 1.0), Some(5.0));
        assert!(quantile(&v, 0.99).is_some_and(|q| (q - 4.96).abs() < 1e-12));
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn rejects_bad_shapes_and_targets() {
        assert!(logit_agreement(&[0.0; 4], &[0.0; 3], 2, &[0, 1]).is_err());
        assert!(logit_agreement(&[0.0; 4], &[0.0; 4], 2, &[0, 2]).is_err());
        assert!(logit_agreement(&[], &[], 2, &[]).is_err());
        assert!(logit_agreement(&[], &[], 0, &[0]).is_err());
    }

    #[test]
    fn nan_logits_fail_every_gate() {
        let s = stats(&[0.0, 1.0], &[f32::NAN, 1.0], 2, &[0]);
        let gates = s.gates(&LogitThresholds::for_weights(WeightClass::F32));
        assert!(gates
            .iter()
            .filter(|g| g.gate != "same_top1")
            .all(|g| !g.passed));
    }
}
