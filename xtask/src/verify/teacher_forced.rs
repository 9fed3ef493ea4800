//! The teacher-forced case (spec `off`, any topology, single files and split sets): the engine
//! and the reference on the same tokens, tap by tap (end to end and layer-isolated, MoE
//! route-aware), then the coherence gates, the split-set and TP gates, and throughput.

use std::time::Instant;

use anyhow::{Context, Result};
use engine::exec::{self, AnyEngine, Session, Topology};
use engine::model::Model;
use engine::taps::TapRecorder;
use engine::tokenizer::Tokenizer;
use harness::cases::{Backend, Case};
use harness::coherence::{self, DegeneracyParams};
use harness::gate::GateResult;
use harness::report::{CaseResult, Figure};
use harness::tap::Tap;
use harness::throughput::{self, Baseline};
use harness::tolerance::Numerics;
use reference::{Precision, ReferenceModel};

use super::common::{argmax, device_of, truncate_text, Budget, CaseEnv, PROMPT, TEXT};
use super::gates::{bos_gate, logit_thresholds, tokens_gate};
use super::isolate::Isolating;
use super::reference_runs::{RefSource, ReferenceCache, ReferenceRun};

/// Run one case; `Ok` carries the judged result (passed or failed), `Err` an error that kept the
/// case from being judged at all.
pub fn run(
    case: &Case,
    env: &CaseEnv,
    refs: &mut ReferenceCache,
) -> Result<(CaseResult, Option<Baseline>)> {
    let started = Instant::now();
    let name = case.name();
    let ctx = case.context()?;
    let device = device_of(case.backend, env.threads)?;
    let split = super::tp_case::split_source(case, env.path)?;
    let model = match &split {
        Some(s) => Model::load_listed(&s.listing).context("loading the split set as listed")?,
        None => Model::load(env.path).with_context(|| format!("loading {}", env.path.display()))?,
    };
    let tokenizer = Tokenizer::from_gguf(model.gguf()).context("loading the tokenizer")?;
    let engine = exec::open(&model, &device, &Topology::single())
        .with_context(|| format!("opening the model on {device}"))?;
    let topology = super::tp_case::topology(case)?;
    let tp_engine = if topology.tp > 1 {
        Some(
            exec::open(&model, &device, &topology)
                .with_context(|| format!("preparing {} ranks of {}", topology.tp, case.model))?,
        )
    } else {
        None
    };
    // Teacher-forced taps and logits on the case's topology; everything else on the whole engine.
    let fwd: &AnyEngine<'_> = tp_engine.as_ref().unwrap_or(&engine);
    let budget = env.budget;
    let ref_src = match &split {
        Some(s) => RefSource::Listed {
            shards: &s.listing,
            single: &s.single,
        },
        None => RefSource::File(env.path),
    };
    let reference = refs.get(ref_src, budget, env.real)?;

    // Each side tokenizes with its own tokenizer; the `tokens` gate requires the same ids.
    let engine_text = tokenizer
        .encode(TEXT, true, false)
        .context("engine: tokenizing the fixed text")?;
    let engine_prompt = tokenizer
        .encode(PROMPT, true, false)
        .context("engine: tokenizing the prompt")?;
    let tokens_gate = tokens_gate(&[
        ("text", &engine_text, &reference.text_ids),
        ("prompt", &engine_prompt, &reference.prompt),
    ]);
    let bos = reference.bos.map(|bos| {
        // The sequences the engine is fed, against the BOS the reference read from the file.
        bos_gate(bos, &[("text", &engine_text), ("prompt", &engine_prompt)])
    });
    if !tokens_gate.passed {
        // Different inputs: no tap or logit comparison would mean anything.
        let gates = std::iter::once(tokens_gate).chain(bos).collect();
        let result = CaseResult::judged(&name, None, gates, Vec::new())
            .with_duration(started.elapsed().as_secs_f64());
        return Ok((result, None));
    }
    let engine_tokens = truncate_text(&engine_text, budget.n_text)?;

    // Teacher-forced: the same tokens, one batched forward, every tap and every position's logits.
    let mut recorder = TapRecorder::new();
    let mut session = Session::new(fwd, 4096)?;
    session.set_logits_all(true);
    let logits = session
        .forward(&engine_tokens, Some(&mut recorder))
        .context("engine forward pass")?;
    let disagreements = std::mem::take(&mut recorder.disagreements);
    let engine_taps: Vec<Tap> = recorder
        .taps
        .into_iter()
        .map(|t| Tap::new(t.name, t.shape, t.data))
        .collect();
    let n_layers = model.config().n_layer;
    // End to end, MoE route-aware: the f32 reference following the engine's expert choices at
    // the near-ties where the two diverged (a flip there is rounding, and the error it carries
    // downstream is not the engine's), each flip inside the margin of the router tap's
    // end-to-end bound at its layer.
    let followed = follow_end_to_end(ref_src, reference, &engine_taps, env, &ctx, n_layers)?;
    let (full_ref, e2e_routes, e2e_selections) = match &followed {
        Some(f) => (f.taps.as_slice(), f.routes, f.selections),
        None => (reference.taps.as_slice(), 0, 0),
    };
    let full = harness::compare::compare_taps(&engine_taps, full_ref, env.policy, &ctx);
    // The logit gates judge the engine's logits against the same reference (following the
    // engine's near-tie choices, if any).
    let ref_logits = full_ref
        .iter()
        .rev()
        .find(|t| t.name == "logits")
        .map_or(reference.logits(), |t| t.data.as_slice());
    // Layer-isolated, exact numerics: every engine layer on the exact reference's input to it.
    let exact_ctx = ctx.with_numerics(Numerics::ExactIsolated);
    let mut iso = Isolating::new(&reference.exact_taps);
    let mut session = Session::new(&engine, 4096)?;
    session
        .forward(&engine_tokens, Some(&mut iso))
        .context("engine forward pass, layer-isolated")?;
    let isolated =
        harness::compare::compare_taps(&iso.taps, &reference.exact_taps, env.policy, &exact_ctx);
    // MoE, route-aware: flips of the expert choice between the two routers' logits, accepted
    // inside the tie margin, and their layers compared with the reference following the
    // engine's choice (super::routes); glm-dsa, selection-aware, the same for the indexer's
    // selections (super::selections).
    let router_bound = env
        .policy
        .exact_tolerance(harness::tap::TapKind::Router, &exact_ctx)
        .nmse_max;
    let flips = super::routes::flips(
        &reference.routing,
        &iso.taps,
        &reference.exact_taps,
        &|_| router_bound,
    );
    let indexed = has_indexer(&iso.taps);
    let selection_flips = if super::selections::differ(&iso.taps, &reference.exact_taps, 0) {
        let exact = src_exact(ref_src, reference)?;
        let (_, scores) = exact
            .forward_hidden_scored(
                &reference.tokens,
                &Default::default(),
                &Default::default(),
                &mut |_, _, _| {},
            )
            .context("the exact-numerics reference's indexer scores")?;
        let bound = env
            .policy
            .exact_tolerance(harness::tap::TapKind::IndexerTopK, &exact_ctx)
            .nmse_max;
        super::selections::flips(&iso.taps, &reference.exact_taps, &scores, 0, &|_| bound)
    } else {
        Vec::new()
    };
    let following = super::routes::Following {
        routes: super::routes::forced(&flips),
        selections: super::selections::forced(&selection_flips),
    };
    let isolated = match follow_flips(ref_src, reference, &following)? {
        Some(followed) => {
            harness::compare::compare_taps(&iso.taps, &followed, env.policy, &exact_ctx)
        }
        None => isolated,
    };
    // End to end against the exact reference: reported (how far exact numerics stay together
    // through the depth), judged by neither bound.
    let exact_e2e =
        harness::compare::compare_taps(&engine_taps, &reference.exact_taps, env.policy, &exact_ctx);
    // The finding is the first layer-isolated divergence (a layer's own error, tight bounds);
    // failing that, the full-precision end-to-end one.
    let (comparison, divergence_mode) = if isolated.first_divergence.is_some() {
        (&isolated, "layer-isolated, exact numerics")
    } else {
        (&full, "end to end, full precision")
    };

    let mut gates: Vec<GateResult> = vec![tokens_gate];
    gates.extend(bos);
    gates.push(reference.golden.clone());
    if !reference.routing.is_empty() {
        gates.push(super::routes::gate(&flips));
    }
    if indexed {
        gates.push(super::selections::gate(&selection_flips));
    }
    let (logit_gates, mut figures) = logit_gates(reference, ref_logits, &logits.data, &ctx)?;
    gates.extend(logit_gates);
    gates.extend(greedy_gates(
        &engine,
        &engine_prompt,
        reference,
        budget,
        env.real,
    )?);
    let max_nmse = |c: &harness::compare::Comparison| {
        c.taps.iter().map(|t| t.metrics.nmse).fold(0.0, f64::max)
    };
    figures.push(Figure::new("max_nmse", max_nmse(&full), ""));
    figures.push(Figure::new("isolated_max_nmse", max_nmse(&isolated), ""));
    figures.push(Figure::new("exact_e2e_max_nmse", max_nmse(&exact_e2e), ""));
    if !reference.routing.is_empty() {
        figures.push(Figure::new(
            "e2e_route_flips_followed",
            e2e_routes as f64,
            "",
        ));
    }
    if indexed {
        figures.push(Figure::new(
            "e2e_selection_flips_followed",
            e2e_selections as f64,
            "",
        ));
    }

    if let Some(s) = &split {
        gates.push(super::tp_case::split_gate(
            s,
            &device,
            &reference.tokens,
            &logits.data,
        )?);
    }
    if let Some(e) = &tp_engine {
        gates.push(super::tp_case::rank_agreement_gate(&disagreements));
        let (f, gate) = super::tp_case::comm_report(e, &reference.prompt, 16)?;
        figures.extend(f);
        gates.push(gate);
    }

    let mut measured = None;
    // Throughput is judged on the real model only: a fixture's forward pass takes microseconds,
    // so its tokens/s on a shared machine is noise, not a signal.
    // Nor on the emulated CUDA device, whose speed says nothing about a GPU's.
    if env.bench && env.real && split.is_none() && case.backend != Backend::CudaEmu {
        let tensors = model.gguf().tensors();
        let weights = WeightSize {
            bytes: tensors.iter().map(|t| t.n_bytes).sum::<u64>() as f64,
            elements: tensors.iter().map(|t| t.n_elements()).sum::<u64>() as f64,
        };
        let m = bench(&engine, &engine_tokens, budget, weights, env.threads)?;
        figures.push(Figure::new("prefill_tps", m.prefill_tps, "tok/s"));
        figures.push(Figure::new("decode_tps", m.decode_tps, "tok/s"));
        figures.push(Figure::new("prefill_ratio", m.ratios.prefill_ratio, ""));
        figures.push(Figure::new("decode_ratio", m.ratios.decode_ratio, ""));
        gates.extend(
            env.baselines
                .gates(&name, &m.ratios, throughput::DEFAULT_NOISE_MARGIN),
        );
        measured = Some(m.ratios);
    }

    let result = CaseResult::judged(&name, Some(comparison), gates, figures)
        .with_divergence_mode(divergence_mode)
        .with_comparison_series("isolated_exact", &isolated)
        .with_comparison_series("e2e_exact", &exact_e2e)
        .with_comparison_series("e2e_full", &full)
        .with_tolerances(env.policy.table(n_layers, &ctx))
        .with_duration(started.elapsed().as_secs_f64());
    Ok((result, measured))
}

/// The logit gates over the teacher-forced text (position t predicts token t+1: mean KL, same
/// top-1, perplexity ratio), bounded by the weight class widened to the exact reference's
/// rounding noise on the same positions; the figures they report.
fn logit_gates(
    reference: &ReferenceRun,
    ref_logits: &[f32],
    logits: &[f32],
    ctx: &harness::tolerance::CaseContext,
) -> Result<(Vec<GateResult>, Vec<Figure>)> {
    let n_vocab = reference.n_vocab;
    // Logit agreement over the text: position t predicts token t+1.
    let n_pos = reference.tokens.len() - 1;
    let stats = coherence::logit_agreement(
        ref_logits
            .get(..n_pos * n_vocab)
            .context("the reference's logits are short of the text")?,
        &logits[..n_pos * n_vocab],
        n_vocab,
        &reference.tokens[1..],
    )?;
    // The rounding noise a correct engine shows: the exact-numerics reference (an independent
    // implementation of the engine's activation rounding) against the plain one, same positions.
    let noise = reference
        .exact_taps
        .iter()
        .find(|t| t.name == "logits")
        .map(|t| {
            coherence::logit_agreement(
                &reference.logits()[..n_pos * n_vocab],
                &t.data[..n_pos * n_vocab],
                n_vocab,
                &reference.tokens[1..],
            )
        })
        .transpose()?;
    let has_router = reference.taps.iter().any(|t| t.name.ends_with(".router"));
    let thresholds = logit_thresholds(ctx, noise.as_ref(), has_router);
    let gates = stats.gates(&thresholds);

    let mut figures = vec![
        Figure::new("mean_kld", stats.kld_mean, ""),
        Figure::new("same_top1", stats.same_top1_rate, ""),
        Figure::new("ppl_ratio", stats.ppl_ratio, ""),
    ];
    if let Some(noise) = &noise {
        figures.push(Figure::new("noise_kld", noise.kld_mean, ""));
        figures.push(Figure::new("noise_same_top1", noise.same_top1_rate, ""));
        figures.push(Figure::new("noise_ppl_ratio", noise.ppl_ratio, ""));
    }
    Ok((gates, figures))
}

/// Greedy continuation of the prompt: equal to the reference's for its first tokens (or a
/// near-tie), and, on the real model, not degenerate.
fn greedy_gates(
    engine: &AnyEngine<'_>,
    engine_prompt: &[u32],
    reference: &ReferenceRun,
    budget: Budget,
    real: bool,
) -> Result<Vec<GateResult>> {
    let n_vocab = reference.n_vocab;
    let mut gates = Vec::new();
    // Greedy continuation: equal to the reference's for the first tokens, and not degenerate.
    let (generated, gen_logits) = greedy(engine, engine_prompt, budget.n_generate)?;
    // A divergence at a near-tie passes. The engine quantizes activations to Q8 before each
    // product and the reference does not, so two close logits may trade places: on the real model
    // the scalar kernels flip one greedy step where the reference's lead is 0.34 nats and the
    // engine's 0.04. 0.5 nats on each side admits such a flip; a bug moves the logits it touches
    // by whole units, and the teacher-forced KL gates still judge every position.
    gates.push(coherence::greedy_prefix_or_tie(
        &generated,
        &reference.greedy,
        budget.n_greedy,
        &coherence::GreedyRows {
            engine: &gen_logits,
            golden: &reference.greedy_rows,
            n_vocab,
        },
        0.5,
    ));
    if real {
        // Fixtures have random weights: their output is noise by construction, so only the real
        // model is judged for degeneracy.
        gates.extend(coherence::detect_degeneracy(
            &generated,
            &gen_logits,
            n_vocab,
            &DegeneracyParams::default(),
        )?);
    }

    Ok(gates)
}

/// Whether the engine's taps hold an indexer's selection (`glm-dsa`).
fn has_indexer(taps: &[Tap]) -> bool {
    taps.iter().any(|t| {
        harness::tap::TapId::parse(&t.name)
            .is_some_and(|id| id.kind == harness::tap::TapKind::IndexerTopK)
    })
}

/// The exact-numerics reference model of `reference`'s file.
fn src_exact(src: RefSource<'_>, reference: &ReferenceRun) -> Result<ReferenceModel> {
    src.open(Precision::Exact, reference.residency)
        .context("the exact-numerics reference, to follow the engine's near-tie choices")
}

/// The exact reference's taps with each layer that has flips inside the tie margin recomputed
/// following the engine's choice (one forced run per layer, so each layer's input stays the
/// unforced reference's, as layer isolation feeds the engine; super::routes::follow says which
/// taps); `None` when there is nothing to follow.
fn follow_flips(
    src: RefSource<'_>,
    reference: &ReferenceRun,
    following: &super::routes::Following,
) -> Result<Option<Vec<Tap>>> {
    if following.is_empty() {
        return Ok(None);
    }
    let exact = src_exact(src, reference)?;
    let per_layer = super::routes::forced_runs(&exact, &reference.tokens, following)?;
    Ok(Some(super::routes::follow(
        &reference.exact_taps,
        &per_layer,
    )))
}

/// The f32 reference's taps following the engine's end-to-end expert choices and indexer
/// selections where they flipped inside the margin (super::routes::follow_end_to_end); `None`
/// for a model with neither, or when both sides chose alike.
fn follow_end_to_end(
    src: RefSource<'_>,
    reference: &ReferenceRun,
    engine_taps: &[Tap],
    env: &CaseEnv,
    ctx: &harness::tolerance::CaseContext,
    n_layers: usize,
) -> Result<Option<super::routes::FollowedRun>> {
    if reference.routing.is_empty() && !has_indexer(engine_taps) {
        return Ok(None);
    }
    let f32_model = src
        .open(Precision::F32, reference.residency)
        .context("the f32 reference, to follow the engine's near-tie choices")?;
    let bound = |kind| {
        move |layer| {
            env.policy
                .tolerance(kind, Some(layer), n_layers, ctx)
                .nmse_max
        }
    };
    super::routes::follow_end_to_end(
        &f32_model,
        &reference.tokens,
        &reference.routing,
        engine_taps,
        &reference.taps,
        &bound(harness::tap::TapKind::Router),
        &bound(harness::tap::TapKind::IndexerTopK),
    )
}

/// Greedy decoding through the KV cache; returns the new ids and their logits rows.
fn greedy(engine: &AnyEngine<'_>, prompt: &[u32], n: usize) -> Result<(Vec<u32>, Vec<f32>)> {
    let mut session = Session::new(engine, prompt.len() + n + 1)?;
    let mut logits = session.forward(prompt, None).context("engine prefill")?;
    let mut ids = Vec::with_capacity(n);
    let mut rows = Vec::with_capacity(n * logits.n_vocab);
    for _ in 0..n {
        let row = logits.last();
        let next = argmax(row);
        rows.extend_from_slice(row);
        ids.push(next);
        logits = session
            .forward(&[next], None)
            .context("engine decode step")?;
    }
    Ok((ids, rows))
}

/// What the roofline calibrations divide by.
#[derive(Clone, Copy)]
struct WeightSize {
    bytes: f64,
    elements: f64,
}

struct Speed {
    prefill_tps: f64,
    decode_tps: f64,
    /// Medians of the per-run ratios to the calibrations measured right before each run.
    ratios: Baseline,
}

fn bench(
    engine: &AnyEngine<'_>,
    tokens: &[u32],
    budget: Budget,
    weights: WeightSize,
    threads: usize,
) -> Result<Speed> {
    let n_decode = 16;
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    let (mut prefill_ratio, mut decode_ratio) = (Vec::new(), Vec::new());
    for _ in 0..budget.bench_runs {
        let bw = throughput::measure_memory_bandwidth_with(
            throughput::DEFAULT_BANDWIDTH_BUFFER,
            3,
            threads,
        )?;
        let fma = throughput::measure_compute_with(
            throughput::DEFAULT_COMPUTE_FMAS / threads.max(1),
            threads,
        )?;
        let mut session = Session::new(engine, tokens.len() + n_decode + 1)?;
        let t = Instant::now();
        let mut logits = session.forward(tokens, None)?;
        let p = tokens.len() as f64 / t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..n_decode {
            let next = argmax(logits.last());
            logits = session.forward(&[next], None)?;
        }
        let d = n_decode as f64 / t.elapsed().as_secs_f64();
        prefill.push(p);
        decode.push(d);
        prefill_ratio.push(throughput::ratio(
            p,
            fma.fma_per_s / (2.0 * weights.elements),
        ));
        decode_ratio.push(throughput::ratio(d, bw.bytes_per_s / weights.bytes));
    }
    let med = |v: &[f64]| throughput::median(v).unwrap_or(f64::NAN);
    Ok(Speed {
        prefill_tps: med(&prefill),
        decode_tps: med(&decode),
        ratios: Baseline {
            prefill_ratio: med(&prefill_ratio),
            decode_ratio: med(&decode_ratio),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::follow_flips;
    use crate::verify::common::Budget;
    use crate::verify::reference_runs::{reference_run, RefSource, ReferenceRun};
    use reference::Residency;

    /// Fixture `name` written to a temporary directory, and its reference run.
    fn fixture_run(name: &str) -> (tempfile::TempDir, std::path::PathBuf, ReferenceRun) {
        let (Ok(dir), Some(spec)) = (tempfile::tempdir(), golden::fixtures::by_name(name)) else {
            panic!("temp dir or fixture {name}")
        };
        let path = golden::fixtures::write(&spec, dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let run = reference_run(
            RefSource::File(&path),
            Budget::for_model(false),
            Residency::Eager,
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        (dir, path, run)
    }

    #[test]
    fn followed_flips_replace_only_the_flipped_rows() {
        use crate::verify::routes::Flip;
        let (_dir, path, run) = fixture_run("deepseek2-lite-q8_0");
        let src = RefSource::File(&path);
        let (&layer, routing) = run.routing.iter().next().expect("an MoE layer");
        let router = run
            .exact_taps
            .iter()
            .find(|t| t.name == format!("blk.{layer}.router"))
            .expect("router tap");
        let w = router.shape[1];
        let logits: Vec<f64> = router.data[3 * w..4 * w]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let ranking = routing.ranking(&logits);
        let k = routing.n_expert_used;
        // The engine's choice: the reference's with its last expert replaced by the next one.
        let mut engine: Vec<usize> = ranking[..k].to_vec();
        engine[k - 1] = ranking[k];
        let flip = |margin: f64| Flip {
            layer,
            token: 3,
            engine: engine.iter().map(|&e| (e, 0.0)).collect(),
            reference: ranking[..k].iter().map(|&e| (e, 0.0)).collect(),
            gap: 0.01,
            margin,
        };
        let following = |margin: f64| crate::verify::routes::Following {
            routes: crate::verify::routes::forced(&[flip(margin)]),
            ..Default::default()
        };
        assert!(follow_flips(src, &run, &following(0.001))
            .unwrap_or_else(|e| panic!("{e:#}"))
            .is_none());
        let followed = follow_flips(src, &run, &following(1.0))
            .unwrap_or_else(|e| panic!("{e:#}"))
            .expect("followed taps");
        for (a, b) in run.exact_taps.iter().zip(&followed) {
            assert_eq!(a.name, b.name);
            let own =
                a.name == format!("blk.{layer}.ffn_out") || a.name == format!("blk.{layer}.out");
            let w = a.shape[1];
            for p in 0..a.shape[0] {
                let differs = a.data[p * w..(p + 1) * w] != b.data[p * w..(p + 1) * w];
                assert_eq!(differs, own && p == 3, "{} row {p}", a.name);
            }
        }
    }

    #[test]
    fn a_followed_selection_replaces_its_layer_from_the_indexer_on_for_its_query_only() {
        use crate::verify::routes::Following;
        let (_dir, path, run) = fixture_run("glm-dsa-q8_0");
        let src = RefSource::File(&path);
        let sel = run
            .exact_taps
            .iter()
            .find(|t| t.name == "blk.0.indexer_top_k")
            .expect("layer 0's selection");
        let top_k = sel.shape[1];
        // The first query that sees more positions than it keeps: swap its lowest kept position
        // for one it left out.
        let query = top_k;
        let kept: Vec<usize> = sel.data[query * top_k..(query + 1) * top_k]
            .iter()
            .map(|&p| p as usize)
            .collect();
        let left_out = (0..=query)
            .find(|p| !kept.contains(p))
            .expect("a position left out");
        let mut engine = kept[1..].to_vec();
        engine.push(left_out);
        engine.sort_unstable();
        let following = Following {
            selections: [((0, query), engine.clone())].into(),
            ..Default::default()
        };
        let followed = follow_flips(src, &run, &following)
            .unwrap_or_else(|e| panic!("{e:#}"))
            .expect("followed taps");
        let own = super::super::routes::AFTER_SELECTION;
        for (a, b) in run.exact_taps.iter().zip(&followed) {
            assert_eq!(a.name, b.name);
            let w = a.shape[1];
            for p in 0..a.shape[0] {
                let differs = a.data[p * w..(p + 1) * w] != b.data[p * w..(p + 1) * w];
                let expect = p == query && own.iter().any(|s| a.name == format!("blk.0.{s}"));
                // The router and the MoE see the forced attention only through its value.
                if a.name != "blk.0.router" {
                    assert_eq!(differs, expect, "{} row {p}", a.name);
                }
            }
        }
        let forced = followed
            .iter()
            .find(|t| t.name == "blk.0.indexer_top_k")
            .expect("followed selection");
        let got: Vec<usize> = forced.data[query * top_k..(query + 1) * top_k]
            .iter()
            .map(|&p| p as usize)
            .collect();
        assert_eq!(got, engine);
    }
}
