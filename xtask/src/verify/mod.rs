//! `cargo xtask verify`: every case of the matrix this machine can run — the engine against the
//! candle reference tap by tap, coherence gates, throughput gates — with the rest reported as
//! skipped and why. Writes `report.json`, `report.md` (with NMSE-by-layer plots) and `junit.xml`
//! under `target/verify/`; exits non-zero on any failure.
//!
//! `cargo xtask verify --model FILE` runs the same case runner on one file instead of the matrix,
//! with the reference streaming layer by layer and its peak memory measured ([`model_file`]).

mod batch_case;
mod common;
mod counters;
mod faults;
mod gates;
mod isolate;
mod kinds;
mod model_file;
mod models;
mod path_case;
mod reference_runs;
mod routes;
mod rss;
mod selections;
mod serve_case;
mod spec_case;
mod teacher_forced;
mod tp_case;
mod tree_shapes;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use harness::cases::{Backend, EngineCaps, Filter, MachineCaps, Matrix};
use harness::report::{CaseResult, Report};
use harness::throughput::{Baselines, BASELINES_PATH};
use harness::tolerance::TolerancePolicy;
use kernels::cpu::Isa;

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Only cases whose name matches this glob (`*`, `?`); repeatable
    #[arg(long)]
    pub filter: Vec<String>,
    /// Only cases with AXIS=VALUE (axes: model, weights, backend, tp, topology, path, spec, kv:
    /// f32 or f16, the engine's KV cache); repeatable
    #[arg(long)]
    pub only: Vec<String>,
    /// Drop cases whose name matches this glob; repeatable
    #[arg(long)]
    pub exclude: Vec<String>,
    /// Run once per injected engine fault and require each to be detected at the right place
    #[arg(long)]
    pub faults: bool,
    /// With --faults: only this fault (a name of engine::faults::Fault); repeatable
    #[arg(long, requires = "faults")]
    pub fault: Vec<String>,
    /// Print the report as JSON on stdout
    #[arg(long)]
    pub json: bool,
    /// Rewrite ci/baselines.json with this run's throughput (for review)
    #[arg(long)]
    pub update_baselines: bool,
    /// Skip the throughput measurements
    #[arg(long)]
    pub no_bench: bool,
    /// Add the CUDA backend on the CUDA emulator even where a real GPU is present (`cuda-emu`
    /// cases: every model and weight mix, the fixtures' paths, speculation and TP 2 on the one
    /// device; the emulator is built first). Without a GPU they are in the matrix anyway
    #[arg(long, conflicts_with = "no_cuda_emu")]
    pub cuda_emu: bool,
    /// Leave the emulated CUDA cases out
    #[arg(long)]
    pub no_cuda_emu: bool,
    /// Threads for the engine (default: all cores)
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where the reports go
    #[arg(long, default_value = "target/verify")]
    pub out: PathBuf,
    /// Verify this GGUF file (a single file, or any shard of a split set) instead of the matrix:
    /// the engine's best CPU backend against the streaming reference, with the reference's peak
    /// memory reported
    #[arg(long, value_name = "FILE", conflicts_with_all = ["faults", "filter", "only", "exclude", "update_baselines"])]
    pub model: Option<PathBuf>,
    /// With --model: teacher-forced tokens of the fixed text (default 64)
    #[arg(long, value_name = "N", requires = "model")]
    pub tokens: Option<usize>,
}

pub fn run(args: Args) -> Result<()> {
    if args.faults {
        return faults::run(&args);
    }
    // A misspelt PLUMBLINE_FAULT must fail loudly, and one set for a build without fault hooks
    // must not look like a clean run of that fault.
    let fault = engine::faults::setting().context("the fault setting")?;
    if !cfg!(feature = "fault-injection") && std::env::var_os(engine::faults::ENV_VAR).is_some() {
        bail!(
            "{} is set, but this xtask has no fault hooks (run cargo xtask verify --faults, or \
             cargo xtask-faults verify)",
            engine::faults::ENV_VAR
        );
    }
    if let Some(f) = fault {
        eprintln!("fault injected: {f}");
    }
    let report = match &args.model {
        Some(path) => model_file::verify(&args, path)?,
        None => verify(&args)?,
    };
    if report.has_failures() {
        bail!("verify failed: {}", report.summary());
    }
    Ok(())
}

/// The machine's capabilities, as the engine reports them ([`engine::capabilities`]).
fn machine_caps() -> MachineCaps {
    let caps = engine::capabilities();
    MachineCaps {
        avx2: caps.has_isa(Isa::Avx2),
        avx512: caps.has_isa(Isa::Avx512),
        cuda_archs: caps.cuda_devices.iter().map(|d| d.arch).collect(),
        nvlink: false,
        cuda_emu_missing: None,
        engine: EngineCaps {
            cuda: caps.cuda_backend,
            tensor_parallel: caps.tensor_parallel,
            speculative: caps.speculative,
        },
        models_missing: Default::default(),
    }
}

pub fn verify(args: &Args) -> Result<Report> {
    let started = Instant::now();
    let mut models = models::discover(&args.out.join("fixtures"), true)?;
    let mut machine = machine_caps().with_models(&models.entries);
    let filter = Filter::new(&args.filter, &args.only, &args.exclude)?;
    let mut all = Matrix::enumerate(&models.entries, &machine);
    // The CUDA backend runs on the emulator where no GPU is there to run it (a GPU runs the
    // real `cuda-smXX` cases through the same code instead).
    if args.cuda_emu || (!args.no_cuda_emu && machine.cuda_archs.is_empty()) {
        all.extend(Matrix::emulated(&models.entries));
    }
    tp_case::extend(&mut all, &mut models, &mut machine);
    let cases = filter.apply(all);
    if cases.is_empty() {
        bail!("no case matches the filters");
    }
    if machine.engine.cuda && cases.iter().any(|c| c.backend == Backend::CudaEmu) {
        // Built (or brought up to date) only when an emulated case is selected.
        machine.cuda_emu_missing = crate::cuda_emu::missing();
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let policy = TolerancePolicy::default();
    let baselines_path = PathBuf::from(BASELINES_PATH);
    let mut baselines = Baselines::load(&baselines_path)?;
    let mut report = Report::default();
    let mut refs = reference_runs::ReferenceCache::default();
    let mut kinds = kinds::Kinds::default();
    let mut updated = false;
    for (i, case) in cases.iter().enumerate() {
        let name = case.name();
        if let Some(reason) = case.skip_reason(&machine) {
            report.push(CaseResult::skipped(&name, &reason));
            continue;
        }
        eprintln!("[{}/{}] {name}", i + 1, cases.len());
        let Some(path) = models
            .paths
            .get(&(case.model.clone(), case.weights.clone()))
        else {
            report.push(CaseResult::error(&name, "no model file for this case"));
            continue;
        };
        // A split set of the real model is the real model (its budget and gates).
        let real = case.model.split('@').next() == Some(models::REAL_MODEL);
        let env = common::CaseEnv {
            path,
            real,
            budget: common::Budget::for_case(real, case.backend),
            threads,
            policy: &policy,
            baselines: &baselines,
            bench: !args.no_bench,
        };
        let outcome = kinds.run(case, &env, &mut refs);
        let result = match outcome {
            Ok((result, measured)) => {
                // Only the real model is benched (teacher_forced::run says why).
                if let (true, Some(m)) = (args.update_baselines, measured) {
                    baselines.update(&name, m);
                    updated = true;
                }
                result
            }
            Err(e) => CaseResult::error(&name, &format!("{e:#}")),
        };
        eprintln!("      {} {}", result.verdict.label(), result.headline());
        report.push(result);
    }

    if updated {
        baselines.save(&baselines_path)?;
        eprintln!(
            "updated {} (review the change before committing)",
            baselines_path.display()
        );
    }
    publish(args, &report, started)?;
    Ok(report)
}

/// Write `target/verify/report.{json,md}`, `junit.xml` and the plots, then print the table (or
/// the JSON with `--json`) on stdout.
fn publish(args: &Args, report: &Report, started: Instant) -> Result<()> {
    let written = report.write_all(&args.out).context("writing the reports")?;
    if args.json {
        println!("{}", report.to_json()?);
    } else {
        print!("{}", harness::report::console_table(report));
        println!(
            "reports: {}, {}, {}",
            written.markdown.display(),
            written.json.display(),
            written.junit.display()
        );
        println!("{:.0} s", started.elapsed().as_secs_f64());
    }
    Ok(())
}
