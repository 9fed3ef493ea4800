//! [`BatchEngine`]: everything a caller drives an engine with — a session, the server's
//! scheduler, tree speculation, the verify cases — whatever the device and the topology: a
//! whole model on one backend ([`Engine`]), its tensor-parallel ranks
//! ([`crate::tp::TpEngine`]), or either on any device ([`super::AnyEngine`]).

use crate::model::Model;
use crate::runtime::{Backend, Batch, KvCache, KvDtype, Logits, RuntimeError, SeqCache, SeqId};
use crate::taps::TapObserver;
use crate::tp::{TpCache, TpEngine};

use super::{Engine, Hidden};

/// A prepared model that runs ragged batches (chains and draft trees of many sequences) against
/// a cache of its own kind.
pub trait BatchEngine {
    /// The cache every sequence of a batch lives in.
    type Cache: SeqCache;
    /// The last layer's residual stream of a forward's tokens, for [`BatchEngine::head`].
    type Hidden;

    fn model(&self) -> &Model;

    /// Layers this engine runs (all of the model's, or a self-draft's first few).
    fn n_layers(&self) -> usize;

    /// An empty cache of at most `capacity` cells (per rank, for tensor parallelism).
    fn new_cache(&self, capacity: usize, dtype: KvDtype) -> Result<Self::Cache, RuntimeError>;

    /// Run `batch`: every token at its position in its sequence, attending to its sequence's
    /// cached cells and (chain or tree) to its ancestors in the batch. The batch's keys and
    /// values become pending cells of `cache`, to commit, compact or roll back; on error nothing
    /// is left pending. With `taps`, every tap of `docs/TAPS.md` is emitted for the batch's
    /// tokens, in batch order, at full shape.
    fn forward(
        &self,
        cache: &mut Self::Cache,
        batch: &Batch,
        taps: Option<&mut dyn TapObserver>,
    ) -> Result<Logits, RuntimeError>;

    /// [`BatchEngine::forward`] without taps.
    fn forward_batch(
        &self,
        cache: &mut Self::Cache,
        batch: &Batch,
    ) -> Result<Logits, RuntimeError> {
        self.forward(cache, batch, None)
    }

    /// The layers of a forward without the output head, to send any subset of rows through
    /// [`BatchEngine::head`] later (tree verification computes logits only for the nodes the
    /// acceptance walk visits). The batch's cells are pending as after `forward`.
    fn forward_hidden(
        &self,
        cache: &mut Self::Cache,
        batch: &Batch,
    ) -> Result<Self::Hidden, RuntimeError>;

    /// Logits of rows `rows` (batch indices, ascending) of `hidden`.
    fn head(&self, hidden: &Self::Hidden, rows: &[usize]) -> Result<Logits, RuntimeError>;

    /// Keep the pending cells of batch tokens `keep` (moved into the lowest free cells), drop
    /// the others.
    fn compact(&self, cache: &mut Self::Cache, keep: &[usize]) -> Result<(), RuntimeError>;

    /// The device as a short name for reports: `cpu-avx512`, `cuda:0 sm_90`.
    fn device_name(&self) -> String;

    /// Host threads the engine computes with (every rank's).
    fn threads(&self) -> usize;

    /// A short description for logs: `cpu-avx512 2 threads`, `tp2 shm (2 threads in all)`.
    fn describe(&self) -> String;

    /// The communicator of a tensor-parallel engine (`shm`), `None` for a whole one.
    fn communicator(&self) -> Option<&'static str> {
        None
    }

    /// Keep every pending cell.
    fn commit(&self, cache: &mut Self::Cache) {
        cache.commit();
    }

    /// Forget every committed cell of `seq`.
    fn remove_seq(&self, cache: &mut Self::Cache, seq: SeqId) {
        cache.remove_seq(seq);
    }
}

impl<'m, B: Backend + 'm> BatchEngine for Engine<'m, B> {
    type Cache = KvCache<B>;
    type Hidden = Hidden<B>;

    fn model(&self) -> &Model {
        Engine::model(self)
    }

    fn n_layers(&self) -> usize {
        Engine::n_layers(self)
    }

    fn new_cache(&self, capacity: usize, dtype: KvDtype) -> Result<KvCache<B>, RuntimeError> {
        Engine::new_cache(self, capacity, dtype)
    }

    fn forward(
        &self,
        cache: &mut KvCache<B>,
        batch: &Batch,
        taps: Option<&mut dyn TapObserver>,
    ) -> Result<Logits, RuntimeError> {
        Engine::forward(self, cache, batch, taps)
    }

    fn forward_hidden(
        &self,
        cache: &mut KvCache<B>,
        batch: &Batch,
    ) -> Result<Hidden<B>, RuntimeError> {
        Engine::forward_hidden(self, cache, batch)
    }

    fn head(&self, hidden: &Hidden<B>, rows: &[usize]) -> Result<Logits, RuntimeError> {
        Engine::head(self, hidden, rows)
    }

    fn compact(&self, cache: &mut KvCache<B>, keep: &[usize]) -> Result<(), RuntimeError> {
        cache.compact(self.backend(), keep)
    }

    fn device_name(&self) -> String {
        self.backend().name()
    }

    fn threads(&self) -> usize {
        self.backend().threads()
    }

    fn describe(&self) -> String {
        let be = self.backend();
        format!("{} {} threads", be.name(), be.threads())
    }
}

/// The rows a [`TpEngine`] has no separate head pass for: a tensor-parallel `forward_hidden`
/// runs the head on every token at once (the head's rows are split over the ranks, so one pass
/// over all rows costs each rank its share), and `head` picks rows from it.
pub struct TpHidden {
    logits: Logits,
}

impl<'t, B: Backend + 't> BatchEngine for TpEngine<'t, B> {
    type Cache = TpCache<B>;
    type Hidden = TpHidden;

    fn model(&self) -> &Model {
        self.tp_model().model()
    }

    fn n_layers(&self) -> usize {
        self.tp_model().model().config().n_layer
    }

    fn new_cache(&self, capacity: usize, dtype: KvDtype) -> Result<TpCache<B>, RuntimeError> {
        TpEngine::new_cache(self, capacity, dtype)
    }

    fn forward(
        &self,
        cache: &mut TpCache<B>,
        batch: &Batch,
        taps: Option<&mut dyn TapObserver>,
    ) -> Result<Logits, RuntimeError> {
        TpEngine::forward(self, cache, batch, taps)
    }

    fn forward_hidden(
        &self,
        cache: &mut TpCache<B>,
        batch: &Batch,
    ) -> Result<TpHidden, RuntimeError> {
        let logits = TpEngine::forward(self, cache, &batch.with_all_logits(), None)?;
        Ok(TpHidden { logits })
    }

    fn head(&self, hidden: &TpHidden, rows: &[usize]) -> Result<Logits, RuntimeError> {
        let all = &hidden.logits;
        let mut data = Vec::with_capacity(rows.len() * all.n_vocab);
        for &r in rows {
            let row = all.of_token(r).ok_or(RuntimeError::Shape {
                op: "head row (a batch index of the forward)",
                expected: all.n_rows,
                found: r,
            })?;
            data.extend_from_slice(row);
        }
        Ok(Logits {
            data,
            n_rows: rows.len(),
            n_vocab: all.n_vocab,
            tokens: rows.to_vec(),
        })
    }

    fn compact(&self, cache: &mut TpCache<B>, keep: &[usize]) -> Result<(), RuntimeError> {
        cache.compact(self.backends(), keep)
    }

    fn device_name(&self) -> String {
        self.backends()
            .first()
            .map_or_else(String::new, Backend::name)
    }

    fn threads(&self) -> usize {
        self.backends().iter().map(Backend::threads).sum()
    }

    fn communicator(&self) -> Option<&'static str> {
        Some(self.comm_kind())
    }

    fn describe(&self) -> String {
        format!(
            "tp{} {} {} ({} threads in all)",
            self.tp_model().degree(),
            self.comm_kind(),
            self.device_name(),
            self.threads()
        )
    }
}
