//! [`Session`]: one sequence being decoded, with its own KV cache, on any [`BatchEngine`]
//! (whole or tensor-parallel, any device): the simple way to run a prompt and decode.

use crate::model::Model;
use crate::runtime::{Batch, KvDtype, RuntimeError, SeqCache};
use crate::taps::TapObserver;

use crate::runtime::Logits;

use super::BatchEngine;

/// The sequence id a [`Session`] uses in its cache.
const SEQ: u32 = 0;

/// One sequence on one engine: the KV cache and the position.
pub struct Session<'e, E: BatchEngine + ?Sized> {
    engine: &'e E,
    cache: E::Cache,
    n_ctx: usize,
    logits_all: bool,
}

impl<'e, E: BatchEngine + ?Sized> Session<'e, E> {
    /// A session of at most `n_ctx` positions (not capped at the training context: a model may
    /// run past it, with the usual loss of quality), with an f32 cache.
    pub fn new(engine: &'e E, n_ctx: usize) -> Result<Self, RuntimeError> {
        Self::with_cache(engine, n_ctx, KvDtype::F32)
    }

    /// [`Session::new`] with the cache stored as `dtype`.
    pub fn with_cache(engine: &'e E, n_ctx: usize, dtype: KvDtype) -> Result<Self, RuntimeError> {
        Ok(Session {
            engine,
            cache: engine.new_cache(n_ctx, dtype)?,
            n_ctx,
            logits_all: false,
        })
    }

    /// Return logits for every token of each call (perplexity) instead of the last only
    /// (generation).
    pub fn set_logits_all(&mut self, all: bool) {
        self.logits_all = all;
    }

    /// Positions already in the cache.
    pub fn n_past(&self) -> usize {
        self.cache.next_pos(SEQ) as usize
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn model(&self) -> &Model {
        self.engine.model()
    }

    pub fn engine(&self) -> &'e E {
        self.engine
    }

    pub fn cache(&self) -> &E::Cache {
        &self.cache
    }

    /// Forget positions `n..` (e.g. to start a new window).
    pub fn truncate(&mut self, n: usize) {
        self.cache.truncate(SEQ, n as u32);
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
        // Empty input, bad ids and a full context (the cache holds `n_ctx` cells) are refused
        // by the forward.
        let batch = Batch::chain(SEQ, self.n_past() as u32, tokens, self.logits_all);
        let logits = self.engine.forward(&mut self.cache, &batch, taps)?;
        self.engine.commit(&mut self.cache);
        Ok(logits)
    }
}
