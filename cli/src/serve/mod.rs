//! `plumbline serve`: an OpenAI-compatible HTTP server (axum on tokio) that says it is ready
//! only when it can generate.
//!
//! - [`routes`]: `POST /v1/completions`, `POST /v1/chat/completions` (both streaming as SSE
//!   ending in `data: [DONE]`), `GET /v1/models`, `/health` (the process answers), `/ready`
//!   (a real generation went through the request path), `/metrics` (Prometheus text).
//! - [`api`]: request bodies and their validation; [`error`]: OpenAI error objects.
//! - [`batcher`]: the engine thread, continuous batching over the core's ragged batches (the
//!   model whole or `--tp N` ranks), tree speculation per sequence with `--spec tree`,
//!   cancellation when a client goes away; [`scheduler`]: its scheduling policy (admission,
//!   prefill chunks under the token budget, decode and speculation items, the bookkeeping after
//!   a step), model-free and unit-tested.
//! - [`readiness`] and the prober below; [`chat`]: the chat template (minijinja);
//!   [`metrics`]; [`hooks`]: test-only fault and delay hooks.
//!
//! The listener is bound before the model loads, so `/health` and `/ready` (503, "loading")
//! answer from the first second; the address is printed on stdout as
//! `listening on http://HOST:PORT` (with `--port 0` the system picks the port).

pub mod api;
pub mod batcher;
pub mod chat;
pub mod error;
pub mod hooks;
pub mod metrics;
pub mod readiness;
pub mod routes;
pub mod scheduler;

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use engine::sampling::SamplerConfig;
use engine::tokenizer::Tokenizer;

use crate::engine_args::EngineArgs;
use crate::generate::{Draft, SpecArgs, SpecKind};
use batcher::{EngineConfig, Event, Job, SpecSetup};
use chat::ChatTemplate;
use error::ApiError;
use hooks::Hooks;
use metrics::Metrics;
use readiness::{Readiness, State};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model file (any shard of a split set)
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed on stdout)
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Most sequences decoded together in one batch
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Positions per sequence: prompt plus generated tokens
    #[arg(long, default_value_t = 2048)]
    pub ctx: usize,
    /// Most requests waiting for a batch slot; one more is answered 429
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Most prompt tokens prefilled in one engine step (longer prompts take several)
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Largest request body in bytes; a larger one is answered 413
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a request body may take to arrive (408 after)
    #[arg(long, default_value_t = 30)]
    pub body_timeout_secs: u64,
    /// Seconds without a generated token after which /ready re-probes with a real generation
    #[arg(long, default_value_t = 30)]
    pub ready_idle_secs: u64,
    /// Seconds a readiness probe may take before /ready reports it failed
    #[arg(long, default_value_t = 120)]
    pub probe_timeout_secs: u64,
    /// The model id clients name (default: the file name without `.gguf`)
    #[arg(long)]
    pub model_name: Option<String>,
}

/// What the handlers need of the loaded model.
pub struct ModelInfo {
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub n_vocab: usize,
    pub arch: String,
}

/// Server settings the handlers read.
#[derive(Debug, Clone)]
pub struct Config {
    pub model_id: String,
    pub ctx: usize,
    pub queue: usize,
    pub max_body_bytes: usize,
    pub body_timeout: Duration,
    pub ready_idle: Duration,
    pub probe_timeout: Duration,
    /// Tokens a readiness probe generates: 1, or 2 with speculation (the second comes from a
    /// speculative round).
    pub probe_tokens: usize,
}

/// Shared by the handlers, the prober and the engine thread.
pub struct AppState {
    pub cfg: Config,
    pub info: OnceLock<ModelInfo>,
    queue: SyncSender<Job>,
    pub ready: Readiness,
    pub metrics: Metrics,
    pub shutdown: AtomicBool,
    next_id: AtomicU64,
    started: Instant,
}

impl AppState {
    /// Put `job` in the bounded queue: 429 when it is full, 503 when the engine has stopped.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        // Counted before the send so that the engine's decrement never comes first.
        self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        match self.queue.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                Err(match e {
                    TrySendError::Full(_) => ApiError::queue_full(self.cfg.queue),
                    TrySendError::Disconnected(_) => {
                        ApiError::unavailable("the engine has stopped")
                    }
                })
            }
        }
    }

    /// A fresh number for response ids and default seeds.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The model, or 503 with the readiness reason while it loads.
    pub fn model(&self) -> Result<&ModelInfo, ApiError> {
        self.info.get().ok_or_else(|| {
            ApiError::unavailable(
                self.ready
                    .reason()
                    .unwrap_or_else(|| "the model is not loaded".into()),
            )
        })
    }

    /// A seed for requests that give none: different per request, and not the same across
    /// restarts.
    pub fn fresh_seed(&self) -> u64 {
        let mut s = self.started.elapsed().as_nanos() as u64 ^ (self.next_id() << 32);
        engine::sampling::splitmix64(&mut s)
    }
}

pub fn run(args: Args) -> Result<()> {
    let hooks = Hooks::from_env()?;
    if args.max_batch == 0 || args.queue == 0 || args.prefill_chunk == 0 {
        bail!(
            "--max-batch, --queue and --prefill-chunk must be at least 1, found {}, {}, {}",
            args.max_batch,
            args.queue,
            args.prefill_chunk
        );
    }
    if args.ctx < 2 {
        bail!(
            "--ctx must be at least 2 (a prompt token and a generated one), found {}",
            args.ctx
        );
    }
    args.engine.topology()?;
    args.engine.device()?;
    if args.spec.spec.is_some() && args.spec.head_rows != crate::generate::HeadRowsArg::Auto {
        bail!(
            "--head-rows does not apply to the server: it computes every tree node's head row \
             in the batch's one forward"
        );
    }
    spec_setup(&args.spec)?;
    if hooks.is_active() {
        tracing::warn!(?hooks, "{} is set: test hooks active", hooks::ENV_VAR);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(serve(args, hooks))
}

async fn serve(args: Args, hooks: Hooks) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on http://{addr}")?;
        out.flush()?;
    }
    tracing::info!(%addr, model = %args.model.display(), "listening; loading the model");

    let model_id = args.model_name.clone().unwrap_or_else(|| {
        args.model
            .file_name()
            .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_else(|| "model".into())
    });
    let (tx, rx) = sync_channel(args.queue);
    let state = Arc::new(AppState {
        cfg: Config {
            model_id,
            ctx: args.ctx,
            queue: args.queue,
            max_body_bytes: args.max_body_bytes,
            body_timeout: Duration::from_secs(args.body_timeout_secs),
            ready_idle: Duration::from_secs(args.ready_idle_secs.max(1)),
            probe_timeout: Duration::from_secs(args.probe_timeout_secs.max(1)),
            probe_tokens: if args.spec.spec.is_some() { 2 } else { 1 },
        },
        info: OnceLock::new(),
        queue: tx,
        ready: Readiness::new(args.model.display().to_string()),
        metrics: Metrics::default(),
        shutdown: AtomicBool::new(false),
        next_id: AtomicU64::new(1),
        started: Instant::now(),
    });

    let engine_cfg = EngineConfig {
        model_path: args.model.clone(),
        engine: args.engine.clone(),
        spec: spec_setup(&args.spec)?,
        max_batch: args.max_batch,
        ctx: args.ctx,
        prefill_chunk: args.prefill_chunk,
        hooks,
    };
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<Result<()>>();
    let engine_state = state.clone();
    std::thread::Builder::new()
        .name("plumbline-engine".into())
        .spawn(move || {
            let r = batcher::run(engine_cfg, engine_state, rx);
            let _ = done_tx.send(r);
        })
        .context("starting the engine thread")?;
    tokio::spawn(prober(state.clone()));

    let app = routes::router(state.clone());
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown_signal());
    let result = tokio::select! {
        r = server => r.context("serving HTTP"),
        r = done_rx => match r {
            Ok(Err(e)) => Err(e.context("the engine stopped")),
            Ok(Ok(())) => Err(anyhow!("the engine stopped")),
            Err(_) => Err(anyhow!("the engine thread ended without a result (it panicked)")),
        },
    };
    state.shutdown.store(true, Ordering::Relaxed);
    result
}

/// `--spec tree` and its options, checked.
fn spec_setup(args: &SpecArgs) -> Result<Option<SpecSetup>> {
    let Some(SpecKind::Tree) = args.spec else {
        return Ok(None);
    };
    let draft: Draft = args.draft.parse()?;
    let cfg = args.config();
    cfg.validate().context("--spec tree settings")?;
    if args.draft_window == 0 {
        bail!("--draft-window must be at least 1");
    }
    Ok(Some(SpecSetup {
        cfg,
        draft,
        window: args.draft_window,
    }))
}

async fn shutdown_signal() {
    if tokio::signal::ctrl_c().await.is_err() {
        // No signal handler could be installed: serve until killed.
        std::future::pending::<()>().await;
    }
    tracing::info!("shutting down");
}

/// The readiness prober: the warm-up generation once the model is loaded, a fresh one after
/// `ready_idle` without any generated token, and retries while not ready.
async fn prober(state: Arc<AppState>) {
    let mut last_probe: Option<Instant> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if state.shutdown.load(Ordering::Relaxed) {
            return;
        }
        let Some(info) = state.info.get() else {
            continue;
        };
        let idle = state.cfg.ready_idle;
        let since_probe = last_probe.map(|t| t.elapsed());
        let due = match state.ready.state() {
            State::Loading => false,
            State::Warming => last_probe.is_none(),
            State::Ready => {
                let busy = state.metrics.running.load(Ordering::Relaxed) > 0
                    || state.metrics.queue_depth.load(Ordering::Relaxed) > 0;
                !busy
                    && state.ready.idle_for().is_none_or(|d| d >= idle)
                    && since_probe.is_none_or(|d| d >= idle)
            }
            State::NotReady(_) => since_probe.is_none_or(|d| d >= idle),
        };
        if !due {
            continue;
        }
        last_probe = Some(Instant::now());
        match probe(&state, info).await {
            Ok(()) => tracing::debug!("readiness probe produced a token"),
            Err(ProbeError::Busy) => {}
            Err(ProbeError::Failed(reason)) => {
                state.metrics.probes_failed.fetch_add(1, Ordering::Relaxed);
                tracing::error!(%reason, "readiness probe failed");
                state
                    .ready
                    .failed(format!("readiness probe failed: {reason}"));
            }
        }
    }
}

enum ProbeError {
    /// The queue is full: requests are being served, nothing to conclude.
    Busy,
    Failed(String),
}

/// A greedy generation after "Hello" through the queue and the engine loop, as a request takes
/// (`probe_tokens` tokens, end-of-generation ignored), to its end.
async fn probe(state: &AppState, info: &ModelInfo) -> Result<(), ProbeError> {
    let prompt = info
        .tokenizer
        .encode("Hello", true, false)
        .map_err(|e| ProbeError::Failed(format!("tokenizing the probe prompt: {e}")))?;
    if prompt.is_empty() {
        return Err(ProbeError::Failed(
            "the probe prompt tokenizes to nothing".into(),
        ));
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let job = Job {
        prompt,
        max_tokens: state.cfg.probe_tokens,
        sampler: SamplerConfig::greedy(),
        stop: Vec::new(),
        top_logprobs: None,
        ignore_eos: true,
        events: tx,
        enqueued: Instant::now(),
        probe: true,
    };
    match state.submit(job) {
        Ok(()) => {}
        Err(e) if e.status.as_u16() == 429 => return Err(ProbeError::Busy),
        Err(e) => return Err(ProbeError::Failed(e.message)),
    }
    let expected = state.cfg.probe_tokens;
    let wait = async {
        loop {
            match rx.recv().await {
                Some(Event::Delta { .. }) => {}
                Some(Event::Done {
                    completion_tokens, ..
                }) if completion_tokens == expected => return Ok(()),
                Some(Event::Done {
                    completion_tokens, ..
                }) => {
                    return Err(ProbeError::Failed(format!(
                        "the probe ended after {completion_tokens} of {expected} tokens"
                    )))
                }
                Some(Event::Failed(reason)) => return Err(ProbeError::Failed(reason)),
                None => return Err(ProbeError::Failed("the engine dropped the probe".into())),
            }
        }
    };
    match tokio::time::timeout(state.cfg.probe_timeout, wait).await {
        Ok(r) => r,
        Err(_) => Err(ProbeError::Failed(format!(
            "no token within {} s",
            state.cfg.probe_timeout.as_secs()
        ))),
    }
}
