//! [`Session`]: one sequence being decoded, with its KV cache.

use crate::model::{forward, Model};
use crate::taps::{TapObserver, Taps};

use super::{Backend, KvCache, RuntimeError};

/// Logits of a forward call: `n_rows` rows of `n_vocab`, for the last token only or for every
/// token of the call (see [`Session::set_logits_all`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    pub data: Vec<f32>,
    pub n_rows: usize,
    pub n_vocab: usize,
}

impl Logits {
    /// Row `i` (`0..n_rows`).
    pub fn row(&self, i: usize) -> &[f32] {
        self.data
            .get(i * self.n_vocab..(i + 1) * self.n_vocab)
            .unwrap_or(&[])
    }

    /// The last token's logits.
    pub fn last(&self) -> &[f32] {
        self.row(self.n_rows.saturating_sub(1))
    }
}

/// One sequence on one model and backend: the KV cache and the position.
pub struct Session<'a> {
    model: &'a Model,
    backend: &'a dyn Backend,
    cache: KvCache,
    n_ctx: usize,
    logits_all: bool,
}

impl<'a> Session<'a> {
    /// A session of at most `n_ctx` positions (capped at nothing: a model may run past its
    /// training context, with the usual loss of quality).
    pub fn new(model: &'a Model, backend: &'a dyn Backend, n_ctx: usize) -> Session<'a> {
        Session {
            model,
            backend,
            cache: KvCache::new(model.config()),
            n_ctx,
            logits_all: false,
        }
    }

    /// Return logits for every token of each call (perplexity) instead of the last only
    /// (generation).
    pub fn set_logits_all(&mut self, all: bool) {
        self.logits_all = all;
    }

    /// Positions already in the cache.
    pub fn n_past(&self) -> usize {
        self.cache.len()
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn model(&self) -> &'a Model {
        self.model
    }

    pub fn backend(&self) -> &'a dyn Backend {
        self.backend
    }

    /// Forget positions `n..` (e.g. to start a new window).
    pub fn truncate(&mut self, n: usize) {
        self.cache.truncate(n);
    }

    /// Forget everything.
    pub fn reset(&mut self) {
        self.cache.clear();
    }

    /// Run `tokens` (all at once: a batched prefill, or one token of decode) at positions
    /// `n_past()..`, append them to the cache, and return their logits. With `taps`, every tap
    /// of `docs/TAPS.md` is emitted for these tokens. On error the cache is left as before.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        taps: Option<&mut dyn TapObserver>,
    ) -> Result<Logits, RuntimeError> {
        if tokens.is_empty() {
            return Err(RuntimeError::NoTokens);
        }
        let n_vocab = self.model.config().n_vocab;
        if let Some((index, &token)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= n_vocab)
        {
            return Err(RuntimeError::TokenOutOfRange {
                token,
                index,
                n_vocab,
            });
        }
        let n_past = self.cache.len();
        if n_past + tokens.len() > self.n_ctx {
            return Err(RuntimeError::ContextFull {
                n_past,
                n_new: tokens.len(),
                n_ctx: self.n_ctx,
            });
        }
        let mut taps = Taps::new(taps);
        match forward::forward(
            self.model,
            self.backend,
            &mut self.cache,
            tokens,
            &mut taps,
            self.logits_all,
        ) {
            Ok((data, n_rows)) => {
                self.cache.commit(tokens.len());
                Ok(Logits {
                    data,
                    n_rows,
                    n_vocab,
                })
            }
            Err(e) => {
                self.cache.truncate(n_past);
                Err(e)
            }
        }
    }
}
