//! Tree speculative decoding (DDTree-style), lossless by construction.
//!
//! One round: a [`Proposer`] drafts a tree after the text ([`tree::build`], best-first over path
//! log-probability, node budget B, top-k per node); [`verify::verify`] runs the root and the B
//! nodes through the target in one forward (ancestor-only mask ∩ sliding window, positions =
//! start + depth); [`acceptance::walk`] draws each next token from the *target* at the visited
//! node and follows the child that carries it; [`kv::keep_path`] keeps the accepted path's cells
//! and drops the rest; [`policy::Policy`] picks B from the measured cost of verifying n tokens
//! and the observed acceptance, down to plain decoding when speculation would not pay.
//!
//! Invariants (each has a test; `docs/SPEC.md` has the proof):
//! - The drafter's probabilities never decide what is emitted; only the target's logits and the
//!   sampler's one draw per emitted token do, in the same order as plain decoding. Greedy
//!   speculation therefore emits plain greedy's tokens, and seeded sampling plain seeded
//!   sampling's.
//! - A token of target probability 0 is never emitted.
//! - Generation stops at end-of-generation, a stop rule or the token limit inside an accepted
//!   path, without emitting past it.
//! - After a round the cache holds exactly the emitted text's cells but the last token's, laid
//!   out as plain decoding lays them out.
//!
//! One sequence's rounds are a [`Speculation`] (draft, then accept from the verified logits):
//! [`generate`] drives one for a sequence alone in its cache, the server one per sequence of
//! its ragged batch.
//!
//! Start reading at [`generate`].

pub mod acceptance;
pub mod kv;
pub mod policy;
pub mod proposer;
pub mod sequence;
pub mod tree;
pub mod verify;

use std::time::Instant;

use crate::exec::{BatchEngine, Session};
use crate::runtime::{Batch, RuntimeError, SeqCache};
use crate::sampling::Sampler;

pub use acceptance::{walk, Flow, SamplerTarget, Target, Walk};
pub use policy::{CostCurve, Policy};
pub use proposer::{ModelProposer, NgramProposer, Proposer, SyntheticProposer, TableProposer};
pub use sequence::Speculation;
pub use tree::{Tree, TreeShape};
pub use verify::HeadRows;

/// The sequence id speculation uses in the target's cache.
pub const SEQ: u32 = 0;

/// Why speculation failed.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("the context is empty; speculation needs at least one token")]
    EmptyContext,
    #[error("token {token} is outside the drafter's vocabulary of {n_vocab}")]
    VocabMismatch { token: u32, n_vocab: usize },
    #[error(
        "the drafter's vocabulary has {draft} tokens, the target's {target}; they must be equal"
    )]
    DrafterVocab { draft: usize, target: usize },
    #[error("{0}")]
    Config(String),
}

/// How to speculate.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecConfig {
    /// The largest tree: budget, top-k, deepest depth.
    pub shape: TreeShape,
    /// Pick the budget per round from measured cost and acceptance (else always `shape.budget`).
    pub adaptive: bool,
    /// Which head rows the first head pass computes.
    pub head_rows: HeadRows,
    /// Keep each round's tree, visited logits and walk in [`SpecOutput::trace`] (for checks).
    pub trace: bool,
    /// The measured cost of verifying n tokens, if already known (else the adaptive policy
    /// measures it after the prefill). Its `head_row` is a one-row head pass.
    pub cost: Option<CostCurve>,
    /// With a `head_rows` plan measured beforehand ([`choose_head_rows`], once for many
    /// generations): its cost per head row, which the adaptive policy prices verify rows at.
    pub head_per_row: Option<f64>,
}

impl SpecConfig {
    /// The deployment's shape: budget 8, top-k 4, fixed.
    pub fn new(budget: usize, top_k: usize) -> SpecConfig {
        SpecConfig {
            shape: TreeShape::new(budget, top_k),
            adaptive: false,
            head_rows: HeadRows::Auto,
            trace: false,
            cost: None,
            head_per_row: None,
        }
    }

    pub fn validate(&self) -> Result<(), SpecError> {
        if self.shape.budget > 256 {
            return Err(SpecError::Config(format!(
                "the node budget is at most 256, found {}",
                self.shape.budget
            )));
        }
        if self.shape.budget > 0 && self.shape.top_k == 0 {
            return Err(SpecError::Config(
                "top-k must be at least 1 when the budget is above 0".into(),
            ));
        }
        Ok(())
    }
}

/// When generation stops.
#[derive(Clone, Debug, Default)]
pub struct Limits {
    pub max_tokens: usize,
    /// End-of-generation ids (not emitted).
    pub eog: Vec<u32>,
    /// Token sequences that end generation once the output ends with one (emitted).
    pub stop_sequences: Vec<Vec<u32>>,
}

impl Limits {
    /// The decision after `token`, given the output before it.
    pub fn after(&self, out: &[u32], token: u32) -> Flow {
        if self.eog.contains(&token) {
            return Flow::StopBefore;
        }
        if out.len() + 1 >= self.max_tokens {
            return Flow::Stop;
        }
        let ends = |s: &Vec<u32>| {
            !s.is_empty()
                && s.last() == Some(&token)
                && out.len() + 1 >= s.len()
                && out[out.len() + 1 - s.len()..] == s[..s.len() - 1]
        };
        if self.stop_sequences.iter().any(ends) {
            return Flow::Stop;
        }
        Flow::Continue
    }
}

/// One round, kept when [`SpecConfig::trace`] is set.
#[derive(Clone, Debug)]
pub struct Round {
    /// Output tokens before the round (the root is the last of prompt + output).
    pub at: usize,
    pub tree: Tree,
    /// The target's logits at each visited node, in walk order: (node, logits).
    pub visited: Vec<(usize, Vec<f32>)>,
    pub walk: Walk,
}

/// Counters of a speculative generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Verify forwards (plain steps included) after the prefill.
    pub rounds: usize,
    /// Rounds that verified at least one draft node.
    pub spec_rounds: usize,
    /// Tokens emitted by speculative rounds (accepted drafts and the token drawn after them).
    pub spec_tokens: usize,
    /// Draft nodes verified.
    pub drafted: usize,
    /// Per depth d (index d - 1): speculative rounds whose tree reached depth d, and rounds
    /// whose accepted path did.
    pub depth_offered: Vec<usize>,
    pub depth_accepted: Vec<usize>,
    /// Per budget: rounds run with it.
    pub budget_rounds: Vec<(usize, usize)>,
    pub head_passes: usize,
    pub head_rows: usize,
    pub prefill_secs: f64,
    pub draft_secs: f64,
    pub verify_secs: f64,
    /// Wall time after the prefill (draft, verify, walk, compaction, policy).
    pub decode_secs: f64,
}

impl SpecStats {
    /// τ: mean tokens emitted per speculative round (accepted drafts + 1).
    pub fn tau(&self) -> f64 {
        if self.spec_rounds == 0 {
            return 0.0;
        }
        self.spec_tokens as f64 / self.spec_rounds as f64
    }

    /// Acceptance at each depth: of the speculative rounds whose tree reached depth d, the
    /// fraction whose accepted path did.
    pub fn acceptance_by_depth(&self) -> Vec<f64> {
        self.depth_offered
            .iter()
            .zip(&self.depth_accepted)
            .map(|(&o, &a)| if o == 0 { 0.0 } else { a as f64 / o as f64 })
            .collect()
    }

    fn count_budget(&mut self, b: usize) {
        match self.budget_rounds.iter_mut().find(|x| x.0 == b) {
            Some(x) => x.1 += 1,
            None => {
                self.budget_rounds.push((b, 1));
                self.budget_rounds.sort_unstable();
            }
        }
    }
}

/// The result of [`generate`].
#[derive(Clone, Debug)]
pub struct SpecOutput {
    /// Emitted tokens (no end-of-generation token).
    pub tokens: Vec<u32>,
    pub stats: SpecStats,
    pub trace: Vec<Round>,
    /// The policy's cost curve and acceptance at the end (adaptive runs).
    pub policy: Option<Policy>,
}

/// What a cost measurement times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostMode {
    /// The layers over `n` tokens, and one head row on its own (`CostCurve::head_row`): for a
    /// verify that computes only the head rows its walk visits (`generate`).
    LayersThenHead,
    /// The whole forward of `n` tokens with every row through the head, as a batch that asks
    /// for every node's logits runs it (the server); `head_row` is 0.
    WholeForward,
}

/// Measure the target over `n` tokens for `n = 1..=max_n` (1, 2, 3, 5, 9, … measured, best of
/// `reps`; linear between) on a cache holding the context, as `mode` says; every measurement is
/// rolled back.
pub fn measure_cost<E: BatchEngine + ?Sized>(
    engine: &E,
    cache: &mut E::Cache,
    token: u32,
    max_n: usize,
    reps: usize,
    mode: CostMode,
) -> Result<CostCurve, SpecError> {
    let start = cache.next_pos(SEQ);
    let max_n = max_n.max(1);
    // 1, 2, 3, 5, 9, 17, … and max_n; linear between them.
    let mut points = vec![1usize];
    while let Some(&last) = points.last() {
        let next = if last < 3 { last + 1 } else { 2 * last - 1 };
        if next >= max_n {
            break;
        }
        points.push(next);
    }
    if max_n > 1 {
        points.push(max_n);
    }
    let mut measured = Vec::with_capacity(points.len());
    for &n in &points {
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            match mode {
                CostMode::LayersThenHead => {
                    let batch = Batch::chain(SEQ, start, &vec![token; n], false);
                    engine.forward_hidden(cache, &batch)?;
                }
                CostMode::WholeForward => {
                    let batch = Batch::chain(SEQ, start, &vec![token; n], true);
                    engine.forward(cache, &batch, None)?;
                }
            }
            best = best.min(t.elapsed().as_secs_f64());
            cache.rollback();
        }
        measured.push(best);
    }
    let mut head_row = 0.0;
    if mode == CostMode::LayersThenHead {
        // One head row on its own.
        let batch = Batch::chain(SEQ, start, &[token], false);
        let hidden = engine.forward_hidden(cache, &batch)?;
        cache.rollback();
        head_row = f64::INFINITY;
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            engine.head(&hidden, &[0])?;
            head_row = head_row.min(t.elapsed().as_secs_f64());
        }
    }
    let mut secs = Vec::with_capacity(max_n);
    for n in 1..=max_n {
        let i = points.partition_point(|&p| p < n);
        let s = if points[i] == n {
            measured[i]
        } else {
            let (p0, p1) = (points[i - 1], points[i]);
            let f = (n - p0) as f64 / (p1 - p0) as f64;
            measured[i - 1] + f * (measured[i] - measured[i - 1])
        };
        secs.push(s);
    }
    Ok(CostCurve { secs, head_row })
}

/// Which head plan pays on this backend, and the seconds per head row under it: a head pass of
/// `k` rows (a verify's best chain, at most 8) against a pass of one row, best of two each.
/// [`HeadRows::Chain`] when the `k`-row pass costs less than half of `k` one-row passes — a
/// head product that streams its weights once for several rows, as the AVX-512 VNNI rows kernel
/// does (measured on Gemma 3 270M, 2 threads: 8 rows 1.18 decode steps, one row 0.61) — so that
/// computing a chain the walk may leave early still pays; [`HeadRows::Visited`] where the cost
/// grows with the rows. Either plan gives the same tokens.
pub fn choose_head_rows<E: BatchEngine + ?Sized>(
    engine: &E,
    cache: &mut E::Cache,
    token: u32,
    k: usize,
) -> Result<(HeadRows, f64), SpecError> {
    let k = k.clamp(1, 8);
    let start = cache.next_pos(SEQ);
    let batch = Batch::chain(SEQ, start, &vec![token; k], false);
    let hidden = engine.forward_hidden(cache, &batch)?;
    cache.rollback();
    let rows: Vec<usize> = (0..k).collect();
    let (mut one, mut many) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..2 {
        let t = Instant::now();
        engine.head(&hidden, &rows[..1])?;
        one = one.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        engine.head(&hidden, &rows)?;
        many = many.min(t.elapsed().as_secs_f64());
    }
    if k > 1 && many < 0.5 * k as f64 * one {
        Ok((HeadRows::Chain, many / k as f64))
    } else {
        Ok((HeadRows::Visited, one))
    }
}

/// Plain decoding under the same stop rules as [`generate`]: prefill, then one token per
/// forward. It is the baseline a speculative run must equal token for token and beat in time.
/// Returns the tokens and the seconds spent after the prefill.
pub fn generate_plain<E: BatchEngine + ?Sized>(
    engine: &E,
    prompt: &[u32],
    sampler: &mut Sampler,
    limits: &Limits,
) -> Result<(Vec<u32>, f64), RuntimeError> {
    let mut s = Session::new(engine, prompt.len() + limits.max_tokens + 1)?;
    let mut logits = s.forward(prompt, None)?;
    let mut history = prompt.to_vec();
    let mut out = Vec::new();
    let t = Instant::now();
    loop {
        let tok = sampler.sample(logits.last(), &history);
        match limits.after(&out, tok) {
            Flow::StopBefore => break,
            Flow::Stop => {
                out.push(tok);
                break;
            }
            Flow::Continue => {
                out.push(tok);
                history.push(tok);
            }
        }
        logits = s.forward(&[tok], None)?;
    }
    Ok((out, t.elapsed().as_secs_f64()))
}

/// One round's draft: the tree to verify and the seconds drafting took. Without a policy, the
/// drafter's tree of `shape`. With one, the policy's budget of it: a cheap drafter drafts the
/// full tree every round (the policy learns from it even on a plain round); a costly one drafts
/// only when the policy speculates, and the shape the policy asks for (a one-level probe until
/// a draft has been timed), its time recorded per level. `out_len`: tokens emitted so far (the
/// policy settles each tree once the tokens after it are known).
fn draft_round(
    proposer: &mut dyn Proposer,
    policy: Option<&mut Policy>,
    history: &[u32],
    shape: TreeShape,
    out_len: usize,
) -> Result<(Tree, f64), SpecError> {
    let root = *history.last().ok_or(SpecError::EmptyContext)?;
    let costly = proposer.is_costly();
    let budget = policy.as_deref().map_or(shape.budget, Policy::choose);
    let shape = match policy.as_deref() {
        Some(p) if costly => p.draft_shape(shape),
        _ => shape,
    };
    let t = Instant::now();
    let full = if budget > 0 || (policy.is_some() && !costly) {
        proposer.propose(history, shape)?
    } else {
        Tree::root(root)
    };
    let secs = t.elapsed().as_secs_f64();
    let tree = full.prefix(budget);
    if let Some(p) = policy {
        if budget > 0 && costly {
            p.drafted(secs, shape.max_depth.min(shape.budget));
        }
        p.record(out_len, full);
    }
    Ok((tree, secs))
}

/// Generate after `prompt` with tree speculation: prefill, draw the first token, then rounds of
/// draft → verify → walk → keep the accepted path, until `limits` stop it. `cache` must be empty
/// and hold at least `prompt.len() + max_tokens + budget + 1` cells.
pub fn generate<E: BatchEngine + ?Sized>(
    engine: &E,
    cache: &mut E::Cache,
    prompt: &[u32],
    proposer: &mut dyn Proposer,
    sampler: &mut Sampler,
    cfg: &SpecConfig,
    limits: &Limits,
) -> Result<SpecOutput, SpecError> {
    cfg.validate()?;
    if prompt.is_empty() {
        return Err(SpecError::EmptyContext);
    }
    let mut trace = Vec::new();
    let mut seq = Speculation::new(Box::new(proposer), cfg.shape, prompt);
    let done = |seq: Speculation<'_>, trace: Vec<Round>| {
        let (tokens, stats, policy) = seq.finish();
        SpecOutput {
            tokens,
            stats,
            trace,
            policy,
        }
    };
    if limits.max_tokens == 0 {
        return Ok(done(seq, trace));
    }

    let t0 = Instant::now();
    let logits = engine.forward(cache, &Batch::chain(SEQ, 0, prompt, false), None)?;
    engine.commit(cache);
    seq.stats_mut().prefill_secs = t0.elapsed().as_secs_f64();
    let first = sampler.sample(logits.last(), seq.history());
    let flow = limits.after(seq.emitted(), first);
    if flow == Flow::StopBefore {
        return Ok(done(seq, trace));
    }
    seq.push_token(first);
    if flow == Flow::Stop {
        return Ok(done(seq, trace));
    }

    let t_decode = Instant::now();
    if cfg.adaptive && cfg.shape.budget > 0 {
        let cost = match &cfg.cost {
            Some(c) => c.clone(),
            None => measure_cost(
                engine,
                cache,
                first,
                cfg.shape.budget + 1,
                1,
                CostMode::LayersThenHead,
            )?,
        };
        seq.set_policy(Policy::new(cfg.shape.budget, cost));
    }
    let head_rows = match cfg.head_rows {
        // Budget 0 never verifies a tree: nothing to measure.
        HeadRows::Auto if cfg.shape.budget == 0 => HeadRows::Visited,
        HeadRows::Auto => {
            let depth = cfg.shape.max_depth.min(cfg.shape.budget) + 1;
            let (plan, per_row) = choose_head_rows(engine, cache, first, depth)?;
            if let Some(p) = seq.policy_mut() {
                // The policy prices each emitted token at one head row of the chosen plan.
                p.cost.head_row = per_row;
            }
            plan
        }
        plan => {
            if let (Some(p), Some(r)) = (seq.policy_mut(), cfg.head_per_row) {
                p.cost.head_row = r;
            }
            plan
        }
    };
    loop {
        let tree = seq.draft()?;
        let tv = Instant::now();
        let mut verified = verify::verify(engine, cache, &tree, SEQ, head_rows)?;
        let mut visited = Vec::new();
        let before = seq.emitted().len();
        let walk = {
            let mut row = |node: usize| -> Result<std::rc::Rc<Vec<f32>>, SpecError> {
                let l = verified.logits(engine, node)?;
                if cfg.trace {
                    visited.push((node, l.to_vec()));
                }
                Ok(l)
            };
            let mut target = acceptance::SamplerTarget::new(&mut row, sampler);
            seq.accept(&tree, &mut target, &mut |out, token| {
                limits.after(out, token)
            })?
        };
        let (layers_secs, head_secs, head_rows) =
            (verified.layers_secs, verified.head_secs, verified.head_rows);
        let stats = seq.stats_mut();
        stats.head_passes += verified.head_passes;
        stats.head_rows += head_rows;
        drop(verified);
        kv::keep_path(engine, cache, &walk.path)?;
        seq.stats_mut().verify_secs += tv.elapsed().as_secs_f64();
        if let Some(p) = seq.policy_mut() {
            p.measured(tree.len(), layers_secs);
            p.measured_head(head_rows, head_secs);
        }
        let stopped = walk.stopped;
        if cfg.trace {
            trace.push(Round {
                at: before,
                tree,
                visited,
                walk,
            });
        }
        if stopped {
            break;
        }
    }
    seq.stats_mut().decode_secs = t_decode.elapsed().as_secs_f64();
    Ok(done(seq, trace))
}
