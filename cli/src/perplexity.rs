//! `plumbline perplexity --model FILE --file TEXT`: perplexity as llama.cpp's `llama-perplexity`
//! computes it.
//!
//! The whole text is tokenized once (with BOS), cut into non-overlapping windows of `--ctx`
//! tokens, and each window's first token is replaced by BOS. Each window runs as one batch
//! from an empty cache; only the second half is scored (`first = ctx / 2`): the logits at
//! positions `first .. ctx-1` predict the tokens after them. PPL = exp(mean NLL); the error is
//! llama.cpp's estimate `ppl · sqrt((mean(NLL²) − mean(NLL)²) / (count − 1))`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::exec::{BatchEngine, Session};
use engine::tokenizer::Tokenizer;
use serde_json::json;

use crate::engine_args::EngineArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model file (any shard of a split set)
    #[arg(long)]
    pub model: PathBuf,
    /// UTF-8 text file to score
    #[arg(long)]
    pub file: PathBuf,
    /// Window length in tokens
    #[arg(long, default_value_t = 128)]
    pub ctx: usize,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Print one JSON object instead of the running values
    #[arg(long)]
    pub json: bool,
}

/// Negative log-likelihood of `target` under `logits` (log-softmax in f64, as llama.cpp).
pub fn nll(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lt = logits
        .get(target as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    -(f64::from(lt - max) - sum.ln())
}

/// Running NLL sums.
#[derive(Debug, Default, Clone, Copy)]
pub struct PplAccumulator {
    pub nll: f64,
    pub nll2: f64,
    pub count: usize,
}

impl PplAccumulator {
    pub fn add(&mut self, v: f64) {
        self.nll += v;
        self.nll2 += v * v;
        self.count += 1;
    }

    pub fn ppl(&self) -> f64 {
        (self.nll / self.count.max(1) as f64).exp()
    }

    /// llama.cpp's error estimate of the PPL (`None` below two samples or with no spread).
    pub fn error(&self) -> Option<f64> {
        if self.count < 2 {
            return None;
        }
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        (var > 0.0).then(|| (var / (n - 1.0)).sqrt() * self.ppl())
    }
}

pub fn run(args: Args) -> Result<()> {
    if args.ctx < 4 {
        bail!("--ctx: expected at least 4 tokens, found {}", args.ctx);
    }
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let model = args.engine.load_model(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(model.gguf())
        .with_context(|| format!("reading the tokenizer of {}", args.model.display()))?;
    let tokens = tokenizer
        .encode(&text, true, false)
        .with_context(|| format!("tokenizing {}", args.file.display()))?;
    let n_ctx = args.ctx;
    let n_windows = tokens.len() / n_ctx;
    if n_windows == 0 {
        bail!(
            "{}: expected at least --ctx ({n_ctx}) tokens, found {}",
            args.file.display(),
            tokens.len()
        );
    }
    let bos = tokenizer.bos();
    let first = n_ctx / 2;

    let engine = args.engine.open(&model)?;
    let mut session = Session::with_cache(&engine, n_ctx, args.engine.kv_dtype())?;
    session.set_logits_all(true);
    let mut acc = PplAccumulator::default();
    let mut running = Vec::with_capacity(n_windows);
    let t0 = Instant::now();
    for w in 0..n_windows {
        let start = w * n_ctx;
        let mut batch = tokens[start..start + n_ctx].to_vec();
        if let Some(b) = bos {
            batch[0] = b;
        }
        session.reset();
        let logits = session
            .forward(&batch, None)
            .with_context(|| format!("window {w} (tokens {start}..{})", start + n_ctx))?;
        for pos in first..n_ctx - 1 {
            acc.add(nll(logits.row(pos), tokens[start + pos + 1]));
        }
        running.push(acc.ppl());
        if !args.json {
            print!("[{}]{:.4} ", w + 1, acc.ppl());
            use std::io::Write;
            std::io::stdout().flush()?;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let tps = (n_windows * n_ctx) as f64 / secs.max(f64::MIN_POSITIVE);
    if args.json {
        let out = json!({
            "ppl": acc.ppl(),
            "ppl_error": acc.error(),
            "n_tokens": tokens.len(),
            "n_windows": n_windows,
            "ctx": n_ctx,
            "n_scored": acc.count,
            "running_ppl": running,
            "tokens_per_s": tps,
            "backend": engine.device_name(),
            "threads": engine.threads(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!();
        match acc.error() {
            Some(e) => println!("Final estimate: PPL = {:.4} +/- {:.5}", acc.ppl(), e),
            None => println!("Final estimate: PPL = {:.4}", acc.ppl()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_of_uniform_logits_is_log_vocab() {
        // Uniform over 4: NLL = ln 4 exactly (up to f64 rounding).
        approx::assert_abs_diff_eq!(nll(&[0.5; 4], 2), 4f64.ln(), epsilon = 1e-12);
    }

    #[test]
    fn ppl_of_constant_nll_has_no_error() {
        let mut a = PplAccumulator::default();
        for _ in 0..10 {
            a.add(2f64.ln());
        }
        approx::assert_abs_diff_eq!(a.ppl(), 2.0, epsilon = 1e-12);
        assert_eq!(a.error(), None);
    }

    #[test]
    fn ppl_error_matches_hand_computation() {
        // NLLs 1 and 3: mean 2, mean of squares 5, variance 1, error = e² · sqrt(1 / 1).
        let mut a = PplAccumulator::default();
        a.add(1.0);
        a.add(3.0);
        approx::assert_abs_diff_eq!(a.ppl(), 2f64.exp(), epsilon = 1e-12);
        approx::assert_abs_diff_eq!(a.error().unwrap_or(0.0), 2f64.exp(), epsilon = 1e-9);
    }
}
