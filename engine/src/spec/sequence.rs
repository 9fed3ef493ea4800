//! One sequence's speculation, round by round: what [`super::generate`] drives for one sequence
//! and the server drives for each sequence of its ragged batch (llama.cpp's `common/speculative`
//! pattern: one per-sequence begin / draft / accept API for the CLI and the server).
//!
//! A round is [`Speculation::draft`] (a tree after the text, its root the last token),
//! [`verify::push_tree`](super::verify::push_tree) into the batch the caller forwards (alone, or
//! beside other sequences' work), then [`Speculation::accept`] over the verified logits: the
//! target's draws walk the tree ([`acceptance::walk`]), the emitted tokens join the text, and the
//! counters and the adaptive policy learn from the round. Which cells to keep is the walk's
//! `path`: [`super::kv::keep_path`] for a sequence alone in its cache, the batch's keep mask
//! for a server step. Tokens drawn outside a tree (the prefill's first, a plain decode step's)
//! join the text through [`Speculation::push_token`].

use super::acceptance::{self, Flow, Target, Walk};
use super::policy::Policy;
use super::proposer::Proposer;
use super::tree::{Tree, TreeShape};
use super::{draft_round, SpecError, SpecStats};

/// The speculation state of one sequence: its drafter, its policy, its text and its counters.
pub struct Speculation<'p> {
    proposer: Box<dyn Proposer + 'p>,
    policy: Option<Policy>,
    shape: TreeShape,
    /// Prompt and emitted tokens; its last token is the next tree's root.
    history: Vec<u32>,
    /// Emitted tokens (no end-of-generation token).
    emitted: Vec<u32>,
    stats: SpecStats,
}

impl<'p> Speculation<'p> {
    /// A sequence after `prompt`, drafting trees of `shape` with `proposer`, with no policy
    /// (every round drafts `shape`) until [`Speculation::set_policy`].
    pub fn new(
        proposer: Box<dyn Proposer + 'p>,
        shape: TreeShape,
        prompt: &[u32],
    ) -> Speculation<'p> {
        Speculation {
            proposer,
            policy: None,
            shape,
            history: prompt.to_vec(),
            emitted: Vec::new(),
            stats: SpecStats::default(),
        }
    }

    /// Let `policy` choose each round's budget from now on. It learns the drafter's kind here:
    /// a cheap drafter drafts the full tree every round (the policy learns from it even on a
    /// plain round), a costly one only when the policy speculates; a self-drafter's draft cost
    /// is estimated from the target's until measured.
    pub fn set_policy(&mut self, mut policy: Policy) {
        policy.shadow = !self.proposer.is_costly();
        policy.max_depth = self.shape.max_depth;
        if let Some(f) = self.proposer.self_draft_fraction() {
            policy.self_draft(f);
        }
        self.policy = Some(policy);
    }

    /// Prompt and emitted tokens.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// The tokens emitted so far.
    pub fn emitted(&self) -> &[u32] {
        &self.emitted
    }

    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    pub fn stats_mut(&mut self) -> &mut SpecStats {
        &mut self.stats
    }

    pub fn policy(&self) -> Option<&Policy> {
        self.policy.as_ref()
    }

    pub fn policy_mut(&mut self) -> Option<&mut Policy> {
        self.policy.as_mut()
    }

    /// The counters and the policy, when the sequence is done.
    pub fn finish(self) -> (Vec<u32>, SpecStats, Option<Policy>) {
        (self.emitted, self.stats, self.policy)
    }

    /// A token drawn outside a tree (the prefill's, or a plain decode step's), emitted.
    pub fn push_token(&mut self, token: u32) {
        self.history.push(token);
        self.emitted.push(token);
    }

    /// This round's tree, rooted at the last token of the text: the policy's budget of the
    /// drafter's tree (a root alone when it decodes plainly), or the fixed shape's.
    pub fn draft(&mut self) -> Result<Tree, SpecError> {
        let (tree, secs) = draft_round(
            self.proposer.as_mut(),
            self.policy.as_mut(),
            &self.history,
            self.shape,
            self.emitted.len(),
        )?;
        self.stats.draft_secs += secs;
        Ok(tree)
    }

    /// Walk the verified `tree` with `target` (the target's logits at each node), emitting each
    /// token through `emit` (given the tokens emitted before it; a token it answers
    /// [`Flow::StopBefore`] for is not part of the output), and count the round.
    pub fn accept(
        &mut self,
        tree: &Tree,
        target: &mut dyn Target,
        emit: &mut dyn FnMut(&[u32], u32) -> Flow,
    ) -> Result<Walk, SpecError> {
        let before = self.emitted.len();
        let emitted = &mut self.emitted;
        let walk = acceptance::walk(tree, target, &mut self.history, &mut |token| {
            let flow = emit(emitted, token);
            if flow != Flow::StopBefore {
                emitted.push(token);
            }
            flow
        })?;
        let stats = &mut self.stats;
        stats.rounds += 1;
        stats.count_budget(tree.n_draft());
        if !tree.is_empty() {
            stats.spec_rounds += 1;
            stats.spec_tokens += self.emitted.len() - before;
            stats.drafted += tree.n_draft();
            let d_tree = tree.max_depth() as usize;
            let d_acc = walk.path.len() - 1;
            if stats.depth_offered.len() < d_tree {
                stats.depth_offered.resize(d_tree, 0);
                stats.depth_accepted.resize(d_tree, 0);
            }
            for d in 0..d_tree {
                stats.depth_offered[d] += 1;
                if d < d_acc {
                    stats.depth_accepted[d] += 1;
                }
            }
        }
        if let Some(p) = self.policy.as_mut() {
            p.observe(&self.emitted);
        }
        Ok(walk)
    }
}
