//! [`Engine`]: a model prepared on a backend, and the forward over a [`Batch`].

use crate::model::{forward, Model, Weights};
use crate::taps::{TapObserver, Taps};

use crate::runtime::{Backend, KvDtype};
use crate::runtime::{Batch, KvCache, Logits, RuntimeError, Shared};

/// The last layer's residual stream of a forward's tokens ([`Engine::forward_hidden`]), on the
/// backend.
pub struct Hidden<B: Backend> {
    buf: B::Buf,
    n: usize,
}

impl<B: Backend> Hidden<B> {
    /// Tokens (rows).
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// A model with its weights prepared on one backend. Cheap to share: every [`KvCache`] and
/// [`super::Session`] runs on it.
pub struct Engine<'m, B: Backend + 'm> {
    model: &'m Model,
    backend: Shared<'m, B>,
    weights: Weights<'m, B>,
}

impl<'m, B: Backend + 'm> Engine<'m, B> {
    /// Prepare every weight of `model` on `backend` (once), which the caller keeps.
    pub fn new(model: &'m Model, backend: &'m B) -> Result<Engine<'m, B>, RuntimeError> {
        Self::shared(model, Shared::Borrowed(backend))
    }

    /// [`Engine::new`] on a backend the engine keeps (so the engine borrows only the model).
    pub fn owning(model: &'m Model, backend: B) -> Result<Engine<'m, B>, RuntimeError> {
        Self::shared(model, Shared::Owned(std::sync::Arc::new(backend)))
    }

    fn shared(model: &'m Model, backend: Shared<'m, B>) -> Result<Engine<'m, B>, RuntimeError> {
        let weights = Weights::prepare(model, &*backend)?;
        Ok(Engine {
            model,
            backend,
            weights,
        })
    }

    /// Prepare only the first `n_layers` layers of `model` (with its embedding and head): the
    /// target's own first layers as a self-draft model. Its caches have `n_layers` layers.
    pub fn with_layers(
        model: &'m Model,
        backend: &'m B,
        n_layers: usize,
    ) -> Result<Engine<'m, B>, RuntimeError> {
        let backend = Shared::Borrowed(backend);
        if n_layers == 0 || n_layers > model.config().n_layer {
            return Err(RuntimeError::Shape {
                op: "self-draft layers (1 ..= the model's layers)",
                expected: model.config().n_layer,
                found: n_layers,
            });
        }
        let weights = Weights::prepare_layers(model, &*backend, n_layers)?;
        Ok(Engine {
            model,
            backend,
            weights,
        })
    }

    /// Layers this engine runs (all of the model's, or a self-draft's first few).
    pub fn n_layers(&self) -> usize {
        self.weights.n_layers()
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// An empty cache for this model of at most `capacity` cells.
    pub fn new_cache(&self, capacity: usize, dtype: KvDtype) -> Result<KvCache<B>, RuntimeError> {
        KvCache::new(
            &*self.backend,
            self.model.config().kv_layout(self.weights.n_layers()),
            capacity,
            dtype,
        )
    }

    /// The layers of [`Engine::forward`] without the output head: the last layer's residual
    /// stream for every batch token, to send any subset of rows through [`Engine::head`] later
    /// (tree verification computes logits only for the nodes the acceptance walk visits). The
    /// batch's cells are pending in `cache` as after `forward`; on error nothing is left pending.
    pub fn forward_hidden(
        &self,
        cache: &mut KvCache<B>,
        batch: &Batch,
    ) -> Result<Hidden<B>, RuntimeError> {
        let (model, weights, backend) = (self.model, &self.weights, &*self.backend);
        let buf = self.guarded(cache, |cache| {
            backend.scoped(|| {
                let mut taps = Taps::new(None);
                forward::forward_hidden(model, weights, backend, cache, batch, &mut taps)
            })
        })?;
        Ok(Hidden {
            buf,
            n: batch.len(),
        })
    }

    /// Run `f` on a cache with nothing pending; on error leave nothing pending.
    fn guarded<T>(
        &self,
        cache: &mut KvCache<B>,
        f: impl FnOnce(&mut KvCache<B>) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        if !cache.pending().is_empty() {
            return Err(RuntimeError::PendingCells {
                n: cache.pending().len(),
            });
        }
        f(cache).inspect_err(|_| cache.rollback())
    }

    /// Logits of rows `rows` (batch indices, ascending) of `hidden`, in one pass over the
    /// head's weights.
    pub fn head(&self, hidden: &Hidden<B>, rows: &[usize]) -> Result<Logits, RuntimeError> {
        let rows: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let (model, weights, backend) = (self.model, &self.weights, &*self.backend);
        let (data, rows) = backend.scoped(|| {
            let mut taps = Taps::new(None);
            forward::head(
                model,
                weights,
                backend,
                &hidden.buf,
                hidden.n,
                &rows,
                &mut taps,
            )
        })?;
        Ok(Logits::of_rows(data, &rows, self.model.config().n_vocab))
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
        let (model, weights, backend) = (self.model, &self.weights, &*self.backend);
        let (data, rows) = self.guarded(cache, |cache| match taps {
            // Every pass without taps runs inside the backend's scope (`Backend::scoped`); with
            // taps it cannot, as an observer need not be `Send`.
            None => backend.scoped(|| {
                forward::forward(model, weights, backend, cache, batch, &mut Taps::new(None))
            }),
            Some(t) => {
                let mut taps = Taps::new(Some(t));
                forward::forward(model, weights, backend, cache, batch, &mut taps)
            }
        })?;
        Ok(Logits::of_rows(data, &rows, self.model.config().n_vocab))
    }
}
