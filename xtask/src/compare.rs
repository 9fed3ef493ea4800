//! `cargo xtask compare --model FILE --prompt TEXT`: the engine against the reference on one prompt,
//! teacher-forced, every tap in forward order with NMSE, max abs error (where and both values) and
//! cosine, the first tap past tolerance marked, then top-1 agreement at every position. The tool a
//! person reaches for when output looks wrong.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use engine::exec::{self, Device, Session, Topology};
use engine::model::Model;
use engine::taps::TapRecorder;
use engine::tokenizer::Tokenizer;
use harness::coherence::logits::argmax;
use harness::tap::Tap;
use harness::tolerance::{CaseContext, TolerancePolicy};
use kernels::cpu::Isa;
use reference::{Precision, ReferenceModel};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model file
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt text (tokenized by the engine's tokenizer, BOS added as the file asks)
    #[arg(long)]
    pub prompt: String,
    /// Weight class for the tolerance policy (f32, f16, bf16, or a quantized type such as q4_k_m)
    #[arg(long, default_value = "q4_k_m")]
    pub weights: String,
    /// Engine CPU kernels: scalar, avx2, avx512 (default: the best this CPU has)
    #[arg(long)]
    pub isa: Option<String>,
    #[arg(long)]
    pub threads: Option<usize>,
    /// Reference precision: f32 or f64
    #[arg(long, default_value = "f32")]
    pub precision: String,
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let isa = match &args.isa {
        Some(name) => Isa::from_name(name)
            .with_context(|| format!("unknown ISA {name:?}; expected scalar, avx2 or avx512"))?,
        None => Isa::detect(),
    };
    let precision = match args.precision.as_str() {
        "f32" => Precision::F32,
        "f64" => Precision::F64,
        other => bail!("unknown precision {other:?}; expected f32 or f64"),
    };
    let model =
        Model::load(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
    let tokenizer = Tokenizer::from_gguf(model.gguf()).context("loading the tokenizer")?;
    let tokens = tokenizer
        .encode(&args.prompt, true, false)
        .context("tokenizing the prompt")?;
    if tokens.is_empty() {
        bail!("the prompt tokenizes to no tokens");
    }

    let reference = ReferenceModel::load(&args.model, precision)
        .with_context(|| format!("loading {} in the reference", args.model.display()))?;
    let mut ref_taps = Vec::new();
    let ref_logits = reference
        .forward(&tokens, &mut |name, shape, data| {
            ref_taps.push(Tap::new(name, shape.to_vec(), data.to_vec()))
        })
        .context("reference forward pass")?;

    let mut recorder = TapRecorder::new();
    let engine = exec::open(
        &model,
        &Device::cpu_with(Some(isa), args.threads),
        &Topology::single(),
    )
    .context("preparing the weights")?;
    let mut session = Session::new(&engine, tokens.len())?;
    session.set_logits_all(true);
    let logits = session
        .forward(&tokens, Some(&mut recorder))
        .context("engine forward pass")?;
    let eng_taps: Vec<Tap> = recorder
        .taps
        .into_iter()
        .map(|t| Tap::new(t.name, t.shape, t.data))
        .collect();

    let backend_name = format!("cpu-{}", isa.name());
    let ctx = CaseContext::new(&args.weights, &backend_name)?;
    let comparison =
        harness::compare::compare_taps(&eng_taps, &ref_taps, &TolerancePolicy::default(), &ctx);
    let first = comparison
        .first_divergence
        .as_ref()
        .map(|d| d.finding.tap().to_owned());

    let n_vocab = reference.vocab_size();
    let top1: Vec<(u32, u32)> = (0..tokens.len())
        .map(|i| {
            let r = argmax(&ref_logits[i * n_vocab..(i + 1) * n_vocab]).unwrap_or(0) as u32;
            let e = argmax(logits.row(i)).unwrap_or(0) as u32;
            (e, r)
        })
        .collect();
    let same = top1.iter().filter(|(e, r)| e == r).count();

    if args.json {
        let out = json!({
            "tokens": tokens, "isa": isa.name(), "comparison": comparison,
            "first_divergence": first,
            "top1": top1.iter().map(|(e, r)| json!({"engine": e, "reference": r})).collect::<Vec<_>>(),
            "same_top1": same, "positions": tokens.len(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("{} tokens: {:?}", tokens.len(), tokens);
        println!(
            "engine: cpu-{} | reference: candle {:?}\n",
            isa.name(),
            precision
        );
        println!(
            "{:<22} {:>12} {:>10} {:>10} {:>10} {:>24}  status",
            "tap", "shape", "nmse", "tolerance", "cosine", "max |err| at [tok,col]"
        );
        for t in &comparison.taps {
            let (err, at) = match &t.metrics.max_abs {
                Some(m) => (
                    format!("{:.3e}", m.abs_error),
                    format!(
                        "[{},{}] {:.4}/{:.4}",
                        m.token, m.column, m.engine, m.reference
                    ),
                ),
                None => ("-".into(), String::new()),
            };
            let status = if first.as_deref() == Some(t.tap.as_str()) {
                "FIRST PAST TOLERANCE"
            } else if t.passed() {
                "ok"
            } else {
                "past tolerance"
            };
            println!(
                "{:<22} {:>12} {:>10.3e} {:>10.3e} {:>10.6} {:>10} {:<14}  {status}",
                t.tap,
                format!("{:?}", t.shape),
                t.metrics.nmse,
                t.tolerance.nmse_max,
                t.metrics.cosine,
                err,
                at
            );
        }
        for f in &comparison.findings {
            if !matches!(f, harness::compare::Finding::PastTolerance { .. }) {
                println!("finding: {f:?}");
            }
        }
        println!();
        for (i, (e, r)) in top1.iter().enumerate() {
            if e != r {
                println!(
                    "position {i}: engine top-1 {e} {:?}, reference top-1 {r} {:?}",
                    tokenizer.token_piece(*e),
                    tokenizer.token_piece(*r)
                );
            }
        }
        println!("identical top-1 at {same} of {} positions", tokens.len());
        match &first {
            Some(tap) => println!("first divergence: {tap}"),
            None => println!("every tap within tolerance"),
        }
    }
    if first.is_some() {
        bail!("engine and reference diverge");
    }
    Ok(())
}
