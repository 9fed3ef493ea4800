//! The exact law: with a target and drafters given as tables on a three-token vocabulary and a
//! discrete random source (each draw is a coin with 8 equally likely values), enumerate every
//! coin sequence and check that the distribution of emitted sequences equals the target's law
//! exactly.
//!
//! Exact arithmetic: every target probability is `k / 8` with integer `k`, every coin sequence
//! of length N has probability `1 / 8^N`, and the walk draws once per emitted token, so the
//! probability of an emitted sequence is (number of coin sequences that emit it) / 8^N and the
//! target's law of that sequence is (product of its `k`s) / 8^N. The test compares the two
//! numerators as integers: rational equality with the common denominator 8^N.
//!
//! The round loop here is `spec::generate`'s (draft, walk, keep the path) with the target's
//! verify logits replaced by the table at each node's *path* (what the verify forward computes
//! for that node), so a walk that follows a path other than the emitted text (a rejection not
//! honoured) draws from the wrong row and changes the law. Run with
//! `PLUMBLINE_FAULT=accept-zero-probability` (or `accept-by-draft-probability`,
//! `accept-past-rejection`) and `--features fault-injection` to see it fail.

use std::collections::HashMap;

use engine::spec::{
    walk, Flow, Limits, NgramProposer, Proposer, SpecError, TableProposer, Target, Tree, TreeShape,
};

/// Coin values per draw.
const M: u64 = 8;
/// Tokens emitted per run.
const N: usize = 4;
const V: u32 = 3;

/// The target: `k[t]` of 8 for each token after `ctx` (zeros included), from a hash of the
/// whole context, so the law depends on every earlier token.
fn target_k(ctx: &[u32]) -> [u64; 3] {
    const PATTERNS: [[u64; 3]; 6] = [
        [8, 0, 0],
        [4, 4, 0],
        [2, 3, 3],
        [1, 0, 7],
        [0, 5, 3],
        [6, 1, 1],
    ];
    let h = ctx.iter().fold(17u64, |a, &t| {
        a.wrapping_mul(31).wrapping_add(u64::from(t) + 1)
    });
    let p = PATTERNS[(h % 6) as usize];
    let r = ((h / 6) % 3) as usize;
    [p[r % 3], p[(r + 1) % 3], p[(r + 2) % 3]]
}

/// Draws from the table at each node's path with the next coin of `coins`.
struct TableTarget<'a> {
    base: Vec<u32>,
    tree: &'a Tree,
    coins: &'a [u64],
    used: &'a mut usize,
}

impl TableTarget<'_> {
    fn text(&self, node: usize) -> Vec<u32> {
        let mut t = self.base.clone();
        t.extend(self.tree.path_tokens(node));
        t
    }
}

impl Target for TableTarget<'_> {
    fn draw(&mut self, node: usize, _history: &[u32]) -> Result<u32, SpecError> {
        let k = target_k(&self.text(node));
        let coin = *self
            .coins
            .get(*self.used)
            .ok_or_else(|| SpecError::Config("more draws than emitted tokens".into()))?;
        *self.used += 1;
        // Inverse CDF with `coin < cumulative`: a token with k = 0 is never drawn.
        let mut acc = 0;
        for (t, &kt) in k.iter().enumerate() {
            acc += kt;
            if coin < acc {
                return Ok(t as u32);
            }
        }
        Err(SpecError::Config(
            "the table's counts do not sum to 8".into(),
        ))
    }

    fn prob(&mut self, node: usize, _history: &[u32], token: u32) -> Result<f64, SpecError> {
        let k = target_k(&self.text(node));
        Ok(k.get(token as usize).map_or(0.0, |&x| x as f64 / M as f64))
    }

    fn sampling(&self) -> bool {
        true
    }
}

/// One speculative generation of `N` tokens after `prompt` with the coins `coins`.
fn generate(
    prompt: &[u32],
    drafter: &mut dyn Proposer,
    shape: TreeShape,
    coins: &[u64],
) -> Vec<u32> {
    let limits = Limits {
        max_tokens: N,
        ..Limits::default()
    };
    let mut history = prompt.to_vec();
    let mut out: Vec<u32> = Vec::new();
    let mut used = 0;
    loop {
        let tree = drafter
            .propose(&history, shape)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut target = TableTarget {
            base: history.clone(),
            tree: &tree,
            coins,
            used: &mut used,
        };
        let mut emit = |t: u32| {
            let f = limits.after(&out, t);
            if f != Flow::StopBefore {
                out.push(t);
            }
            f
        };
        let w = walk(&tree, &mut target, &mut history, &mut emit).unwrap_or_else(|e| panic!("{e}"));
        if w.stopped {
            return out;
        }
    }
}

/// The target's law of every length-N sequence, as numerators over 8^N.
fn law(prompt: &[u32]) -> HashMap<Vec<u32>, u64> {
    let mut out = HashMap::new();
    let mut stack = vec![(Vec::new(), 1u64)];
    while let Some((seq, w)) = stack.pop() {
        if seq.len() == N {
            out.insert(seq, w);
            continue;
        }
        let mut ctx = prompt.to_vec();
        ctx.extend_from_slice(&seq);
        for (t, &k) in target_k(&ctx).iter().enumerate() {
            if k > 0 {
                let mut s = seq.clone();
                s.push(t as u32);
                stack.push((s, w * k));
            }
        }
    }
    out
}

fn enumerate(
    prompt: &[u32],
    drafter: &mut dyn Proposer,
    shape: TreeShape,
) -> HashMap<Vec<u32>, u64> {
    let mut counts = HashMap::new();
    let total = M.pow(N as u32);
    for i in 0..total {
        let coins: Vec<u64> = (0..N).map(|d| (i / M.pow(d as u32)) % M).collect();
        *counts
            .entry(generate(prompt, drafter, shape, &coins))
            .or_insert(0) += 1;
    }
    counts
}

type Table = Box<dyn FnMut(&[u32]) -> Vec<(u32, f64)>>;

/// Drafters: friendly, adversarial (the target's impossible tokens first), constant, arbitrary.
fn drafters() -> Vec<(&'static str, Table)> {
    let by_k = |ctx: &[u32], best_first: bool| {
        let k = target_k(ctx);
        let mut t: Vec<u32> = (0..V).collect();
        t.sort_by_key(|&x| {
            if best_first {
                u64::MAX - k[x as usize]
            } else {
                k[x as usize]
            }
        });
        t.into_iter()
            .enumerate()
            .map(|(r, x)| (x, -(r as f64) - 0.1))
            .collect::<Vec<_>>()
    };
    vec![
        (
            "target's best first",
            Box::new(move |c: &[u32]| by_k(c, true)) as Table,
        ),
        (
            "target's impossible first",
            Box::new(move |c: &[u32]| by_k(c, false)),
        ),
        (
            "constant",
            Box::new(|_: &[u32]| vec![(2, -0.05), (0, -0.1), (1, -3.0)]),
        ),
        (
            "arbitrary",
            Box::new(|c: &[u32]| {
                let h = c
                    .iter()
                    .fold(5u32, |a, &t| a.wrapping_mul(7).wrapping_add(t));
                vec![(h % V, -0.2), ((h + 1) % V, -1.0)]
            }),
        ),
    ]
}

fn shapes() -> Vec<TreeShape> {
    vec![
        TreeShape::new(1, 1),
        TreeShape::new(3, 2),
        TreeShape::new(6, 3),
        TreeShape {
            budget: 8,
            top_k: 3,
            max_depth: 3,
        },
    ]
}

fn check(name: &str, shape: TreeShape, prompt: &[u32], got: &HashMap<Vec<u32>, u64>) {
    let want = law(prompt);
    assert_eq!(
        got.values().sum::<u64>(),
        M.pow(N as u32),
        "every coin sequence emits one sequence"
    );
    for (seq, &n) in got {
        let w = want.get(seq).copied().unwrap_or(0);
        assert_eq!(
            n, w,
            "{name} {shape:?}: P({seq:?}) = {n}/8^{N}, the target's law says {w}/8^{N}"
        );
    }
    for (seq, &w) in &want {
        assert_eq!(
            got.get(seq).copied().unwrap_or(0),
            w,
            "{name} {shape:?}: {seq:?} missing"
        );
    }
}

#[test]
fn emitted_sequences_follow_the_target_law_exactly_for_table_drafters() {
    for prompt in [vec![0u32], vec![2, 1, 1]] {
        for (name, table) in drafters() {
            let mut d = TableProposer { table };
            for shape in shapes() {
                let got = enumerate(&prompt, &mut d, shape);
                check(name, shape, &prompt, &got);
            }
        }
    }
}

#[test]
fn emitted_sequences_follow_the_target_law_exactly_for_the_ngram_drafter() {
    // A prompt with repeats so the n-gram drafter proposes.
    let prompt = vec![0u32, 1, 2, 0, 1, 2, 0, 1];
    for shape in shapes() {
        let mut d = NgramProposer::new(2048);
        let got = enumerate(&prompt, &mut d, shape);
        check("ngram", shape, &prompt, &got);
    }
}

#[test]
fn the_check_can_fail() {
    // A walk that emits the drafted token instead of the drawn one changes the law: shown by
    // perturbing the counts as such a walk would (moving one coin sequence's outcome).
    let prompt = vec![0u32];
    let mut d = TableProposer {
        table: Box::new(|_: &[u32]| vec![(1u32, -0.1)]) as Table,
    };
    let mut got = enumerate(&prompt, &mut d, TreeShape::new(2, 1));
    let (k1, _) = got
        .iter()
        .next()
        .map(|(k, v)| (k.clone(), *v))
        .unwrap_or_default();
    *got.entry(k1).or_insert(0) -= 1;
    *got.entry(vec![9; N]).or_insert(0) += 1;
    let r = std::panic::catch_unwind(|| check("perturbed", TreeShape::new(2, 1), &prompt, &got));
    assert!(r.is_err(), "a perturbed law must not pass");
}
