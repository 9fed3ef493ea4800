//! Choosing the next token from logits.
//!
//! The chain is llama.cpp's default order: repetition penalty → top-k → top-p → min-p →
//! temperature → a seeded draw. Top-p and min-p therefore see the distribution at temperature
//! 1; the temperature only shapes the final draw. Temperature 0 is greedy: the highest logit
//! after the repetition penalty, the lowest id on ties.
//!
//! The random source is xoshiro256** seeded through splitmix64, written out here so that a
//! seed gives the same tokens on every platform and every version of every dependency.
//! [`Sampler::distribution`] returns the exact distribution the draw uses, for tests and for
//! speculative decoding's acceptance rule.

/// Sampling parameters. Each filter is off at its neutral value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// 0 (or below) is greedy.
    pub temperature: f32,
    /// Keep the `top_k` highest logits; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability sums to at least
    /// `top_p`; 1.0 keeps all.
    pub top_p: f32,
    /// Keep tokens whose probability is at least `min_p` times the most likely one's; 0 keeps
    /// all.
    pub min_p: f32,
    /// Logits of tokens among the last `repeat_last_n` of the history are divided by this
    /// (multiplied when negative); 1.0 is off.
    pub repeat_penalty: f32,
    /// How much of the history the penalty looks at; 0 is off.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    /// llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, no penalty.
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding, nothing else.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            seed: 0,
        }
    }
}

/// splitmix64: one step, as in Vigna's reference `splitmix64.c`.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256**, seeded from splitmix64 as its authors recommend.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        Rng {
            s: [
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
            ],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A sampler: a configuration and the random state it advances.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        Sampler {
            rng: Rng::new(cfg.seed),
            cfg,
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// The next token. `history` is the sequence so far (prompt and generated tokens), used by
    /// the repetition penalty. Empty `logits` give 0; NaN logits are never chosen unless every
    /// logit is NaN.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(&self.penalized(logits, history));
        }
        let dist = self.distribution(logits, history);
        let u = self.rng.next_f64();
        let mut acc = 0.0f64;
        for &(id, p) in &dist {
            acc += p;
            if u < acc {
                return id;
            }
        }
        // Rounding left the sum a hair below 1 and u above it: the last candidate.
        dist.last().map_or(0, |&(id, _)| id)
    }

    /// The distribution the draw uses after every filter and the temperature: (id, probability)
    /// pairs, most likely first (ties: lower id first), probabilities summing to 1. Greedy
    /// configurations give the single argmax with probability 1.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f64)> {
        let pen = self.penalized(logits, history);
        if pen.is_empty() {
            return Vec::new();
        }
        if self.cfg.temperature <= 0.0 {
            return vec![(argmax(&pen), 1.0)];
        }
        let mut cand: Vec<(u32, f32)> = pen
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if cand.is_empty() {
            return vec![(0, 1.0)];
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));

        // top-k
        if self.cfg.top_k > 0 && self.cfg.top_k < cand.len() {
            cand.truncate(self.cfg.top_k);
        }
        // top-p: softmax over what is left, keep the shortest prefix reaching top_p.
        if self.cfg.top_p < 1.0 {
            let probs = softmax(&cand, 1.0);
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= f64::from(self.cfg.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        // min-p: p_i >= min_p · p_max  ⇔  l_i >= l_max + ln(min_p).
        if self.cfg.min_p > 0.0 {
            let max = f64::from(cand[0].1);
            let threshold = max + f64::from(self.cfg.min_p).ln();
            let keep = cand
                .iter()
                .take_while(|(_, l)| f64::from(*l) >= threshold)
                .count();
            cand.truncate(keep.max(1));
        }
        let probs = softmax(&cand, self.cfg.temperature);
        cand.iter().map(|&(id, _)| id).zip(probs).collect()
    }

    /// Logits with the repetition penalty applied to every distinct token among the last
    /// `repeat_last_n` of `history`.
    fn penalized<'l>(&self, logits: &'l [f32], history: &[u32]) -> std::borrow::Cow<'l, [f32]> {
        let p = self.cfg.repeat_penalty;
        if p == 1.0 || self.cfg.repeat_last_n == 0 {
            // No copy of the 262k logits per token when nothing changes them.
            return std::borrow::Cow::Borrowed(logits);
        }
        let mut out = logits.to_vec();
        let start = history.len().saturating_sub(self.cfg.repeat_last_n);
        let mut seen = std::collections::HashSet::new();
        for &id in &history[start..] {
            if !seen.insert(id) {
                continue;
            }
            if let Some(l) = out.get_mut(id as usize) {
                *l = if *l <= 0.0 { *l * p } else { *l / p };
            }
        }
        std::borrow::Cow::Owned(out)
    }
}

/// Index of the largest logit, lowest index on ties; NaN never wins unless all are NaN (then 0).
pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes the compiler vectorizes (the maximum, then its first position) instead of one
    // branchy pass: greedy decoding runs this over the whole vocabulary every token.
    // `f32::max` skips NaN, so the maximum is that of the non-NaN logits (NaN if all are).
    let max = logits.iter().copied().fold(f32::NAN, f32::max);
    logits
        .iter()
        .position(|&l| l == max)
        .map_or(0, |i| i as u32)
}

/// Softmax of `logits / temperature` in f64, candidates sorted by logit descending (the first
/// is the maximum). All `-inf` candidates share the mass equally.
fn softmax(cand: &[(u32, f32)], temperature: f32) -> Vec<f64> {
    let t = f64::from(temperature);
    let max = f64::from(cand[0].1);
    if max == f64::NEG_INFINITY {
        return vec![1.0 / cand.len() as f64; cand.len()];
    }
    let e: Vec<f64> = cand
        .iter()
        .map(|&(_, l)| {
            let l = f64::from(l);
            if l == max {
                1.0
            } else {
                ((l - max) / t).exp()
            }
        })
        .collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SamplerConfig {
        SamplerConfig {
            temperature: 1.0,
            ..SamplerConfig::greedy()
        }
    }

    /// Logits whose softmax is exactly `probs`.
    fn logits_of(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    /// Compares (id, probability) lists; 1e-6 covers f32 logits (ln of the hand values is
    /// rounded to f32, a relative error near 1e-7) pushed through an f64 softmax.
    fn check_dist(got: &[(u32, f64)], expect: &[(u32, f64)]) {
        assert_eq!(got.len(), expect.len(), "{got:?} vs {expect:?}");
        for (g, e) in got.iter().zip(expect) {
            assert_eq!(g.0, e.0, "{got:?} vs {expect:?}");
            approx::assert_abs_diff_eq!(g.1, e.1, epsilon = 1e-6);
        }
    }

    #[test]
    fn splitmix64_matches_the_reference_vectors() {
        // The first five outputs for seed 1234567 published with Vigna's splitmix64.c.
        let mut s = 1_234_567;
        let got: Vec<u64> = (0..5).map(|_| splitmix64(&mut s)).collect();
        assert_eq!(
            got,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423,
                4593380528125082431,
                16408922859458223821
            ]
        );
    }

    #[test]
    fn greedy_picks_argmax_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 1.9], &[]), 1);
        assert_eq!(s.sample(&[0.5, 3.0, 3.0, 1.0], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, -1.0, -2.0], &[]), 1);
        assert_eq!(s.sample(&[], &[]), 0);
        assert_eq!(s.sample(&[f32::NAN, f32::NAN], &[]), 0);
        assert_eq!(
            s.sample(&[f32::NEG_INFINITY, f32::NEG_INFINITY, -1e30], &[]),
            2
        );
        assert_eq!(
            s.sample(&[f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY], &[]),
            0
        );
        assert_eq!(s.sample(&[-0.0, 0.0, -0.0], &[]), 0);
        // A maximum after NaNs, and one on a long vocabulary's last entry.
        assert_eq!(s.sample(&[f32::NAN, 1.0, f32::NAN, 3.0, 3.0], &[]), 3);
        let mut long = vec![0.25f32; 262_144];
        long[262_143] = 0.5;
        assert_eq!(s.sample(&long, &[]), 262_143);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        // Penalty 2 on tokens 0 and 1: [2.0, -1.0, 1.5] → [1.0, -2.0, 1.5], argmax 2.
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            repeat_last_n: 64,
            ..SamplerConfig::greedy()
        };
        let logits = [2.0, -1.0, 1.5];
        assert_eq!(Sampler::new(c).sample(&logits, &[0, 1, 0]), 2);
        // Looking back one token penalizes only token 1: argmax stays 0.
        let c = SamplerConfig {
            repeat_last_n: 1,
            ..c
        };
        assert_eq!(Sampler::new(c).sample(&logits, &[0, 1]), 0);
        // In the distribution too: softmax([1.0, -2.0, 1.5]) at temperature 1.
        let c = SamplerConfig {
            temperature: 1.0,
            repeat_last_n: 64,
            ..c
        };
        let (e1, e2, e3) = (1f64.exp(), (-2f64).exp(), 1.5f64.exp());
        let z = e1 + e2 + e3;
        check_dist(
            &Sampler::new(c).distribution(&logits, &[0, 1]),
            &[(2, e3 / z), (0, e1 / z), (1, e2 / z)],
        );
    }

    #[test]
    fn top_k_keeps_the_k_highest() {
        // softmax([3, 2]) = [e/(e+1), 1/(e+1)].
        let e = 1f64.exp();
        let c = SamplerConfig { top_k: 2, ..cfg() };
        check_dist(
            &Sampler::new(c).distribution(&[1.0, 3.0, 2.0, 0.0], &[]),
            &[(1, e / (e + 1.0)), (2, 1.0 / (e + 1.0))],
        );
    }

    #[test]
    fn top_p_keeps_the_shortest_prefix_reaching_p() {
        let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
        // 0.5 < 0.75 ≤ 0.8: two tokens, renormalized 0.5/0.8 and 0.3/0.8.
        let c = SamplerConfig {
            top_p: 0.75,
            ..cfg()
        };
        check_dist(
            &Sampler::new(c).distribution(&logits, &[]),
            &[(0, 0.625), (1, 0.375)],
        );
        // 0.8 < 0.85 ≤ 0.95: three tokens.
        let c = SamplerConfig {
            top_p: 0.85,
            ..cfg()
        };
        check_dist(
            &Sampler::new(c).distribution(&logits, &[]),
            &[(0, 0.5 / 0.95), (1, 0.3 / 0.95), (2, 0.15 / 0.95)],
        );
    }

    #[test]
    fn min_p_keeps_tokens_above_a_fraction_of_the_best() {
        let logits = logits_of(&[0.5, 0.3, 0.15, 0.05]);
        // Threshold 0.2 · 0.5 = 0.1: 0.05 goes.
        let c = SamplerConfig {
            min_p: 0.2,
            ..cfg()
        };
        check_dist(
            &Sampler::new(c).distribution(&logits, &[]),
            &[(0, 0.5 / 0.95), (1, 0.3 / 0.95), (2, 0.15 / 0.95)],
        );
        // Threshold 0.5 · 0.5 = 0.25: 0.5 and 0.3 stay.
        let c = SamplerConfig {
            min_p: 0.5,
            ..cfg()
        };
        check_dist(
            &Sampler::new(c).distribution(&logits, &[]),
            &[(0, 0.625), (1, 0.375)],
        );
    }

    #[test]
    fn temperature_scales_logits() {
        // Logits [0, ln 2] at temperature 0.5 are [0, 2 ln 2]: weights 1 and 4.
        let c = SamplerConfig {
            temperature: 0.5,
            ..cfg()
        };
        check_dist(
            &Sampler::new(c).distribution(&[0.0, 2f32.ln()], &[]),
            &[(1, 0.8), (0, 0.2)],
        );
    }

    #[test]
    fn top_k_runs_before_top_p() {
        // After top-k 2, [0.4, 0.3] renormalizes to [4/7, 3/7]; 4/7 ≥ 0.5 so top-p keeps one.
        // Top-p first on the full distribution would have kept two (0.4 < 0.5).
        let c = SamplerConfig {
            top_k: 2,
            top_p: 0.5,
            ..cfg()
        };
        let logits = logits_of(&[0.4, 0.3, 0.2, 0.1]);
        check_dist(&Sampler::new(c).distribution(&logits, &[]), &[(0, 1.0)]);
    }

    #[test]
    fn same_seed_same_sequence() {
        let c = SamplerConfig {
            seed: 42,
            ..SamplerConfig::default()
        };
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7) % 11) as f32 * 0.3).collect();
        let run = |c: SamplerConfig| {
            let mut s = Sampler::new(c);
            (0..200).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(c), run(c));
        assert_ne!(run(c), run(SamplerConfig { seed: 43, ..c }));
    }

    #[test]
    fn empirical_frequencies_match_the_filtered_softmax() {
        let c = SamplerConfig {
            temperature: 0.7,
            top_k: 4,
            top_p: 0.9,
            min_p: 0.05,
            seed: 7,
            ..SamplerConfig::greedy()
        };
        let logits = [2.0, 1.5, 1.0, 0.2, -0.5, -2.0];
        // By hand: top-k 4 leaves [2.0, 1.5, 1.0, 0.2]; their softmax is [0.4674, 0.2835,
        // 0.1719, 0.0773], cumulative 0.4674, 0.7508, 0.9227 ≥ 0.9, so top-p leaves three;
        // min-p 0.05 · 0.4674 removes none of them; at temperature 0.7 the weights are
        // exp((l − 2)/0.7) = 1, 0.4895, 0.2397, normalized below.
        let expect = [0.578_304_5, 0.283_104_2, 0.138_591_3];
        let mut s = Sampler::new(c);
        let dist = s.distribution(&logits, &[]);
        check_dist(&dist, &[(0, expect[0]), (1, expect[1]), (2, expect[2])]);
        let n = 20_000usize;
        let mut counts = [0usize; 6];
        for _ in 0..n {
            counts[s.sample(&logits, &[]) as usize] += 1;
        }
        assert_eq!(
            counts[3] + counts[4] + counts[5],
            0,
            "filtered tokens drawn"
        );
        for (i, &p) in expect.iter().enumerate() {
            // Each count is Binomial(n, p): 5 standard deviations leave a false alarm chance
            // below 1e-6 per token for a correct sampler (and the seed is fixed anyway).
            let mean = n as f64 * p;
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            let dev = (counts[i] as f64 - mean).abs();
            assert!(
                dev <= 5.0 * sd,
                "token {i}: {} draws, expected {mean:.0} ± {sd:.0}",
                counts[i]
            );
        }
    }
}
