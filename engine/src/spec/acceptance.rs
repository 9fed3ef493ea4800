//! Target-only acceptance: walk the verified tree from the root, at each visited node draw the
//! next token from the *target's* distribution there (argmax, or a seeded sample with the
//! sampler's temperature, top-k, top-p and min-p), emit it, and move to the child carrying it;
//! stop at the first node without such a child.
//!
//! Why it is lossless: the walk draws every emitted token from the target's distribution given
//! exactly the tokens before it, in order, from the same random stream as plain decoding (one
//! draw per emitted token), so the emitted sequence is the one plain decoding would emit with
//! the same seed. The drafter only decides which nodes were computed; its probabilities never
//! enter. A token of probability 0 cannot be drawn ([`crate::sampling::Sampler`] draws with
//! `u < cumulative`, so a zero-probability token never wins, even at `u = 0`).
//!
//! Every emitted token passes through the caller's `emit`, which may stop generation there (end
//! of generation, a stop string, the token limit): the walk never emits past a stop.

use crate::faults::{self, Fault};
use crate::sampling::Sampler;

use super::tree::Tree;
use super::SpecError;

/// What the caller says after each emitted token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Keep going.
    Continue,
    /// Stop generating after this token (it was emitted).
    Stop,
    /// Stop, and the token is not part of the output (an end-of-generation token).
    StopBefore,
}

/// The outcome of one walk.
#[derive(Clone, Debug, PartialEq)]
pub struct Walk {
    /// Nodes whose keys and values stay in the cache: the root and each accepted child, in
    /// order (a root-to-node path).
    pub path: Vec<usize>,
    /// Tokens emitted, in order: the accepted children's tokens, then the token drawn at the
    /// last node (the next root), unless generation stopped first.
    pub emitted: Vec<u32>,
    /// Whether the caller stopped generation.
    pub stopped: bool,
    /// Nodes whose logits the walk read (for head-row accounting).
    pub visited: usize,
}

/// The target as the walk sees it: a draw at a node, and the probability of a token there.
pub trait Target {
    /// Draw the next token at `node` (whose text is `history`) from the target's distribution:
    /// one draw of the random stream per call.
    fn draw(&mut self, node: usize, history: &[u32]) -> Result<u32, SpecError>;
    /// The target's probability of `token` at `node` (the distribution [`Target::draw`] uses).
    fn prob(&mut self, node: usize, history: &[u32], token: u32) -> Result<f64, SpecError>;
    /// Whether draws are random (temperature above 0).
    fn sampling(&self) -> bool;
}

/// A node's logits as [`SamplerTarget`]'s `row` hands them out: borrowed or shared, never copied.
pub trait LogitsRow {
    fn logits(&self) -> &[f32];
}

impl LogitsRow for &[f32] {
    fn logits(&self) -> &[f32] {
        self
    }
}

impl LogitsRow for Vec<f32> {
    fn logits(&self) -> &[f32] {
        self
    }
}

impl LogitsRow for std::rc::Rc<Vec<f32>> {
    fn logits(&self) -> &[f32] {
        self
    }
}

/// The engine's target: logits of a node from `row`, drawn by a [`Sampler`]. `row` hands out
/// any `R` that reads as a slice (a borrowed row of a batch's logits, a shared row of a verify),
/// so that a row is never copied to be sampled.
pub struct SamplerTarget<'s, F, R>
where
    F: FnMut(usize) -> Result<R, SpecError>,
    R: LogitsRow,
{
    pub row: F,
    pub sampler: &'s mut Sampler,
    last: Option<(usize, R)>,
}

impl<'s, F, R> SamplerTarget<'s, F, R>
where
    F: FnMut(usize) -> Result<R, SpecError>,
    R: LogitsRow,
{
    pub fn new(row: F, sampler: &'s mut Sampler) -> Self {
        SamplerTarget {
            row,
            sampler,
            last: None,
        }
    }

    fn logits(&mut self, node: usize) -> Result<&[f32], SpecError> {
        if self.last.as_ref().map(|l| l.0) != Some(node) {
            self.last = Some((node, (self.row)(node)?));
        }
        Ok(self.last.as_ref().map_or(&[][..], |l| l.1.logits()))
    }
}

impl<F, R> Target for SamplerTarget<'_, F, R>
where
    F: FnMut(usize) -> Result<R, SpecError>,
    R: LogitsRow,
{
    fn draw(&mut self, node: usize, history: &[u32]) -> Result<u32, SpecError> {
        self.logits(node)?;
        let logits = self.last.as_ref().map_or(&[][..], |l| l.1.logits());
        Ok(self.sampler.sample(logits, history))
    }

    fn prob(&mut self, node: usize, history: &[u32], token: u32) -> Result<f64, SpecError> {
        self.logits(node)?;
        let logits = self.last.as_ref().map_or(&[][..], |l| l.1.logits());
        Ok(self
            .sampler
            .distribution(logits, history)
            .iter()
            .find(|(t, _)| *t == token)
            .map_or(0.0, |x| x.1))
    }

    fn sampling(&self) -> bool {
        self.sampler.config().temperature > 0.0
    }
}

/// Walk `tree`: at each visited node draw from `target`, emit, follow the matching child.
/// `history` is the sequence so far (prompt and emitted tokens, its last token the root) and
/// grows by each emitted token; `emit` is called once per emitted token with that token.
pub fn walk(
    tree: &Tree,
    target: &mut dyn Target,
    history: &mut Vec<u32>,
    emit: &mut dyn FnMut(u32) -> Flow,
) -> Result<Walk, SpecError> {
    let mut out = Walk {
        path: vec![0],
        emitted: Vec::new(),
        stopped: false,
        visited: 0,
    };
    let mut at = 0usize;
    loop {
        out.visited += 1;
        let drawn = target.draw(at, history)?;
        let (token, child) = match tree.child_with(at, drawn) {
            Some(c) => (drawn, Some(c)),
            None => faulty_choice(tree, at, drawn, target, history)?,
        };
        match emit(token) {
            Flow::StopBefore => {
                out.stopped = true;
                return Ok(out);
            }
            Flow::Stop => {
                history.push(token);
                out.emitted.push(token);
                if let Some(c) = child {
                    out.path.push(c);
                }
                out.stopped = true;
                return Ok(out);
            }
            Flow::Continue => {
                history.push(token);
                out.emitted.push(token);
            }
        }
        match child {
            Some(c) => {
                out.path.push(c);
                at = c;
            }
            None => return Ok(out),
        }
    }
}

/// The token and child after a rejection: the drawn token and no child, unless a fault
/// planted a lossy rule.
fn faulty_choice(
    tree: &Tree,
    at: usize,
    drawn: u32,
    target: &mut dyn Target,
    history: &[u32],
) -> Result<(u32, Option<usize>), SpecError> {
    let Some(c) = tree.children(at).next() else {
        return Ok((drawn, None));
    };
    if faults::is_active(Fault::AcceptPastRejection) {
        // Emits the target's token but keeps walking into the drafted child.
        return Ok((drawn, Some(c)));
    }
    if faults::is_active(Fault::AcceptByDraftProbability) {
        // Accepts the drafted token when the drafter is confident (lossy).
        let conditional = (tree.logw(c) - tree.logw(at)).exp();
        if conditional >= 0.3 {
            return Ok((tree.token(c), Some(c)));
        }
    }
    if faults::is_active(Fault::AcceptZeroProbability)
        && target.sampling()
        && target.prob(at, history, tree.token(c))? == 0.0
    {
        // The `coin == 0` bug: `u <= p/q` with u = 0 accepts a token of target probability 0.
        return Ok((tree.token(c), Some(c)));
    }
    Ok((drawn, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplerConfig;

    fn logits_for(best: u32, n: usize) -> Vec<f32> {
        (0..n as u32)
            .map(|t| if t == best { 5.0 } else { 0.0 })
            .collect()
    }

    /// Root 0 with children 1 (token 5) and 2 (token 6); node 1 has child 3 (token 7).
    fn tree() -> Tree {
        let mut t = Tree::root(9);
        t.push(5, 0, -0.1, 0);
        t.push(6, 0, -2.0, 1);
        t.push(7, 1, -0.2, 0);
        t
    }

    fn run(best: [u32; 4], stop_at: Option<usize>) -> Walk {
        let t = tree();
        let mut sampler = Sampler::new(SamplerConfig::greedy());
        let mut target = SamplerTarget::new(|node| Ok(logits_for(best[node], 10)), &mut sampler);
        let mut history = vec![1, 9];
        let mut n = 0;
        walk(&t, &mut target, &mut history, &mut |_| {
            n += 1;
            if Some(n) == stop_at {
                Flow::Stop
            } else {
                Flow::Continue
            }
        })
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn follows_the_target_and_stops_at_the_first_rejection() {
        // The target says 5 at the root, 7 at node 1, 3 at node 3: path 0→1→3, bonus 3.
        let w = run([5, 7, 0, 3], None);
        assert_eq!(w.path, vec![0, 1, 3]);
        assert_eq!(w.emitted, vec![5, 7, 3]);
        // The target says 6: the second child, then its own choice.
        let w = run([6, 0, 8, 0], None);
        assert_eq!(w.path, vec![0, 2]);
        assert_eq!(w.emitted, vec![6, 8]);
        // Rejected at the root: one token, the root alone stays.
        let w = run([4, 0, 0, 0], None);
        assert_eq!(w.path, vec![0]);
        assert_eq!(w.emitted, vec![4]);
    }

    #[test]
    fn a_stop_inside_the_accepted_path_emits_nothing_after_it() {
        let w = run([5, 7, 0, 3], Some(2));
        assert_eq!(w.emitted, vec![5, 7]);
        assert!(w.stopped);
        assert_eq!(w.visited, 2);
    }
}
