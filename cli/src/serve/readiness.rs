//! Readiness: `/ready` is 200 only once a real generation of at least one token has gone
//! through the path requests take (queue → engine loop → sampled token → response channel), and
//! again only while that stays true: a failed generation turns it 503 at once, and when no token
//! has been produced for a while the prober runs a fresh generation (TGI's health check and
//! SGLang's `/health_generate` do the same; a process that merely answers is `/health`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Loading,
    /// Loaded; the first generation has not produced a token yet.
    Warming,
    Ready,
    /// The last generation (probe or request) failed, or the model could not be loaded.
    NotReady(String),
}

#[derive(Debug)]
struct Inner {
    state: State,
    last_token: Option<Instant>,
}

/// Shared between the engine thread, the prober and the handlers.
#[derive(Debug)]
pub struct Readiness {
    inner: Mutex<Inner>,
    model: String,
}

impl Readiness {
    pub fn new(model: String) -> Readiness {
        Readiness {
            inner: Mutex::new(Inner {
                state: State::Loading,
                last_token: None,
            }),
            model,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        // A poisoned lock only means a panic elsewhere while holding it; the state is a plain
        // value, still meaningful.
        let mut g = match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut g)
    }

    pub fn state(&self) -> State {
        self.with(|i| i.state.clone())
    }

    pub fn is_ready(&self) -> bool {
        self.state() == State::Ready
    }

    /// `None` when ready, otherwise why not.
    pub fn reason(&self) -> Option<String> {
        match self.state() {
            State::Ready => None,
            State::Loading => Some(format!("loading model {}", self.model)),
            State::Warming => Some(
                "warming up: the first generation through the request path has not produced a token yet"
                    .to_string(),
            ),
            State::NotReady(r) => Some(r),
        }
    }

    pub fn loaded(&self) {
        self.with(|i| {
            if i.state == State::Loading {
                i.state = State::Warming;
            }
        });
    }

    /// A token came out of the request path.
    pub fn token_produced(&self) {
        self.with(|i| {
            i.last_token = Some(Instant::now());
            i.state = State::Ready;
        });
    }

    /// A generation failed (or the model could not be loaded).
    pub fn failed(&self, reason: String) {
        self.with(|i| i.state = State::NotReady(reason));
    }

    /// Time since the last token (`None` before the first).
    pub fn idle_for(&self) -> Option<Duration> {
        self.with(|i| i.last_token.map(|t| t.elapsed()))
    }
}
