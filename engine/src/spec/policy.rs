//! Choosing the node budget: from the measured cost of verifying `n` tokens and the observed
//! acceptance, speculate with the budget that gives the most tokens per second, or decode plainly
//! when no budget beats one token per plain step.
//!
//! Acceptance is observed exactly, also for budgets not run: target-only acceptance emits the
//! tokens plain decoding would emit, and the tree of budget `b` is the first `b` nodes of the
//! tree of any larger budget (best-first order is the same), so once the tokens after a tree are
//! known, the tokens budget `b` would have accepted is the number of nodes `≤ b` on the path of
//! the tree that matches them. The policy keeps each round's tree (also on plain rounds, when
//! drafting is cheap) until its continuation is known, and keeps a running mean of accepted
//! tokens per budget.

use std::collections::VecDeque;

use super::tree::{Tree, TreeShape};

/// The measured cost of a verify: the target's layers over `n` tokens, and one head row.
#[derive(Clone, Debug, PartialEq)]
pub struct CostCurve {
    /// Seconds of the layers over `n` tokens, `secs[n - 1]`.
    pub secs: Vec<f64>,
    /// Seconds of one row through the output norm and head.
    pub head_row: f64,
}

impl CostCurve {
    /// Seconds for `n` tokens (`n ≥ 1`; past the measured range, linear from the last two).
    /// Never less than for fewer tokens: a noisy measurement must not make a larger verify look
    /// cheaper than a smaller one.
    pub fn secs(&self, n: usize) -> f64 {
        let n = n.max(1);
        let upto = n.min(self.secs.len());
        let floor = self.secs[..upto].iter().copied().fold(0.0, f64::max);
        floor.max(self.raw_secs(n))
    }

    fn raw_secs(&self, n: usize) -> f64 {
        match self.secs.len() {
            0 => n as f64,
            len if n <= len => self.secs[n - 1],
            1 => self.secs[0] * n as f64,
            len => {
                let slope = (self.secs[len - 1] - self.secs[len - 2]).max(0.0);
                self.secs[len - 1] + slope * (n - len) as f64
            }
        }
    }

    /// Seconds of a verify of `n` tokens whose walk reads `rows` head rows.
    pub fn verify_secs(&self, n: usize, rows: f64) -> f64 {
        self.secs(n) + rows * self.head_row
    }

    /// Cost of a verify of `n` tokens with `rows` head rows over a plain decode step.
    pub fn ratio(&self, n: usize, rows: f64) -> f64 {
        self.verify_secs(n, rows) / self.verify_secs(1, 1.0).max(f64::MIN_POSITIVE)
    }
}

/// A costly drafter is tried only if, with every draft token accepted, some budget would beat
/// plain decoding by this factor: learning its acceptance costs drafts and verifies that gain
/// nothing when it is poor, and a best case under 1.25× cannot win that back within a short
/// generation (a self-draft of Gemma 3 270M, whose 262k-row head is 0.6 of a decode step, has a
/// best case of about 1.1×; a small model drafting for a large one, 2–4×).
pub const PROBE_WORTH: f64 = 1.25;

/// The policy's state.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Budgets considered (0 is plain decoding).
    pub budgets: Vec<usize>,
    pub cost: CostCurve,
    /// Mean accepted draft tokens per round for each budget, and rounds observed.
    accepted: Vec<f64>,
    observed: usize,
    /// Mean seconds of drafting one depth level (a model drafter's forward), measured.
    pub draft_level_secs: f64,
    /// Deepest draft (the tree shape's `max_depth`): a costly drafter runs one forward per level,
    /// `min(budget, max_depth)` levels for budget `budget`.
    pub max_depth: usize,
    /// Seconds of a one-row head pass (the cost curve's `head_row` when the policy was made,
    /// before a multi-row plan reprices verify rows): a plain step's head and a self-draft's.
    pub head_one: f64,
    /// `draft_level_secs` is [`Policy::self_draft`]'s estimate, not yet a measurement.
    draft_estimated: bool,
    /// Trees waiting for their continuation: (index in the output where the tree's first
    /// draft token would go, tree).
    pending: VecDeque<(usize, Tree)>,
    /// A budget must beat plain decoding by this factor to be chosen (hysteresis against noise
    /// in the measured costs).
    pub margin: f64,
    /// Trees observed before the first choice from observations; until then the smallest
    /// budget (plain decoding once a measured draft is too costly to ever pay), or plain
    /// decoding when `shadow` (a cheap drafter's trees are observed on plain rounds too, so
    /// nothing is spent on speculation that may not pay).
    pub warmup: usize,
    pub shadow: bool,
}

impl Policy {
    pub fn new(max_budget: usize, cost: CostCurve) -> Policy {
        let head_one = cost.head_row;
        let mut budgets = vec![0usize];
        let mut b = 1;
        while b < max_budget {
            budgets.push(b);
            b *= 2;
        }
        if max_budget > 0 {
            budgets.push(max_budget);
        }
        budgets.dedup();
        Policy {
            accepted: vec![0.0; budgets.len()],
            budgets,
            cost,
            observed: 0,
            draft_level_secs: 0.0,
            max_depth: usize::MAX,
            head_one,
            draft_estimated: false,
            pending: VecDeque::new(),
            margin: 1.05,
            warmup: 4,
            shadow: false,
        }
    }

    /// Expected tokens per second with budget `b` (relative units), from what was observed.
    pub fn rate(&self, i: usize) -> f64 {
        let b = self.budgets[i];
        if b == 0 {
            return 1.0 / (self.cost.secs(1) + self.head_one);
        }
        let tokens = 1.0 + self.accepted[i];
        tokens / self.round_secs(b, tokens)
    }

    /// The budget for the next round.
    ///
    /// Before enough trees are observed: plain decoding for a cheap drafter (its trees are
    /// observed on plain rounds), otherwise the smallest budget (the trees observed are the
    /// drafter's full ones, so every budget's acceptance is still learnt) — and plain decoding
    /// as soon as a measured (for a self-draft, estimated) draft costs so much that no budget
    /// could beat plain decoding by [`PROBE_WORTH`] even if every draft token were accepted.
    pub fn choose(&self) -> usize {
        if self.observed < self.warmup {
            if self.shadow || (self.draft_level_secs > 0.0 && !self.could_pay(PROBE_WORTH)) {
                return 0;
            }
            return self.budgets.get(1).copied().unwrap_or(0);
        }
        let plain = self.rate(0);
        let (mut best, mut best_rate) = (0, plain * self.margin);
        for i in 1..self.budgets.len() {
            let r = self.rate(i);
            if r > best_rate {
                best = self.budgets[i];
                best_rate = r;
            }
        }
        best
    }

    /// Seconds of a round of budget `b` that emits `tokens`: the layers over the tree, the head
    /// (one row per emitted token at the plan's price, and never less than one one-row pass),
    /// and a costly drafter's levels.
    fn round_secs(&self, b: usize, tokens: f64) -> f64 {
        let head = (tokens * self.cost.head_row).max(self.head_one);
        self.cost.secs(b + 1) + head + self.draft_cost(b)
    }

    /// Whether some budget beats plain decoding by `factor` when all its draft tokens are
    /// accepted (a chain of `min(b, max_depth)`).
    fn could_pay(&self, factor: f64) -> bool {
        let plain = self.rate(0) * factor;
        self.budgets.iter().skip(1).any(|&b| {
            let tokens = 1.0 + b.min(self.max_depth) as f64;
            tokens / self.round_secs(b, tokens) > plain
        })
    }

    /// Seconds a costly drafter spends on a tree of budget `b` (0 until a draft was measured).
    fn draft_cost(&self, b: usize) -> f64 {
        self.draft_level_secs * b.min(self.max_depth) as f64
    }

    /// A self-draft runs `fraction` of the target's layers and the target's head: price one of
    /// its levels from the cost curve before any draft (so that one that can never pay is never
    /// run, not even as a probe). Nothing changes once a draft has been timed; the first timed
    /// draft replaces the estimate (a curve whose `secs` include the head, with `head_row` 0,
    /// gives a low estimate).
    pub fn self_draft(&mut self, fraction: f64) {
        if self.draft_level_secs == 0.0 && fraction.is_finite() && fraction > 0.0 {
            self.draft_level_secs = fraction * self.cost.secs(1) + self.head_one;
            self.draft_estimated = true;
        }
    }

    /// The shape to draft for a costly drafter: until one draft has been measured, the smallest
    /// budget's (a probe of one level, so that a drafter that can never pay costs one cheap
    /// draft before the policy falls back, not a full tree), then `shape`.
    pub fn draft_shape(&self, shape: TreeShape) -> TreeShape {
        if self.draft_level_secs > 0.0 {
            return shape;
        }
        let probe = self.budgets.get(1).copied().unwrap_or(0);
        TreeShape {
            budget: probe.min(shape.budget),
            ..shape
        }
    }

    /// A draft of `levels` levels took `secs` (a costly drafter's forwards): the first
    /// measurement as it is, then a running mean, per level.
    pub fn drafted(&mut self, secs: f64, levels: usize) {
        if !secs.is_finite() || secs <= 0.0 || levels == 0 {
            return;
        }
        let per_level = secs / levels as f64;
        if self.draft_level_secs == 0.0 || self.draft_estimated {
            self.draft_estimated = false;
            self.draft_level_secs = per_level;
        } else {
            self.draft_level_secs += 0.2 * (per_level - self.draft_level_secs);
        }
    }

    /// Remember `tree`, drafted when the output had `at` tokens (its first draft token would be
    /// output token `at`).
    pub fn record(&mut self, at: usize, tree: Tree) {
        if !tree.is_empty() {
            self.pending.push_back((at, tree));
        }
    }

    /// The output so far: settle every remembered tree whose continuation is known.
    pub fn observe(&mut self, output: &[u32]) {
        while let Some((at, tree)) = self.pending.front() {
            // The path of the tree that the output follows, node indices. It is final once the
            // output leaves the tree (or reaches a leaf): a tree is settled as soon as the
            // tokens after it diverge, not only once its whole depth has been emitted, so that
            // a cheap drafter's warm-up on plain rounds takes a few rounds, not depth more.
            let mut node = 0;
            let mut path = Vec::new();
            let mut settled = false;
            for &t in output.get(*at..).unwrap_or(&[]) {
                match tree.child_with(node, t) {
                    Some(c) => {
                        path.push(c);
                        node = c;
                    }
                    None => {
                        settled = true;
                        break;
                    }
                }
            }
            if !settled && tree.children(node).next().is_some() {
                break;
            }
            self.pending.pop_front();
            self.observed += 1;
            let w = 1.0 / (self.observed.min(32) as f64);
            for (i, &b) in self.budgets.iter().enumerate() {
                let acc = path.iter().filter(|&&n| n <= b).count() as f64;
                self.accepted[i] += w * (acc - self.accepted[i]);
            }
        }
    }

    /// Update the cost of the layers over `n` tokens with a measurement (a running mean).
    pub fn measured(&mut self, n: usize, secs: f64) {
        if n == 0 || !secs.is_finite() {
            return;
        }
        if self.cost.secs.len() < n {
            let fill: Vec<f64> = (self.cost.secs.len() + 1..=n)
                .map(|k| self.cost.secs(k))
                .collect();
            self.cost.secs.extend(fill);
        }
        let s = &mut self.cost.secs[n - 1];
        *s += 0.1 * (secs - *s);
    }

    /// Update the cost of one head row with a pass of `rows` rows (a running mean).
    pub fn measured_head(&mut self, rows: usize, secs: f64) {
        if rows == 0 || !secs.is_finite() {
            return;
        }
        let per_row = secs / rows as f64;
        self.cost.head_row += 0.1 * (per_row - self.cost.head_row);
    }

    /// Mean accepted draft tokens per round for each budget.
    pub fn accepted(&self) -> Vec<(usize, f64)> {
        self.budgets
            .iter()
            .copied()
            .zip(self.accepted.iter().copied())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(tokens: &[u32]) -> Tree {
        let mut t = Tree::root(0);
        for (i, &tok) in tokens.iter().enumerate() {
            t.push(tok, i, -(i as f64), 0);
        }
        t
    }

    #[test]
    fn falls_back_when_verifying_costs_more_than_it_gains() {
        // Verifying 9 tokens costs 8 plain steps; drafts are never right.
        let cost = CostCurve {
            secs: (1..=9).map(|n| n as f64).collect(),
            head_row: 1.0,
        };
        let mut p = Policy::new(8, cost);
        for r in 0..10 {
            p.record(r, chain(&[99, 98]));
            p.observe(&vec![1; r + 3]);
        }
        assert_eq!(p.choose(), 0);
    }

    #[test]
    fn speculates_when_drafts_are_right_and_verify_is_cheap() {
        // Verifying costs little more than one token; the drafts are always right.
        let cost = CostCurve {
            secs: (1..=9).map(|n| 1.0 + 0.05 * n as f64).collect(),
            head_row: 0.1,
        };
        let mut p = Policy::new(8, cost);
        let out: Vec<u32> = (0..100).collect();
        for r in 0..10 {
            p.record(r, chain(&out[r..r + 8]));
            p.observe(&out[..r + 9]);
        }
        assert_eq!(p.choose(), 8);
        // Budget 2 would have accepted exactly 2.
        assert_eq!(p.accepted()[2], (2, 2.0));
    }

    #[test]
    fn a_costly_drafter_warms_up_small_and_falls_back_once_a_draft_costs_too_much() {
        let cost = CostCurve {
            secs: (1..=17).map(|n| 0.5 + 0.25 * n as f64).collect(),
            head_row: 0.5,
        };
        let mut p = Policy::new(16, cost);
        p.max_depth = 8;
        let full = TreeShape::new(16, 4);
        // Nothing observed or measured yet: the smallest budget, and a probe of one level.
        assert_eq!(p.choose(), 1);
        assert_eq!(p.draft_shape(full).budget, 1);
        // One level as costly as ten plain steps: even 17 accepted tokens could not pay.
        p.drafted(12.5, 1);
        assert_eq!(p.draft_level_secs, 12.5);
        assert_eq!(p.choose(), 0);
        // A cheap level: speculation could pay, so the warm-up goes on with full trees.
        let mut q = Policy::new(16, p.cost.clone());
        q.drafted(0.01, 1);
        assert_eq!(q.choose(), 1);
        assert_eq!(q.draft_shape(full), full);
        // Later measurements are a running mean per level.
        q.drafted(2.02, 2);
        assert!((q.draft_level_secs - 0.21).abs() < 1e-12);
    }

    #[test]
    fn a_tree_is_settled_as_soon_as_the_output_leaves_it() {
        let cost = CostCurve {
            secs: vec![1.0; 9],
            head_row: 0.1,
        };
        let mut p = Policy::new(8, cost);
        // A chain of 8 drafted at output length 0; the output follows it for 2 tokens.
        p.record(0, chain(&[10, 11, 12, 13, 14, 15, 16, 17]));
        p.observe(&[10, 11]);
        assert_eq!(p.observed, 0, "the output may still follow the chain");
        p.observe(&[10, 11, 99]);
        assert_eq!(
            p.observed, 1,
            "settled at the divergence, 5 tokens before its depth"
        );
        assert_eq!(p.accepted()[2], (2, 2.0));
        assert_eq!(p.accepted()[4], (8, 2.0));
        // A path to a leaf is settled too.
        p.record(3, chain(&[20]));
        p.observe(&[10, 11, 99, 20]);
        assert_eq!(p.observed, 2);
    }

    #[test]
    fn a_self_draft_that_cannot_pay_is_never_run() {
        // Gemma 3 270M at 2 threads: layers 0.4 of a step, the head row 0.6. Four layers of 18
        // and the full head cost 0.69 of a step per level, and every emitted token costs a head
        // row in the verify: no budget pays even if every draft token is accepted.
        let cost = CostCurve {
            secs: (1..=17).map(|n| 0.2 + 0.2 * n as f64).collect(),
            head_row: 0.6,
        };
        let mut p = Policy::new(8, cost.clone());
        p.max_depth = 4;
        p.self_draft(4.0 / 18.0);
        assert!((p.draft_level_secs - (4.0 / 18.0 * 0.4 + 0.6)).abs() < 1e-12);
        assert_eq!(p.choose(), 0);
        // A cheap head (a small vocabulary) and layers whose cost hardly grows with the tokens
        // (a large model): the same self-draft could pay, so it warms up.
        let mut q = Policy::new(
            8,
            CostCurve {
                secs: (1..=17).map(|n| 0.2 + 0.02 * n as f64).collect(),
                head_row: 0.01,
            },
        );
        q.self_draft(4.0 / 18.0);
        assert_eq!(q.choose(), 1);
        // The first timed draft replaces the estimate; later ones are a running mean.
        q.drafted(0.5, 1);
        assert_eq!(q.draft_level_secs, 0.5);
        q.drafted(1.5, 1);
        assert!((q.draft_level_secs - 0.7).abs() < 1e-12);
    }

    #[test]
    fn the_draft_cost_grows_with_the_levels_a_budget_drafts() {
        // One level costs a quarter of a plain step and drafts are always right: budget 2 (two
        // levels) pays, budget 16 at 8 levels pays less per token than 4 does at 4.
        let cost = CostCurve {
            secs: (1..=17).map(|n| 0.5 + 0.02 * n as f64).collect(),
            head_row: 0.5,
        };
        let mut p = Policy::new(16, cost);
        p.max_depth = 4;
        p.drafted(0.25, 1);
        let out: Vec<u32> = (0..200).collect();
        for r in 0..10 {
            p.record(r, chain(&out[r..r + 4]));
            p.observe(&out[..r + 5]);
        }
        // Budgets 4, 8 and 16 all accept 4 (the depth); 8 and 16 verify more nodes for nothing.
        assert_eq!(p.choose(), 4);
    }
}
