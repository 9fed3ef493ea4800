//! [`Engine`]: a model prepared on a backend, and the forward over a [`Batch`].

use crate::model::{forward, Model, Weights};
use crate::taps::{TapObserver, Taps};

use super::backend::{Backend, KvDtype};
use super::{Batch, KvCache, RuntimeError};

/// Logits of a forward call: `n_rows` rows of `n_vocab`, one per batch token that asked for
/// logits (`tokens[i]` is row `i`'s batch index).
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    pub data: Vec<f32>,
    pub n_rows: usize,
    pub n_vocab: usize,
    /// The batch index of each row.
    pub tokens: Vec<usize>,
}

impl Logits {
    /// Row `i` (`0..n_rows`).
    pub fn row(&self, i: usize) -> &[f32] {
        self.data
            .get(i * self.n_vocab..(i + 1) * self.n_vocab)
            .unwrap_or(&[])
    }

    /// The row of batch token `index`, if it asked for logits.
    pub fn of_token(&self, index: usize) -> Option<&[f32]> {
        self.tokens
            .iter()
            .position(|&t| t == index)
            .map(|i| self.row(i))
    }

    /// The last row.
    pub fn last(&self) -> &[f32] {
        self.row(self.n_rows.saturating_sub(1))
    }
}

/// A model with its weights prepared on one backend. Cheap to share: every [`KvCache`] and
/// [`super::Session`] runs on it.
pub struct Engine<'m, B: Backend + 'm> {
    model: &'m Model,
    backend: &'m B,
    weights: Weights<'m, B>,
}

impl<'m, B: Backend + 'm> Engine<'m, B> {
    /// Prepare every weight of `model` on `backend` (once).
    pub fn new(model: &'m Model, backend: &'m B) -> Result<Engine<'m, B>, RuntimeError> {
        Ok(Engine {
            model,
            backend,
            weights: Weights::prepare(model, backend)?,
        })
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    pub fn backend(&self) -> &'m B {
        self.backend
    }

    /// An empty cache for this model of at most `capacity` cells.
    pub fn new_cache(&self, capacity: usize, dtype: KvDtype) -> Result<KvCache<B>, RuntimeError> {
        KvCache::new(self.backend, self.model.config(), capacity, dtype)
    }

    /// Run `batch`: every token at its position in its sequence, attending to its sequence's
    /// cached cells and (chain or tree) to its ancestors in the batch. The batch's keys and
    /// values become pending cells of `cache`, to [`KvCache::commit`], [`KvCache::compact`] or
    /// [`KvCache::rollback`]; on error nothing is left pending. With `taps`, every tap of
    /// `docs/TAPS.md` is emitted for the batch's tokens, in batch order.
    pub fn forward(
        &self,
        cache: &mut KvCache<B>,
        batch: &Batch,
        taps: Option<&mut dyn TapObserver>,
    ) -> Result<Logits, RuntimeError> {
        if !cache.pending().is_empty() {
            return Err(RuntimeError::PendingCells {
                n: cache.pending().len(),
            });
        }
        let mut taps = Taps::new(taps);
        match forward::forward(
            self.model,
            &self.weights,
            self.backend,
            cache,
            batch,
            &mut taps,
        ) {
            Ok((data, rows)) => Ok(Logits {
                data,
                n_rows: rows.len(),
                n_vocab: self.model.config().n_vocab,
                tokens: rows.into_iter().map(|r| r as usize).collect(),
            }),
            Err(e) => {
                cache.rollback();
                Err(e)
            }
        }
    }
}
