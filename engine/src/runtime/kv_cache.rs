//! The KV cache: cells (rows) shared by every sequence, each tagged with its sequence and
//! position; the rows themselves live on the backend, one [`Backend::Kv`] per layer.
//!
//! Attention selects cells by sequence and position ([`super::Mask`]), never by row index, so a
//! cell can sit anywhere. A forward writes its tokens to free cells as *pending*; the caller
//! then [`commit`](KvCache::commit)s them (plain decoding), [`rollback`](KvCache::rollback)s
//! them (an error, a rejected draft) or [`compact`](KvCache::compact)s them (tree speculation:
//! keep the accepted path, moved into the lowest free cells, drop the rest).
//!
//! Sliding-window layers keep the whole history; the window is part of the mask. The MLA cache
//! holds the latent form (the normed compressed kv and the roped shared key, `kv_lora_rank +
//! qk_rope` values per cell, no values row) that DeepSeek-V3/Kimi K2 serve from; attention
//! expands it with `attn_kv_b`.
//!
//! A model with DeepSeek Sparse Attention (`glm-dsa`) has a second row per cell and layer: the
//! lightning indexer's key ([`KvLayout::index_width`] values), in its own backend layer beside
//! the latent one. The same cells, so it follows every allocation, commit, rollback and
//! compaction of the cache (the indexer of a shared layer writes nothing to its row).

use super::backend::{Backend, CellMeta, KvDtype, SeqId};
use super::RuntimeError;

/// The shape of a cache: its layers and the row widths of a cell (the model layer computes it,
/// `crate::model::ModelConfig::kv_layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    /// Values per key row of a cell (`n_head_kv × head_dim_k`, or MLA's latent row).
    pub k_width: usize,
    /// Values per value row (0 for MLA, whose values are expanded from the latent row).
    pub v_width: usize,
    /// Values per indexer key row (DeepSeek Sparse Attention's `indexer.key_length`), 0 for a
    /// model without an indexer.
    pub index_width: usize,
}

/// What a scheduler, a session or a drafter reads and changes of a cache's cells, whatever the
/// cache holds them in: one [`KvCache`], one per tensor-parallel rank (all with the same cells),
/// or either on any device. Compaction moves rows, so it needs the backend: it is the engine's
/// (`crate::exec::BatchEngine::compact`).
pub trait SeqCache {
    /// Every cell's sequence, position and state.
    fn cells(&self) -> &[CellMeta];
    /// Cells written by the last forward and not yet committed, in batch order.
    fn pending(&self) -> &[u32];
    /// The position after `seq`'s last cell (0 if it has none).
    fn next_pos(&self, seq: SeqId) -> u32;
    /// Committed cells of `seq`.
    fn seq_len(&self, seq: SeqId) -> usize;
    fn capacity(&self) -> usize;
    fn used(&self) -> usize;
    fn dtype(&self) -> KvDtype;
    /// Keep every pending cell.
    fn commit(&mut self);
    /// Drop every pending cell.
    fn rollback(&mut self);
    /// Forget `seq`'s positions `from..`.
    fn truncate(&mut self, seq: SeqId, from: u32);
    /// Forget `seq`'s positions below `before` (a sliding draft window).
    fn forget_before(&mut self, seq: SeqId, before: u32);
    /// Forget every committed cell of `seq`.
    fn remove_seq(&mut self, seq: SeqId);
    /// Forget everything.
    fn clear(&mut self);
}

impl<B: Backend> SeqCache for KvCache<B> {
    fn cells(&self) -> &[CellMeta] {
        KvCache::cells(self)
    }
    fn pending(&self) -> &[u32] {
        KvCache::pending(self)
    }
    fn next_pos(&self, seq: SeqId) -> u32 {
        KvCache::next_pos(self, seq)
    }
    fn seq_len(&self, seq: SeqId) -> usize {
        KvCache::seq_len(self, seq)
    }
    fn capacity(&self) -> usize {
        KvCache::capacity(self)
    }
    fn used(&self) -> usize {
        KvCache::used(self)
    }
    fn dtype(&self) -> KvDtype {
        KvCache::dtype(self)
    }
    fn commit(&mut self) {
        KvCache::commit(self)
    }
    fn rollback(&mut self) {
        KvCache::rollback(self)
    }
    fn truncate(&mut self, seq: SeqId, from: u32) {
        KvCache::truncate(self, seq, from)
    }
    fn forget_before(&mut self, seq: SeqId, before: u32) {
        KvCache::forget_before(self, seq, before)
    }
    fn remove_seq(&mut self, seq: SeqId) {
        KvCache::remove_seq(self, seq)
    }
    fn clear(&mut self) {
        KvCache::clear(self)
    }
}

/// Keys and values of every cached token, for every layer.
pub struct KvCache<B: Backend> {
    layers: Vec<B::Kv>,
    /// The lightning indexer's key rows, one backend layer per model layer (empty without one).
    index: Vec<B::Kv>,
    cells: Vec<CellMeta>,
    /// Free cells, highest first (so `pop` gives the lowest).
    free: Vec<u32>,
    /// Cells written by the last forward and not yet committed, in batch order.
    pending: Vec<u32>,
    capacity: usize,
    dtype: KvDtype,
}

impl<B: Backend> std::fmt::Debug for KvCache<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("cells", &self.cells.len())
            .field("used", &self.used())
            .field("pending", &self.pending.len())
            .field("capacity", &self.capacity)
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl<B: Backend> KvCache<B> {
    /// An empty cache of at most `capacity` cells, shaped by `layout`.
    pub fn new(
        be: &B,
        layout: KvLayout,
        capacity: usize,
        dtype: KvDtype,
    ) -> Result<KvCache<B>, RuntimeError> {
        let layers = (0..layout.n_layers)
            .map(|_| be.kv_new(layout.k_width, layout.v_width, dtype))
            .collect::<Result<_, _>>()?;
        let index = if layout.index_width > 0 {
            (0..layout.n_layers)
                .map(|_| be.kv_new(layout.index_width, 0, dtype))
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        Ok(KvCache {
            layers,
            index,
            cells: Vec::new(),
            free: Vec::new(),
            pending: Vec::new(),
            capacity,
            dtype,
        })
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Cells in use (committed and pending).
    pub fn used(&self) -> usize {
        self.cells.len() - self.free.len()
    }

    /// Every cell's metadata (attention reads it).
    pub fn cells(&self) -> &[CellMeta] {
        &self.cells
    }

    /// Cells written by the last forward and not yet committed, in batch order.
    pub fn pending(&self) -> &[u32] {
        &self.pending
    }

    /// The next position of `seq`: one past its highest committed position (0 when empty).
    pub fn next_pos(&self, seq: SeqId) -> u32 {
        self.cells
            .iter()
            .filter(|c| c.seq == seq && c.batch == CellMeta::COMMITTED)
            .map(|c| c.pos + 1)
            .max()
            .unwrap_or(0)
    }

    /// Committed cells of `seq`.
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.cells
            .iter()
            .filter(|c| c.seq == seq && c.batch == CellMeta::COMMITTED)
            .count()
    }

    pub(crate) fn layer(&self, il: usize) -> Option<&B::Kv> {
        self.layers.get(il)
    }

    pub(crate) fn layer_mut(&mut self, il: usize) -> Option<&mut B::Kv> {
        self.layers.get_mut(il)
    }

    /// Layer `il`'s indexer key rows (a model with a lightning indexer).
    pub(crate) fn index_layer(&self, il: usize) -> Option<&B::Kv> {
        self.index.get(il)
    }

    pub(crate) fn index_layer_mut(&mut self, il: usize) -> Option<&mut B::Kv> {
        self.index.get_mut(il)
    }

    /// Take `n` free cells for a forward's tokens (lowest first), tagged with their batch
    /// index, sequence and position. Fails without change when the cache would overflow.
    pub(crate) fn allocate(
        &mut self,
        be: &B,
        seqs: &[SeqId],
        positions: &[u32],
    ) -> Result<Vec<u32>, RuntimeError> {
        let n = seqs.len();
        debug_assert!(
            self.pending.is_empty(),
            "Engine::forward checks pending cells"
        );
        if self.used() + n > self.capacity {
            return Err(RuntimeError::ContextFull {
                n_past: self.used(),
                n_new: n,
                n_ctx: self.capacity,
            });
        }
        let grow = n.saturating_sub(self.free.len());
        if grow > 0 {
            let new_len = self.cells.len() + grow;
            for kv in self.layers.iter_mut().chain(&mut self.index) {
                be.kv_reserve(kv, new_len)?;
            }
            let first = self.cells.len() as u32;
            self.cells.resize(
                new_len,
                CellMeta {
                    pos: 0,
                    seq: CellMeta::FREE,
                    batch: CellMeta::COMMITTED,
                },
            );
            self.free.extend((first..new_len as u32).rev());
            self.free.sort_unstable_by(|a, b| b.cmp(a));
        }
        let mut out = Vec::with_capacity(n);
        for (i, (&seq, &pos)) in seqs.iter().zip(positions).enumerate() {
            let Some(c) = self.free.pop() else {
                unreachable!("free cells were reserved above")
            };
            self.cells[c as usize] = CellMeta {
                pos,
                seq,
                batch: i as u32,
            };
            out.push(c);
        }
        self.pending = out.clone();
        Ok(out)
    }

    fn release(&mut self, cell: u32) {
        if let Some(c) = self.cells.get_mut(cell as usize) {
            c.seq = CellMeta::FREE;
            c.batch = CellMeta::COMMITTED;
            self.free.push(cell);
        }
    }

    fn sort_free(&mut self) {
        self.free.sort_unstable_by(|a, b| b.cmp(a));
    }

    /// Keep every pending cell.
    pub fn commit(&mut self) {
        for &c in &self.pending {
            self.cells[c as usize].batch = CellMeta::COMMITTED;
        }
        self.pending.clear();
    }

    /// Drop every pending cell (the cache is as before the last forward).
    pub fn rollback(&mut self) {
        for c in std::mem::take(&mut self.pending) {
            self.release(c);
        }
        self.sort_free();
    }

    /// Keep the pending cells of batch tokens `keep` (in that order, e.g. an accepted
    /// root-to-leaf path), drop the other pending cells, and move the kept rows into the
    /// lowest free cells, so that a sequence decoded by speculation is laid out as plain
    /// decoding would have laid it out. Positions are those the tokens were run at.
    pub fn compact(&mut self, be: &B, keep: &[usize]) -> Result<(), RuntimeError> {
        let pending = std::mem::take(&mut self.pending);
        let mut seen = vec![false; pending.len()];
        for &k in keep {
            match seen.get_mut(k) {
                Some(s) if !*s => *s = true,
                _ => {
                    self.pending = pending;
                    return Err(RuntimeError::BadCompact {
                        index: k,
                        n_pending: seen.len(),
                    });
                }
            }
        }
        for (i, &c) in pending.iter().enumerate() {
            if !seen[i] {
                self.release(c);
            }
        }
        // Every kept cell leaves its place too; then they are placed in order at the lowest
        // free cells (possibly their own).
        let kept: Vec<(u32, CellMeta)> = keep
            .iter()
            .map(|&k| (pending[k], self.cells[pending[k] as usize]))
            .collect();
        for &(c, _) in &kept {
            self.release(c);
        }
        self.sort_free();
        let mut moves = Vec::new();
        for (from, meta) in kept {
            let Some(to) = self.free.pop() else {
                unreachable!("each kept cell freed one")
            };
            self.cells[to as usize] = CellMeta {
                batch: CellMeta::COMMITTED,
                ..meta
            };
            if to != from {
                moves.push((from, to));
            }
        }
        // `kv_move` reads every source before it writes, so the order of `keep` is free.
        if !moves.is_empty() {
            for kv in &mut self.layers {
                be.kv_move(kv, &moves)?;
            }
            for kv in &mut self.index {
                be.kv_move(kv, &moves)?;
            }
        }
        Ok(())
    }

    /// Forget the committed positions `from..` of `seq` (and nothing pending).
    pub fn truncate(&mut self, seq: SeqId, from: u32) {
        let drop: Vec<u32> = (0..self.cells.len() as u32)
            .filter(|&i| {
                let c = self.cells[i as usize];
                c.seq == seq && c.batch == CellMeta::COMMITTED && c.pos >= from
            })
            .collect();
        for c in drop {
            self.release(c);
        }
        self.sort_free();
    }

    /// Forget the committed positions `..before` of `seq` (a sliding draft window: attention
    /// then sees only the positions kept; the positions of what is kept do not change).
    pub fn forget_before(&mut self, seq: SeqId, before: u32) {
        let drop: Vec<u32> = (0..self.cells.len() as u32)
            .filter(|&i| {
                let c = self.cells[i as usize];
                c.seq == seq && c.batch == CellMeta::COMMITTED && c.pos < before
            })
            .collect();
        for c in drop {
            self.release(c);
        }
        self.sort_free();
    }

    /// Forget every cell of `seq`.
    pub fn remove_seq(&mut self, seq: SeqId) {
        self.truncate(seq, 0);
    }

    /// Forget everything.
    pub fn clear(&mut self) {
        self.pending.clear();
        for c in &mut self.cells {
            c.seq = CellMeta::FREE;
            c.batch = CellMeta::COMMITTED;
        }
        self.free = (0..self.cells.len() as u32).rev().collect();
    }
}
