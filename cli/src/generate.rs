//! `plumbline generate --model FILE --prompt TEXT`: greedy or sampled continuation, streamed to
//! stdout as it decodes; `--json` prints one object with ids, text and throughput instead.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::exec::{AnyEngine, BatchEngine, Session};
use engine::model::Model;
use engine::sampling::{Sampler, SamplerConfig};
use engine::spec::{
    self, HeadRows, Limits, ModelProposer, NgramProposer, Proposer, SpecConfig, SpecError,
};
use engine::tokenizer::Tokenizer;
use serde_json::json;

use crate::engine_args::EngineArgs;

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
    pub engine: EngineArgs,
    /// Print one JSON object (ids, text, throughput) instead of streaming text
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// Speculative decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecKind {
    /// DDTree-style tree speculation
    Tree,
}

/// Options of `--spec tree`.
#[derive(clap::Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding (lossless: the output is plain decoding's)
    #[arg(long, value_enum)]
    pub spec: Option<SpecKind>,
    /// Draft-tree node budget (the verify forward runs budget + 1 tokens)
    #[arg(long, default_value_t = 8)]
    pub budget: usize,
    /// Children per draft-tree node at most (`--top-k` is the sampler's)
    #[arg(long, default_value_t = 4)]
    pub tree_top_k: usize,
    /// Deepest draft-tree depth (default: the budget)
    #[arg(long)]
    pub max_depth: Option<usize>,
    /// Tokens of history the drafter keeps (its sliding window)
    #[arg(long, default_value_t = 2048)]
    pub draft_window: usize,
    /// Drafter: ngram, model:FILE (same vocabulary) or self:LAYERS (the target's first layers)
    #[arg(long, default_value = "ngram")]
    pub draft: String,
    /// Keep the budget fixed instead of choosing it per round from measured cost and acceptance
    #[arg(long)]
    pub fixed_budget: bool,
    /// Which head rows a verify computes: auto (measured at the start: the best chain in one
    /// pass where the head's cost grows slowly with its rows, else only the rows the walk
    /// visits), chain, or visited
    #[arg(long, value_enum, default_value_t = HeadRowsArg::Auto)]
    pub head_rows: HeadRowsArg,
}

/// `--head-rows`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HeadRowsArg {
    Auto,
    Chain,
    Visited,
}

impl HeadRowsArg {
    pub fn plan(self) -> HeadRows {
        match self {
            HeadRowsArg::Auto => HeadRows::Auto,
            HeadRowsArg::Chain => HeadRows::Chain,
            HeadRowsArg::Visited => HeadRows::Visited,
        }
    }
}

/// A parsed `--draft`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Draft {
    Ngram,
    Model(PathBuf),
    SelfLayers(usize),
}

impl std::str::FromStr for Draft {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Draft> {
        if s == "ngram" {
            return Ok(Draft::Ngram);
        }
        if let Some(f) = s.strip_prefix("model:") {
            if f.is_empty() {
                bail!("--draft model:FILE needs a file name");
            }
            return Ok(Draft::Model(PathBuf::from(f)));
        }
        if let Some(n) = s.strip_prefix("self:") {
            let n: usize = n.parse().with_context(|| {
                format!("--draft self:LAYERS expects a layer count, found {n:?}")
            })?;
            return Ok(Draft::SelfLayers(n));
        }
        bail!("--draft expects ngram, model:FILE or self:LAYERS, found {s:?}")
    }
}

impl SpecArgs {
    /// The speculation settings.
    pub fn config(&self) -> SpecConfig {
        let mut cfg = SpecConfig::new(self.budget, self.tree_top_k);
        if let Some(d) = self.max_depth {
            cfg.shape.max_depth = d;
        }
        cfg.adaptive = !self.fixed_budget;
        cfg.head_rows = self.head_rows.plan();
        cfg
    }
}

/// Run `f` with the drafter `draft` for the target `engine` (a drafter model runs whole on the
/// target's device).
pub fn with_proposer<R>(
    draft: &Draft,
    engine: &AnyEngine<'_>,
    window: usize,
    f: impl FnOnce(&mut dyn Proposer) -> Result<R>,
) -> Result<R> {
    match draft {
        Draft::Ngram => f(&mut NgramProposer::new(window)),
        Draft::Model(path) => {
            let dm = load_drafter(path, engine.model())?;
            let de = engine
                .on_same_device(&dm)
                .context("preparing the draft model")?;
            let mut p = ModelProposer::new(&de, window, format!("model:{}", path.display()))?;
            f(&mut p)
        }
        Draft::SelfLayers(n) => {
            let de = engine
                .self_draft(*n)
                .with_context(|| format!("self-draft of the first {n} layers"))?;
            let mut p = ModelProposer::new(&de, window, format!("self:{n}"))?;
            f(&mut p)
        }
    }
}

/// Load a drafter model and check that its vocabulary is the target's.
pub fn load_drafter(path: &std::path::Path, target: &Model) -> Result<Model> {
    let dm =
        Model::load(path).with_context(|| format!("loading draft model {}", path.display()))?;
    let (dv, tv) = (dm.config().n_vocab, target.config().n_vocab);
    if dv != tv {
        return Err(SpecError::DrafterVocab {
            draft: dv,
            target: tv,
        })
        .with_context(|| format!("draft model {}", path.display()));
    }
    Ok(dm)
}

/// `--spec tree`: speculative generation, printed when done.
fn run_spec(
    args: &Args,
    engine: &AnyEngine<'_>,
    tokenizer: &Tokenizer,
    prompt_ids: &[u32],
    sampler: &mut Sampler,
) -> Result<()> {
    let draft: Draft = args.spec.draft.parse()?;
    let cfg = args.spec.config();
    cfg.validate().context("--spec tree settings")?;
    let mut cache = engine.new_cache(
        prompt_ids.len() + args.max_tokens + args.spec.budget + 2,
        args.engine.kv_dtype(),
    )?;
    let limits = Limits {
        max_tokens: args.max_tokens,
        eog: tokenizer.eog_ids(),
        stop_sequences: Vec::new(),
    };
    let out = with_proposer(&draft, engine, args.spec.draft_window, |p| {
        spec::generate(engine, &mut cache, prompt_ids, p, sampler, &cfg, &limits)
            .context("speculative generation")
    })?;
    let st = &out.stats;
    let n_decoded = out.tokens.len().saturating_sub(1);
    let decode_tps = n_decoded as f64 / st.decode_secs.max(f64::MIN_POSITIVE);
    let mut stdout = std::io::stdout().lock();
    if args.json {
        let j = json!({
            "prompt_ids": prompt_ids,
            "generated_ids": out.tokens,
            "text": tokenizer.decode(&out.tokens),
            "n_prompt": prompt_ids.len(),
            "n_generated": out.tokens.len(),
            "prefill_tokens_per_s": prompt_ids.len() as f64 / st.prefill_secs.max(f64::MIN_POSITIVE),
            "decode_tokens_per_s": decode_tps,
            "spec": {
                "drafter": args.spec.draft,
                "budget": args.spec.budget,
                "top_k": args.spec.tree_top_k,
                "draft_window": args.spec.draft_window,
                "adaptive": cfg.adaptive,
                "tau": st.tau(),
                "acceptance_by_depth": st.acceptance_by_depth(),
                "rounds": st.rounds,
                "spec_rounds": st.spec_rounds,
                "budget_rounds": st.budget_rounds,
                "draft_secs": st.draft_secs,
                "verify_secs": st.verify_secs,
                "head_rows": st.head_rows,
                "head_passes": st.head_passes,
            },
            "backend": engine.device_name(),
            "isa": engine.cpu_isa().map(|i| i.name()),
            "threads": engine.threads(),
            "tp": engine.tp_degree(),
        });
        writeln!(stdout, "{}", serde_json::to_string_pretty(&j)?)?;
    } else {
        writeln!(stdout, "{}", tokenizer.decode(&out.tokens))?;
        tracing::info!(
            n_generated = out.tokens.len(),
            tau = st.tau(),
            decode_tokens_per_s = decode_tps,
            "generate --spec tree done"
        );
    }
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    let model = args.engine.load_model(&args.model)?;
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
    let engine = args.engine.open(&model)?;
    if args.spec.spec == Some(SpecKind::Tree) {
        return run_spec(&args, &engine, &tokenizer, &prompt_ids, &mut sampler);
    }

    let n_ctx = prompt_ids.len() + args.max_tokens;
    let mut session = Session::with_cache(&engine, n_ctx, args.engine.kv_dtype())?;
    let mut stdout = std::io::stdout().lock();
    let mut decoder = tokenizer.stream_decoder();

    let t0 = Instant::now();
    let mut logits = session
        .forward(&prompt_ids, None)
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
            .forward(&[id], None)
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
            "backend": engine.device_name(),
            "isa": engine.cpu_isa().map(|i| i.name()),
            "threads": engine.threads(),
            "tp": engine.tp_degree(),
            "communicator": engine.communicator().unwrap_or("none"),
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
