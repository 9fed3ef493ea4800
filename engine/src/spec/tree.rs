//! The draft tree and its best-first construction (DDTree).
//!
//! A [`Tree`] holds node 0, the *root* (the last emitted token, whose keys and values the
//! target has not computed yet), and up to `budget` draft nodes below it. Nodes are stored
//! parents first (`parent[i] < i`), so the verify batch can be pushed in index order.
//!
//! [`build`] is DDTree's construction (SGLang `speculative/ddtree_utils.py`,
//! `_build_single_tree`): a max-heap over path log-probability. Popping an entry adds its node
//! and pushes two candidates: the node's next sibling (the parent's next-ranked token) and its
//! first child (the best-ranked token one level deeper). Every node is therefore added after its
//! parent and after its better-ranked siblings, the tree holds at most `budget` draft nodes, and
//! each node has at most `top_k` children. Ties in log-probability go to the candidate whose
//! rank path is lexicographically smaller (Python compares heap tuples `(-logw, ranks, …)`), so
//! equal-probability candidates enter in rank order, shallower prefix first.
//!
//! The child distribution is a function of the path ([`build`] takes a closure): a block drafter
//! that gives one distribution per depth ignores the path ([`build_per_depth`], DDTree's case); a
//! conditional drafter (n-gram over the text, a model) answers for each path.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Node budget, top-k per node and the deepest depth of a draft tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeShape {
    /// Draft nodes (the root is not counted): the verify forward runs `budget + 1` tokens.
    pub budget: usize,
    /// Children per node at most.
    pub top_k: usize,
    /// Deepest node depth (the root is depth 0).
    pub max_depth: usize,
}

impl TreeShape {
    pub fn new(budget: usize, top_k: usize) -> TreeShape {
        TreeShape {
            budget,
            top_k,
            max_depth: budget,
        }
    }
}

/// A draft tree rooted at the last emitted token.
#[derive(Clone, Debug, PartialEq)]
pub struct Tree {
    tokens: Vec<u32>,
    parent: Vec<Option<usize>>,
    depth: Vec<u32>,
    /// Path log-probability under the drafter (0 for the root). Reported, never used to accept.
    logw: Vec<f64>,
    /// Rank of the node among its parent's candidates.
    rank: Vec<u32>,
}

impl Tree {
    /// A tree of the root alone (plain decoding: one token per forward).
    pub fn root(token: u32) -> Tree {
        Tree {
            tokens: vec![token],
            parent: vec![None],
            depth: vec![0],
            logw: vec![0.0],
            rank: vec![0],
        }
    }

    /// Add a node under `parent` (which must already be in the tree); returns its index.
    pub fn push(&mut self, token: u32, parent: usize, logw: f64, rank: u32) -> usize {
        debug_assert!(parent < self.tokens.len());
        let d = self.depth[parent] + 1;
        self.tokens.push(token);
        self.parent.push(Some(parent));
        self.depth.push(d);
        self.logw.push(logw);
        self.rank.push(rank);
        self.tokens.len() - 1
    }

    /// The tree of the first `budget` draft nodes (best-first order is prefix-closed: parents
    /// come first, so this is the tree [`build`] gives for that budget).
    pub fn prefix(&self, budget: usize) -> Tree {
        let n = (budget + 1).min(self.len());
        Tree {
            tokens: self.tokens[..n].to_vec(),
            parent: self.parent[..n].to_vec(),
            depth: self.depth[..n].to_vec(),
            logw: self.logw[..n].to_vec(),
            rank: self.rank[..n].to_vec(),
        }
    }

    /// Nodes, the root included.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the tree is the root alone.
    pub fn is_empty(&self) -> bool {
        self.tokens.len() <= 1
    }

    /// Draft nodes (the root not counted).
    pub fn n_draft(&self) -> usize {
        self.tokens.len() - 1
    }

    pub fn token(&self, i: usize) -> u32 {
        self.tokens[i]
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn parent(&self, i: usize) -> Option<usize> {
        self.parent[i]
    }

    pub fn parents(&self) -> &[Option<usize>] {
        &self.parent
    }

    pub fn depth(&self, i: usize) -> u32 {
        self.depth[i]
    }

    pub fn logw(&self, i: usize) -> f64 {
        self.logw[i]
    }

    pub fn rank(&self, i: usize) -> u32 {
        self.rank[i]
    }

    /// Deepest node depth.
    pub fn max_depth(&self) -> u32 {
        self.depth.iter().copied().max().unwrap_or(0)
    }

    /// Children of `i` in index order (better-ranked first).
    pub fn children(&self, i: usize) -> impl Iterator<Item = usize> + '_ {
        (i + 1..self.len()).filter(move |&c| self.parent[c] == Some(i))
    }

    /// The child of `i` carrying `token`, if any.
    pub fn child_with(&self, i: usize, token: u32) -> Option<usize> {
        self.children(i).find(|&c| self.tokens[c] == token)
    }

    /// Node indices from the root to `i`, both included.
    pub fn path_to(&self, i: usize) -> Vec<usize> {
        let mut p = vec![i];
        let mut at = i;
        while let Some(q) = self.parent[at] {
            p.push(q);
            at = q;
        }
        p.reverse();
        p
    }

    /// Tokens of the draft nodes on the path to `i` (the root's token excluded).
    pub fn path_tokens(&self, i: usize) -> Vec<u32> {
        self.path_to(i)
            .into_iter()
            .skip(1)
            .map(|n| self.tokens[n])
            .collect()
    }
}

/// A heap candidate: a node that would be added under `parent` with the parent's
/// `rank`-th token.
#[derive(Debug)]
struct Cand {
    logw: f64,
    /// Rank path from the root (the tie-breaker).
    ranks: Vec<u32>,
    parent: usize,
    rank: usize,
}

impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Cand {
    /// Higher log-probability is greater (popped first); on a tie the lexicographically smaller
    /// rank path is greater, as Python's min-heap over `(-logw, ranks)` orders them.
    fn cmp(&self, o: &Self) -> Ordering {
        self.logw
            .total_cmp(&o.logw)
            .then_with(|| o.ranks.cmp(&self.ranks))
    }
}

/// Best-first construction over a drafter's child distributions.
///
/// `children(path)` gives the candidates after the draft tokens `path` (empty: after the root),
/// as `(token, log-probability)`, best first; only the first `shape.top_k` are used, and
/// tokens must be distinct. Non-finite log-probabilities end the list (a drafter that gives
/// a token probability 0 does not propose it).
pub fn build(
    root: u32,
    shape: TreeShape,
    mut children: impl FnMut(&[u32]) -> Vec<(u32, f64)>,
) -> Tree {
    let mut tree = Tree::root(root);
    if shape.budget == 0 || shape.top_k == 0 || shape.max_depth == 0 {
        return tree;
    }
    // Candidate lists of each expanded node, indexed by node.
    let mut lists: Vec<Vec<(u32, f64)>> = Vec::with_capacity(shape.budget + 1);
    let clean = |mut l: Vec<(u32, f64)>| {
        let n = l
            .iter()
            .take(shape.top_k)
            .take_while(|(_, lp)| lp.is_finite())
            .count();
        l.truncate(n);
        l
    };
    lists.push(clean(children(&[])));
    let mut heap = BinaryHeap::new();
    if let Some(&(_, lp)) = lists[0].first() {
        heap.push(Cand {
            logw: lp,
            ranks: vec![0],
            parent: 0,
            rank: 0,
        });
    }
    while tree.n_draft() < shape.budget {
        let Some(c) = heap.pop() else { break };
        let (token, lp) = lists[c.parent][c.rank];
        let node = tree.push(token, c.parent, c.logw, c.rank as u32);
        // The next sibling: same parent, next rank.
        if let Some(&(_, next_lp)) = lists[c.parent].get(c.rank + 1) {
            let mut ranks = c.ranks.clone();
            if let Some(last) = ranks.last_mut() {
                *last += 1;
            }
            heap.push(Cand {
                logw: c.logw - lp + next_lp,
                ranks,
                parent: c.parent,
                rank: c.rank + 1,
            });
        }
        // The first child, one level deeper.
        let list = if (tree.depth(node) as usize) < shape.max_depth {
            clean(children(&tree.path_tokens(node)))
        } else {
            Vec::new()
        };
        if let Some(&(_, child_lp)) = list.first() {
            let mut ranks = c.ranks;
            ranks.push(0);
            heap.push(Cand {
                logw: c.logw + child_lp,
                ranks,
                parent: node,
                rank: 0,
            });
        }
        lists.push(list);
    }
    tree
}

/// DDTree's case: one distribution per depth (`per_depth[d]` for the nodes at depth `d + 1`),
/// whatever the path.
pub fn build_per_depth(root: u32, shape: TreeShape, per_depth: &[Vec<(u32, f64)>]) -> Tree {
    let shape = TreeShape {
        max_depth: shape.max_depth.min(per_depth.len()),
        ..shape
    };
    build(root, shape, |path| {
        per_depth.get(path.len()).cloned().unwrap_or_default()
    })
}

/// The `k` most likely tokens of `logits` as `(token, log-probability)`, best first (ties:
/// lower id first). NaN logits are never chosen.
pub fn top_k_log_probs(logits: &[f32], k: usize) -> Vec<(u32, f64)> {
    let max = logits
        .iter()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    if !max.is_finite() {
        return Vec::new();
    }
    let lse = f64::from(max)
        + logits
            .iter()
            .filter(|l| !l.is_nan())
            .map(|&l| f64::from(l - max).exp())
            .sum::<f64>()
            .ln();
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() || (best.len() == k && l <= best[k - 1].1) {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b >= l);
        best.insert(at, (i as u32, l));
        best.truncate(k);
    }
    best.into_iter()
        .map(|(t, l)| (t, f64::from(l) - lse))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lp(p: f64) -> f64 {
        p.ln()
    }

    #[test]
    fn per_depth_tree_follows_path_probability() {
        // depth 1: a 1/2, b 1/4; depth 2: c 1/2, d 1/4 (powers of two: the sums are exact).
        let dists = vec![
            vec![(1, lp(0.5)), (2, lp(0.25))],
            vec![(3, lp(0.5)), (4, lp(0.25))],
        ];
        let t = build_per_depth(0, TreeShape::new(4, 2), &dists);
        // Best-first: a (1/2), then a→c and b tie at 1/4 (ranks [0,0] < [1]: a→c first), then
        // a→d and b→c tie at 1/8 ([0,1] < [1,0]: a→d).
        assert_eq!(t.tokens(), &[0, 1, 3, 2, 4]);
        assert_eq!(t.parents(), &[None, Some(0), Some(1), Some(0), Some(1)]);
    }

    #[test]
    fn ties_go_to_the_smaller_rank_path() {
        // Equal probabilities everywhere: the construction is breadth-first in rank order.
        let d = vec![(7, lp(0.5)), (8, lp(0.5))];
        let t = build_per_depth(0, TreeShape::new(3, 2), &[d.clone(), d]);
        // Candidates after the first node [0]: sibling [1] (0.5) and child [0,0] (0.25): the
        // sibling first; then [0,0] (0.25) vs [1,0] (0.25): [0,0] < [1,0].
        assert_eq!(t.tokens(), &[0, 7, 8, 7]);
        assert_eq!(t.parents(), &[None, Some(0), Some(0), Some(1)]);
    }

    #[test]
    fn top_k_log_probs_are_normalized_and_sorted() {
        let l = [0.0f32, 2.0, 1.0, 2.0, f32::NAN];
        let t = top_k_log_probs(&l, 3);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let z: f64 = [0.0f64, 2.0, 1.0, 2.0].iter().map(|v| v.exp()).sum();
        assert!((t[0].1 - (2.0 - z.ln())).abs() < 1e-6);
    }

    /// Brute force: every node's path probability is at least that of every candidate left out
    /// (a candidate is a parent's next unused rank, or a node's first child).
    fn best_first_holds(t: &Tree, dists: &[Vec<(u32, f64)>], shape: TreeShape) -> bool {
        let min_in = (1..t.len())
            .map(|i| t.logw(i))
            .fold(f64::INFINITY, f64::min);
        let full = t.n_draft() == shape.budget;
        for i in 0..t.len() {
            let d = t.depth(i) as usize;
            if d >= shape.max_depth.min(dists.len()) {
                continue;
            }
            let used = t.children(i).count();
            if let Some(&(_, p)) = dists[d].iter().take(shape.top_k).nth(used) {
                let cand = t.logw(i) + p;
                if full && cand > min_in + 1e-12 {
                    return false;
                }
                if !full {
                    return false; // the budget was not used up but a candidate was left
                }
            }
        }
        true
    }

    fn dist_strategy() -> impl Strategy<Value = Vec<Vec<(u32, f64)>>> {
        proptest::collection::vec(proptest::collection::vec(1u32..1000, 1..6), 1..6).prop_map(
            |depths| {
                depths
                    .into_iter()
                    .map(|w| {
                        let total: u32 = w.iter().sum();
                        let mut ps: Vec<f64> =
                            w.iter().map(|&x| f64::from(x) / f64::from(total)).collect();
                        ps.sort_by(|a, b| b.total_cmp(a));
                        ps.into_iter()
                            .enumerate()
                            .map(|(i, p)| (i as u32 + 10, p.ln()))
                            .collect()
                    })
                    .collect()
            },
        )
    }

    proptest! {
        #[test]
        fn tree_invariants(dists in dist_strategy(), budget in 0usize..20, top_k in 1usize..5) {
            let shape = TreeShape::new(budget, top_k);
            let t = build_per_depth(5, shape, &dists);
            prop_assert!(t.n_draft() <= budget);
            prop_assert_eq!(t.token(0), 5);
            for i in 1..t.len() {
                let p = t.parent(i).unwrap_or(usize::MAX);
                // parents first, depth = parent's + 1, within the per-depth lists
                prop_assert!(p < i);
                prop_assert_eq!(t.depth(i), t.depth(p) + 1);
                prop_assert!((t.depth(i) as usize) <= dists.len());
                // the token is the rank-th candidate of its depth; logw is the path's sum
                let d = t.depth(i) as usize - 1;
                let (tok, l) = dists[d][t.rank(i) as usize];
                prop_assert_eq!(t.token(i), tok);
                prop_assert!((t.logw(i) - (t.logw(p) + l)).abs() < 1e-9);
            }
            for i in 0..t.len() {
                let ch: Vec<usize> = t.children(i).collect();
                prop_assert!(ch.len() <= top_k);
                // siblings are the best ranks, in rank order
                for (r, &c) in ch.iter().enumerate() {
                    prop_assert_eq!(t.rank(c) as usize, r);
                }
            }
            prop_assert!(best_first_holds(&t, &dists, shape));
        }
    }
}
