//! A speculation case (`…/tree-b8k4`, `…/tree-b16k4`): tree speculation on the engine against
//! plain decoding on the same engine (the `off` cases compare plain decoding with the
//! reference). Gates, in the order a finding is read:
//!
//! 1. `spec.tree-mask`: every node of a verify forward (budget B, top-k K) has the logits of its
//!    root-to-node path run as a plain sequence (ancestor-only mask ∩ sliding window, positions =
//!    start + depth).
//!    `spec.tree-shapes`: the same for trees as the drafters make them at the CLI's largest
//!    budget (on the CPU) and hand-built ones: past 64 tokens, siblings and cousins adjacent in
//!    batch order, a chain of 96 (`tree_shapes.rs`).
//! 2. `spec.compact`: after keeping the deepest path, the next token's logits equal plain
//!    decoding's of the same text, and the cells sit at positions `0..n`; `spec.compact-skip`:
//!    the same for a kept path whose nodes are spread over the batch.
//! 3. `spec.accept-walk`: every round of a greedy run, re-walked independently from the
//!    recorded node logits: each emitted token is the argmax at its node, the path follows
//!    exactly those tokens and stops at the first node without a matching child.
//! 4. `spec.greedy`: greedy speculation (n-gram and synthetic drafters, fixed and adaptive
//!    budgets) emits plain greedy's tokens.
//! 5. `spec.support`: a seeded sampled run (T 0.8, top-k 40, top-p 0.95) emits only tokens of
//!    positive target probability at their node, and equals plain seeded sampling (`spec.sampled`).
//! 6. `spec.tau`: τ of the synthetic drafter that knows the continuation (rate 1) is at least the
//!    depth its tree offers; `spec.speedup` (real model only): the adaptive n-gram run is not
//!    slower than plain decoding beyond the throughput gates' noise margin (same-run ratio).

use anyhow::{Context, Result};
use engine::exec::{AnyEngine, BatchEngine, Session};
use engine::runtime::{Batch, KvDtype, SeqCache};
use engine::sampling::{Sampler, SamplerConfig};
use engine::spec::{
    self, verify, Limits, NgramProposer, Proposer, SpecConfig, SyntheticProposer, TreeShape, SEQ,
};
use engine::tokenizer::Tokenizer;
use harness::gate::GateResult;
use harness::report::Figure;
use harness::throughput::DEFAULT_NOISE_MARGIN;

use super::tree_shapes::{self, rel_err};

/// Same arithmetic on the same rows, differing only by the kernels' token tiling (summation
/// order): ≤ 1e-5 of a row's largest logit on the fixtures (engine/tests/core.rs); the real
/// model's 18 layers were measured at ≤ 2e-5. A mask that lets a node see a sibling, or a wrong
/// kept row, moves logits by ≥ 1e-2 of the largest. 1e-3 sits between with room both ways.
const LOGIT_REL_TOL: f64 = 1e-3;

pub struct SpecRun {
    pub gates: Vec<GateResult>,
    pub figures: Vec<Figure>,
}

fn plain_logits(engine: &AnyEngine<'_>, tokens: &[u32]) -> Result<Vec<f32>> {
    let mut s = Session::new(engine, tokens.len() + 1)?;
    Ok(s.forward(tokens, None)?.last().to_vec())
}

fn plain(
    engine: &AnyEngine<'_>,
    prompt: &[u32],
    cfg: SamplerConfig,
    limits: &Limits,
) -> Result<(Vec<u32>, f64)> {
    Ok(spec::generate_plain(
        engine,
        prompt,
        &mut Sampler::new(cfg),
        limits,
    )?)
}

#[allow(clippy::too_many_arguments)]
fn speculate(
    engine: &AnyEngine<'_>,
    prompt: &[u32],
    proposer: &mut dyn Proposer,
    scfg: SamplerConfig,
    cfg: &SpecConfig,
    limits: &Limits,
) -> Result<spec::SpecOutput> {
    let mut cache = engine.new_cache(
        prompt.len() + limits.max_tokens + cfg.shape.budget + 2,
        KvDtype::F32,
    )?;
    let mut sampler = Sampler::new(scfg);
    spec::generate(
        engine,
        &mut cache,
        prompt,
        proposer,
        &mut sampler,
        cfg,
        limits,
    )
    .context("speculative generation")
}

/// A prompt whose text repeats, so the n-gram drafter has something to propose.
fn prompt(tokenizer: &Tokenizer, real: bool) -> Result<Vec<u32>> {
    if real {
        let text = "Monday: wake up, run, work, read, sleep.\nTuesday: wake up, run, work, read, sleep.\nWednesday:";
        return tokenizer
            .encode(text, true, false)
            .context("tokenizing the speculation prompt");
    }
    // Fixture vocabularies are tiny: a fixed id pattern, repeated.
    let n = tokenizer.vocab_size().max(2) as u32;
    Ok((0..24u32).map(|i| (i % 6) * 7 % n).collect())
}

pub fn run(
    engine: &AnyEngine<'_>,
    tokenizer: &Tokenizer,
    budget: usize,
    top_k: usize,
    real: bool,
    bench: bool,
) -> Result<SpecRun> {
    let mut gates = Vec::new();
    let mut figures = Vec::new();
    let n_vocab = engine.model().config().n_vocab;
    let prompt = prompt(tokenizer, real)?;
    let n_gen = if real { 48 } else { 32 };
    let limits = Limits {
        max_tokens: n_gen,
        eog: Vec::new(),
        stop_sequences: Vec::new(),
    };
    let (want, _) = plain(engine, &prompt, SamplerConfig::greedy(), &limits)?;
    let mut oracle = prompt.clone();
    oracle.extend_from_slice(&want);

    // 1. Tree mask: one verify forward, every node against its path.
    let shape = TreeShape::new(budget, top_k);
    let mut drafter = SyntheticProposer::new(oracle.clone(), 1.0, n_vocab, 7);
    let tree = drafter.propose(&prompt, shape)?;
    let mut cache = engine.new_cache(prompt.len() + budget + 8, KvDtype::F32)?;
    let ctx = &prompt[..prompt.len() - 1];
    engine.forward(&mut cache, &Batch::chain(SEQ, 0, ctx, false), None)?;
    cache.commit();
    let mut verified = verify::verify(engine, &mut cache, &tree, SEQ, verify::HeadRows::All)?;
    let mut worst = (0.0f64, 0usize);
    for node in 0..tree.len() {
        let got = verified.logits(engine, node)?;
        let mut text = prompt.clone();
        text.extend(tree.path_tokens(node));
        let e = rel_err(&got, &plain_logits(engine, &text)?);
        if e > worst.0 {
            worst = (e, node);
        }
    }
    drop(verified);
    gates.push(GateResult::at_most(
        "spec.tree-mask",
        worst.0,
        LOGIT_REL_TOL,
        format!(
            "{} nodes, depth {}: worst node {} (depth {}) rel err {:.2e} against its path run plainly",
            tree.len(),
            tree.max_depth(),
            worst.1,
            tree.depth(worst.1),
            worst.0
        ),
    ));

    // 1b. The shapes drafters make at the CLI's largest budget and hand-built ones past 64
    // tokens with adjacent siblings (tree_shapes.rs). The drafted trees need one plain run per
    // leaf (up to ~200): on the CPU only, every drafter on the fixtures, the n-gram drafter's
    // on the real model.
    let shapes_started = std::time::Instant::now();
    let root = *prompt.last().context("an empty speculation prompt")?;
    let mut shapes = tree_shapes::built(root, n_vocab);
    if engine.cpu_isa().is_some() {
        shapes.extend(tree_shapes::drafted(
            engine, &prompt, &oracle, top_k, !real,
        )?);
    }
    let worst_shapes = shapes
        .iter()
        .map(|s| tree_shapes::check(engine, &prompt, s))
        .collect::<Result<Vec<_>>>()?;
    figures.push(Figure::new(
        "tree_shapes_s",
        shapes_started.elapsed().as_secs_f64(),
        "s",
    ));
    let worst = worst_shapes
        .iter()
        .max_by(|a, b| a.rel_err.total_cmp(&b.rel_err))
        .cloned();
    let listed: Vec<String> = worst_shapes
        .iter()
        .map(|w| format!("{} ({} nodes) {:.1e}", w.shape, w.nodes, w.rel_err))
        .collect();
    gates.push(GateResult::at_most(
        "spec.tree-shapes",
        worst.as_ref().map_or(0.0, |w| w.rel_err),
        LOGIT_REL_TOL,
        format!(
            "{}; worst: {}",
            listed.join(", "),
            worst.map_or("-".into(), |w| format!(
                "{} node {} (depth {}) rel err {:.2e} against its path run plainly",
                w.shape, w.node, w.depth, w.rel_err
            ))
        ),
    ));

    // 2. Compaction: keep the deepest path, decode one more token.
    let deepest = (0..tree.len())
        .max_by_key(|&i| (tree.depth(i), usize::MAX - i))
        .unwrap_or(0);
    let path = tree.path_to(deepest);
    spec::kv::keep_path(engine, &mut cache, &path)?;
    let mut text = prompt.clone();
    text.extend(tree.path_tokens(deepest));
    let next = *oracle.get(text.len()).unwrap_or(&0);
    let pos = cache.next_pos(SEQ);
    let layout_ok = tree_shapes::cells_at_positions(&cache, text.len());
    let l = engine.forward(&mut cache, &Batch::chain(SEQ, pos, &[next], false), None)?;
    cache.commit();
    text.push(next);
    let e = rel_err(l.last(), &plain_logits(engine, &text)?);
    gates.push(GateResult::at_most(
        "spec.compact",
        if layout_ok { e } else { f64::INFINITY },
        LOGIT_REL_TOL,
        format!(
            "kept path of {} nodes; cells at positions 0..{}: {}; next-token rel err {e:.2e} against plain decoding",
            path.len(),
            text.len() - 1,
            if layout_ok { "yes" } else { "no" }
        ),
    ));

    // 2b. Compaction of a path whose nodes are spread over the batch: the fan's last branch,
    // one node in every eight, its last nodes past batch index 64.
    let fan = tree_shapes::fan(root, 8, 10, n_vocab);
    let e = tree_shapes::compact_skipping(engine, &prompt, &fan, fan.len() - 1)?;
    gates.push(GateResult::at_most(
        "spec.compact-skip",
        e,
        LOGIT_REL_TOL,
        format!(
            "kept the fan 8×10's path to node {} (nodes {:?}); next-token rel err {e:.2e} \
             against plain decoding (inf: cells not at positions 0..n)",
            fan.len() - 1,
            fan.path_to(fan.len() - 1)
        ),
    ));

    // 3. and 4. Greedy runs, traced.
    let mut mismatches = Vec::new();
    let mut walk_errors = Vec::new();
    let mut taus = Vec::new();
    let mut cfgs = vec![("fixed", SpecConfig::new(budget, top_k))];
    let mut adaptive = SpecConfig::new(budget, top_k);
    adaptive.adaptive = true;
    cfgs.push(("adaptive", adaptive));
    for (label, mut cfg) in cfgs {
        cfg.trace = true;
        let mut drafters: Vec<Box<dyn Proposer>> = vec![
            Box::new(NgramProposer::new(2048)),
            Box::new(SyntheticProposer::new(oracle.clone(), 0.8, n_vocab, 3)),
        ];
        for d in &mut drafters {
            let out = speculate(
                engine,
                &prompt,
                d.as_mut(),
                SamplerConfig::greedy(),
                &cfg,
                &limits,
            )?;
            let name = format!("{} {label}", d.name());
            for r in &out.trace {
                if let Some(why) = rewalk(r) {
                    walk_errors.push(format!("{name}, round at token {}: {why}", r.at));
                }
            }
            if out.tokens != want {
                let at = want
                    .iter()
                    .zip(&out.tokens)
                    .take_while(|(a, b)| a == b)
                    .count();
                mismatches.push(format!("{name}: first difference at token {at}"));
            }
            taus.push((name, out.stats.tau()));
        }
    }
    gates.push(GateResult::at_most(
        "spec.accept-walk",
        walk_errors.len() as f64,
        0.0,
        if walk_errors.is_empty() {
            "every round re-walked from the recorded target logits: same path, same tokens".into()
        } else {
            walk_errors.join("; ")
        },
    ));
    gates.push(GateResult::at_most(
        "spec.greedy",
        mismatches.len() as f64,
        0.0,
        if mismatches.is_empty() {
            format!("{} runs × {n_gen} tokens equal plain greedy", taus.len())
        } else {
            mismatches.join("; ")
        },
    ));
    for (name, tau) in &taus {
        figures.push(Figure::new(&format!("tau {name}"), *tau, "tokens/verify"));
    }

    // 5. A seeded sampled run.
    let scfg = SamplerConfig {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
        seed: 11,
    };
    let (want_s, _) = plain(engine, &prompt, scfg, &limits)?;
    let mut oracle_s = prompt.clone();
    oracle_s.extend_from_slice(&want_s);
    let mut cfg = SpecConfig::new(budget, top_k);
    cfg.trace = true;
    // The drafter offers the sampled continuation's tokens and wrong ones beside them.
    let mut d = SyntheticProposer::new(oracle_s, 0.7, n_vocab, 5);
    let out = speculate(engine, &prompt, &mut d, scfg, &cfg, &limits)?;
    let sampler = Sampler::new(scfg);
    let mut zero = Vec::new();
    let mut history = prompt.clone();
    for r in &out.trace {
        for (i, (node, logits)) in r.visited.iter().enumerate() {
            let Some(&tok) = r.walk.emitted.get(i) else {
                break;
            };
            let p = sampler
                .distribution(logits, &history)
                .iter()
                .find(|(t, _)| *t == tok)
                .map_or(0.0, |x| x.1);
            if p == 0.0 {
                zero.push(format!(
                    "token {} (id {tok}) at node {node}",
                    history.len() - prompt.len()
                ));
            }
            history.push(tok);
        }
    }
    gates.push(GateResult::at_most(
        "spec.support",
        zero.len() as f64,
        0.0,
        if zero.is_empty() {
            "every sampled token has positive target probability at its node".into()
        } else {
            format!(
                "tokens of target probability 0 emitted: {}",
                zero.join(", ")
            )
        },
    ));
    let same = out.tokens == want_s;
    gates.push(GateResult::at_most(
        "spec.sampled",
        f64::from(u8::from(!same)),
        0.0,
        format!(
            "seeded sampling (T 0.8, top-k 40, top-p 0.95, seed 11) {} plain seeded sampling",
            if same { "equals" } else { "differs from" }
        ),
    ));

    // 6. τ of the drafter that knows the continuation, and (real model) the speedup.
    let mut cfg = SpecConfig::new(budget, top_k);
    cfg.trace = true;
    let mut d = SyntheticProposer::new(oracle.clone(), 1.0, n_vocab, 9);
    let out = speculate(
        engine,
        &prompt,
        &mut d,
        SamplerConfig::greedy(),
        &cfg,
        &limits,
    )?;
    // Every round's whole chain is accepted: τ is the mean tree depth + 1 but for the last
    // round, cut by the token limit; 0.9 × that leaves room for the cut.
    let depth = out
        .trace
        .iter()
        .map(|r| f64::from(r.tree.max_depth()))
        .sum::<f64>()
        / out.trace.len().max(1) as f64;
    gates.push(GateResult::at_least(
        "spec.tau",
        out.stats.tau(),
        0.9 * (depth + 1.0),
        format!(
            "a drafter that knows the continuation: τ {:.2} with trees of mean depth {depth:.2}",
            out.stats.tau()
        ),
    ));
    figures.push(Figure::new(
        "tau synthetic:1",
        out.stats.tau(),
        "tokens/verify",
    ));

    if real && bench {
        let mut cfg = SpecConfig::new(budget, top_k);
        cfg.adaptive = true;
        let (_, plain_secs) = plain(engine, &prompt, SamplerConfig::greedy(), &limits)?;
        let mut d = NgramProposer::new(2048);
        let out = speculate(
            engine,
            &prompt,
            &mut d,
            SamplerConfig::greedy(),
            &cfg,
            &limits,
        )?;
        let speedup = plain_secs / out.stats.decode_secs.max(f64::MIN_POSITIVE);
        figures.push(Figure::new("speedup ngram adaptive", speedup, "x"));
        gates.push(GateResult::at_least(
            "spec.speedup",
            speedup,
            1.0 - DEFAULT_NOISE_MARGIN,
            format!(
                "adaptive n-gram speculation over plain greedy, same run: {speedup:.2}x (τ {:.2}); the bound is 1 less the throughput gates' noise margin",
                out.stats.tau()
            ),
        ));
    }
    Ok(SpecRun { gates, figures })
}

/// Re-walk one greedy round from its recorded node logits; `None` when the walk was right.
fn rewalk(r: &spec::Round) -> Option<String> {
    let tree = &r.tree;
    let mut at = 0usize;
    let mut path = vec![0usize];
    for (i, (node, logits)) in r.visited.iter().enumerate() {
        if *node != at {
            return Some(format!("visited node {node}, expected node {at}"));
        }
        let best = engine::sampling::argmax(logits);
        let emitted = r.walk.emitted.get(i).copied();
        if emitted.is_some_and(|e| e != best) {
            return Some(format!(
                "emitted {} at node {node}, the target's argmax is {best}",
                emitted.unwrap_or(0)
            ));
        }
        match tree.child_with(at, best) {
            Some(c) => {
                at = c;
                path.push(c);
            }
            None => {
                if i + 1 != r.visited.len() {
                    return Some(format!(
                        "walk continued after node {node} although no child carries {best}"
                    ));
                }
            }
        }
    }
    let stopped_early = r.walk.stopped;
    let n = r.walk.path.len();
    if r.walk.path != path[..n.min(path.len())] || (!stopped_early && r.walk.path != path) {
        return Some(format!(
            "kept path {:?}, the target's choices give {:?}",
            r.walk.path, path
        ));
    }
    None
}
