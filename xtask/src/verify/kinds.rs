//! The kinds of verify case behind one trait, chosen once per case ([`Kinds::run`]):
//!
//! | kind | cases | module |
//! |---|---|---|
//! | teacher-forced | spec `off` (TP 1 or N ranks, single files and split sets) | `teacher_forced` |
//! | paths | spec `chunked`, `decode` | `path_case` |
//! | speculation | spec `tree-b…k…` | `spec_case` |
//! | serving | spec `serve` | `serve_case` |
//! | batched | path `batched` | `batch_case` |
//!
//! Each kind opens what it needs through `engine::exec::open` and judges the case with the
//! same tolerance policy; what they share lives in `common`, `gates` and `reference_runs`.

use std::time::Instant;

use anyhow::{ensure, Result};
use engine::exec::{self, AnyEngine, Topology};
use engine::tokenizer::Tokenizer;
use harness::cases::{Case, KvCache, PathMode, Spec};
use harness::report::CaseResult;
use harness::throughput::Baseline;

use super::common::{device_of, load_model, CaseEnv};
use super::reference_runs::ReferenceCache;

/// A case's verdict and, for a benched case, the throughput ratios it measured.
pub type Outcome = (CaseResult, Option<Baseline>);

/// One kind of case.
pub trait CaseKind {
    /// Whether this kind runs `case`.
    fn runs(&self, case: &Case) -> bool;

    /// Run `case`: `Ok` carries the judged result (passed or failed), `Err` an error that kept
    /// the case from being judged at all.
    fn run(&mut self, case: &Case, env: &CaseEnv<'_>, refs: &mut ReferenceCache)
        -> Result<Outcome>;
}

/// Every kind, each with what it keeps between cases (the path cases' reference).
pub struct Kinds {
    kinds: Vec<Box<dyn CaseKind>>,
}

impl Default for Kinds {
    fn default() -> Self {
        Kinds {
            kinds: vec![
                Box::new(Serving),
                Box::new(Batching),
                Box::new(Speculation),
                Box::new(Paths::default()),
                Box::new(TeacherForced),
            ],
        }
    }
}

impl Kinds {
    /// Run `case` with the one kind that runs it.
    pub fn run(
        &mut self,
        case: &Case,
        env: &CaseEnv<'_>,
        refs: &mut ReferenceCache,
    ) -> Result<Outcome> {
        ensure!(
            case.kv == KvCache::F32 || matches!(case.path, PathMode::Chunked | PathMode::Decode),
            "{}: an f16 KV cache is verified on the chunked and decode paths only",
            case.name()
        );
        let (result, measured) = match self.kinds.iter_mut().find(|k| k.runs(case)) {
            Some(kind) => kind.run(case, env, refs)?,
            None => anyhow::bail!("{}: no kind of case runs spec {}", case.name(), case.spec),
        };
        // A CUDA device's efficiency counters, gated beside the case's own gates.
        if super::counters::applies(case) {
            return Ok((super::counters::attach(case, env, result)?, measured));
        }
        Ok((result, measured))
    }
}

/// Run `f` on the case's model file opened whole on the case's device, with its tokenizer.
fn on_whole_engine<R>(
    case: &Case,
    env: &CaseEnv<'_>,
    f: impl FnOnce(&AnyEngine<'_>, &Tokenizer) -> Result<R>,
) -> Result<R> {
    let (model, tokenizer) = load_model(env.path)?;
    let device = device_of(case.backend, env.threads)?;
    let engine = exec::open(&model, &device, &Topology::single())?;
    f(&engine, &tokenizer)
}

struct TeacherForced;

impl CaseKind for TeacherForced {
    fn runs(&self, case: &Case) -> bool {
        case.spec == Spec::Off && case.path == PathMode::Prefill
    }

    fn run(
        &mut self,
        case: &Case,
        env: &CaseEnv<'_>,
        refs: &mut ReferenceCache,
    ) -> Result<Outcome> {
        super::teacher_forced::run(case, env, refs)
    }
}

#[derive(Default)]
struct Paths {
    /// The path cases' reference (longer texts, no head), kept across the cases of one model.
    refs: super::path_case::PathRefs,
}

impl CaseKind for Paths {
    fn runs(&self, case: &Case) -> bool {
        matches!(case.path, PathMode::Chunked | PathMode::Decode)
    }

    fn run(&mut self, case: &Case, env: &CaseEnv<'_>, _: &mut ReferenceCache) -> Result<Outcome> {
        ensure!(
            case.tp == 1 && super::tp_case::split_source(case, env.path)?.is_none(),
            "{}: path cases run on a single file at TP 1",
            case.name()
        );
        let result = on_whole_engine(case, env, |engine, tokenizer| {
            super::path_case::run(
                case,
                engine,
                tokenizer,
                env.path,
                env.real,
                env.policy,
                &mut self.refs,
            )
        })?;
        Ok((result, None))
    }
}

struct Speculation;

impl CaseKind for Speculation {
    fn runs(&self, case: &Case) -> bool {
        case.path == PathMode::Prefill && matches!(case.spec, Spec::Tree { .. })
    }

    fn run(&mut self, case: &Case, env: &CaseEnv<'_>, _: &mut ReferenceCache) -> Result<Outcome> {
        let started = Instant::now();
        let Spec::Tree { budget, top_k } = case.spec else {
            anyhow::bail!("{}: not a speculation case", case.name());
        };
        let r = on_whole_engine(case, env, |engine, tokenizer| {
            super::spec_case::run(
                engine,
                tokenizer,
                budget as usize,
                top_k as usize,
                env.real,
                env.bench,
            )
        })?;
        Ok(judged(case, started, r.gates, r.figures))
    }
}

/// A case judged by its gates alone (no tap comparison of its own), timed from `started`.
fn judged(
    case: &Case,
    started: Instant,
    gates: Vec<harness::gate::GateResult>,
    figures: Vec<harness::report::Figure>,
) -> Outcome {
    let result = CaseResult::judged(&case.name(), None, gates, figures)
        .with_duration(started.elapsed().as_secs_f64());
    (result, None)
}

struct Serving;

impl CaseKind for Serving {
    fn runs(&self, case: &Case) -> bool {
        case.path == PathMode::Serve
    }

    fn run(
        &mut self,
        case: &Case,
        env: &CaseEnv<'_>,
        refs: &mut ReferenceCache,
    ) -> Result<Outcome> {
        Ok((super::serve_case::run(case, env, refs)?, None))
    }
}

struct Batching;

impl CaseKind for Batching {
    fn runs(&self, case: &Case) -> bool {
        case.path == PathMode::Batched
    }

    fn run(
        &mut self,
        case: &Case,
        env: &CaseEnv<'_>,
        refs: &mut ReferenceCache,
    ) -> Result<Outcome> {
        let started = Instant::now();
        let ctx = case.context()?;
        let reference = refs.get(
            super::reference_runs::RefSource::File(env.path),
            env.budget,
            env.real,
        )?;
        let r = on_whole_engine(case, env, |engine, _| {
            super::batch_case::run(engine, reference, &ctx)
        })?;
        Ok(judged(case, started, r.gates, r.figures))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which kind runs a case named `name` (by the index in `Kinds::default`).
    fn kind_of(name: &str) -> Option<usize> {
        let case: Case = name.parse().unwrap_or_else(|e| panic!("{name}: {e}"));
        Kinds::default().kinds.iter().position(|k| k.runs(&case))
    }

    #[test]
    fn every_spec_has_exactly_one_kind() {
        let check = |name: &str, kind: usize| {
            let case: Case = name.parse().unwrap_or_else(|e| panic!("{name}: {e}"));
            let n = Kinds::default()
                .kinds
                .iter()
                .filter(|k| k.runs(&case))
                .count();
            assert_eq!(n, 1, "{name}: {n} kinds run it");
            assert_eq!(kind_of(name), Some(kind), "{name}");
        };
        check("llama/q8_0/cpu-avx2/tp1-shm/serve", 0);
        check("llama/q8_0/cpu-avx2/tp1-shm/batched", 1);
        check("llama/q8_0/cpu-avx2/tp1-shm/tree-b8k4", 2);
        check("llama/q8_0/cpu-avx2/tp1-shm/chunked", 3);
        check("llama/q8_0/cpu-avx2/tp1-shm/decode", 3);
        check("gemma3/q4_k_m/cpu-avx2/tp1-shm/chunked-kvf16", 3);
        check("glm-dsa/q8_0/cpu-avx2/tp1-shm/decode-kvf16", 3);
        check("llama/q8_0/cpu-avx2/tp1-shm/off", 4);
        check("llama/q8_0/cpu-avx2/tp2-shm/off", 4);
    }
}
