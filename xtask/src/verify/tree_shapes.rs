//! Tree shapes for the speculation case (`spec_case.rs`), beyond the case's own tree: trees as
//! the drafters make them at the largest budget the CLI allows, and hand-built shapes whose
//! verify forward no drafter is sure to produce. Each tree is verified in one forward after the
//! prompt and every node is judged against its root-to-node path run as a plain chain after the
//! same cached prompt on the same engine (`spec.tree-shapes`); one path keeps nodes that are not adjacent in batch order
//! (`spec.compact-skip`).
//!
//! What the case's own tree (8 or 16 nodes, one sibling group per level at most) cannot show:
//! - a verify batch past 64 tokens, where a query's ancestors live in the second word of its
//!   ancestor bit set (`runtime/batch.rs`, `Mask::visible`, the CUDA attention's `anc_words`);
//! - siblings and cousins next to each other in batch order, where an off-by-one in the mask or
//!   in a row index lands on a node that is not an ancestor;
//! - paths deeper than the sliding window of a local layer, where the window and the tree mask
//!   compose;
//! - an accepted path whose nodes are spread over the batch, so compaction moves rows from
//!   scattered cells.
//!
//! The judge is the same engine's plain run, not the reference: the plain prefill path is
//! compared with the reference by the `off` and path cases of the same backend, and a same-engine
//! judge keeps the bound at the kernels' tiling noise (`LOGIT_REL_TOL`), far below what a node
//! that sees one wrong cell changes.

use anyhow::{Context, Result};
use engine::exec::{AnyEngine, BatchEngine, Session};
use engine::runtime::{Batch, KvDtype, SeqCache};
use engine::spec::{
    self, verify, ModelProposer, NgramProposer, Proposer, SyntheticProposer, Tree, TreeShape, SEQ,
};

/// The node budget the CLI and `SpecConfig::validate` allow at most.
pub const MAX_BUDGET: usize = 256;

/// A tree to verify and where it came from.
pub struct Shape {
    pub name: String,
    pub tree: Tree,
}

/// The worst node of one shape.
#[derive(Clone, Debug)]
pub struct Worst {
    pub shape: String,
    pub nodes: usize,
    pub node: usize,
    pub depth: u32,
    pub rel_err: f64,
}

/// A token id for the `i`-th hand-built node: spread over the vocabulary, distinct among
/// neighbours.
fn token(i: usize, n_vocab: usize) -> u32 {
    ((i as u64 * 2_654_435_761 + 12_345) % n_vocab.max(1) as u64) as u32
}

/// `branches` children of the root, each the head of a chain `depth` long, pushed level by level:
/// the root's children sit side by side, and at every level the nodes of different branches
/// (cousins) are neighbours in batch order. `branches × depth` draft nodes.
pub fn fan(root: u32, branches: usize, depth: usize, n_vocab: usize) -> Tree {
    let mut tree = Tree::root(root);
    let mut heads: Vec<usize> = vec![0; branches];
    for level in 0..depth {
        for (b, head) in heads.iter_mut().enumerate() {
            let i = level * branches + b;
            *head = tree.push(token(i, n_vocab), *head, -(level as f64), b as u32);
        }
    }
    tree
}

/// One chain of `depth` draft nodes.
pub fn chain(root: u32, depth: usize, n_vocab: usize) -> Tree {
    fan(root, 1, depth, n_vocab)
}

/// The hand-built shapes every backend runs: cheap to judge (one plain run per leaf, 9 leaves).
pub fn built(root: u32, n_vocab: usize) -> Vec<Shape> {
    vec![
        Shape {
            name: "fan 8×10 (siblings and cousins adjacent, 81 tokens)".into(),
            tree: fan(root, 8, 10, n_vocab),
        },
        Shape {
            name: "chain 96".into(),
            tree: chain(root, 96, n_vocab),
        },
    ]
}

/// Trees from the drafters the CLI offers at its largest budget with the case's top-k: the n-gram
/// drafter (the CLI's default), and with `all` also a self-draft of half the layers and the
/// synthetic drafter that knows the continuation 70 % of the time (random branching). Each
/// node costs a head row in the verify forward and one in its plain run: on a model with a
/// 262144-token head that is most of a case's time, so the real model runs the n-gram tree only.
pub fn drafted(
    engine: &AnyEngine<'_>,
    prompt: &[u32],
    oracle: &[u32],
    top_k: usize,
    all: bool,
) -> Result<Vec<Shape>> {
    let n_vocab = engine.model().config().n_vocab;
    let shape = TreeShape::new(MAX_BUDGET, top_k);
    let mut out = Vec::new();
    let mut add = |name: &str, p: &mut dyn Proposer| -> Result<()> {
        let tree = p
            .propose(prompt, shape)
            .with_context(|| format!("the {name} drafter's tree"))?;
        out.push(Shape {
            name: format!("{name} b{MAX_BUDGET}k{top_k}"),
            tree,
        });
        Ok(())
    };
    add("n-gram", &mut NgramProposer::new(2048))?;
    if !all {
        return Ok(out);
    }
    add(
        "synthetic 70%",
        &mut SyntheticProposer::new(oracle.to_vec(), 0.7, n_vocab, 11),
    )?;
    let half = (engine.model().config().n_layer / 2).max(1);
    let draft = engine
        .self_draft(half)
        .with_context(|| format!("self-draft of the first {half} layers"))?;
    add(
        &format!("self:{half}"),
        &mut ModelProposer::new(&draft, 2048, format!("self:{half}"))?,
    )?;
    Ok(out)
}

/// The largest difference between two logits rows, relative to `b`'s largest magnitude.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    f64::from(a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale)
}

/// Whether the cache's cells of the sequence sit at positions `0..n` exactly (after a
/// compaction).
pub fn cells_at_positions(cache: &impl SeqCache, n: usize) -> bool {
    let mut at: Vec<u32> = cache
        .cells()
        .iter()
        .filter(|c| c.seq == SEQ)
        .map(|c| c.pos)
        .collect();
    at.sort_unstable();
    at == (0..n as u32).collect::<Vec<_>>()
}

/// Leaves of `tree` (nodes without children).
fn leaves(tree: &Tree) -> Vec<usize> {
    let mut has_child = vec![false; tree.len()];
    for p in tree.parents().iter().flatten() {
        has_child[*p] = true;
    }
    (0..tree.len()).filter(|&i| !has_child[i]).collect()
}

/// The prompt but its last token, committed: the state a verify forward runs in.
fn primed(engine: &AnyEngine<'_>, prompt: &[u32], extra: usize) -> Result<engine::exec::AnyCache> {
    let mut cache = engine.new_cache(prompt.len() + extra + 8, KvDtype::F32)?;
    let ctx = &prompt[..prompt.len() - 1];
    engine.forward(&mut cache, &Batch::chain(SEQ, 0, ctx, false), None)?;
    cache.commit();
    Ok(cache)
}

/// Verify `tree` after `prompt` in one forward and compare every node's logits with its
/// root-to-node path run plainly: a chain batch of the path after the same cached prompt, rolled
/// back after each run. A leaf's path gives the logits of every node on it, so the plain runs are
/// one per leaf, with head rows only for the nodes not judged yet (the real model's head is 262144
/// rows wide: its cost, not the layers', is what a row per path token would multiply).
pub fn check(engine: &AnyEngine<'_>, prompt: &[u32], shape: &Shape) -> Result<Worst> {
    let tree = &shape.tree;
    let mut cache = primed(engine, prompt, tree.len())?;
    let mut verified = verify::verify(engine, &mut cache, tree, SEQ, verify::HeadRows::All)
        .with_context(|| format!("verifying the {} tree", shape.name))?;
    let mut plain_cache = primed(engine, prompt, tree.max_depth() as usize + 1)?;
    let mut worst = Worst {
        shape: shape.name.clone(),
        nodes: tree.len(),
        node: 0,
        depth: 0,
        rel_err: 0.0,
    };
    let mut judged = vec![false; tree.len()];
    let start = (prompt.len() - 1) as u32;
    for leaf in leaves(tree) {
        let path = tree.path_to(leaf);
        let mut batch = Batch::new();
        for (d, &node) in path.iter().enumerate() {
            batch.push(tree.token(node), start + d as u32, SEQ, !judged[node]);
        }
        let plain = engine.forward(&mut plain_cache, &batch, None)?;
        plain_cache.rollback();
        for (d, &node) in path.iter().enumerate() {
            if std::mem::replace(&mut judged[node], true) {
                continue;
            }
            let row = plain.of_token(d).context("a plain run's logits row")?;
            let e = rel_err(&verified.logits(engine, node)?, row);
            if e > worst.rel_err || e.is_nan() {
                worst = Worst {
                    node,
                    depth: tree.depth(node),
                    rel_err: if e.is_nan() { f64::INFINITY } else { e },
                    ..worst
                };
            }
        }
    }
    Ok(worst)
}

/// Keep the path to `leaf` of `tree` after its verify forward (its nodes spread over the batch)
/// and decode one more token: its logits against plain decoding of the same text, with the cells
/// at positions `0..n`. The relative error, or infinity where the cells are misplaced.
pub fn compact_skipping(
    engine: &AnyEngine<'_>,
    prompt: &[u32],
    tree: &Tree,
    leaf: usize,
) -> Result<f64> {
    let mut cache = primed(engine, prompt, tree.len())?;
    drop(verify::verify(
        engine,
        &mut cache,
        tree,
        SEQ,
        verify::HeadRows::All,
    )?);
    let path = tree.path_to(leaf);
    spec::kv::keep_path(engine, &mut cache, &path)?;
    let mut text = prompt.to_vec();
    text.extend(tree.path_tokens(leaf));
    if !cells_at_positions(&cache, text.len()) {
        return Ok(f64::INFINITY);
    }
    let next = token(7, engine.model().config().n_vocab);
    let pos = cache.next_pos(SEQ);
    let l = engine.forward(&mut cache, &Batch::chain(SEQ, pos, &[next], false), None)?;
    text.push(next);
    let mut s = Session::new(engine, text.len() + 1)?;
    Ok(rel_err(l.last(), s.forward(&text, None)?.last()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fan_puts_branches_side_by_side_and_crosses_the_first_bitset_word() {
        let t = fan(5, 8, 10, 1000);
        assert_eq!(t.len(), 81);
        assert_eq!(t.max_depth(), 10);
        // The root's 8 children are nodes 1..=8, in a row.
        assert!((1..=8).all(|i| t.parent(i) == Some(0)));
        // Node 9 (level 2) continues branch 0; neighbours 9 and 10 are cousins.
        assert_eq!(t.parent(9), Some(1));
        assert_eq!(t.parent(10), Some(2));
        // A path whose nodes are spread over the batch, past index 64.
        let p = t.path_to(80);
        assert_eq!(p, vec![0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80]);
        assert_eq!(leaves(&t), (73..=80).collect::<Vec<_>>());
        assert_eq!(leaves(&chain(1, 96, 10)), vec![96]);
    }
}
