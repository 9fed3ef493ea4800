//! The engine thread: continuous batching over the core's ragged [`Engine::forward`].
//!
//! One thread owns the model, the backend and one [`KvCache`] shared by every running request.
//! Each request is a sequence (its slot index is its sequence id) in that cache. Every step:
//!
//! 1. requests whose client went away (their event channel is closed: the response stream or
//!    the waiting handler was dropped) are cancelled and their cells freed;
//! 2. waiting requests join the running batch while slots are free (between decode steps, never
//!    in the middle of one);
//! 3. one batch is built: the next sampled token of each decoding sequence, and up to
//!    `prefill_chunk` prompt tokens of the sequences still prefilling (long prompts span
//!    several steps);
//! 4. one forward; each sequence that asked for logits samples its next token with its own
//!    sampler, checks end-of-generation, stop strings and its token limit, and sends the newly
//!    complete text to its client;
//! 5. finished sequences are removed from the cache (`remove_seq`).
//!
//! The readiness probe is an ordinary request through this same loop.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use engine::model::Model;
use engine::runtime::{Backend, Batch, Engine, KvCache, KvDtype, SeqId};
use engine::sampling::{Sampler, SamplerConfig};
use engine::tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use super::chat::ChatTemplate;
use super::hooks::Hooks;
use super::{AppState, ModelInfo};

/// One generation request as the engine sees it (already validated and tokenized).
#[derive(Debug)]
pub struct Job {
    pub prompt: Vec<u32>,
    /// At least 1; prompt + max_tokens fits the per-sequence context.
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub top_logprobs: Option<usize>,
    /// Do not stop at end-of-generation tokens.
    pub ignore_eos: bool,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
    /// A readiness probe (kept out of the request metrics).
    pub probe: bool,
}

/// Log-probability of one token (under the model's distribution, before sampling filters, as
/// OpenAI reports them) and of the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// (id, text, bytes, log-probability), most likely first.
    pub top: Vec<(u32, String, Vec<u8>, f32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What the engine sends back for one request, in order: deltas, then `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Newly complete text (possibly empty while a stop string might be starting), and the
    /// token sampled in this step when there was one.
    Delta {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed(String),
}

/// Engine-thread settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_path: std::path::PathBuf,
    pub run: crate::generate::RunArgs,
    pub max_batch: usize,
    /// Positions per sequence (prompt + generated).
    pub ctx: usize,
    pub prefill_chunk: usize,
    pub hooks: Hooks,
}

/// Load the model, publish its tokenizer and template, then batch until shutdown.
pub fn run(cfg: EngineConfig, state: Arc<AppState>, rx: Receiver<Job>) -> Result<()> {
    let loaded = load(&cfg);
    let (model, backend, tokenizer, template) = match loaded {
        Ok(v) => v,
        Err(e) => {
            state
                .ready
                .failed(format!("the model could not be loaded: {e:#}"));
            return Err(e);
        }
    };
    let engine = Engine::new(&model, &backend).context("preparing the weights")?;
    let cache = engine
        .new_cache(cfg.ctx.saturating_mul(cfg.max_batch), KvDtype::F32)
        .context("creating the KV cache")?;
    let tokenizer = Arc::new(tokenizer);
    tracing::info!(
        backend = backend.name(),
        isa = backend.isa().name(),
        threads = backend.threads(),
        chat_template = template.source().describe(),
        max_batch = cfg.max_batch,
        ctx = cfg.ctx,
        "model loaded"
    );
    let _ = state.info.set(ModelInfo {
        tokenizer: tokenizer.clone(),
        template,
        n_vocab: model.config().n_vocab,
        arch: model.config().arch_name.clone(),
    });
    state.ready.loaded();
    if let Some(d) = cfg.hooks.warmup_delay {
        tracing::warn!(delay_ms = d.as_millis() as u64, "test hook: slow warm-up");
        std::thread::sleep(d);
    }
    let mut b = Batcher {
        engine: &engine,
        tokenizer: &tokenizer,
        cache,
        slots: (0..cfg.max_batch).map(|_| None).collect(),
        state: &state,
        cfg: &cfg,
    };
    b.run(&rx);
    Ok(())
}

type Loaded = (Model, engine::runtime::CpuBackend, Tokenizer, ChatTemplate);

fn load(cfg: &EngineConfig) -> Result<Loaded> {
    let (model, backend) = cfg.run.load(&cfg.model_path)?;
    let tokenizer = Tokenizer::from_gguf(model.gguf())
        .with_context(|| format!("reading the tokenizer of {}", cfg.model_path.display()))?;
    let gguf_template = model
        .gguf()
        .get_str_opt("tokenizer.chat_template")
        .with_context(|| {
            format!(
                "reading tokenizer.chat_template of {}",
                cfg.model_path.display()
            )
        })?;
    let piece = |id: Option<u32>| {
        id.map(|i| String::from_utf8_lossy(&tokenizer.token_bytes_special(i, true)).into_owned())
            .unwrap_or_default()
    };
    let template = ChatTemplate::new(
        gguf_template,
        &piece(tokenizer.bos()),
        &piece(tokenizer.eos()),
    )
    .map_err(anyhow::Error::msg)
    .with_context(|| format!("the chat template of {}", cfg.model_path.display()))?;
    Ok((model, backend, tokenizer, template))
}

struct Active<'t> {
    seq: SeqId,
    job: Job,
    sampler: Sampler,
    /// Prompt tokens already in the cache.
    fed: usize,
    /// The sequence's next position.
    pos: u32,
    /// The last sampled token, to feed in the next step.
    next: Option<u32>,
    generated: usize,
    decoder: StreamDecoder<'t>,
    /// Text not sent yet because it may be the start of a stop string.
    held: String,
    last_token: Option<Instant>,
    /// This step's batch index whose logits this sequence samples from.
    row: Option<usize>,
    /// Whether this step's batch holds tokens of this sequence.
    in_batch: bool,
}

struct Batcher<'a, 'm, B: Backend> {
    engine: &'a Engine<'m, B>,
    tokenizer: &'a Tokenizer,
    cache: KvCache<B>,
    slots: Vec<Option<Active<'a>>>,
    state: &'a AppState,
    cfg: &'a EngineConfig,
}

impl<'a, 'm, B: Backend> Batcher<'a, 'm, B> {
    fn run(&mut self, rx: &Receiver<Job>) {
        loop {
            if self.state.shutdown.load(Ordering::Relaxed) {
                return;
            }
            self.drop_cancelled();
            if self.n_active() == 0 {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(job) => self.admit(job),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while self.slots.iter().any(Option::is_none) {
                match rx.try_recv() {
                    Ok(job) => self.admit(job),
                    Err(_) => break,
                }
            }
            self.state
                .metrics
                .running
                .store(self.n_active(), Ordering::Relaxed);
            self.step();
            self.state
                .metrics
                .running
                .store(self.n_active(), Ordering::Relaxed);
        }
    }

    fn n_active(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    fn admit(&mut self, job: Job) {
        self.state
            .metrics
            .queue_depth
            .fetch_sub(1, Ordering::Relaxed);
        if job.events.is_closed() {
            self.state.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Some(i) = self.slots.iter().position(Option::is_none) else {
            // The caller admits only while a slot is free.
            let _ = job
                .events
                .send(Event::Failed("no free slot in the running batch".into()));
            return;
        };
        if !job.probe {
            self.state
                .metrics
                .prompt_tokens
                .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        }
        self.slots[i] = Some(Active {
            seq: i as SeqId,
            sampler: Sampler::new(job.sampler),
            job,
            fed: 0,
            pos: 0,
            next: None,
            generated: 0,
            decoder: self.tokenizer.stream_decoder(),
            held: String::new(),
            last_token: None,
            row: None,
            in_batch: false,
        });
    }

    fn drop_cancelled(&mut self) {
        for slot in &mut self.slots {
            if slot.as_ref().is_some_and(|a| a.job.events.is_closed()) {
                if let Some(a) = slot.take() {
                    self.cache.remove_seq(a.seq);
                    self.state.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        seq = a.seq,
                        generated = a.generated,
                        "client went away; cancelled"
                    );
                }
            }
        }
    }

    fn step(&mut self) {
        let mut batch = Batch::new();
        let mut budget = self.cfg.prefill_chunk.max(1);
        for a in self.slots.iter_mut().flatten() {
            a.row = None;
            a.in_batch = false;
            let n_prompt = a.job.prompt.len();
            if a.fed < n_prompt {
                let n = (n_prompt - a.fed).min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                a.in_batch = true;
                for j in a.fed..a.fed + n {
                    let last = j + 1 == n_prompt;
                    let idx = batch.push(a.job.prompt[j], a.pos, a.seq, last);
                    a.pos += 1;
                    if last {
                        a.row = Some(idx);
                    }
                }
                a.fed += n;
            } else if let Some(t) = a.next {
                a.in_batch = true;
                a.row = Some(batch.push(t, a.pos, a.seq, true));
                a.pos += 1;
            }
        }
        if batch.is_empty() {
            return;
        }
        if let Some(d) = self.cfg.hooks.step_delay {
            std::thread::sleep(d);
        }
        let result = match self.cfg.hooks.broken() {
            Some(reason) => Err(reason),
            None => self
                .engine
                .forward(&mut self.cache, &batch, None)
                .map_err(|e| format!("forward of a batch of {} tokens: {e}", batch.len())),
        };
        let logits = match result {
            Ok(l) => l,
            Err(reason) => {
                tracing::error!(%reason, "generation failed");
                self.state
                    .ready
                    .failed(format!("generation failed: {reason}"));
                for slot in &mut self.slots {
                    if slot.as_ref().is_some_and(|a| a.in_batch) {
                        if let Some(a) = slot.take() {
                            self.cache.remove_seq(a.seq);
                            let _ = a.job.events.send(Event::Failed(reason.clone()));
                        }
                    }
                }
                return;
            }
        };
        self.cache.commit();

        for i in 0..self.slots.len() {
            let Some(row) = self.slots[i].as_ref().and_then(|a| a.row) else {
                continue;
            };
            let Some(logits) = logits.of_token(row) else {
                self.finish_failed(
                    i,
                    format!("the forward returned no logits for batch row {row}"),
                );
                continue;
            };
            if let Some(done) = self.advance(i, logits) {
                self.finish(i, done);
            }
        }
    }

    /// Sample sequence `i`'s next token from `logits`; `Some(finish)` when it is done.
    fn advance(&mut self, i: usize, logits: &[f32]) -> Option<Finish> {
        let tokenizer = self.tokenizer;
        let metrics = &self.state.metrics;
        let a = self.slots[i].as_mut()?;
        let id = a.sampler.sample(logits, &[]);
        let now = Instant::now();
        self.state.ready.token_produced();
        if !a.job.probe {
            match a.last_token {
                None => metrics.ttft(now.duration_since(a.job.enqueued).as_secs_f64()),
                Some(t) => metrics.itl(now.duration_since(t).as_secs_f64()),
            }
            metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
        } else if a.last_token.is_none() {
            metrics.probes_ok.fetch_add(1, Ordering::Relaxed);
        }
        a.last_token = Some(now);
        if !a.job.ignore_eos && tokenizer.is_eog(id) {
            return Some(Finish::Stop);
        }
        a.generated += 1;
        let logprob = a
            .job
            .top_logprobs
            .map(|k| token_logprob(tokenizer, logits, id, k));
        let piece = a.decoder.push(id);
        let (text, stopped) = scan_stop(&mut a.held, &piece, &a.job.stop);
        let _ = a.job.events.send(Event::Delta { text, logprob });
        if stopped {
            return Some(Finish::Stop);
        }
        if a.generated >= a.job.max_tokens {
            return Some(Finish::Length);
        }
        a.next = Some(id);
        None
    }

    fn finish(&mut self, i: usize, finish: Finish) {
        let Some(mut a) = self.slots[i].take() else {
            return;
        };
        self.cache.remove_seq(a.seq);
        let mut tail = std::mem::take(&mut a.held);
        tail.push_str(&a.decoder.finish());
        if finish == Finish::Length && !tail.is_empty() {
            let _ = a.job.events.send(Event::Delta {
                text: tail,
                logprob: None,
            });
        }
        if !a.job.probe {
            self.state
                .metrics
                .e2e(a.job.enqueued.elapsed().as_secs_f64());
        }
        let _ = a.job.events.send(Event::Done {
            finish,
            prompt_tokens: a.job.prompt.len(),
            completion_tokens: a.generated,
        });
    }

    fn finish_failed(&mut self, i: usize, reason: String) {
        if let Some(a) = self.slots[i].take() {
            self.cache.remove_seq(a.seq);
            let _ = a.job.events.send(Event::Failed(reason));
        }
    }
}

/// Append `piece` to the held-back text and return what can be sent now, and whether a stop
/// string was reached (the text before it is sent, the stop string and everything after it
/// are not). Text that might be the beginning of a stop string stays held until the next piece
/// decides it.
pub fn scan_stop(held: &mut String, piece: &str, stops: &[String]) -> (String, bool) {
    held.push_str(piece);
    if stops.is_empty() {
        return (std::mem::take(held), false);
    }
    if let Some(at) = stops.iter().filter_map(|s| held.find(s.as_str())).min() {
        let out = held[..at].to_string();
        held.clear();
        return (out, true);
    }
    // The longest suffix of `held` that is a proper prefix of a stop string.
    let mut keep = 0;
    for s in stops {
        for k in (1..s.len()).rev() {
            if k <= keep {
                break;
            }
            if s.is_char_boundary(k) && held.ends_with(&s[..k]) {
                keep = k;
                break;
            }
        }
    }
    let cut = held.len() - keep;
    let out = held[..cut].to_string();
    held.drain(..cut);
    (out, false)
}

/// Log-softmax of `logits` at `id`, and the `k` most likely tokens with theirs.
fn token_logprob(tok: &Tokenizer, logits: &[f32], id: u32, k: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    let log_z = f64::from(max) + sum.ln();
    let lp = |i: u32| {
        logits
            .get(i as usize)
            .map_or(f32::NEG_INFINITY, |&l| (f64::from(l) - log_z) as f32)
    };
    let text = |i: u32| {
        let bytes = tok.token_bytes(i);
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    };
    // The k largest, highest first (ties: lower id first).
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if l.is_nan() {
                continue;
            }
            if top.len() == k && top.last().is_some_and(|&(_, m)| l <= m) {
                continue;
            }
            let at = top.partition_point(|&(_, m)| m >= l);
            top.insert(at, (i as u32, l));
            top.truncate(k);
        }
    }
    let (token, bytes) = text(id);
    TokenLogprob {
        id,
        token,
        bytes,
        logprob: lp(id),
        top: top
            .into_iter()
            .map(|(i, _)| {
                let (t, b) = text(i);
                (i, t, b, lp(i))
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_stops(pieces: &[&str], stops: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut held = String::new();
        let mut out = String::new();
        for p in pieces {
            let (t, stopped) = scan_stop(&mut held, p, &stops);
            out.push_str(&t);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&held);
        (out, false)
    }

    #[test]
    fn stop_strings_across_pieces() {
        assert_eq!(
            run_stops(&["Hel", "lo wo", "rld"], &["o w"]),
            ("Hell".into(), true)
        );
        assert_eq!(run_stops(&["ab", "c"], &["bd"]), ("abc".into(), false));
        assert_eq!(
            run_stops(&["x\n", "\ny"], &["\n\n", "zz"]),
            ("x".into(), true)
        );
        assert_eq!(run_stops(&["STOP"], &["STOP"]), ("".into(), true));
        assert_eq!(run_stops(&["a", "b"], &[]), ("ab".into(), false));
        // Multi-byte: a held prefix ends on a character boundary.
        assert_eq!(run_stops(&["é", "è"], &["éa"]), ("éè".into(), false));
    }

    #[test]
    fn held_text_is_only_a_possible_stop_start() {
        let stops = vec!["END".to_string()];
        let mut held = String::new();
        assert_eq!(
            scan_stop(&mut held, "the E", &stops),
            ("the ".into(), false)
        );
        assert_eq!(held, "E");
        assert_eq!(scan_stop(&mut held, "x", &stops), ("Ex".into(), false));
        assert!(held.is_empty());
    }
}
