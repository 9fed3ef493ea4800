//! `plumbline spec-bench --model FILE`: where tree speculation pays. First the cost of one
//! target forward of n tokens (n = 1..=17) relative to one, with every row through the head and
//! with one; then, for a code, a repetitive, a prose and a numbered-list prompt, plain greedy
//! decoding and greedy speculation per drafter and budget, in the same run: τ (tokens per
//! verify), speedup (plain decode seconds ÷ speculative decode seconds), and whether the output
//! equals plain decoding's (it must).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::exec::{AnyEngine, BatchEngine};
use engine::runtime::{Batch, KvDtype, SeqCache};
use engine::sampling::{Sampler, SamplerConfig};
use engine::spec::{self, measure_cost, CostMode, HeadRows, Limits, SpecConfig, SEQ};
use engine::tokenizer::Tokenizer;
use serde_json::json;

use crate::engine_args::EngineArgs;
use crate::generate::{with_proposer, Draft};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model file
    #[arg(long)]
    pub model: PathBuf,
    /// Tokens generated per prompt
    #[arg(long, default_value_t = 96)]
    pub max_tokens: usize,
    /// Drafters, comma-separated (ngram, self:LAYERS, model:FILE)
    #[arg(long, default_value = "ngram,self:4")]
    pub drafts: String,
    /// Fixed budgets to run, comma-separated (each with tree top-k 4); `adaptive` adds the
    /// policy's choice up to the largest
    #[arg(long, default_value = "4,8,16,adaptive")]
    pub budgets: String,
    /// Repetitions of each run (the fastest counts)
    #[arg(long, default_value_t = 1)]
    pub reps: usize,
    /// Which head rows a verify computes (auto: measured, chain or visited; see `generate`)
    #[arg(long, value_enum, default_value_t = crate::generate::HeadRowsArg::Auto)]
    pub head_rows: crate::generate::HeadRowsArg,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long)]
    pub json: bool,
}

/// The four kinds of text (the numbered list: where issue 28 measured adaptive n-gram speculation
/// at 0.86× plain decoding, τ ≈ 2).
const PROMPTS: [(&str, &str); 4] = [
    (
        "code",
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n",
    ),
    (
        "repetitive",
        "Monday: wake up, run, work, read, sleep.\nTuesday: wake up, run, work, read, sleep.\nWednesday: wake up, run, work, read, sleep.\nThursday:",
    ),
    (
        "prose",
        "The old lighthouse keeper had lived alone on the island for thirty years. Every evening he",
    ),
    (
        "list",
        "Ten things to pack for a week of hiking:\n1. A tent\n2. A sleeping bag\n3. A stove\n4.",
    ),
];

#[derive(Clone, Debug)]
enum Budget {
    Fixed(usize),
    Adaptive(usize),
}

fn parse_budgets(s: &str) -> Result<Vec<Budget>> {
    let mut fixed = Vec::new();
    let mut adaptive = false;
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part == "adaptive" {
            adaptive = true;
        } else {
            fixed.push(part.parse::<usize>().with_context(|| {
                format!("--budgets: expected numbers or adaptive, found {part:?}")
            })?);
        }
    }
    let mut v: Vec<Budget> = fixed.iter().map(|&b| Budget::Fixed(b)).collect();
    if adaptive {
        v.push(Budget::Adaptive(fixed.iter().copied().max().unwrap_or(8)));
    }
    if v.is_empty() {
        bail!("--budgets lists nothing");
    }
    Ok(v)
}

pub fn run(args: Args) -> Result<()> {
    if args.engine.kv_dtype() != KvDtype::F32 {
        anyhow::bail!(
            "spec-bench pairs each run with plain decoding (engine::spec::generate_plain), \
             which keeps an f32 cache: --kv-dtype {} would compare two different caches",
            args.engine.kv_dtype().name()
        );
    }
    let model = args.engine.load_model(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(model.gguf())
        .with_context(|| format!("reading the tokenizer of {}", args.model.display()))?;
    let engine = args.engine.open(&model)?;
    let drafts: Vec<Draft> = args
        .drafts
        .split(',')
        .map(|d| d.trim().parse())
        .collect::<Result<_>>()?;
    let budgets = parse_budgets(&args.budgets)?;
    let max_budget = budgets
        .iter()
        .map(|b| match b {
            Budget::Fixed(n) | Budget::Adaptive(n) => *n,
        })
        .max()
        .unwrap_or(8);

    // The cost curve on a short context.
    let warm = tokenizer
        .encode(PROMPTS[2].1, true, false)
        .context("tokenizing the prose prompt")?;
    let mut cache = engine.new_cache(warm.len() + 64, KvDtype::F32)?;
    engine.forward(&mut cache, &Batch::chain(SEQ, 0, &warm, false), None)?;
    engine.commit(&mut cache);
    let token = warm[warm.len() - 1];
    let n_max = 17.max(max_budget + 1);
    let cost = measure_cost(
        &engine,
        &mut cache,
        token,
        n_max,
        3,
        CostMode::LayersThenHead,
    )?;
    let mut all_rows = Vec::new();
    for n in 1..=n_max {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let b = Batch::chain(SEQ, cache.next_pos(SEQ), &vec![token; n], true);
            let t = Instant::now();
            engine.forward(&mut cache, &b, None)?;
            best = best.min(t.elapsed().as_secs_f64());
            cache.rollback();
        }
        all_rows.push(best);
    }
    let step = cost.verify_secs(1, 1.0);
    let mut stdout = std::io::stdout().lock();
    if !args.json {
        writeln!(
            stdout,
            "cost of a forward of n tokens ÷ one decode step ({} threads, {}; one head row = {:.2} of a step):",
            engine.threads(),
            engine.cpu_isa().map_or("-", |i| i.name()),
            cost.head_row / step
        )?;
        writeln!(stdout, "{:>3}  {:>10}  {:>10}", "n", "layers", "all rows")?;
        for n in 1..=n_max {
            writeln!(
                stdout,
                "{n:>3}  {:>10.2}  {:>10.2}",
                cost.secs(n) / step,
                all_rows[n - 1] / step
            )?;
        }
    }

    let mut rows = Vec::new();
    let mut plans = std::collections::HashMap::new();
    for (kind, text) in PROMPTS {
        let prompt = tokenizer
            .encode(text, true, false)
            .with_context(|| format!("tokenizing the {kind} prompt"))?;
        let limits = Limits {
            max_tokens: args.max_tokens,
            eog: tokenizer.eog_ids(),
            stop_sequences: Vec::new(),
        };
        // Plain greedy decoding, timed after the first token as the speculative runs are.
        let mut plain_secs = f64::INFINITY;
        let mut plain_out = Vec::new();
        for _ in 0..args.reps.max(1) {
            let (out, secs) = plain(&engine, &prompt, &limits)?;
            plain_secs = plain_secs.min(secs);
            plain_out = out;
        }
        eprintln!(
            "{kind}: plain {} tokens, {:.1} tokens/s",
            plain_out.len(),
            (plain_out.len().saturating_sub(1)) as f64 / plain_secs
        );
        for draft in &drafts {
            for budget in &budgets {
                let mut cfg = match budget {
                    Budget::Fixed(b) => SpecConfig::new(*b, 4),
                    Budget::Adaptive(b) => {
                        let mut c = SpecConfig::new(*b, 4);
                        c.adaptive = true;
                        c.cost = Some(cost.clone());
                        c
                    }
                };
                cfg.head_rows = args.head_rows.plan();
                if let Draft::SelfLayers(_) | Draft::Model(_) = draft {
                    // A model drafter runs one forward per depth: a shallow tree.
                    cfg.shape.max_depth = 4;
                }
                if cfg.head_rows == HeadRows::Auto && cfg.shape.budget > 0 {
                    // Measured once per depth for the whole run, as a server measures it once
                    // (not once per generation, which would charge every run for it).
                    let depth = cfg.shape.max_depth.min(cfg.shape.budget) + 1;
                    let (plan, per_row) = match plans.get(&depth) {
                        Some(&p) => p,
                        None => {
                            let p = spec::choose_head_rows(&engine, &mut cache, token, depth)?;
                            plans.insert(depth, p);
                            p
                        }
                    };
                    cfg.head_rows = plan;
                    cfg.head_per_row = Some(per_row);
                }
                // Plain decoding again right before each speculative run (a paired ratio: the
                // machine's load changes between runs).
                let mut pair_plain = f64::INFINITY;
                let mut best: Option<spec::SpecOutput> = None;
                for _ in 0..args.reps.max(1) {
                    pair_plain = pair_plain.min(plain(&engine, &prompt, &limits)?.1);
                    let mut cache = engine.new_cache(
                        prompt.len() + args.max_tokens + cfg.shape.budget + 2,
                        KvDtype::F32,
                    )?;
                    let mut sampler = Sampler::new(SamplerConfig::greedy());
                    let out = with_proposer(draft, &engine, 2048, |p| {
                        spec::generate(&engine, &mut cache, &prompt, p, &mut sampler, &cfg, &limits)
                            .context("speculative generation")
                    })?;
                    if best
                        .as_ref()
                        .is_none_or(|b| out.stats.decode_secs < b.stats.decode_secs)
                    {
                        best = Some(out);
                    }
                }
                let Some(out) = best else { continue };
                let st = &out.stats;
                let speedup = pair_plain / st.decode_secs.max(f64::MIN_POSITIVE);
                let budget_name = match budget {
                    Budget::Fixed(b) => b.to_string(),
                    Budget::Adaptive(b) => format!("adaptive≤{b}"),
                };
                let draft_name = match draft {
                    Draft::Ngram => "ngram".to_string(),
                    Draft::Model(p) => format!("model:{}", p.display()),
                    Draft::SelfLayers(n) => format!("self:{n}"),
                };
                eprintln!(
                    "{kind} {draft_name} {budget_name}: τ {:.2}, speedup {speedup:.2}",
                    st.tau()
                );
                rows.push(json!({
                    "text": kind,
                    "drafter": draft_name,
                    "budget": budget_name,
                    "tau": st.tau(),
                    "speedup": speedup,
                    "equal_to_plain": out.tokens == plain_out,
                    "tokens": out.tokens.len(),
                    "rounds": st.rounds,
                    "spec_rounds": st.spec_rounds,
                    "budget_rounds": st.budget_rounds,
                    "acceptance_by_depth": st.acceptance_by_depth(),
                    "plain_decode_secs": pair_plain,
                    "spec_decode_secs": st.decode_secs,
                    "draft_secs": st.draft_secs,
                }));
            }
        }
    }
    if args.json {
        let j = json!({
            "threads": engine.threads(),
            "isa": engine.cpu_isa().map_or("-", |i| i.name()),
            "cost_layers": (1..=n_max).map(|n| cost.secs(n) / step).collect::<Vec<_>>(),
            "cost_all_rows": all_rows.iter().map(|s| s / step).collect::<Vec<_>>(),
            "head_row": cost.head_row / step,
            "runs": rows,
        });
        writeln!(stdout, "{}", serde_json::to_string_pretty(&j)?)?;
    } else {
        writeln!(
            stdout,
            "\n{:<11} {:<10} {:<12} {:>6} {:>8} {:>6}",
            "text", "drafter", "budget", "τ", "speedup", "equal"
        )?;
        for r in &rows {
            writeln!(
                stdout,
                "{:<11} {:<10} {:<12} {:>6.2} {:>7.2}x {:>6}",
                r["text"].as_str().unwrap_or(""),
                r["drafter"].as_str().unwrap_or(""),
                r["budget"].as_str().unwrap_or(""),
                r["tau"].as_f64().unwrap_or(0.0),
                r["speedup"].as_f64().unwrap_or(0.0),
                if r["equal_to_plain"] == true {
                    "yes"
                } else {
                    "NO"
                }
            )?;
        }
    }
    if rows.iter().any(|r| r["equal_to_plain"] != true) {
        bail!("a speculative run's output differs from plain greedy decoding");
    }
    Ok(())
}

/// Plain greedy decoding: the tokens and the seconds after the first token.
fn plain(engine: &AnyEngine<'_>, prompt: &[u32], limits: &Limits) -> Result<(Vec<u32>, f64)> {
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    Ok(spec::generate_plain(engine, prompt, &mut sampler, limits)?)
}
