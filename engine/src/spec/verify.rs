//! The verify forward: every node of the tree in one batch, node `i` at position
//! `start + depth(i)` under its parent, so each node attends to the committed cache and to its
//! own ancestors only (the core's tree mask, intersected with each layer's sliding window by the
//! same [`crate::runtime::Mask`]).
//!
//! The output head (for Gemma 3: 262k rows) is most of a decode step, so the layers run first
//! ([`Engine::forward_hidden`]) and head rows are computed only for the nodes the acceptance
//! walk may visit, in one pass over the head's weights per [`HeadRows`] plan.

use std::collections::HashMap;
use std::rc::Rc;

use crate::exec::BatchEngine;
use crate::runtime::{Batch, SeqCache, SeqId};

use super::tree::Tree;
use super::SpecError;

/// Which nodes' logits the first head pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadRows {
    /// Every node (one pass; never a second).
    All,
    /// The root and the drafter's best chain below it; any other node the walk reaches is
    /// computed on demand together with its own best chain (one more pass each time).
    Chain,
    /// Exactly the nodes the walk visits, one pass each (best where a head pass costs in
    /// proportion to its rows, as on a CPU whose head product is compute-bound).
    Visited,
    /// Chain or Visited, whichever the backend's head pays for: chosen by
    /// [`super::choose_head_rows`] from a measurement at the start of a generation. If it
    /// reaches a verify unresolved, it acts as Visited.
    Auto,
}

/// A verify batch of `tree` for `seq` whose root sits at position `start` (node `i` at
/// `start + depth(i)`), no logits rows asked for (the head runs later on the rows the walk
/// visits).
pub fn tree_batch(tree: &Tree, seq: SeqId, start: u32) -> Batch {
    let mut b = Batch::new();
    push_tree(&mut b, tree, seq, start, false);
    b
}

/// Append `tree`'s nodes for `seq` to `batch` (root at position `start`), each asking for its
/// logits row if `logits`; returns the batch index of the root (node `i` is at `root + i`). A
/// server puts many sequences' trees in one batch this way.
pub fn push_tree(batch: &mut Batch, tree: &Tree, seq: SeqId, start: u32, logits: bool) -> usize {
    let base = batch.len();
    for i in 0..tree.len() {
        let parent = tree.parent(i).map(|p| base + p);
        batch.push_node(tree.token(i), start + tree.depth(i), seq, parent, logits);
    }
    base
}

/// A tree run through the target's layers, with the logits computed so far.
pub struct Verified<'t, E: BatchEngine + ?Sized> {
    tree: &'t Tree,
    hidden: E::Hidden,
    /// Each computed row, shared: the acceptance walk samples it where it lies.
    logits: HashMap<usize, Rc<Vec<f32>>>,
    plan: HeadRows,
    /// Head passes and rows computed, and their seconds.
    pub head_passes: usize,
    pub head_rows: usize,
    pub head_secs: f64,
    /// Seconds of the layers.
    pub layers_secs: f64,
}

/// Run `tree` (root first) through the target's layers; its cells are pending in `cache`
/// until [`super::kv::keep_path`] keeps the accepted path.
pub fn verify<'t, E: BatchEngine + ?Sized>(
    engine: &E,
    cache: &mut E::Cache,
    tree: &'t Tree,
    seq: SeqId,
    plan: HeadRows,
) -> Result<Verified<'t, E>, SpecError> {
    let start = cache.next_pos(seq);
    let batch = tree_batch(tree, seq, start);
    let t = std::time::Instant::now();
    let hidden = engine.forward_hidden(cache, &batch)?;
    let mut v = Verified {
        tree,
        hidden,
        logits: HashMap::new(),
        plan,
        head_passes: 0,
        head_rows: 0,
        head_secs: 0.0,
        layers_secs: t.elapsed().as_secs_f64(),
    };
    let first = match plan {
        HeadRows::All => (0..tree.len()).collect(),
        HeadRows::Chain => best_chain(tree, 0),
        HeadRows::Visited | HeadRows::Auto => vec![0],
    };
    v.compute(engine, first)?;
    Ok(v)
}

/// `from` and its best-ranked descendants, down to a leaf.
fn best_chain(tree: &Tree, from: usize) -> Vec<usize> {
    let mut chain = vec![from];
    let mut at = from;
    while let Some(c) = tree.children(at).next() {
        chain.push(c);
        at = c;
    }
    chain
}

impl<E: BatchEngine + ?Sized> Verified<'_, E> {
    fn compute(&mut self, engine: &E, mut rows: Vec<usize>) -> Result<(), SpecError> {
        rows.retain(|r| !self.logits.contains_key(r));
        rows.sort_unstable();
        rows.dedup();
        if rows.is_empty() {
            return Ok(());
        }
        let t = std::time::Instant::now();
        let l = engine.head(&self.hidden, &rows)?;
        self.head_secs += t.elapsed().as_secs_f64();
        self.head_passes += 1;
        self.head_rows += rows.len();
        if let [r] = rows[..] {
            // One row (every plain round, and a walk's rows one at a time): the head's output
            // buffer itself, not a copy of its 1 MiB (262k-entry vocabulary).
            self.logits.insert(r, Rc::new(l.data));
        } else {
            for (i, &r) in rows.iter().enumerate() {
                self.logits.insert(r, Rc::new(l.row(i).to_vec()));
            }
        }
        Ok(())
    }

    /// The target's logits at `node` (computed now if the plan skipped it), shared, not copied.
    pub fn logits(&mut self, engine: &E, node: usize) -> Result<Rc<Vec<f32>>, SpecError> {
        if node >= self.tree.len() {
            return Err(SpecError::Config(format!(
                "node {node} is outside the tree of {} nodes",
                self.tree.len()
            )));
        }
        if !self.logits.contains_key(&node) {
            let rows = match self.plan {
                HeadRows::All | HeadRows::Visited | HeadRows::Auto => vec![node],
                HeadRows::Chain => best_chain(self.tree, node),
            };
            self.compute(engine, rows)?;
        }
        self.logits
            .get(&node)
            .cloned()
            .ok_or_else(|| SpecError::Config(format!("no logits computed for node {node}")))
    }
}
