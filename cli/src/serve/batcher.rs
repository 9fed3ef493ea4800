//! The engine thread: continuous batching over the core's ragged batches, on the model whole
//! ([`Engine`]) or tensor-parallel (`--tp N`, [`engine::tp::TpEngine`]), both through
//! [`BatchEngine`].
//!
//! One thread owns the model, the backends and one cache shared by every running request.
//! Each request is a sequence (its slot index is its sequence id) in that cache. Every step:
//!
//! 1. requests whose client went away (their event channel is closed: the response stream or
//!    the waiting handler was dropped) are cancelled and their cells freed;
//! 2. waiting requests join the running batch while slots are free (between decode steps, never
//!    in the middle of one);
//! 3. the [`Scheduler`] plans the step (up to `prefill_chunk` prompt tokens of the sequences
//!    still prefilling, long prompts spanning several steps, and for each decoding sequence its
//!    next sampled token, or with `--spec tree` a draft tree rooted at it) and one batch is
//!    built from the plan (a tree's nodes under its root; a root alone when its policy decodes
//!    plainly);
//! 4. one forward; each sequence that asked for logits samples its next token with its own
//!    sampler, or walks its verified tree (the target's draw at each node, the lossless
//!    acceptance of [`engine::spec`]), checks end-of-generation, stop strings and its token
//!    limit at every token, sends the newly complete text to its client, and reports the
//!    sampled token or the tree's accepted path back to the scheduler;
//! 5. the batch's cells are committed, or with trees compacted to the accepted paths; finished
//!    sequences are removed from the cache.
//!
//! The readiness probe is an ordinary request through this same loop; with speculation it asks
//! for two tokens, and only a token from a speculative round makes the server ready.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use engine::exec::{AnyEngine, BatchEngine};
use engine::model::Model;
use engine::runtime::{Batch, Logits};
use engine::sampling::{Sampler, SamplerConfig};
use engine::spec::verify::push_tree;
use engine::spec::{
    measure_cost, CostCurve, CostMode, Flow, ModelProposer, NgramProposer, Policy, Proposer,
    SamplerTarget, SpecConfig, SpecError, Speculation, Tree,
};
use engine::tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use super::chat::ChatTemplate;
use super::hooks::Hooks;
use super::scheduler::{Scheduler, Work};
use super::{AppState, ModelInfo};
use crate::generate::Draft;

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

/// `--spec tree` as the engine thread runs it.
#[derive(Debug, Clone)]
pub struct SpecSetup {
    pub cfg: SpecConfig,
    pub draft: Draft,
    /// Tokens of history a drafter keeps.
    pub window: usize,
}

/// Engine-thread settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_path: std::path::PathBuf,
    /// Device, threads, tensor-parallel ranks, weight placement.
    pub engine: crate::engine_args::EngineArgs,
    pub spec: Option<SpecSetup>,
    pub max_batch: usize,
    /// Positions per sequence (prompt + generated).
    pub ctx: usize,
    pub prefill_chunk: usize,
    pub hooks: Hooks,
}

/// Load the model, publish its tokenizer and template, then batch until shutdown.
pub fn run(cfg: EngineConfig, state: Arc<AppState>, rx: Receiver<Job>) -> Result<()> {
    let r = load_and_serve(&cfg, &state, &rx);
    if let Err(e) = &r {
        state
            .ready
            .failed(format!("the model could not be loaded: {e:#}"));
    }
    r
}

fn load_and_serve(cfg: &EngineConfig, state: &Arc<AppState>, rx: &Receiver<Job>) -> Result<()> {
    let (model, tokenizer, template) = load(cfg)?;
    let engine = cfg.engine.open(&model)?;
    let draft_model = match cfg.spec.as_ref().map(|s| &s.draft) {
        Some(Draft::Model(path)) => Some(crate::generate::load_drafter(path, &model)?),
        _ => None,
    };
    let draft_engine = match (cfg.spec.as_ref().map(|s| &s.draft), &draft_model) {
        (Some(Draft::SelfLayers(n)), _) => Some(
            engine
                .self_draft(*n)
                .with_context(|| format!("self-draft of the first {n} layers"))?,
        ),
        (Some(Draft::Model(_)), Some(dm)) => Some(
            engine
                .on_same_device(dm)
                .context("preparing the draft model")?,
        ),
        _ => None,
    };
    let loaded = Loaded {
        tokenizer: Arc::new(tokenizer),
        template: Some(template),
        draft: draft_engine.as_ref(),
    };
    serve_on(&engine, loaded, cfg, state, rx)
}

/// What the loop needs besides the target engine.
struct Loaded<'d, 'm> {
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    /// The drafter of `--draft self:N` or `model:FILE`.
    draft: Option<&'d AnyEngine<'m>>,
}

fn serve_on<E: BatchEngine>(
    engine: &E,
    mut loaded: Loaded<'_, '_>,
    cfg: &EngineConfig,
    state: &Arc<AppState>,
    rx: &Receiver<Job>,
) -> Result<()> {
    // Each sequence's committed cells, and during a speculative step its tree beyond them.
    let tree_cells = cfg.spec.as_ref().map_or(0, |s| s.cfg.shape.budget + 1);
    let cells = cfg
        .ctx
        .saturating_add(tree_cells)
        .saturating_mul(cfg.max_batch);
    let mut cache = engine
        .new_cache(cells, cfg.engine.kv_dtype())
        .context("creating the KV cache")?;
    let cost = match &cfg.spec {
        Some(s) if s.cfg.adaptive && s.cfg.shape.budget > 0 => Some(
            // Every tree node's head row is computed in the batch's one forward.
            measure_cost(
                engine,
                &mut cache,
                0,
                s.cfg.shape.budget + 1,
                2,
                CostMode::WholeForward,
            )
            .context("measuring the cost of verifying n tokens")?,
        ),
        _ => None,
    };
    let model = engine.model();
    let template = loaded
        .template
        .take()
        .context("the chat template was taken")?;
    tracing::info!(
        engine = engine.describe(),
        chat_template = template.source().describe(),
        max_batch = cfg.max_batch,
        ctx = cfg.ctx,
        spec = ?cfg.spec.as_ref().map(|s| (&s.draft, s.cfg.shape.budget, s.cfg.adaptive)),
        "model loaded"
    );
    let _ = state.info.set(ModelInfo {
        tokenizer: loaded.tokenizer.clone(),
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
        engine,
        tokenizer: &loaded.tokenizer,
        cache,
        sched: Scheduler::new(cfg.max_batch, cfg.prefill_chunk),
        state,
        cfg,
        draft: loaded.draft,
        cost,
    };
    b.run(rx);
    Ok(())
}

type LoadedModel = (Model, Tokenizer, ChatTemplate);

fn load(cfg: &EngineConfig) -> Result<LoadedModel> {
    let model = cfg.engine.load_model(&cfg.model_path)?;
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
    Ok((model, tokenizer, template))
}

/// What the loop reads while a sequence emits a token.
#[derive(Clone, Copy)]
struct Env<'a> {
    tokenizer: &'a Tokenizer,
    state: &'a AppState,
    /// Whether this token proves the whole request path works (with speculation, only tokens
    /// of a speculative round do: the first token comes from the prefill alone).
    proves_ready: bool,
}

/// A sequence's output side: its text so far and what was sent of it.
struct Emitter<'t> {
    generated: usize,
    decoder: StreamDecoder<'t>,
    /// Text not sent yet because it may be the start of a stop string.
    held: String,
    /// A stop string ended the sequence (what follows it, decoder leftovers included, is not
    /// part of the output).
    stop_matched: bool,
    last_token: Option<Instant>,
}

impl Emitter<'_> {
    /// Emit sampled token `id` (drawn from `logits`): `None` to go on, or how the sequence ends
    /// and whether `id` is part of the output.
    fn emit(&mut self, job: &Job, id: u32, logits: &[f32], env: Env<'_>) -> Option<(Finish, Flow)> {
        let metrics = &env.state.metrics;
        let now = Instant::now();
        if env.proves_ready {
            env.state.ready.token_produced();
        }
        if !job.probe {
            match self.last_token {
                None => metrics.ttft(now.duration_since(job.enqueued).as_secs_f64()),
                Some(t) => metrics.itl(now.duration_since(t).as_secs_f64()),
            }
            metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
        } else if self.last_token.is_none() {
            metrics.probes_ok.fetch_add(1, Ordering::Relaxed);
        }
        self.last_token = Some(now);
        if !job.ignore_eos && env.tokenizer.is_eog(id) {
            return Some((Finish::Stop, Flow::StopBefore));
        }
        self.generated += 1;
        let logprob = job
            .top_logprobs
            .map(|k| token_logprob(env.tokenizer, logits, id, k));
        let piece = self.decoder.push(id);
        let (text, stopped) = scan_stop(&mut self.held, &piece, &job.stop);
        let _ = job.events.send(Event::Delta { text, logprob });
        if stopped {
            self.stop_matched = true;
            return Some((Finish::Stop, Flow::Stop));
        }
        if self.generated >= job.max_tokens {
            return Some((Finish::Length, Flow::Stop));
        }
        None
    }
}

/// The text a sequence still owes its client when it ends: what was held as a possible start
/// of a stop string that never came, and the decoder's leftover bytes — whether it ended by
/// length or by end-of-generation (an EOG right after a held "\n" with stop "\n\n" must not
/// lose the "\n"). After a stop string nothing is owed: the text after it is not output.
fn final_text(held: &mut String, stop_matched: bool, leftover: impl FnOnce() -> String) -> String {
    if stop_matched {
        held.clear();
        return String::new();
    }
    let mut tail = std::mem::take(held);
    tail.push_str(&leftover());
    tail
}

/// A running request beside its scheduling state (which the [`Scheduler`] holds).
struct Active<'t> {
    job: Job,
    sampler: Sampler,
    emitter: Emitter<'t>,
    spec: Option<Speculation<'t>>,
}

/// What a sequence with tokens in this step's batch reads back from the forward.
enum Readback {
    /// Nothing: a prompt chunk before the prompt's last token.
    Nothing,
    /// The logits of this batch index (a prompt's last token or a decode token), to sample.
    Row(usize),
    /// Its draft tree, the root at this batch index, to walk.
    Tree(Tree, usize),
}

/// What one step decided for a sequence.
enum Outcome {
    Go,
    Finish(Finish),
    Fail(String),
}

struct Batcher<'a, 'm, E: BatchEngine> {
    engine: &'a E,
    tokenizer: &'a Tokenizer,
    cache: E::Cache,
    /// The running sequences and the policy that feeds them.
    sched: Scheduler<Active<'a>>,
    state: &'a AppState,
    cfg: &'a EngineConfig,
    draft: Option<&'a AnyEngine<'m>>,
    /// The adaptive policy's measured verify cost.
    cost: Option<CostCurve>,
}

impl<'a, 'm, E: BatchEngine> Batcher<'a, 'm, E> {
    fn run(&mut self, rx: &Receiver<Job>) {
        loop {
            if self.state.shutdown.load(Ordering::Relaxed) {
                return;
            }
            self.drop_cancelled();
            // The gauge follows every change, a cancellation that empties the batch included
            // (the loop then waits for work without stepping).
            self.state
                .metrics
                .running
                .store(self.n_active(), Ordering::Relaxed);
            if self.n_active() == 0 {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(job) => self.admit(job),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while self.sched.has_free_slot() {
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
        self.sched.n_active()
    }

    fn env(&self, proves_ready: bool) -> Env<'a> {
        Env {
            tokenizer: self.tokenizer,
            state: self.state,
            proves_ready,
        }
    }

    /// A fresh drafter and policy for a sequence, when speculating.
    fn seq_spec(&self, prompt: &[u32]) -> Result<Option<Speculation<'a>>, String> {
        let Some(setup) = &self.cfg.spec else {
            return Ok(None);
        };
        let proposer: Box<dyn Proposer + 'a> = match (&setup.draft, self.draft) {
            (Draft::Ngram, _) => Box::new(NgramProposer::new(setup.window)),
            (Draft::SelfLayers(n), Some(de)) => Box::new(
                ModelProposer::new(de, setup.window, format!("self:{n}"))
                    .map_err(|e| format!("starting the drafter: {e}"))?,
            ),
            (Draft::Model(p), Some(de)) => Box::new(
                ModelProposer::new(de, setup.window, format!("model:{}", p.display()))
                    .map_err(|e| format!("starting the drafter: {e}"))?,
            ),
            (d, None) => return Err(format!("the drafter {d:?} was not prepared")),
        };
        let mut seq = Speculation::new(proposer, setup.cfg.shape, prompt);
        if let Some(c) = &self.cost {
            seq.set_policy(Policy::new(setup.cfg.shape.budget, c.clone()));
        }
        Ok(Some(seq))
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
        let n_prompt = job.prompt.len();
        if let Err(e) = self.sched.check_admit(n_prompt) {
            // The caller admits only while a slot is free, and the routes refuse empty prompts.
            let _ = job.events.send(Event::Failed(e.to_string()));
            return;
        }
        let spec = match self.seq_spec(&job.prompt) {
            Ok(s) => s,
            Err(reason) => {
                let _ = job.events.send(Event::Failed(reason));
                return;
            }
        };
        let probe = job.probe;
        let speculates = spec.is_some();
        let active = Active {
            sampler: Sampler::new(job.sampler),
            job,
            emitter: Emitter {
                generated: 0,
                decoder: self.tokenizer.stream_decoder(),
                held: String::new(),
                stop_matched: false,
                last_token: None,
            },
            spec,
        };
        match self.sched.admit(n_prompt, speculates, active) {
            Ok(_) if !probe => {
                self.state
                    .metrics
                    .prompt_tokens
                    .fetch_add(n_prompt as u64, Ordering::Relaxed);
            }
            Ok(_) => {}
            Err((e, a)) => {
                let _ = a.job.events.send(Event::Failed(e.to_string()));
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let gone: Vec<usize> = self
            .sched
            .occupied()
            .filter(|(_, a)| a.job.events.is_closed())
            .map(|(i, _)| i)
            .collect();
        for i in gone {
            if let Some((seq, a)) = self.sched.remove(i) {
                self.engine.remove_seq(&mut self.cache, seq);
                self.state.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    seq,
                    generated = a.emitter.generated,
                    "client went away; cancelled"
                );
            }
        }
    }

    /// Put one planned item into `batch`: its tokens, or the tree drafted for its root.
    fn push_work(&mut self, batch: &mut Batch, work: &Work) -> Result<Readback, String> {
        let slot = work.slot();
        let a = self
            .sched
            .get_mut(slot)
            .ok_or_else(|| format!("expected a sequence in slot {slot}, found a free slot"))?;
        match *work {
            Work::Prefill {
                seq,
                ref range,
                pos0,
                logits_for_last,
                ..
            } => {
                let tokens = a.job.prompt.get(range.clone()).ok_or_else(|| {
                    format!(
                        "expected prompt tokens {range:?}, found a prompt of {} tokens",
                        a.job.prompt.len()
                    )
                })?;
                let mut row = None;
                let first = batch.len();
                for (k, &t) in tokens.iter().enumerate() {
                    let last = logits_for_last && k + 1 == tokens.len();
                    let idx = batch.push(t, pos0 + k as u32, seq, last);
                    if last {
                        row = Some(idx);
                    }
                }
                if engine::faults::is_active(engine::faults::Fault::ServeRowOfNeighbour)
                    && first > 0
                {
                    row = row.map(|_| first - 1);
                }
                Ok(row.map_or(Readback::Nothing, Readback::Row))
            }
            Work::Decode {
                seq, token, pos, ..
            } => Ok(Readback::Row(batch.push(token, pos, seq, true))),
            Work::Speculate { seq, root, pos, .. } => {
                let s = a.spec.as_mut().ok_or_else(|| {
                    format!(
                        "drafting: a tree was planned for slot {slot}, which does not speculate"
                    )
                })?;
                let tree = s.draft().map_err(|e| format!("drafting: {e}"))?;
                match tree.tokens().first() {
                    Some(&r) if r == root => {}
                    found => {
                        return Err(format!(
                            "drafting: expected a tree rooted at the pending token {root}, found root {found:?}"
                        ))
                    }
                }
                let base = push_tree(batch, &tree, seq, pos, true);
                Ok(Readback::Tree(tree, base))
            }
        }
    }

    /// One step: the scheduler's plan becomes one batch and one forward, then every sequence
    /// in it samples (or walks its verified tree) and reports back, the cells it keeps are
    /// kept, and finished sequences leave.
    fn step(&mut self) {
        let plan = self.sched.plan();
        let mut batch = Batch::new();
        let mut outcomes: Vec<(usize, Outcome)> = Vec::new();
        // The sequences with tokens in the batch, in slot order, and what each reads back.
        let mut fed: Vec<(usize, Readback)> = Vec::with_capacity(plan.len());
        for work in &plan {
            match self.push_work(&mut batch, work) {
                Ok(r) => fed.push((work.slot(), r)),
                Err(reason) => outcomes.push((work.slot(), Outcome::Fail(reason))),
            }
        }
        if batch.is_empty() {
            self.apply(outcomes);
            return;
        }
        let logits = match self.forward(&batch) {
            Ok(l) => l,
            Err(reason) => {
                outcomes.extend(fed.iter().map(|&(i, _)| (i, Outcome::Fail(reason.clone()))));
                self.apply(outcomes);
                return;
            }
        };
        // Tree nodes are kept only on the accepted path; everything else of the batch is kept.
        let mut keep: Vec<bool> = vec![true; batch.len()];
        let any_tree = fed.iter().any(|(_, r)| matches!(r, Readback::Tree(..)));
        for (i, readback) in fed {
            match self.read_back(i, readback, &logits, &mut keep) {
                Outcome::Go => {}
                o => outcomes.push((i, o)),
            }
        }
        let kept = if any_tree {
            let keep: Vec<usize> = (0..batch.len()).filter(|&k| keep[k]).collect();
            self.engine.compact(&mut self.cache, &keep)
        } else {
            self.engine.commit(&mut self.cache);
            Ok(())
        };
        if let Err(e) = kept {
            // The cache no longer matches any sequence's text: every running one is lost.
            let reason = format!("keeping the accepted cells: {e}");
            self.generation_failed(&reason);
            outcomes = self
                .sched
                .occupied()
                .map(|(i, _)| (i, Outcome::Fail(reason.clone())))
                .collect();
        }
        self.apply(outcomes);
    }

    /// The step's forward (or the test hooks' delay and failure).
    fn forward(&mut self, batch: &Batch) -> Result<Logits, String> {
        if let Some(d) = self.cfg.hooks.step_delay {
            std::thread::sleep(d);
        }
        let result = match self.cfg.hooks.broken() {
            Some(reason) => Err(reason),
            None => self
                .engine
                .forward_batch(&mut self.cache, batch)
                .map_err(|e| format!("forward of a batch of {} tokens: {e}", batch.len())),
        };
        if let Err(reason) = &result {
            self.generation_failed(reason);
        }
        result
    }

    fn generation_failed(&self, reason: &str) {
        tracing::error!(%reason, "generation failed");
        self.state
            .ready
            .failed(format!("generation failed: {reason}"));
    }

    /// Sequence `i`'s share of the forward: sample from its row or walk its tree, emit, and
    /// report to the scheduler; a tree's nodes off the accepted path are cleared in `keep`.
    fn read_back(
        &mut self,
        i: usize,
        readback: Readback,
        logits: &Logits,
        keep: &mut [bool],
    ) -> Outcome {
        let env_round = self.env(true);
        let env_plain = self.env(self.cfg.spec.is_none());
        let Some(a) = self.sched.get_mut(i) else {
            return Outcome::Go;
        };
        match readback {
            Readback::Nothing => Outcome::Go,
            Readback::Tree(tree, base) => {
                keep[base..base + tree.len()].fill(false);
                let w = match walk_tree(a, &tree, base, logits, env_round) {
                    Ok(w) => w,
                    Err(e) => return Outcome::Fail(format!("verifying the draft tree: {e}")),
                };
                for &n in &w.path {
                    keep[base + n] = true;
                }
                match (w.finish, w.next) {
                    (Some(f), _) => Outcome::Finish(f),
                    (None, Some(next)) => match self.sched.accepted(i, w.path.len(), next) {
                        Ok(()) => Outcome::Go,
                        Err(e) => Outcome::Fail(format!("scheduling: {e}")),
                    },
                    (None, None) => Outcome::Fail(
                        "verifying the draft tree: expected a next token from the acceptance \
                         walk, found none"
                            .into(),
                    ),
                }
            }
            Readback::Row(row) => {
                let Some(l) = logits.of_token(row) else {
                    return Outcome::Fail(format!(
                        "the forward returned no logits for batch row {row}"
                    ));
                };
                let id = a.sampler.sample(l, &[]);
                if let Some((finish, _)) = a.emitter.emit(&a.job, id, l, env_plain) {
                    return Outcome::Finish(finish);
                }
                if let Some(s) = a.spec.as_mut() {
                    s.push_token(id);
                }
                match self.sched.sampled(i, id) {
                    Ok(()) => Outcome::Go,
                    Err(e) => Outcome::Fail(format!("scheduling: {e}")),
                }
            }
        }
    }

    fn apply(&mut self, outcomes: Vec<(usize, Outcome)>) {
        for (i, o) in outcomes {
            match o {
                Outcome::Go => {}
                Outcome::Finish(f) => self.finish(i, f),
                Outcome::Fail(reason) => self.finish_failed(i, reason),
            }
        }
    }

    fn finish(&mut self, i: usize, finish: Finish) {
        let Some((seq, mut a)) = self.sched.remove(i) else {
            return;
        };
        self.engine.remove_seq(&mut self.cache, seq);
        let e = &mut a.emitter;
        let tail = final_text(&mut e.held, e.stop_matched, || e.decoder.finish());
        if !tail.is_empty() {
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
            completion_tokens: a.emitter.generated,
        });
    }

    fn finish_failed(&mut self, i: usize, reason: String) {
        if let Some((seq, a)) = self.sched.remove(i) {
            self.engine.remove_seq(&mut self.cache, seq);
            let _ = a.job.events.send(Event::Failed(reason));
        }
    }
}

/// A verified tree's walk as the loop reports it.
struct TreeWalk {
    /// The accepted path (tree nodes, the root first).
    path: Vec<usize>,
    /// The last token emitted: the next tree's root.
    next: Option<u32>,
    /// How the sequence ends, if it does.
    finish: Option<Finish>,
}

/// Walk sequence `a`'s verified tree (its nodes at batch indices `base..`): the target's draw at
/// each visited node, emitted through the sequence's emitter, down the matching child.
fn walk_tree(
    a: &mut Active<'_>,
    tree: &Tree,
    base: usize,
    logits: &Logits,
    env: Env<'_>,
) -> Result<TreeWalk, SpecError> {
    let Active {
        job,
        sampler,
        emitter,
        spec,
    } = a;
    let s = spec
        .as_mut()
        .ok_or_else(|| SpecError::Config("a tree for a sequence that does not speculate".into()))?;
    let node_logits = |node: usize| {
        logits
            .of_token(base + node)
            .ok_or_else(|| SpecError::Config(format!("no logits for tree node {node}")))
    };
    let at = std::cell::Cell::new(0usize);
    let mut row = |node: usize| {
        at.set(node);
        node_logits(node)
    };
    let mut finish = None;
    let mut emit = |_: &[u32], token: u32| {
        let l = node_logits(at.get()).unwrap_or(&[]);
        match emitter.emit(job, token, l, env) {
            None => Flow::Continue,
            Some((f, flow)) => {
                finish = Some(f);
                flow
            }
        }
    };
    let mut target = SamplerTarget::new(&mut row, sampler);
    let w = s.accept(tree, &mut target, &mut emit)?;
    let m = &env.state.metrics;
    m.spec_rounds.fetch_add(1, Ordering::Relaxed);
    m.spec_drafted
        .fetch_add(tree.n_draft() as u64, Ordering::Relaxed);
    m.spec_accepted
        .fetch_add((w.path.len() - 1) as u64, Ordering::Relaxed);
    Ok(TreeWalk {
        next: w.emitted.last().copied(),
        path: w.path,
        finish,
    })
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
    let found = |s: &String| {
        if engine::faults::is_active(engine::faults::Fault::ServeStopInOnePiece) {
            let newest = held.len() - piece.len();
            return held[newest..].find(s.as_str()).map(|i| newest + i);
        }
        held.find(s.as_str())
    };
    if let Some(at) = stops.iter().filter_map(found).min() {
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

    /// The bug issue 28 found: text held as a possible stop-string start was dropped when the
    /// sequence ended by end-of-generation instead of by length.
    #[test]
    fn held_text_is_owed_at_the_end_unless_a_stop_string_ended_it() {
        let stops = vec!["\n\n".to_string()];
        let mut held = String::new();
        let (sent, stopped) = scan_stop(&mut held, "Paris.\n", &stops);
        assert_eq!((sent.as_str(), stopped), ("Paris.", false));
        assert_eq!(held, "\n");
        // End-of-generation (or length) now: the held "\n" and the decoder's leftover are owed.
        let mut h = held.clone();
        assert_eq!(
            final_text(&mut h, false, || "\u{fffd}".into()),
            "\n\u{fffd}"
        );
        assert!(h.is_empty());
        // A stop string ended it: nothing after it is output, leftovers included.
        let mut h = held.clone();
        let (sent, stopped) = scan_stop(&mut h, "\nMore", &stops);
        assert_eq!((sent.as_str(), stopped), ("", true));
        assert_eq!(final_text(&mut h, true, || "x".into()), "");
    }

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

    /// Issue 28: two stop strings matching the same held text — the earliest match ends the
    /// text, whichever string it is and in whatever order they were given; two possible starts
    /// held at once are both kept until a piece decides them.
    #[test]
    fn two_stop_strings_in_the_same_held_text() {
        for stops in [["o wo", "lo w"], ["lo w", "o wo"]] {
            assert_eq!(
                run_stops(&["Hel", "l", "o", " w", "orld"], &stops),
                ("Hel".into(), true),
                "{stops:?}"
            );
        }
        // "ab" and "abc" both match at the same place: nothing of either is sent.
        assert_eq!(run_stops(&["xa", "bc"], &["abc", "ab"]), ("x".into(), true));
        // "aXb" and "bYc": after "a", "X" and "b" ... the held text is a possible start of both
        // ("aXb" needs nothing more than "b"; "b" starts "bYc"); "Z" frees all of it.
        let stops = vec!["aXbQ".to_string(), "bY".to_string()];
        let mut held = String::new();
        assert_eq!(scan_stop(&mut held, "-aX", &stops), ("-".into(), false));
        assert_eq!(scan_stop(&mut held, "b", &stops), ("".into(), false));
        assert_eq!(held, "aXb");
        assert_eq!(scan_stop(&mut held, "Z", &stops), ("aXbZ".into(), false));
        assert!(held.is_empty());
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
