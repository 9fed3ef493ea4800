//! One verify case: the engine and the reference on the same tokens, tap by tap, then the
//! coherence and throughput gates.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use engine::model::Model;
use engine::runtime::{CpuBackend, Engine, Session};
use engine::taps::TapRecorder;
use engine::tokenizer::Tokenizer;
use harness::cases::{Backend, Case, Spec};
use harness::coherence::{self, DegeneracyParams, LogitThresholds};
use harness::gate::GateResult;
use harness::report::{CaseResult, Figure};
use harness::tap::Tap;
use harness::throughput::{self, Bandwidth, Baseline, Baselines};
use harness::tolerance::TolerancePolicy;
use kernels::cpu::Isa;
use reference::{Precision, ReferenceModel};

/// The fixed English text every case is teacher-forced on (public domain, golden/data/README.md).
const TEXT: &str = include_str!("../../../golden/data/pride_and_prejudice_ch1.txt");
/// Greedy continuation prompt for the coherence gates.
const PROMPT: &str = "The capital of France is";

/// How much work a case does; the real model gets more tokens than the tiny fixtures need.
#[derive(Clone, Copy)]
pub struct Budget {
    /// Teacher-forced tokens for the tap comparison and the logit gates.
    pub n_text: usize,
    /// Greedy tokens compared with the reference's greedy continuation.
    pub n_greedy: usize,
    /// Greedy tokens judged by the degeneracy detector.
    pub n_generate: usize,
    /// Runs of the throughput measurement (the median is kept).
    pub bench_runs: usize,
}

impl Budget {
    pub fn for_model(real: bool) -> Budget {
        if real {
            Budget {
                n_text: 64,
                n_greedy: 8,
                n_generate: 32,
                bench_runs: 3,
            }
        } else {
            Budget {
                n_text: 32,
                n_greedy: 4,
                n_generate: 32,
                bench_runs: 3,
            }
        }
    }
}

/// What the reference computed for one model; shared by every backend's case of that model.
pub struct ReferenceRun {
    pub tokens: Vec<u32>,
    pub taps: Vec<Tap>,
    pub logits: Vec<f32>,
    pub n_vocab: usize,
    pub greedy: Vec<u32>,
    /// The reference's logits at each greedy step (`n_greedy × n_vocab`).
    pub greedy_rows: Vec<f32>,
    pub prompt: Vec<u32>,
    /// `Some(id)` when the file's metadata asks for BOS (`add_bos_token`) and names it, read by
    /// the reference, not by the engine's tokenizer; `None` when the file does not ask for BOS.
    pub bos: Option<Option<u32>>,
}

/// Reference runs by model file, computed on first use.
#[derive(Default)]
pub struct ReferenceCache(HashMap<PathBuf, ReferenceRun>);

impl ReferenceCache {
    pub fn get(
        &mut self,
        path: &Path,
        tokenizer: &Tokenizer,
        budget: Budget,
    ) -> Result<&ReferenceRun> {
        if !self.0.contains_key(path) {
            let run = reference_run(path, tokenizer, budget)?;
            self.0.insert(path.to_owned(), run);
        }
        self.0
            .get(path)
            .ok_or_else(|| anyhow!("reference run for {} vanished", path.display()))
    }
}

fn text_tokens(tokenizer: &Tokenizer, n: usize) -> Result<Vec<u32>> {
    let mut tokens = tokenizer
        .encode(TEXT, true, false)
        .context("tokenizing the fixed text")?;
    tokens.truncate(n);
    anyhow::ensure!(
        tokens.len() >= 2,
        "the fixed text tokenizes to {} tokens, need at least 2",
        tokens.len()
    );
    Ok(tokens)
}

fn argmax(row: &[f32]) -> u32 {
    coherence::logits::argmax(row).unwrap_or(0) as u32
}

fn reference_run(path: &Path, tokenizer: &Tokenizer, budget: Budget) -> Result<ReferenceRun> {
    let model = ReferenceModel::load(path, Precision::F32)
        .with_context(|| format!("loading {} in the reference", path.display()))?;
    let n_vocab = model.vocab_size();
    let tokens = text_tokens(tokenizer, budget.n_text)?;
    let mut taps = Vec::new();
    let logits = model
        .forward(&tokens, &mut |name, shape, data| {
            taps.push(Tap::new(name, shape.to_vec(), data.to_vec()))
        })
        .context("reference forward pass")?;
    // Greedy continuation without a KV cache: one full forward per new token (slow, obvious).
    let prompt = tokenizer
        .encode(PROMPT, true, false)
        .context("tokenizing the prompt")?;
    let mut seq = prompt.clone();
    let mut greedy = Vec::new();
    let mut greedy_rows = Vec::new();
    for _ in 0..budget.n_greedy {
        let logits = model
            .forward(&seq, &mut |_, _, _| {})
            .context("reference greedy step")?;
        let row = &logits[logits.len() - n_vocab..];
        let next = argmax(row);
        greedy_rows.extend_from_slice(row);
        greedy.push(next);
        seq.push(next);
    }
    let bos = model.add_bos().then(|| model.bos_token_id());
    Ok(ReferenceRun {
        tokens,
        taps,
        logits,
        n_vocab,
        greedy,
        greedy_rows,
        prompt,
        bos,
    })
}

pub fn isa_of(backend: Backend) -> Option<Isa> {
    match backend {
        Backend::CpuScalar => Some(Isa::Scalar),
        Backend::CpuAvx2 => Some(Isa::Avx2),
        Backend::CpuAvx512 => Some(Isa::Avx512),
        Backend::Cuda { .. } => None,
    }
}

pub struct CaseEnv<'a> {
    pub path: &'a Path,
    pub real: bool,
    pub threads: usize,
    pub policy: &'a TolerancePolicy,
    pub bandwidth: Option<&'a Bandwidth>,
    pub baselines: &'a Baselines,
    pub bench: bool,
}

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
    let isa =
        isa_of(case.backend).ok_or_else(|| anyhow!("{} is not a CPU backend", case.backend))?;
    let model = Model::load(env.path).with_context(|| format!("loading {}", env.path.display()))?;
    let tokenizer = Tokenizer::from_gguf(model.gguf()).context("loading the tokenizer")?;
    let backend = CpuBackend::new(Some(isa), Some(env.threads))?;
    let engine = Engine::new(&model, &backend).context("preparing the weights")?;
    if let Spec::Tree { budget, top_k } = case.spec {
        let r = super::spec_case::run(
            &engine,
            &tokenizer,
            budget as usize,
            top_k as usize,
            env.real,
            env.bench,
        )?;
        let result = CaseResult::judged(&name, None, r.gates, r.figures)
            .with_duration(started.elapsed().as_secs_f64());
        return Ok((result, None));
    }
    let budget = Budget::for_model(env.real);
    let reference = refs.get(env.path, &tokenizer, budget)?;
    let n_vocab = reference.n_vocab;

    // Teacher-forced: the same tokens, one batched forward, every tap and every position's logits.
    let mut recorder = TapRecorder::new();
    let mut session = Session::new(&engine, 4096)?;
    session.set_logits_all(true);
    let logits = session
        .forward(&reference.tokens, Some(&mut recorder))
        .context("engine forward pass")?;
    let engine_taps: Vec<Tap> = recorder
        .taps
        .into_iter()
        .map(|t| Tap::new(t.name, t.shape, t.data))
        .collect();
    let n_layers = model.config().n_layer;
    let comparison =
        harness::compare::compare_taps(&engine_taps, &reference.taps, env.policy, &ctx);

    let mut gates: Vec<GateResult> = Vec::new();
    // Logit agreement over the text: position t predicts token t+1.
    let n_pos = reference.tokens.len() - 1;
    let stats = coherence::logit_agreement(
        &reference.logits[..n_pos * n_vocab],
        &logits.data[..n_pos * n_vocab],
        n_vocab,
        &reference.tokens[1..],
    )?;
    let mut thresholds = LogitThresholds::for_weights(ctx.weight_class);
    if reference.taps.iter().any(|t| t.name.ends_with(".router")) {
        // Top-k routing flips on near-tie router scores (see TolerancePolicy::moe_route_flip_nmse)
        // move a token's logits by a whole expert's contribution; on the deepseek2 fixtures
        // (random routers) this was measured at mean KL 0.009 and same-top-1 0.87 over 31
        // positions. These bounds leave about 2x room and still fail wrong routing everywhere.
        thresholds.kld_mean_max = thresholds.kld_mean_max.max(0.02);
        thresholds.kld_p99_max = thresholds.kld_p99_max.max(0.2);
        thresholds.same_top1_min = thresholds.same_top1_min.min(0.75);
        thresholds.ppl_ratio_tolerance = thresholds.ppl_ratio_tolerance.max(0.05);
    }
    gates.extend(stats.gates(&thresholds));
    if let Some(bos) = reference.bos {
        // Both sides are fed the engine tokenizer's ids, so no tap can see a tokenizer that drops
        // BOS: check the sequences actually fed (the text and the greedy prompt, the very vectors
        // passed to both forwards) against the BOS the reference read from the file.
        gates.push(bos_gate(
            bos,
            &[("text", &reference.tokens), ("prompt", &reference.prompt)],
        ));
    }

    // Greedy continuation: equal to the reference's for the first tokens, and not degenerate.
    let (generated, gen_logits) = greedy(&engine, &reference.prompt, budget.n_generate)?;
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
    if env.real {
        // Fixtures have random weights: their output is noise by construction, so only the real
        // model is judged for degeneracy.
        gates.extend(coherence::detect_degeneracy(
            &generated,
            &gen_logits,
            n_vocab,
            &DegeneracyParams::default(),
        )?);
    }

    let mut figures = vec![
        Figure::new("mean_kld", stats.kld_mean, ""),
        Figure::new("same_top1", stats.same_top1_rate, ""),
        Figure::new("ppl_ratio", stats.ppl_ratio, ""),
    ];
    if let Some(first) = comparison
        .taps
        .iter()
        .map(|t| t.metrics.nmse)
        .reduce(f64::max)
    {
        figures.push(Figure::new("max_nmse", first, ""));
    }

    let mut measured = None;
    if env.bench {
        let m = bench(&engine, &reference.tokens, budget)?;
        figures.push(Figure::new("prefill_tps", m.prefill_tps, "tok/s"));
        figures.push(Figure::new("decode_tps", m.decode_tps, "tok/s"));
        if let Some(bw) = env.bandwidth {
            let bytes: u64 = model.gguf().tensors().iter().map(|t| t.n_bytes).sum();
            let roofline =
                throughput::roofline_fraction(bytes as f64, bw.bytes_per_s, 1.0 / m.decode_tps)
                    .unwrap_or(0.0);
            figures.push(Figure::new("roofline", roofline, ""));
            let measured_b = Baseline {
                prefill_tps: m.prefill_tps,
                decode_tps: m.decode_tps,
                roofline,
            };
            gates.extend(
                env.baselines
                    .gates(&name, &measured_b, throughput::DEFAULT_NOISE_MARGIN),
            );
            measured = Some(measured_b);
        }
    }

    let result = CaseResult::judged(&name, Some(&comparison), gates, figures)
        .with_tolerances(env.policy.table(n_layers, &ctx))
        .with_duration(started.elapsed().as_secs_f64());
    Ok((result, measured))
}

/// The `bos` gate: every fed sequence starts with `bos`, the id the file's metadata names (a file
/// that asks for BOS but names none fails). The value is the number of sequences that do not.
fn bos_gate(bos: Option<u32>, fed: &[(&str, &[u32])]) -> GateResult {
    let wrong: Vec<String> = fed
        .iter()
        .filter(|(_, seq)| bos.is_none() || seq.first().copied() != bos)
        .map(|(what, seq)| match seq.first() {
            Some(id) => format!("{what} starts with {id}"),
            None => format!("{what} is empty"),
        })
        .collect();
    let detail = match bos {
        None => "the file asks for BOS (add_bos_token) but names no bos_token_id".to_owned(),
        Some(id) if wrong.is_empty() => format!("every fed sequence starts with BOS {id}"),
        Some(id) => format!(
            "expected BOS {id} first (add_bos_token): {}",
            wrong.join(", ")
        ),
    };
    GateResult::at_most("bos", wrong.len() as f64, 0.0, detail)
}

/// Greedy decoding through the KV cache; returns the new ids and their logits rows.
fn greedy(
    engine: &Engine<'_, CpuBackend>,
    prompt: &[u32],
    n: usize,
) -> Result<(Vec<u32>, Vec<f32>)> {
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

struct Speed {
    prefill_tps: f64,
    decode_tps: f64,
}

/// Prefill and decode tokens/s, median of `runs`.
fn bench(engine: &Engine<'_, CpuBackend>, tokens: &[u32], budget: Budget) -> Result<Speed> {
    let n_decode = 16;
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for _ in 0..budget.bench_runs {
        let mut session = Session::new(engine, tokens.len() + n_decode + 1)?;
        let t = Instant::now();
        let mut logits = session.forward(tokens, None)?;
        prefill.push(tokens.len() as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..n_decode {
            let next = argmax(logits.last());
            logits = session.forward(&[next], None)?;
        }
        decode.push(n_decode as f64 / t.elapsed().as_secs_f64());
    }
    Ok(Speed {
        prefill_tps: throughput::median(&prefill).unwrap_or(0.0),
        decode_tps: throughput::median(&decode).unwrap_or(0.0),
    })
}

#[cfg(test)]
mod tests {
    use super::bos_gate;

    fn check(bos: Option<u32>, fed: &[(&str, &[u32])], passed: bool, value: f64) {
        let g = bos_gate(bos, fed);
        assert_eq!(
            (g.gate, g.passed, g.value),
            ("bos", passed, value),
            "{}",
            g.detail
        );
    }

    #[test]
    fn bos_first_everywhere_passes() {
        check(
            Some(1),
            &[("text", &[1, 5, 6]), ("prompt", &[1, 7])],
            true,
            0.0,
        );
    }

    #[test]
    fn dropped_bos_fails_per_sequence() {
        check(
            Some(1),
            &[("text", &[5, 6]), ("prompt", &[1, 7])],
            false,
            1.0,
        );
        check(Some(1), &[("text", &[5, 6]), ("prompt", &[])], false, 2.0);
    }

    #[test]
    fn bos_asked_but_unnamed_fails() {
        check(None, &[("text", &[1, 5])], false, 1.0);
    }
}
