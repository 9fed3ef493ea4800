//! Tree speculation against plain decoding on the tiny models of every architecture and several
//! weight types: greedy speculation emits plain greedy's tokens, seeded sampling plain seeded
//! sampling's, for every drafter (n-gram, another model, the target's first layers, synthetic,
//! adversarial tables) and several budgets; stops inside an accepted path; the emitted
//! distribution passes a χ² test against the target's exact law (float path).
//!
//! Equality is exact, token for token: the acceptance walk draws each token from the target's
//! logits at its node, and those logits equal plain decoding's up to the kernels' token tiling
//! (≤ 1e-5 of a row's largest logit, `core.rs`); a near-tie closer than that would show as a
//! divergence and be reported with its gap.

mod model_support;

use engine::exec::{Engine, Session};
use engine::runtime::{CpuBackend, KvDtype};
use engine::sampling::{Sampler, SamplerConfig};
use engine::spec::{
    self, HeadRows, Limits, ModelProposer, NgramProposer, Proposer, SpecConfig, SyntheticProposer,
    TableProposer, TreeShape,
};
use kernels::cpu::Isa;
use kernels::quant::GgmlType;
use model_support::{load, tokens, Arch, Spec, N_VOCAB};

/// An adversarial drafter's table: the candidates after a context.
type Table = Box<dyn FnMut(&[u32]) -> Vec<(u32, f64)>>;

fn ok<T, E: std::fmt::Display>(r: Result<T, E>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

fn backend() -> CpuBackend {
    ok(CpuBackend::new(Some(Isa::detect()), Some(2)))
}

/// Plain decoding: prefill, then one token per forward, the same stop rules.
fn plain(
    engine: &Engine<'_, CpuBackend>,
    prompt: &[u32],
    cfg: SamplerConfig,
    limits: &Limits,
) -> Vec<u32> {
    ok(spec::generate_plain(
        engine,
        prompt,
        &mut Sampler::new(cfg),
        limits,
    ))
    .0
}

fn speculate(
    engine: &Engine<'_, CpuBackend>,
    prompt: &[u32],
    proposer: &mut dyn Proposer,
    sampler_cfg: SamplerConfig,
    cfg: &SpecConfig,
    limits: &Limits,
) -> spec::SpecOutput {
    let mut cache = ok(engine.new_cache(
        prompt.len() + limits.max_tokens + cfg.shape.budget + 2,
        KvDtype::F32,
    ));
    let mut sampler = Sampler::new(sampler_cfg);
    ok(spec::generate(
        engine,
        &mut cache,
        prompt,
        proposer,
        &mut sampler,
        cfg,
        limits,
    ))
}

fn limits(n: usize) -> Limits {
    Limits {
        max_tokens: n,
        ..Limits::default()
    }
}

/// A prompt that repeats (so the n-gram drafter has something to say).
fn repetitive_prompt(seed: u64) -> Vec<u32> {
    let base = tokens(7, seed);
    let mut p = Vec::new();
    for _ in 0..3 {
        p.extend_from_slice(&base);
    }
    p
}

fn check_same(what: &str, want: &[u32], got: &[u32]) {
    assert_eq!(
        want,
        got,
        "{what}: speculative output differs from plain decoding at token {}",
        want.iter().zip(got).take_while(|(a, b)| a == b).count()
    );
}

fn configs() -> Vec<SpecConfig> {
    let mut v = Vec::new();
    for (b, k) in [(1, 1), (4, 2), (8, 4), (16, 4)] {
        v.push(SpecConfig::new(b, k));
    }
    let mut chain = SpecConfig::new(8, 4);
    chain.head_rows = HeadRows::Chain;
    v.push(chain);
    let mut adaptive = SpecConfig::new(8, 4);
    adaptive.adaptive = true;
    v.push(adaptive);
    v
}

#[test]
fn greedy_speculation_equals_plain_greedy_on_every_architecture() {
    for arch in [Arch::Llama, Arch::Gemma3, Arch::Deepseek2] {
        for ty in [GgmlType::Q8_0, GgmlType::F32, GgmlType::Q4_0] {
            let mut s = Spec::new(arch);
            s.mat_type = ty;
            let (_dir, model) = load(&s);
            let be = backend();
            let engine = ok(Engine::new(&model, &be));
            let prompt = repetitive_prompt(3);
            let lim = limits(24);
            let want = plain(&engine, &prompt, SamplerConfig::greedy(), &lim);
            let mut oracle = prompt.clone();
            oracle.extend_from_slice(&want);
            for cfg in configs() {
                let mut drafters: Vec<Box<dyn Proposer>> = vec![
                    Box::new(NgramProposer::new(2048)),
                    Box::new(SyntheticProposer::new(oracle.clone(), 0.7, N_VOCAB, 1)),
                    Box::new(SyntheticProposer::new(oracle.clone(), 1.0, N_VOCAB, 2)),
                ];
                for d in &mut drafters {
                    let got = speculate(
                        &engine,
                        &prompt,
                        d.as_mut(),
                        SamplerConfig::greedy(),
                        &cfg,
                        &lim,
                    );
                    check_same(
                        &format!(
                            "{arch:?} {ty:?} {} b{} k{}",
                            d.name(),
                            cfg.shape.budget,
                            cfg.shape.top_k
                        ),
                        &want,
                        &got.tokens,
                    );
                }
            }
        }
    }
}

#[test]
fn model_and_self_drafters_are_lossless_and_keep_their_window() {
    let (_d1, target_model) = load(&Spec::new(Arch::Gemma3));
    let (_d2, draft_model) = load(&Spec::new(Arch::Llama));
    let be = backend();
    let target = ok(Engine::new(&target_model, &be));
    let draft = ok(Engine::new(&draft_model, &be));
    let own = ok(Engine::with_layers(&target_model, &be, 2));
    assert_eq!(own.n_layers(), 2);
    let prompt = repetitive_prompt(5);
    let lim = limits(20);
    let want = plain(&target, &prompt, SamplerConfig::greedy(), &lim);
    for cfg in [SpecConfig::new(4, 2), SpecConfig::new(8, 4)] {
        for (name, eng) in [("model", &draft), ("self:2", &own)] {
            // A draft window of 8 tokens: shorter than the text, so the window slides.
            let mut p = ok(ModelProposer::new(eng, 8, name));
            let got = speculate(
                &target,
                &prompt,
                &mut p,
                SamplerConfig::greedy(),
                &cfg,
                &lim,
            );
            check_same(name, &want, &got.tokens);
            assert!(
                p.cached() <= 8,
                "{name}: the draft cache holds {} > 8 positions",
                p.cached()
            );
        }
    }
    // The target's own first layers, all of them, draft exactly what the target decodes: every
    // chain draft is accepted whole (a check that the drafter's cache is kept in step).
    let all = ok(Engine::with_layers(
        &target_model,
        &be,
        target_model.config().n_layer,
    ));
    let mut p = ok(ModelProposer::new(&all, 2048, "self:all"));
    let mut cfg = SpecConfig::new(4, 1);
    cfg.shape = TreeShape {
        budget: 4,
        top_k: 1,
        max_depth: 4,
    };
    let got = speculate(
        &target,
        &prompt,
        &mut p,
        SamplerConfig::greedy(),
        &cfg,
        &lim,
    );
    check_same("self:all", &want, &got.tokens);
    assert!(
        got.stats.tau() > 4.0,
        "a drafter equal to the target should have every draft accepted (τ = 5 but for the last round), τ = {}",
        got.stats.tau()
    );
}

#[test]
fn adversarial_drafters_change_nothing() {
    let (_dir, model) = load(&Spec::new(Arch::Llama));
    let be = backend();
    let engine = ok(Engine::new(&model, &be));
    let prompt = tokens(9, 11);
    let lim = limits(16);
    let sampled = SamplerConfig {
        temperature: 0.9,
        top_k: 8,
        top_p: 0.95,
        min_p: 0.02,
        seed: 42,
        ..SamplerConfig::default()
    };
    for scfg in [SamplerConfig::greedy(), sampled] {
        let want = plain(&engine, &prompt, scfg, &lim);
        // Always the same few tokens; the least likely ids; a context-dependent mix.
        let tables: Vec<Table> = vec![
            Box::new(|_| vec![(0, -0.1), (1, -0.2), (2, -0.3)]),
            Box::new(|_| {
                (0..4)
                    .map(|i| (N_VOCAB as u32 - 1 - i, -0.01 * f64::from(i)))
                    .collect()
            }),
            Box::new(|c| {
                let h = c
                    .iter()
                    .fold(7u32, |a, &t| a.wrapping_mul(31).wrapping_add(t));
                (0..4)
                    .map(|i| ((h + i * 13) % N_VOCAB as u32, -(f64::from(i))))
                    .collect()
            }),
        ];
        for table in tables {
            let mut p = TableProposer { table };
            for cfg in [SpecConfig::new(4, 2), SpecConfig::new(12, 4)] {
                let got = speculate(&engine, &prompt, &mut p, scfg, &cfg, &lim);
                check_same(
                    &format!("table, T = {}", scfg.temperature),
                    &want,
                    &got.tokens,
                );
            }
        }
    }
}

#[test]
fn seeded_sampling_equals_plain_seeded_sampling() {
    for arch in [Arch::Llama, Arch::Gemma3] {
        let (_dir, model) = load(&Spec::new(arch));
        let be = backend();
        let engine = ok(Engine::new(&model, &be));
        let prompt = repetitive_prompt(9);
        let lim = limits(20);
        for seed in 0..6 {
            let scfg = SamplerConfig {
                temperature: 0.7 + 0.1 * seed as f32,
                top_k: [0, 5, 40][seed as usize % 3],
                top_p: 0.9,
                min_p: 0.01,
                repeat_penalty: if seed % 2 == 0 { 1.0 } else { 1.1 },
                seed,
                ..SamplerConfig::default()
            };
            let want = plain(&engine, &prompt, scfg, &lim);
            let mut oracle = prompt.clone();
            oracle.extend_from_slice(&want);
            let mut drafters: Vec<Box<dyn Proposer>> = vec![
                Box::new(NgramProposer::new(2048)),
                Box::new(SyntheticProposer::new(oracle, 0.8, N_VOCAB, seed)),
            ];
            for d in &mut drafters {
                let got = speculate(
                    &engine,
                    &prompt,
                    d.as_mut(),
                    scfg,
                    &SpecConfig::new(8, 4),
                    &lim,
                );
                check_same(
                    &format!("{arch:?} seed {seed} {}", d.name()),
                    &want,
                    &got.tokens,
                );
            }
        }
    }
}

#[test]
fn stops_inside_an_accepted_path_without_overshooting() {
    let (_dir, model) = load(&Spec::new(Arch::Llama));
    let be = backend();
    let engine = ok(Engine::new(&model, &be));
    let prompt = repetitive_prompt(4);
    let full = plain(&engine, &prompt, SamplerConfig::greedy(), &limits(30));
    let mut oracle = prompt.clone();
    oracle.extend_from_slice(&full);
    // The token limit, an end-of-generation id and a stop sequence, each falling inside a
    // round whose whole chain is accepted (rate 1).
    let eog_at = 9;
    let cases = [
        Limits {
            max_tokens: 7,
            ..Limits::default()
        },
        Limits {
            max_tokens: 30,
            eog: vec![full[eog_at]],
            ..Limits::default()
        },
        Limits {
            max_tokens: 30,
            stop_sequences: vec![full[10..12].to_vec()],
            ..Limits::default()
        },
    ];
    for lim in cases {
        let want = plain(&engine, &prompt, SamplerConfig::greedy(), &lim);
        let mut p = SyntheticProposer::new(oracle.clone(), 1.0, N_VOCAB, 0);
        let got = speculate(
            &engine,
            &prompt,
            &mut p,
            SamplerConfig::greedy(),
            &SpecConfig::new(8, 1),
            &lim,
        );
        check_same(&format!("{lim:?}"), &want, &got.tokens);
        assert!(got.tokens.len() <= lim.max_tokens);
    }
}

/// Exact law of the first three tokens at temperature 1 with top-k 3 (27 outcomes), from plain
/// logits; the speculative sampler's empirical frequencies over many seeds must fit it.
#[test]
fn chi_square_of_the_float_path() {
    let (_dir, model) = load(&Spec::new(Arch::Llama));
    let be = backend();
    let engine = ok(Engine::new(&model, &be));
    let prompt = tokens(6, 2);
    let base = SamplerConfig {
        temperature: 1.0,
        top_k: 3,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
        seed: 0,
    };
    let law = exact_law(&engine, &prompt, base, 3);
    let n_runs = 3000u64;
    let mut counts = std::collections::HashMap::<Vec<u32>, u64>::new();
    // A drafter that offers the target's two best tokens at every node (tree top-k 2 of the
    // sampler's 3): most tokens come from accepted nodes, and the third-ranked token is a
    // rejection, where a lossy rule (accept the confident draft) would move its mass.
    for seed in 0..n_runs {
        let scfg = SamplerConfig { seed, ..base };
        let mut drafter = TableProposer {
            table: |c: &[u32]| law_top(&engine, c),
        };
        let got = speculate(
            &engine,
            &prompt,
            &mut drafter,
            scfg,
            &SpecConfig::new(6, 2),
            &limits(3),
        );
        *counts.entry(got.tokens).or_default() += 1;
    }
    let mut chi2 = 0.0;
    for (seq, p) in &law {
        let e = p * n_runs as f64;
        let o = *counts.get(seq).unwrap_or(&0) as f64;
        chi2 += (o - e) * (o - e) / e;
    }
    let unexpected: u64 = counts
        .iter()
        .filter(|(s, _)| !law.iter().any(|(l, _)| l == *s))
        .map(|(_, c)| c)
        .sum();
    assert_eq!(
        unexpected, 0,
        "sequences outside the target's support were emitted"
    );
    // 26 degrees of freedom: the 0.999 quantile of χ²(26) is 54.05 (standard tables); a walk
    // that accepts by the drafter's probability moves mass by far more (the drafter here is
    // always confident).
    assert!(chi2 < 54.05, "χ² = {chi2:.1} over {} outcomes", law.len());
}

/// The target's top-3 after context `c` (plain forward), as drafting weights.
fn law_top(engine: &Engine<'_, CpuBackend>, c: &[u32]) -> Vec<(u32, f64)> {
    let mut s = ok(Session::new(engine, c.len() + 1));
    let l = ok(s.forward(c, None));
    spec::tree::top_k_log_probs(l.last(), 3)
}

/// Every length-`n` continuation with its probability under `cfg` (plain logits).
fn exact_law(
    engine: &Engine<'_, CpuBackend>,
    prompt: &[u32],
    cfg: SamplerConfig,
    n: usize,
) -> Vec<(Vec<u32>, f64)> {
    let sampler = Sampler::new(cfg);
    let mut out = vec![(Vec::new(), 1.0)];
    for _ in 0..n {
        let mut next = Vec::new();
        for (seq, p) in out {
            let mut ctx = prompt.to_vec();
            ctx.extend_from_slice(&seq);
            let mut s = ok(Session::new(engine, ctx.len() + 1));
            let l = ok(s.forward(&ctx, None));
            for (t, q) in sampler.distribution(l.last(), &ctx) {
                let mut s2: Vec<u32> = seq.clone();
                s2.push(t);
                next.push((s2, p * q));
            }
        }
        out = next;
    }
    out
}

#[test]
fn the_policy_falls_back_and_stays_lossless() {
    // A drafter that is always wrong: the adaptive policy must end up decoding plainly.
    let (_dir, model) = load(&Spec::new(Arch::Gemma3));
    let be = backend();
    let engine = ok(Engine::new(&model, &be));
    let prompt = tokens(12, 8);
    let lim = limits(40);
    let want = plain(&engine, &prompt, SamplerConfig::greedy(), &lim);
    let mut oracle = prompt.clone();
    oracle.extend_from_slice(&want);
    let mut p = SyntheticProposer::new(oracle, 0.0, N_VOCAB, 0);
    let mut cfg = SpecConfig::new(8, 4);
    cfg.adaptive = true;
    let got = speculate(
        &engine,
        &prompt,
        &mut p,
        SamplerConfig::greedy(),
        &cfg,
        &lim,
    );
    check_same("adaptive, wrong drafter", &want, &got.tokens);
    let plain_rounds = got
        .stats
        .budget_rounds
        .iter()
        .find(|b| b.0 == 0)
        .map_or(0, |b| b.1);
    assert!(
        plain_rounds * 2 > got.stats.rounds,
        "a drafter that is never right should leave most rounds plain: {:?}",
        got.stats.budget_rounds
    );
}

/// Sequences that speculate side by side in one ragged batch, as the server runs them: each a
/// [`spec::Speculation`] (draft → its tree pushed beside the others' → accept from its own rows),
/// one forward per round for all of them, the cells kept by one compaction. Each sequence must
/// emit what it emits alone (plain greedy decoding), whatever the other sequences drafted: a
/// tree mask that leaks across sequences, a compaction that keeps another sequence's row, or
/// positions shifted by a neighbour's tree all change some sequence's tokens.
#[test]
fn sequences_speculating_in_one_batch_each_equal_plain_decoding() {
    use engine::exec::BatchEngine;
    use engine::runtime::Batch;
    use engine::spec::{verify::push_tree, Flow, SamplerTarget, Speculation};

    for arch in [Arch::Llama, Arch::Gemma3, Arch::Deepseek2] {
        let (_dir, model) = load(&Spec::new(arch));
        let be = backend();
        let engine = ok(Engine::new(&model, &be));
        // Different lengths; the first two start alike, so their trees are alike too.
        let mut short = repetitive_prompt(3);
        short.truncate(13);
        let prompts = [repetitive_prompt(3), short, repetitive_prompt(11)];
        let max_tokens = [24, 17, 30];
        let wants: Vec<Vec<u32>> = prompts
            .iter()
            .zip(max_tokens)
            .map(|(p, n)| plain(&engine, p, SamplerConfig::greedy(), &limits(n)))
            .collect();
        let shape = TreeShape::new(8, 4);
        // A drafter per sequence: n-gram, and synthetic ones that know the answer at 70 %
        // (trees accepted in part, so rows are dropped between kept ones).
        let mut seqs: Vec<Speculation<'_>> = prompts
            .iter()
            .zip(&wants)
            .enumerate()
            .map(|(i, (p, w))| {
                let proposer: Box<dyn Proposer> = if i == 1 {
                    Box::new(NgramProposer::new(2048))
                } else {
                    let mut oracle = p.clone();
                    oracle.extend_from_slice(w);
                    Box::new(SyntheticProposer::new(oracle, 0.7, N_VOCAB, i as u64))
                };
                Speculation::new(proposer, shape, p)
            })
            .collect();
        let mut samplers: Vec<Sampler> = (0..seqs.len())
            .map(|_| Sampler::new(SamplerConfig::greedy()))
            .collect();
        let capacity: usize = prompts.iter().map(Vec::len).sum::<usize>() + 200;
        let mut cache = ok(engine.new_cache(capacity, KvDtype::F32));

        // One prefill of every prompt, each sequence's first token from its last row.
        let mut batch = Batch::new();
        let rows: Vec<usize> = prompts
            .iter()
            .enumerate()
            .map(|(s, p)| {
                let mut last = 0;
                for (k, &t) in p.iter().enumerate() {
                    last = batch.push(t, k as u32, s as u32, k + 1 == p.len());
                }
                last
            })
            .collect();
        let logits = ok(engine.forward_batch(&mut cache, &batch));
        engine.commit(&mut cache);
        let mut live: Vec<usize> = Vec::new();
        for (s, &row) in rows.iter().enumerate() {
            let l = logits
                .of_token(row)
                .unwrap_or_else(|| panic!("no row {row}"));
            let t = samplers[s].sample(l, seqs[s].history());
            seqs[s].push_token(t);
            if limits(max_tokens[s]).after(&[], t) == Flow::Continue {
                live.push(s);
            }
        }

        let mut rounds = 0;
        while !live.is_empty() {
            rounds += 1;
            assert!(rounds < 200, "{arch:?}: no end after 200 rounds");
            let mut batch = Batch::new();
            let trees: Vec<_> = live
                .iter()
                .map(|&s| {
                    let tree = ok(seqs[s].draft());
                    let root_pos = (seqs[s].history().len() - 1) as u32;
                    let base = push_tree(&mut batch, &tree, s as u32, root_pos, true);
                    (tree, base)
                })
                .collect();
            let logits = ok(engine.forward_batch(&mut cache, &batch));
            let mut keep = vec![true; batch.len()];
            let mut still = Vec::new();
            for (&s, (tree, base)) in live.iter().zip(&trees) {
                keep[*base..base + tree.len()].fill(false);
                let lim = limits(max_tokens[s]);
                let mut row = |node: usize| {
                    logits
                        .of_token(base + node)
                        .ok_or_else(|| spec::SpecError::Config(format!("no row for {node}")))
                };
                let mut target = SamplerTarget::new(&mut row, &mut samplers[s]);
                let walk = ok(seqs[s].accept(tree, &mut target, &mut |out, t| lim.after(out, t)));
                for &n in &walk.path {
                    keep[base + n] = true;
                }
                if !walk.stopped {
                    still.push(s);
                }
            }
            let kept: Vec<usize> = (0..batch.len()).filter(|&k| keep[k]).collect();
            ok(engine.compact(&mut cache, &kept));
            for &s in live.iter().filter(|s| !still.contains(s)) {
                engine.remove_seq(&mut cache, s as u32);
            }
            live = still;
        }
        for (s, want) in wants.iter().enumerate() {
            check_same(
                &format!("{arch:?} sequence {s} of {} in one batch", seqs.len()),
                want,
                seqs[s].emitted(),
            );
        }
        assert!(
            seqs.iter()
                .any(|s| s.stats().drafted > 0 && s.stats().spec_rounds > 0),
            "{arch:?}: no tree was verified"
        );
    }
}
