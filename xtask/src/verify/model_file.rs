//! `cargo xtask verify --model FILE`: one GGUF the user is about to deploy (a single file, or any
//! shard of a split set, whose other shards are found beside it), checked by the same case runner
//! and tolerance policy as the matrix ([`super::kinds::Kinds`]) on the engine's best CPU
//! backend: both tokenizers, teacher-forced taps layer-isolated in exact numerics and end to end
//! in full precision, the coherence gates, the usual report.
//!
//! The reference runs first, in a phase of its own, **streaming** ([`Residency::Streaming`]):
//! each layer is read and dequantized when its forward pass reaches it, so its memory stays near
//! one layer's weights whatever the model's size. The phase's peak resident memory is measured
//! ([`super::rss`]) before the engine maps a byte of the model, and reported beside the model's
//! whole-model and largest-layer f32 sizes; the engine's phase is measured separately (its
//! figure includes the model's pages it mapped and the reference's outputs still held).

use std::io::Read;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::gguf::Gguf;
use harness::cases::{Case, Spec, Topology};
use harness::gate::GateResult;
use harness::report::{CaseResult, Figure, Report};
use harness::throughput::Baselines;
use harness::tolerance::TolerancePolicy;
use reference::Residency;

use super::common::{Budget, CaseEnv};
use super::reference_runs::{self, ReferenceCache};
use super::rss::{Phase, PhasePeak};
use super::Args;

const MIB: f64 = 1024.0 * 1024.0;

/// What the engine's reader says about the file before anything runs.
struct FileInfo {
    /// The case's model name: the file name without `.gguf` and without a shard suffix.
    name: String,
    /// The weight type of most matrix elements (`q4_k`, `f16`, …): the tolerance policy's key.
    weights: String,
    /// A golden fixture (random weights): its output is noise by construction, so it is not
    /// judged for degeneracy or benched, and its golden snapshot is the fixture one.
    fixture: bool,
}

/// The file exists and starts with the GGUF magic; a clear error otherwise.
fn preflight(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path)
        .with_context(|| format!("--model {}: no such file", path.display()))?;
    if !meta.is_file() {
        bail!(
            "--model {}: expected a GGUF file, found a directory or special file",
            path.display()
        );
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .with_context(|| format!("--model {}: cannot read its first 4 bytes", path.display()))?;
    if &magic != b"GGUF" {
        bail!(
            "--model {}: not a GGUF file (expected the magic bytes \"GGUF\", found {:?})",
            path.display(),
            String::from_utf8_lossy(&magic)
        );
    }
    Ok(())
}

fn inspect(path: &Path) -> Result<FileInfo> {
    let g = Gguf::open(path).with_context(|| format!("engine: opening {}", path.display()))?;
    let arch = g.architecture().context("engine: general.architecture")?;
    if !matches!(arch, "llama" | "gemma3" | "deepseek2" | "glm-dsa") {
        bail!(
            "--model {}: architecture `{arch}` is not supported (verify knows llama, gemma3, \
             deepseek2 and glm-dsa)",
            path.display()
        );
    }
    let weights = match g.get_u32_opt("general.file_type") {
        Ok(Some(ft)) => file_type_name(ft),
        _ => None,
    };
    let weights = match weights {
        Some(w) => w.to_owned(),
        None => {
            // No (known) file type: the type of most layer-matrix elements.
            let mut by_type: std::collections::BTreeMap<&'static str, u64> = Default::default();
            for t in g
                .tensors()
                .iter()
                .filter(|t| t.dims.len() >= 2 && t.name.starts_with("blk."))
            {
                *by_type.entry(t.ggml_type.name()).or_default() += t.n_elements();
            }
            by_type
                .iter()
                .max_by_key(|(_, n)| **n)
                .map(|(ty, _)| ty.to_ascii_lowercase())
                .with_context(|| format!("--model {}: no layer matrices", path.display()))?
        }
    };
    let stem = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = stem.strip_suffix(".gguf").unwrap_or(&stem);
    // `PREFIX-00001-of-00003` → `PREFIX`
    let name = match stem
        .rsplit_once("-of-")
        .and_then(|(r, _)| r.rsplit_once('-'))
    {
        Some((prefix, no)) if no.len() == 5 && no.bytes().all(|b| b.is_ascii_digit()) => prefix,
        _ => stem,
    };
    // A fixture is recognised by its own metadata, name and description both.
    let fixture = match (
        g.get_str_opt("general.name"),
        g.get_str_opt("general.description"),
    ) {
        (Ok(Some(n)), Ok(Some(d))) => {
            golden::fixtures::by_name(n).is_some_and(|s| s.description == d)
        }
        _ => false,
    };
    Ok(FileInfo {
        // `/` separates a case name's axes
        name: name.replace('/', "_"),
        weights,
        fixture,
    })
}

/// llama.cpp's name of a `general.file_type` (`llama_ftype`, include/llama.h), lower case.
fn file_type_name(ft: u32) -> Option<&'static str> {
    Some(match ft {
        0 => "f32",
        1 => "f16",
        2 => "q4_0",
        3 => "q4_1",
        7 => "q8_0",
        8 => "q5_0",
        9 => "q5_1",
        10 => "q2_k",
        11 => "q3_k_s",
        12 => "q3_k_m",
        13 => "q3_k_l",
        14 => "q4_k_s",
        15 => "q4_k_m",
        16 => "q5_k_s",
        17 => "q5_k_m",
        18 => "q6_k",
        25 => "iq4_nl",
        30 => "iq4_xs",
        32 => "bf16",
        38 => "mxfp4",
        _ => return None,
    })
}

/// The golden gate for a file given by the user: a fixture's own snapshot, the real model's when
/// the file is the real model's, otherwise "not judged" (no snapshot exists for it).
fn golden_for(path: &Path, info: &FileInfo) -> Result<GateResult> {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
    let real_stem = golden::snapshot::REAL_MODEL_FILE.strip_suffix(".gguf");
    if info.fixture {
        reference_runs::golden_gate(path, false)
    } else if stem.as_deref() == real_stem {
        reference_runs::golden_gate(path, true)
    } else {
        Ok(GateResult::not_judged(
            "golden",
            0.0,
            "no golden snapshot for this file".to_owned(),
        ))
    }
}

fn mib_figure(name: &str, bytes: f64) -> Figure {
    Figure::new(name, bytes / MIB, "MiB")
}

pub fn verify(args: &Args, path: &Path) -> Result<Report> {
    let started = Instant::now();
    preflight(path)?;
    let info = inspect(path)?;
    let mut budget = Budget::for_model(true);
    if let Some(n) = args.tokens {
        if n < 2 {
            bail!("--tokens {n}: need at least 2 teacher-forced tokens");
        }
        budget.n_text = n;
    }
    let machine = super::machine_caps();
    let backend = machine.best_cpu_backend();
    let case = Case::new(
        &info.name,
        &info.weights,
        backend,
        1,
        Topology::Shm,
        Spec::Off,
    );
    let name = case.name();
    eprintln!("[1/1] {name} ({})", path.display());

    // The reference's phase, on its own: nothing of the engine is loaded yet.
    eprintln!("      reference (streaming, {} tokens)…", budget.n_text);
    let phase = Phase::begin()?;
    let run = reference_runs::reference_run(
        reference_runs::RefSource::File(path),
        budget,
        Residency::Streaming,
    );
    let ref_mem = phase.end()?;
    let mut run = match run {
        Ok(run) => run,
        // A file the engine reads but the reference refuses (a RoPE scaling it does not
        // implement, a weight type it cannot dequantize) is a judged case that errored.
        Err(e) => {
            let mut report = Report::default();
            report.push(CaseResult::error(&name, &format!("{e:#}")));
            super::publish(args, &report, started)?;
            return Ok(report);
        }
    };
    run.golden = golden_for(path, &info)?;
    let footprint = run.footprint.clone();
    let held = run.held_bytes();
    let mut refs = ReferenceCache::default();
    refs.insert(path, run);

    eprintln!("      engine ({backend})…");
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let policy = TolerancePolicy::default();
    // No baseline can exist for a file the matrix does not know: throughput is reported and
    // shown "not judged".
    let baselines = Baselines::default();
    let env = CaseEnv {
        path,
        real: !info.fixture,
        budget,
        threads,
        policy: &policy,
        baselines: &baselines,
        bench: !args.no_bench,
    };
    let phase = Phase::begin()?;
    let outcome = super::kinds::Kinds::default().run(&case, &env, &mut refs);
    let engine_mem = phase.end()?;
    let mut result = match outcome {
        Ok((result, _)) => result,
        Err(e) => CaseResult::error(&name, &format!("{e:#}")),
    };
    result
        .figures
        .extend(memory_figures(&ref_mem, &engine_mem, &footprint, held));
    eprintln!("      {} {}", result.verdict.label(), result.headline());
    let mut report = Report::default();
    report.push(result);
    super::publish(args, &report, started)?;
    if !args.json {
        println!("{}", memory_line(&ref_mem, &footprint, held));
    }
    Ok(report)
}

fn memory_figures(
    reference: &PhasePeak,
    engine: &PhasePeak,
    f: &reference::Footprint,
    held: usize,
) -> Vec<Figure> {
    let mut v = vec![
        mib_figure("ref_peak_rss", reference.peak as f64),
        mib_figure("ref_rss_before", reference.start as f64),
        mib_figure("ref_outputs_held", held as f64),
        Figure::new("ref_s", reference.seconds, "s"),
        mib_figure("model_f32", f.total_f32_bytes as f64),
    ];
    if let Some((_, bytes)) = f.largest_layer {
        v.push(mib_figure("largest_layer_f32", bytes as f64));
    }
    if let Some((_, bytes)) = &f.largest_global {
        v.push(mib_figure("largest_global_f32", *bytes as f64));
    }
    v.push(mib_figure("engine_peak_rss", engine.peak as f64));
    v.push(Figure::new("model_files", f.n_files as f64, ""));
    v
}

/// The closing line on stdout: the reference's peak against the model's f32 sizes.
fn memory_line(reference: &PhasePeak, f: &reference::Footprint, held: usize) -> String {
    let mib = |b: f64| {
        let m = b / MIB;
        if m < 10.0 {
            format!("{m:.2} MiB")
        } else {
            format!("{m:.0} MiB")
        }
    };
    let layer = f
        .largest_layer
        .map(|(i, b)| format!(", largest layer (blk.{i}) {}", mib(b as f64)))
        .unwrap_or_default();
    let global = f
        .largest_global
        .as_ref()
        .map(|(n, b)| {
            format!(
                ", largest tensor outside the layers ({n}) {}",
                mib(*b as f64)
            )
        })
        .unwrap_or_default();
    let since = if reference.reset {
        "its own phase"
    } else {
        "process start: /proc/self/clear_refs was refused, so this is an upper bound"
    };
    format!(
        "reference memory: peak RSS {} (streaming; measured over {since}, {} resident before it; \
         {} of it is the outputs it keeps for the comparison) in {:.0} s, against {} for the \
         whole model in f32{layer}{global}; {} file(s)",
        mib(reference.peak as f64),
        mib(reference.start as f64),
        mib(held as f64),
        reference.seconds,
        mib(f.total_f32_bytes as f64),
        f.n_files,
    )
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use engine::gguf::{GgufWriter, MetadataValue};
    use harness::report::Verdict;
    use kernels::quant::GgmlType;

    use super::*;

    fn args(model: &Path, out: &Path) -> Args {
        Args {
            filter: Vec::new(),
            only: Vec::new(),
            exclude: Vec::new(),
            faults: false,
            fault: Vec::new(),
            json: true,
            update_baselines: false,
            no_bench: true,
            cuda_emu: false,
            no_cuda_emu: false,
            threads: Some(1),
            out: out.to_path_buf(),
            model: Some(model.to_path_buf()),
            // The fixtures' fixed text is short; 24 tokens keep the case quick.
            tokens: Some(24),
        }
    }

    fn figure(report: &Report, name: &str) -> f64 {
        report.cases[0]
            .figures
            .iter()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("no figure {name}"))
            .value
    }

    /// The fixture `name` written under `dir`.
    fn fixture(name: &str, dir: &Path) -> PathBuf {
        let spec = golden::fixtures::by_name(name).expect("fixture");
        golden::fixtures::write(&spec, dir).expect("write fixture")
    }

    fn error_of(model: &Path) -> String {
        let out = tempfile::tempdir().expect("temp dir");
        match verify(&args(model, out.path()), model) {
            Ok(r) => panic!("expected an error, found {}", r.summary()),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn a_fixture_passes_with_its_memory_reported() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = fixture("gemma3-q4_k_m", dir.path());
        let report = verify(&args(&path, &dir.path().join("out")), &path).expect("verify");
        let case = &report.cases[0];
        assert_eq!(case.verdict, Verdict::Passed, "{}", case.headline());
        assert!(
            case.case.starts_with("gemma3-q4_k_m/q4_k/cpu-"),
            "{}",
            case.case
        );
        // every gate of the matrix's case ran: tokens, bos, golden (the fixture's snapshot),
        // the logit gates, greedy; a fixture is not judged for degeneracy
        let gates: Vec<&str> = case.gates.iter().map(|g| g.gate).collect();
        for g in ["tokens", "golden", "kld_mean", "same_top1"] {
            assert!(gates.contains(&g), "{g} missing from {gates:?}");
        }
        let golden = case
            .gates
            .iter()
            .find(|g| g.gate == "golden")
            .expect("golden");
        assert!(golden.judged && golden.passed, "{}", golden.detail);
        // the figures: the model's f32 size from the engine's directory, independently
        let g = Gguf::open(&path).expect("engine opens the fixture");
        let total: u64 = g.tensors().iter().map(|t| t.n_elements() * 4).sum();
        assert!((figure(&report, "model_f32") - total as f64 / MIB).abs() < 1e-9);
        assert!(figure(&report, "largest_layer_f32") < figure(&report, "model_f32"));
        assert!(figure(&report, "ref_peak_rss") >= figure(&report, "ref_rss_before"));
        assert_eq!(figure(&report, "model_files"), 1.0);
        // the normal reports
        for f in ["report.json", "report.md", "junit.xml"] {
            assert!(dir.path().join("out").join(f).is_file(), "{f}");
        }
    }

    #[test]
    fn a_split_set_is_verified_from_any_shard() {
        let dir = tempfile::tempdir().expect("temp dir");
        let single = fixture("llama-q8_0", dir.path());
        let shards = golden::split::write_by_layer(&single, &dir.path().join("set").join("m"))
            .expect("split set");
        let report =
            verify(&args(&shards[1], &dir.path().join("out")), &shards[1]).expect("verify");
        let case = &report.cases[0];
        assert_eq!(case.verdict, Verdict::Passed, "{}", case.headline());
        assert!(case.case.starts_with("m/q8_0/"), "{}", case.case);
        assert_eq!(figure(&report, "model_files"), shards.len() as f64);
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = error_of(Path::new("/no/such/model.gguf"));
        assert!(e.contains("/no/such/model.gguf: no such file"), "{e}");
    }

    #[test]
    fn a_file_that_is_not_gguf_is_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("notes.gguf");
        std::fs::write(&path, b"hello, this is text").expect("write");
        let e = error_of(&path);
        assert!(
            e.contains("not a GGUF file") && e.contains("\"hell\""),
            "{e}"
        );
    }

    #[test]
    fn an_unsupported_architecture_is_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("mamba.gguf");
        let mut w = GgufWriter::new();
        w.add_metadata(
            "general.architecture",
            MetadataValue::String("mamba".into()),
        );
        w.add_tensor("blk.0.ssm_in.weight", GgmlType::F32, &[4, 4], vec![0; 64])
            .expect("tensor");
        w.write(&path).expect("write");
        let e = error_of(&path);
        assert!(e.contains("architecture `mamba` is not supported"), "{e}");
    }

    #[test]
    fn a_missing_shard_is_named() {
        let dir = tempfile::tempdir().expect("temp dir");
        let single = fixture("llama-q8_0", dir.path());
        let shards = golden::split::write_by_layer(&single, &dir.path().join("set").join("m"))
            .expect("split set");
        std::fs::remove_file(&shards[2]).expect("remove a shard");
        let e = error_of(&shards[0]);
        let missing = shards[2].display().to_string();
        assert!(e.contains(&missing), "{e}");
    }
}
