//! Sampled acceptance on general distributions (issue 28). `spec_exact_law.rs` checks the law
//! with probabilities that are multiples of 1/8; a rule that is lossless only for such special
//! probabilities would pass it. Here the target's probabilities are arbitrary:
//!
//! 1. **Exact, rational**: probabilities `k / 997` (997 prime, every `k` from a hash of the
//!    context, none a power-of-two fraction). Every script of drawn tokens is enumerated with its
//!    probability (the product of `k`s of the draws at the contexts they happened in), and the
//!    emitted sequences' total weights must equal the target's law as integers over `997^N`.
//! 2. **The random stream**: the walk draws once per emitted token, from the target's row at the
//!    emitted text, with the engine's `Sampler`. So speculative sampling with seed `s` must emit
//!    exactly what plain sampling with seed `s` does, token for token, for every drafter and tree
//!    shape (budgets up to 96 nodes, past the ancestor bitset's first word), on general logits
//!    through temperature, top-k, top-p, min-p and a repetition penalty.
//! 3. **χ²**: speculative sampling over many seeds against the target's law computed in f64 from
//!    the same filtered distribution, without plain sampling in the loop.
//!
//! Run with `PLUMBLINE_FAULT=accept-by-draft-probability` (or `accept-past-rejection`,
//! `accept-zero-probability`) and `--features fault-injection` to see them fail.

use std::collections::HashMap;

use engine::sampling::{Sampler, SamplerConfig};
use engine::spec::{
    walk, Flow, Limits, NgramProposer, Proposer, SamplerTarget, SpecError, TableProposer, Target,
    Tree, TreeShape, Walk,
};

/// Tree shapes of every kind the CLI builds: a chain, wide and shallow, deep, and budgets past
/// 64 nodes.
fn shapes() -> Vec<TreeShape> {
    vec![
        TreeShape::new(1, 1),
        TreeShape::new(4, 4),
        TreeShape {
            budget: 8,
            top_k: 1,
            max_depth: 8,
        },
        TreeShape {
            budget: 16,
            top_k: 3,
            max_depth: 4,
        },
        TreeShape {
            budget: 96,
            top_k: 4,
            max_depth: 6,
        },
    ]
}

fn hash(ctx: &[u32], salt: u64) -> u64 {
    ctx.iter().fold(salt, |a, &t| {
        (a ^ (u64::from(t) + 0x9e37)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Drafters as tables of a context: one that proposes the target's likely tokens, one its
/// unlikely ones, and one that ignores it.
type Table = Box<dyn FnMut(&[u32]) -> Vec<(u32, f64)>>;

/// [`drafters`]' tables as proposers, and the n-gram drafter beside them.
fn every_drafter(v: u32, target: fn(&[u32]) -> Vec<f64>) -> Vec<(&'static str, Box<dyn Proposer>)> {
    let mut all: Vec<(&str, Box<dyn Proposer>)> = drafters(v, target)
        .into_iter()
        .map(|(n, t)| (n, Box::new(TableProposer { table: t }) as Box<dyn Proposer>))
        .collect();
    all.push(("ngram", Box::new(NgramProposer::new(2048))));
    all
}

fn drafters(v: u32, target: fn(&[u32]) -> Vec<f64>) -> Vec<(&'static str, Table)> {
    let ranked = move |ctx: &[u32], best_first: bool| {
        let p = target(ctx);
        let mut t: Vec<u32> = (0..v).collect();
        t.sort_by(|&a, &b| {
            let o = p[a as usize].total_cmp(&p[b as usize]);
            if best_first {
                o.reverse()
            } else {
                o
            }
        });
        t.into_iter()
            .enumerate()
            .map(|(r, x)| (x, -(r as f64) * 0.7 - 0.05))
            .collect::<Vec<_>>()
    };
    vec![
        (
            "likely first",
            Box::new(move |c: &[u32]| ranked(c, true)) as Table,
        ),
        (
            "unlikely first",
            Box::new(move |c: &[u32]| ranked(c, false)),
        ),
        (
            "arbitrary",
            Box::new(move |c: &[u32]| {
                let h = hash(c, 3);
                let mut out: Vec<(u32, f64)> = Vec::new();
                for i in 0..4 {
                    let t = ((h >> (8 * i)) % u64::from(v)) as u32;
                    if out.iter().all(|&(u, _)| u != t) {
                        out.push((t, -(i as f64) - 0.3));
                    }
                }
                out
            }),
        ),
    ]
}

/// A round's walk of a tree after the text, emitting through the given function.
type WalkTree<'a> = dyn FnMut(&Tree, &mut Vec<u32>, &mut dyn FnMut(u32) -> Flow) -> Walk + 'a;

/// Speculative generation of `n` tokens after `prompt`: each round `drafter` proposes a tree
/// after the text and `walk_tree` walks it (its target, over the tree, is the caller's), until
/// the limit stops the walk. Returns the emitted tokens.
fn rounds(
    prompt: &[u32],
    drafter: &mut dyn Proposer,
    shape: TreeShape,
    n: usize,
    walk_tree: &mut WalkTree<'_>,
) -> Vec<u32> {
    let limits = Limits {
        max_tokens: n,
        ..Limits::default()
    };
    let mut history = prompt.to_vec();
    let mut out: Vec<u32> = Vec::new();
    loop {
        let tree = drafter
            .propose(&history, shape)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut emit = |t: u32| {
            let f = limits.after(&out, t);
            if f != Flow::StopBefore {
                out.push(t);
            }
            f
        };
        if walk_tree(&tree, &mut history, &mut emit).stopped {
            return out;
        }
    }
}

/// Walk `tree` after `history` with `sampler` drawing from `logits` of each node's path text.
fn sampled_walk(
    tree: &Tree,
    history: &mut Vec<u32>,
    emit: &mut dyn FnMut(u32) -> Flow,
    sampler: &mut Sampler,
    logits: fn(&[u32]) -> Vec<f32>,
) -> Walk {
    let base = history.clone();
    let row = |node: usize| -> Result<Vec<f32>, SpecError> {
        let mut ctx = base.clone();
        ctx.extend(tree.path_tokens(node));
        Ok(logits(&ctx))
    };
    let mut target = SamplerTarget::new(row, sampler);
    walk(tree, &mut target, history, emit).unwrap_or_else(|e| panic!("{e}"))
}

// ---------------------------------------------------------------------------------------------
// 1. Exact, rational.

const DEN: u128 = 997;
const V3: u32 = 3;
const N3: usize = 4;

/// `k` of 997 for each of three tokens after `ctx`: arbitrary, some zero.
fn k997(ctx: &[u32]) -> [u128; 3] {
    let h = hash(ctx, 11);
    // In three contexts of five one token is impossible (its mass moved to the next).
    let zero = (h % 5) as usize;
    let a = 1 + (h >> 8) % 995; // 1..=995
    let b = (h >> 20) % (997 - a);
    let mut k = [a as u128, b as u128, (997 - a - b) as u128];
    if zero < 3 && k[zero] < 997 {
        let moved = k[zero];
        k[zero] = 0;
        k[(zero + 1) % 3] += moved;
    }
    k
}

fn k997_probs(ctx: &[u32]) -> Vec<f64> {
    k997(ctx).iter().map(|&k| k as f64 / DEN as f64).collect()
}

/// Draws the next token of a script, and records the weight (`k`) of each draw at the context
/// it happened in: the node's path text.
struct Scripted<'a> {
    base: Vec<u32>,
    tree: &'a Tree,
    script: &'a [u32],
    used: &'a mut usize,
    weight: &'a mut u128,
}

impl Target for Scripted<'_> {
    fn draw(&mut self, node: usize, _history: &[u32]) -> Result<u32, SpecError> {
        let mut ctx = self.base.clone();
        ctx.extend(self.tree.path_tokens(node));
        let t = *self
            .script
            .get(*self.used)
            .ok_or_else(|| SpecError::Config("more draws than emitted tokens".into()))?;
        *self.used += 1;
        *self.weight *= k997(&ctx)[t as usize];
        Ok(t)
    }

    fn prob(&mut self, node: usize, _history: &[u32], token: u32) -> Result<f64, SpecError> {
        let mut ctx = self.base.clone();
        ctx.extend(self.tree.path_tokens(node));
        Ok(k997(&ctx)[token as usize] as f64 / DEN as f64)
    }

    fn sampling(&self) -> bool {
        true
    }
}

/// One speculative generation of `N3` tokens whose draws are `script`; the emitted tokens and
/// the script's probability numerator (over 997^draws).
fn scripted_generation(
    prompt: &[u32],
    drafter: &mut dyn Proposer,
    shape: TreeShape,
    script: &[u32],
) -> (Vec<u32>, u128) {
    let (mut used, mut weight) = (0, 1u128);
    let out = rounds(prompt, drafter, shape, N3, &mut |tree, history, emit| {
        let mut target = Scripted {
            base: history.clone(),
            tree,
            script,
            used: &mut used,
            weight: &mut weight,
        };
        walk(tree, &mut target, history, emit).unwrap_or_else(|e| panic!("{e}"))
    });
    assert_eq!(used, N3, "one draw per emitted token");
    (out, weight)
}

/// The target's law of every `N3`-token sequence after `prompt`, numerators over 997^N3.
fn law997(prompt: &[u32]) -> HashMap<Vec<u32>, u128> {
    let mut out = HashMap::new();
    let mut stack = vec![(Vec::new(), 1u128)];
    while let Some((seq, w)) = stack.pop() {
        if seq.len() == N3 {
            out.insert(seq, w);
            continue;
        }
        let mut ctx = prompt.to_vec();
        ctx.extend_from_slice(&seq);
        for (t, &k) in k997(&ctx).iter().enumerate() {
            if k > 0 {
                let mut s = seq.clone();
                s.push(t as u32);
                stack.push((s, w * k));
            }
        }
    }
    out
}

#[test]
fn emitted_sequences_follow_a_law_of_arbitrary_rational_probabilities_exactly() {
    let prompts = [vec![0u32], vec![2, 1, 0, 2, 1, 0, 2]];
    for prompt in &prompts {
        let want = law997(prompt);
        let mut drafters = every_drafter(V3, k997_probs);
        for (name, d) in &mut drafters {
            for shape in shapes() {
                let mut got: HashMap<Vec<u32>, u128> = HashMap::new();
                let mut total = 0u128;
                for i in 0..V3.pow(N3 as u32) {
                    let script: Vec<u32> = (0..N3).map(|j| (i / V3.pow(j as u32)) % V3).collect();
                    let (seq, w) = scripted_generation(prompt, d.as_mut(), shape, &script);
                    assert_eq!(
                        seq, script,
                        "{name} {shape:?}: the walk emits what it draws"
                    );
                    total += w;
                    *got.entry(seq).or_default() += w;
                }
                assert_eq!(
                    total,
                    DEN.pow(N3 as u32),
                    "{name} {shape:?}: the law sums to 1"
                );
                for (seq, w) in &want {
                    assert_eq!(
                        got.get(seq).copied().unwrap_or(0),
                        *w,
                        "{name} {shape:?} after {prompt:?}: P({seq:?}) ≠ the target's \
                         {w}/997^{N3}"
                    );
                }
                let extra: u128 = got
                    .iter()
                    .filter(|(s, _)| !want.contains_key(*s))
                    .map(|(_, w)| w)
                    .sum();
                assert_eq!(
                    extra, 0,
                    "{name} {shape:?}: a sequence of probability 0 emitted"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 2. The random stream: speculative sampling equals plain sampling token for token.

const V: u32 = 40;
const N: usize = 24;

/// General logits over `V` tokens after `ctx` (a spread that the filters act on).
fn logits(ctx: &[u32]) -> Vec<f32> {
    let h = hash(ctx, 7);
    (0..V)
        .map(|t| {
            let x = hash(&[t], h) % 10_000;
            (x as f32 / 10_000.0) * 6.0 - 3.0 + if t == (h % 11) as u32 { 2.5 } else { 0.0 }
        })
        .collect()
}

fn softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = l.iter().map(|&x| f64::from(x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

fn logit_probs(ctx: &[u32]) -> Vec<f64> {
    softmax(&logits(ctx))
}

fn configs() -> Vec<SamplerConfig> {
    vec![
        // Plain softmax: greedy's neutral filters at temperature 1.
        SamplerConfig {
            temperature: 1.0,
            ..SamplerConfig::greedy()
        },
        SamplerConfig::default(),
        SamplerConfig {
            temperature: 0.7,
            top_k: 12,
            top_p: 0.8,
            min_p: 0.02,
            repeat_penalty: 1.3,
            repeat_last_n: 16,
            seed: 0,
        },
    ]
}

fn plain(prompt: &[u32], cfg: SamplerConfig) -> Vec<u32> {
    let mut s = Sampler::new(cfg);
    let mut history = prompt.to_vec();
    for _ in 0..N {
        let t = s.sample(&logits(&history), &history);
        history.push(t);
    }
    history.split_off(prompt.len())
}

fn speculative(
    prompt: &[u32],
    cfg: SamplerConfig,
    drafter: &mut dyn Proposer,
    shape: TreeShape,
) -> Vec<u32> {
    let mut s = Sampler::new(cfg);
    rounds(prompt, drafter, shape, N, &mut |tree, history, emit| {
        sampled_walk(tree, history, emit, &mut s, logits)
    })
}

#[test]
fn speculative_sampling_consumes_the_random_stream_as_plain_sampling_does() {
    // A prompt that repeats, so the n-gram drafter proposes from the start.
    let prompt: Vec<u32> = (0..30).map(|i| [3, 9, 27, 3, 9, 14][i % 6]).collect();
    for cfg in configs() {
        for seed in 0..12 {
            let cfg = SamplerConfig { seed, ..cfg };
            let want = plain(&prompt, cfg);
            let mut drafters = every_drafter(V, logit_probs);
            for (name, d) in &mut drafters {
                for shape in shapes() {
                    let got = speculative(&prompt, cfg, d.as_mut(), shape);
                    assert_eq!(
                        got, want,
                        "{name} {shape:?} {cfg:?}: speculative sampling parted from plain \
                         sampling with the same seed"
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. χ² against the law, many seeds.

/// The χ² statistic's value at upper-tail probability `alpha` for `dof` degrees of freedom
/// (Wilson–Hilferty).
fn chi2_critical(dof: f64, z: f64) -> f64 {
    let a = 2.0 / (9.0 * dof);
    dof * (1.0 - a + z * a.sqrt()).powi(3)
}

#[test]
fn speculative_sampling_follows_the_law_of_general_distributions_by_chi_square() {
    // Three tokens of a 4-token vocabulary; probabilities arbitrary and all at least 0.06, so
    // every one of the 64 sequences expects at least 5 of the runs.
    const V4: u32 = 4;
    const N4: usize = 3;
    fn probs(ctx: &[u32]) -> Vec<f64> {
        let h = hash(ctx, 23);
        let raw: Vec<f64> = (0..V4)
            .map(|t| 0.25 + ((hash(&[t], h) % 1000) as f64 / 1000.0))
            .collect();
        let s: f64 = raw.iter().sum();
        raw.into_iter().map(|x| x / s).collect()
    }
    fn logits4(ctx: &[u32]) -> Vec<f32> {
        probs(ctx).iter().map(|p| p.ln() as f32).collect()
    }
    let cfg = SamplerConfig {
        temperature: 1.0,
        ..SamplerConfig::greedy()
    };
    let prompt = vec![1u32, 3, 1, 3, 1];
    let runs = 30_000u64;
    let mut drafter = TableProposer {
        table: |c: &[u32]| {
            let p = probs(c);
            let mut t: Vec<u32> = (0..V4).collect();
            t.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
            t.into_iter()
                .enumerate()
                .map(|(r, x)| (x, -(r as f64) - 0.1))
                .collect()
        },
    };
    let shape = TreeShape::new(6, 2);
    let mut counts: HashMap<Vec<u32>, u64> = HashMap::new();
    for seed in 0..runs {
        let mut s = Sampler::new(SamplerConfig { seed, ..cfg });
        let out = rounds(
            &prompt,
            &mut drafter,
            shape,
            N4,
            &mut |tree, history, emit| sampled_walk(tree, history, emit, &mut s, logits4),
        );
        *counts.entry(out).or_default() += 1;
    }
    let mut chi2 = 0.0;
    let mut bins = 0;
    for i in 0..V4.pow(N4 as u32) {
        let seq: Vec<u32> = (0..N4).map(|j| (i / V4.pow(j as u32)) % V4).collect();
        let mut ctx = prompt.clone();
        let mut p = 1.0;
        for &t in &seq {
            p *= probs(&ctx)[t as usize];
            ctx.push(t);
        }
        let expected = p * runs as f64;
        assert!(expected >= 5.0, "{seq:?} expects {expected:.1} runs");
        let o = counts.get(&seq).copied().unwrap_or(0) as f64;
        chi2 += (o - expected).powi(2) / expected;
        bins += 1;
    }
    assert_eq!(counts.values().sum::<u64>(), runs);
    assert_eq!(
        counts.len(),
        bins,
        "only sequences of the vocabulary are emitted"
    );
    // p = 1e-6 (z = 4.75): a lossless walk fails this once in a million seeds sets; the
    // fixed seeds make it deterministic.
    let critical = chi2_critical((bins - 1) as f64, 4.75);
    assert!(
        chi2 < critical,
        "χ² = {chi2:.1} over {bins} sequences (critical {critical:.1} at p = 1e-6)"
    );
}
