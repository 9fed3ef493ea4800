//! [`BatchEngine`]: what a scheduler that keeps many sequences in one cache needs of an engine,
//! whole ([`Engine`]) or tensor-parallel ([`crate::tp::TpEngine`]), so that one batching loop
//! (the server's) runs on either.

use crate::model::Model;

use super::backend::{Backend, KvDtype, SeqId};
use super::{Batch, Engine, KvCache, Logits, RuntimeError};

/// A prepared model that runs ragged batches (chains and draft trees of many sequences) against
/// a cache of its own kind.
pub trait BatchEngine {
    /// The cache every sequence of a batch lives in.
    type Cache;

    fn model(&self) -> &Model;

    /// An empty cache of at most `capacity` cells (per rank, for tensor parallelism).
    fn new_cache(&self, capacity: usize, dtype: KvDtype) -> Result<Self::Cache, RuntimeError>;

    /// [`Engine::forward`] without taps: the batch's cells are pending in `cache` (none are on
    /// error).
    fn forward_batch(&self, cache: &mut Self::Cache, batch: &Batch)
        -> Result<Logits, RuntimeError>;

    /// Keep every pending cell.
    fn commit(&self, cache: &mut Self::Cache);

    /// [`KvCache::compact`]: keep the pending cells of batch tokens `keep`, drop the others.
    fn compact(&self, cache: &mut Self::Cache, keep: &[usize]) -> Result<(), RuntimeError>;

    /// Forget every committed cell of `seq`.
    fn remove_seq(&self, cache: &mut Self::Cache, seq: SeqId);

    /// A short description for logs: `cpu avx512 2 threads`, `tp2 shm`.
    fn describe(&self) -> String;
}

impl<'m, B: Backend + 'm> BatchEngine for Engine<'m, B> {
    type Cache = KvCache<B>;

    fn model(&self) -> &Model {
        Engine::model(self)
    }

    fn new_cache(&self, capacity: usize, dtype: KvDtype) -> Result<KvCache<B>, RuntimeError> {
        Engine::new_cache(self, capacity, dtype)
    }

    fn forward_batch(&self, cache: &mut KvCache<B>, batch: &Batch) -> Result<Logits, RuntimeError> {
        self.forward(cache, batch, None)
    }

    fn commit(&self, cache: &mut KvCache<B>) {
        cache.commit();
    }

    fn compact(&self, cache: &mut KvCache<B>, keep: &[usize]) -> Result<(), RuntimeError> {
        cache.compact(self.backend(), keep)
    }

    fn remove_seq(&self, cache: &mut KvCache<B>, seq: SeqId) {
        cache.remove_seq(seq);
    }

    fn describe(&self) -> String {
        let be = self.backend();
        format!("{} {} threads", be.name(), be.threads())
    }
}
