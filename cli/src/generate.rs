//! `plumbline generate --model FILE --prompt TEXT`: greedy or sampled continuation, streamed to
//! stdout as it decodes; `--json` prints one object with ids, text and throughput instead.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::model::Model;
use engine::runtime::{Backend, CpuBackend, Engine};
use engine::sampling::{Sampler, SamplerConfig};
use engine::tokenizer::Tokenizer;
use kernels::cpu::Isa;
use serde_json::json;

/// The CPU instruction set to run the kernels with.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum IsaArg {
    Scalar,
    Avx2,
    Avx512,
}

impl From<IsaArg> for Isa {
    fn from(a: IsaArg) -> Isa {
        match a {
            IsaArg::Scalar => Isa::Scalar,
            IsaArg::Avx2 => Isa::Avx2,
            IsaArg::Avx512 => Isa::Avx512,
        }
    }
}

/// Options shared by the commands that run a model on the CPU.
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Worker threads (default: every available core)
    #[arg(long)]
    pub threads: Option<usize>,
    /// Instruction set of the CPU kernels (default: the widest this CPU has)
    #[arg(long, value_enum)]
    pub isa: Option<IsaArg>,
}

impl RunArgs {
    /// Refuse a misspelt fault setting, then load the model and build the backend.
    pub fn load(&self, path: &std::path::Path) -> Result<(Model, CpuBackend)> {
        engine::faults::setting().context("reading the fault-injection setting")?;
        let model =
            Model::load(path).with_context(|| format!("loading model {}", path.display()))?;
        let backend = CpuBackend::new(self.isa.map(Isa::from), self.threads)
            .context("starting the CPU backend")?;
        Ok((model, backend))
    }
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model file (any shard of a split set)
    #[arg(long)]
    pub model: PathBuf,
    /// Text to continue (BOS is added when the model asks for it)
    #[arg(long)]
    pub prompt: String,
    /// Most tokens to generate; generation also stops at an end-of-generation token
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    #[arg(long)]
    pub seed: Option<u64>,
    #[command(flatten)]
    pub run: RunArgs,
    /// Tensor-parallel ranks (threads on this host, `shm`); 1 runs the model whole
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Print one JSON object (ids, text, throughput) instead of streaming text
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let (model, backend) = args.run.load(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(model.gguf())
        .with_context(|| format!("reading the tokenizer of {}", args.model.display()))?;
    let prompt_ids = tokenizer
        .encode(&args.prompt, true, false)
        .context("tokenizing the prompt")?;
    if prompt_ids.is_empty() {
        bail!("the prompt tokenizes to nothing; expected at least one token");
    }
    let mut cfg = SamplerConfig {
        temperature: args.temperature,
        ..SamplerConfig::default()
    };
    if let Some(k) = args.top_k {
        cfg.top_k = k;
    }
    if let Some(p) = args.top_p {
        cfg.top_p = p;
    }
    if let Some(p) = args.min_p {
        cfg.min_p = p;
    }
    if let Some(r) = args.repeat_penalty {
        cfg.repeat_penalty = r;
    }
    if let Some(s) = args.seed {
        cfg.seed = s;
    }
    let mut sampler = Sampler::new(cfg);

    let n_ctx = prompt_ids.len() + args.max_tokens;
    let engine = Engine::new(&model, &backend).context("preparing the weights")?;
    let tp_model = crate::tp_plan::tp_model(&model, args.tp)?;
    let tp_backends = crate::tp_plan::tp_backends(args.tp, &args.run)?;
    let tp_engine = crate::tp_plan::tp_engine(tp_model.as_ref(), &tp_backends)?;
    let mut session = crate::tp_plan::GenSession::new(&engine, tp_engine.as_ref(), n_ctx)?;
    let mut stdout = std::io::stdout().lock();
    let mut decoder = tokenizer.stream_decoder();

    let t0 = Instant::now();
    let mut logits = session
        .forward(&prompt_ids)
        .context("prefilling the prompt")?;
    let prefill_s = t0.elapsed().as_secs_f64();

    let mut history = prompt_ids.clone();
    let mut generated: Vec<u32> = Vec::new();
    let mut decode_s = 0.0;
    let mut n_decode_steps = 0usize;
    while generated.len() < args.max_tokens {
        let id = sampler.sample(logits.last(), &history);
        if tokenizer.is_eog(id) {
            break;
        }
        generated.push(id);
        history.push(id);
        if !args.json {
            let piece = decoder.push(id);
            if !piece.is_empty() {
                stdout.write_all(piece.as_bytes())?;
                stdout.flush()?;
            }
        }
        if generated.len() == args.max_tokens {
            break;
        }
        let t = Instant::now();
        logits = session
            .forward(&[id])
            .with_context(|| format!("decoding at position {}", session.n_past()))?;
        decode_s += t.elapsed().as_secs_f64();
        n_decode_steps += 1;
    }

    let prefill_tps = prompt_ids.len() as f64 / prefill_s.max(f64::MIN_POSITIVE);
    let decode_tps = if n_decode_steps > 0 {
        n_decode_steps as f64 / decode_s.max(f64::MIN_POSITIVE)
    } else {
        0.0
    };
    if args.json {
        let out = json!({
            "prompt_ids": prompt_ids,
            "generated_ids": generated,
            "text": tokenizer.decode(&generated),
            "n_prompt": prompt_ids.len(),
            "n_generated": generated.len(),
            "prefill_tokens_per_s": prefill_tps,
            "decode_tokens_per_s": decode_tps,
            "backend": backend.name(),
            "isa": backend.isa().name(),
            "threads": backend.threads(),
            "tp": args.tp,
            "communicator": tp_engine.as_ref().map_or("none", |e| e.comm_kind()),
        });
        writeln!(stdout, "{}", serde_json::to_string_pretty(&out)?)?;
    } else {
        let rest = decoder.finish();
        writeln!(stdout, "{rest}")?;
        tracing::info!(
            n_prompt = prompt_ids.len(),
            n_generated = generated.len(),
            prefill_tokens_per_s = prefill_tps,
            decode_tokens_per_s = decode_tps,
            "generate done"
        );
    }
    Ok(())
}
