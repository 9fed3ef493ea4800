//! The [`Backend`] trait: the operations a forward pass is made of, on tensors the backend owns.
//!
//! A backend has four kinds of storage, all its own (host vectors for the CPU, device memory
//! for CUDA):
//! - [`Backend::Buf`]: f32 activations (and small vectors: norm weights, biases), row-major,
//!   one row per token. Buffers carry no shape: every op is told its dims and checks lengths.
//! - [`Backend::Ids`]: u32 indices (token ids, routed expert ids).
//! - [`Backend::Mat`]: a weight matrix (or a stack of expert matrices) as [`Backend::prepare`]
//!   made it from the file's bytes: the CPU borrows or repacks them, a GPU uploads them.
//! - [`Backend::Kv`]: one layer's KV rows ("cells"), f32 or f16.
//!
//! The forward pass (`model/forward.rs`) only calls these ops; it does no math of its own. Data
//! crosses to the host only by [`Backend::download`] (logits, and taps when an observer is
//! attached). Per-token metadata (positions, sequence ids, tree ancestors, cache cells) is
//! passed as host slices; a device backend uploads it once per op or per forward.
//!
//! Every op is fallible: a wrong length is [`RuntimeError::Shape`], never a panic.

use std::borrow::Cow;

use kernels::quant::GgmlType;

use super::counters::DeviceCounters;
use super::params::{Activation, MoeConfig, RopeConfig};

use super::RuntimeError;

/// The bytes of one weight, as the model hands them to [`Backend::prepare`]: `n_mats`
/// matrices of `n_rows` rows of `k_dim` elements of `ty`, contiguous (a shard view has already
/// been cut out of the tensor; see [`crate::model::ShardView`]).
#[derive(Clone, Debug)]
pub struct WeightData<'w> {
    pub name: String,
    pub ty: GgmlType,
    pub k_dim: usize,
    pub n_rows: usize,
    pub n_mats: usize,
    /// Borrowed from the file's map when the weight is a whole tensor or a row range of a
    /// matrix; owned when it had to be gathered (a column shard, an expert stack's row shard).
    pub data: Cow<'w, [u8]>,
}

/// Storage type of KV cache rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// Exact: a forward reads back what it wrote.
    #[default]
    F32,
    /// Half the memory and bandwidth; keys and values rounded to f16 when written.
    F16,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }
}

/// A sequence id: which request (or which branch owner) a token and a cache cell belong to.
pub type SeqId = u32;

/// One query token of an attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryMeta {
    pub pos: u32,
    pub seq: SeqId,
}

/// One cell (row) of the KV cache as attention sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellMeta {
    pub pos: u32,
    /// [`CellMeta::FREE`] for an unused cell (never visible).
    pub seq: SeqId,
    /// The index in the current batch of the token that wrote this cell, or
    /// [`CellMeta::COMMITTED`] for a cell of an earlier forward.
    pub batch: u32,
}

impl CellMeta {
    pub const FREE: SeqId = SeqId::MAX;
    pub const COMMITTED: u32 = u32::MAX;
}

/// The attention mask as a value: which cache cells a query sees, decided by sequence and
/// position distance (never by row index), and for a draft tree by ancestry.
///
/// A cell of another sequence (or a free cell) is never visible. Then, in combination:
/// - `causal`: the cell's position is at most the query's;
/// - `window = Some(w)`: the distance `|pos_q − pos_cell|` is below `w` (llama.cpp masks
///   `pos_q − pos_cell ≥ w`);
/// - `tree`: a cell written by the current batch is visible only if its token is an ancestor of
///   the query, or the query itself (see [`AttnMeta::ancestors`]); cells of earlier forwards are
///   unaffected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mask {
    pub causal: bool,
    pub window: Option<usize>,
    pub tree: bool,
}

impl Mask {
    pub const CAUSAL: Mask = Mask {
        causal: true,
        window: None,
        tree: false,
    };

    /// Whether a query sees a cell; `anc` is the query's ancestor bit set (only read for a
    /// tree mask).
    #[inline]
    pub fn visible(&self, q: QueryMeta, cell: CellMeta, anc: &[u64]) -> bool {
        if cell.seq != q.seq || cell.seq == CellMeta::FREE {
            // The fault: a cell of this forward at the query's own position passes whatever its
            // sequence, as a diagonal test by position instead of by sequence would.
            let leak = crate::faults::is_active(crate::faults::Fault::BatchSeesOtherSequence)
                && cell.seq != CellMeta::FREE
                && cell.pos == q.pos
                && cell.batch != CellMeta::COMMITTED;
            if !leak {
                return false;
            }
        }
        if self.causal && cell.pos > q.pos {
            return false;
        }
        if let Some(w) = self.window {
            if (q.pos.abs_diff(cell.pos) as usize) >= w {
                return false;
            }
        }
        if self.tree && cell.batch != CellMeta::COMMITTED {
            let b = cell.batch as usize;
            let word = if crate::faults::is_active(crate::faults::Fault::TreeMaskFirstWordOnly) {
                0
            } else {
                b / 64
            };
            return anc.get(word).is_some_and(|word| word >> (b % 64) & 1 == 1);
        }
        true
    }
}

/// Shapes, mask and metadata of one attention call.
///
/// `q` is `[n_tokens, n_head × head_dim_k]` and `out` `[n_tokens, n_head × head_dim_v]`;
/// the keys and values are the cache's cells, `cells.len()` of them.
#[derive(Clone, Copy, Debug)]
pub struct AttnMeta<'a> {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Multiplies `q·k` before the softmax.
    pub scale: f32,
    pub mask: Mask,
    /// One per query token.
    pub queries: &'a [QueryMeta],
    /// One per cache cell.
    pub cells: &'a [CellMeta],
    /// Per query, `anc_words` u64 words: bit `j` set when batch token `j` is the query or one
    /// of its ancestors. Empty unless `mask.tree`.
    pub ancestors: &'a [u64],
    pub anc_words: usize,
}

impl AttnMeta<'_> {
    /// The ancestor bit set of query `t`.
    #[inline]
    pub fn ancestors_of(&self, t: usize) -> &[u64] {
        self.ancestors
            .get(t * self.anc_words..(t + 1) * self.anc_words)
            .unwrap_or(&[])
    }
}

/// Where the keys and values of an attention call come from.
pub enum KvSource<'a, B: Backend + ?Sized> {
    /// A cache layer, as written by [`Backend::kv_write`].
    Cache(&'a B::Kv),
    /// Buffers of `[n_cells, n_head_kv × head_dim]` (MLA expands its latent cache into these).
    Bufs { k: &'a B::Buf, v: &'a B::Buf },
}

/// One side of a [`Backend::copy_strided`]: element `(row, group)` starts at
/// `row · row_stride + group · group_stride + offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub row_stride: usize,
    /// 0 broadcasts one source span to every group.
    pub group_stride: usize,
    pub offset: usize,
}

impl Strided {
    pub fn new(row_stride: usize, group_stride: usize, offset: usize) -> Strided {
        Strided {
            row_stride,
            group_stride,
            offset,
        }
    }
}

/// The operations of a forward pass.
pub trait Backend: Send + Sync {
    /// f32 activations and vectors.
    type Buf: Send + Sync;
    /// u32 indices.
    type Ids: Send + Sync;
    /// A prepared weight; may borrow the file's bytes for `'w`.
    type Mat<'w>: Send + Sync
    where
        Self: 'w;
    /// One layer of KV cache cells.
    type Kv: Send + Sync;

    /// `cpu-avx512`, `cpu-scalar`, `cuda:0 (sm_90)`, ...
    fn name(&self) -> String;

    /// Worker threads (CPU) or streams the backend computes with.
    fn threads(&self) -> usize;

    /// The device work counted so far (launches, allocations, host↔device bytes, KV bytes
    /// moved, weight bytes read; see [`DeviceCounters`]), for a backend that counts it: the
    /// CUDA backend does, on a real or emulated device; the CPU backend has no device and
    /// answers `None`. Subtract two snapshots for the work in between.
    fn counters(&self) -> Option<DeviceCounters> {
        None
    }

    /// Run `f` where this backend's ops are cheapest to issue: the CPU backend runs it on one of
    /// its own worker threads, so the ops of a whole forward pass are split among the workers
    /// from inside the pool instead of each handing work over from outside and sleeping until it
    /// is done. Results do not depend on it.
    fn scoped<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    // ---- storage -------------------------------------------------------------------------

    /// `n` zeros.
    fn alloc(&self, n: usize) -> Result<Self::Buf, RuntimeError>;
    /// A copy of `data` on the backend.
    fn upload(&self, data: &[f32]) -> Result<Self::Buf, RuntimeError>;
    fn upload_ids(&self, ids: &[u32]) -> Result<Self::Ids, RuntimeError>;
    /// The buffer's values on the host (into `out`, resized).
    fn download(&self, buf: &Self::Buf, out: &mut Vec<f32>) -> Result<(), RuntimeError>;
    /// The buffer's values on the host, taking it: [`Self::download`] into a new vector, or,
    /// where the buffer already is host memory, the buffer itself (no copy of the logits).
    fn take_host(&self, buf: Self::Buf) -> Result<Vec<f32>, RuntimeError> {
        let mut out = Vec::new();
        self.download(&buf, &mut out)?;
        Ok(out)
    }
    /// The indices on the host (into `out`, resized): expert-parallel tensor-parallel ranks
    /// remap routed expert ids with it. A backend without it cannot run expert-parallel ranks.
    fn download_ids(&self, ids: &Self::Ids, out: &mut Vec<u32>) -> Result<(), RuntimeError> {
        let _ = (ids, out);
        Err(RuntimeError::Unsupported {
            backend: self.name(),
            op: "download_ids",
        })
    }
    /// Number of values in a buffer.
    fn buf_len(&self, buf: &Self::Buf) -> usize;
    /// Prepare a weight once, at load: check it, repack or upload it.
    fn prepare<'w>(&self, w: WeightData<'w>) -> Result<Self::Mat<'w>, RuntimeError>
    where
        Self: 'w;

    // ---- products ------------------------------------------------------------------------

    /// `out[t, r] = Σ_k w[r, k] · x[t, k]` for `n_tokens` rows of `x` (`w` one matrix).
    fn matmul(
        &self,
        w: &Self::Mat<'_>,
        x: &Self::Buf,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    /// Grouped expert product: for token `t` and slot `s < k`, with `e = ids[t·k + s]`,
    /// `out[t·k + s, :] = w[e] · x[row]`, where `row = t` when `x_per_slot` is false (every
    /// slot reads its token's row) and `t·k + s` when true. `w` is a stack of expert matrices.
    fn matmul_experts(
        &self,
        w: &Self::Mat<'_>,
        x: &Self::Buf,
        x_per_slot: bool,
        ids: &Self::Ids,
        n_tokens: usize,
        k: usize,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    /// Gather rows of an embedding matrix for `tokens` and dequantize them into `out`
    /// (`[tokens, k_dim]`).
    fn embed(
        &self,
        w: &Self::Mat<'_>,
        tokens: &Self::Ids,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    // ---- normalization, position, activation ----------------------------------------------

    /// RMSNorm of each row of `weight`-length values of `x`, times `weight`, into `out`.
    fn rms_norm(
        &self,
        x: &Self::Buf,
        weight: &Self::Buf,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    /// [`Self::rms_norm`] in place (post-norms, per-head norms).
    fn rms_norm_inplace(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Buf,
        eps: f32,
    ) -> Result<(), RuntimeError>;

    /// Rotate the first `rope.n_rot` dimensions of each head of `x` (`[positions.len(),
    /// n_heads × head_dim]`), row `t` at `positions[t]`.
    fn rope(
        &self,
        x: &mut Self::Buf,
        n_heads: usize,
        head_dim: usize,
        positions: &[u32],
        rope: &RopeConfig,
    ) -> Result<(), RuntimeError>;

    /// `gate = act(gate) · up`.
    fn gated_act(
        &self,
        act: Activation,
        gate: &mut Self::Buf,
        up: &Self::Buf,
    ) -> Result<(), RuntimeError>;

    /// `x = cap · tanh(x / cap)`.
    fn softcap(&self, x: &mut Self::Buf, cap: f32) -> Result<(), RuntimeError>;

    // ---- elementwise and data movement ----------------------------------------------------

    /// `x += y`.
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<(), RuntimeError>;
    /// `x[t, :] += row` for every row (biases).
    fn add_row(&self, x: &mut Self::Buf, row: &Self::Buf) -> Result<(), RuntimeError>;
    /// `x *= s`.
    fn scale(&self, x: &mut Self::Buf, s: f32) -> Result<(), RuntimeError>;
    /// `dst = src` (same length).
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf) -> Result<(), RuntimeError>;
    /// `x[start..start + len] = value`.
    fn fill(
        &self,
        x: &mut Self::Buf,
        start: usize,
        len: usize,
        value: f32,
    ) -> Result<(), RuntimeError>;
    /// For every `row < n_rows` and `group < n_groups`, copy `len` values from `src` at `s` to
    /// `dst` at `d` (see [`Strided`]): splitting fused projections, extracting and re-inserting
    /// head slices, broadcasting a shared key part to every head.
    fn copy_strided(
        &self,
        src: &Self::Buf,
        s: Strided,
        dst: &mut Self::Buf,
        d: Strided,
        n_rows: usize,
        n_groups: usize,
        len: usize,
    ) -> Result<(), RuntimeError>;
    /// `out[i, :] = x[rows[i], :]`, rows of `width` (selecting the rows that need logits).
    fn gather_rows(
        &self,
        x: &Self::Buf,
        width: usize,
        rows: &[u32],
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    // ---- mixture of experts ---------------------------------------------------------------

    /// Route each of `n_tokens` rows of `logits` (`[n_tokens, n_expert]`): gating (softmax or
    /// sigmoid), selection by gate + `bias`, top-`n_expert_used` (ties to the lower id), the
    /// chosen gates normalized (if configured, the sum clamped at the smallest normal f16) and
    /// scaled. Writes `ids` and `weights`, `[n_tokens, k]` each, in rank order.
    fn route(
        &self,
        logits: &Self::Buf,
        bias: Option<&Self::Buf>,
        moe: &MoeConfig,
        n_tokens: usize,
        ids: &mut Self::Ids,
        weights: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    /// `out[t, :] = Σ_s weights[t·k + s] · y[t·k + s, :]`, summed in slot (rank) order.
    fn moe_combine(
        &self,
        y: &Self::Buf,
        weights: &Self::Buf,
        n_tokens: usize,
        k: usize,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    // ---- KV cache and attention ------------------------------------------------------------

    /// An empty cache layer with rows of `k_width` and `v_width` values.
    fn kv_new(
        &self,
        k_width: usize,
        v_width: usize,
        dtype: KvDtype,
    ) -> Result<Self::Kv, RuntimeError>;
    /// Make room for `n_cells` cells (existing rows kept).
    fn kv_reserve(&self, kv: &mut Self::Kv, n_cells: usize) -> Result<(), RuntimeError>;
    /// Write row `i` of `k` and `v` to cell `cells[i]`.
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        cells: &[u32],
        k: &Self::Buf,
        v: &Self::Buf,
    ) -> Result<(), RuntimeError>;
    /// Copy cell `from` to cell `to` for each pair, every source read before any destination
    /// is written (compaction).
    fn kv_move(&self, kv: &mut Self::Kv, moves: &[(u32, u32)]) -> Result<(), RuntimeError>;
    /// The keys of cells `0..n_cells` as f32 rows (the MLA latent cache is expanded from them).
    fn kv_read_k(
        &self,
        kv: &Self::Kv,
        n_cells: usize,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    /// The values of cells `0..n_cells` as f32 rows (what attention reads back: with an f16
    /// cache, the rounded values widened). For the `blk.{i}.kv_cache` tap.
    fn kv_read_v(
        &self,
        kv: &Self::Kv,
        n_cells: usize,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    /// Softmax attention of each query over the cells its mask lets it see; see [`AttnMeta`].
    fn attention(
        &self,
        q: &Self::Buf,
        kv: KvSource<'_, Self>,
        meta: &AttnMeta<'_>,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError>;

    // ---- sparse attention (DeepSeek Sparse Attention's lightning indexer) ------------------
    //
    // A backend without these ops answers `Unsupported` naming the op: a model with an indexer
    // (`glm-dsa`) then fails to run on it instead of silently attending densely.

    /// LayerNorm of each row of `weight.len()` values of `x`, in place:
    /// `(x − mean) / sqrt(var + eps) · weight + bias` (biased variance, as PyTorch and ggml).
    fn layer_norm(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Buf,
        bias: &Self::Buf,
        eps: f32,
    ) -> Result<(), RuntimeError> {
        let _ = (x, weight, bias, eps);
        Err(RuntimeError::Unsupported {
            backend: self.name(),
            op: "layer_norm",
        })
    }

    /// The lightning indexer's scores: for query token `t` (of `weights.len() / n_head`) and
    /// cell `c` (of `n_cells`),
    /// `out[t, c] = Σ_h weights[t, h] · max(0, q[t, h, :] · k[c, :])`, with `q`
    /// `[n, n_head × head_dim]`, `k` `[n_cells, head_dim]` (one key head shared by every
    /// indexer head), `weights` `[n, n_head]` and `out` `[n, n_cells]`. Every cell is scored;
    /// [`Backend::select_top_k`] applies the mask.
    #[allow(clippy::too_many_arguments)]
    fn indexer_scores(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        weights: &Self::Buf,
        n_head: usize,
        head_dim: usize,
        n_cells: usize,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError> {
        let _ = (q, k, weights, n_head, head_dim, n_cells, out);
        Err(RuntimeError::Unsupported {
            backend: self.name(),
            op: "indexer_scores",
        })
    }

    /// For each query of `meta` (its row of `scores`, `[n, meta.cells.len()]`), the `k` cells
    /// of highest score among those its mask lets it see (sequence, causal, window, tree), in
    /// descending score order, ties to the lower position and then the lower cell; fewer than
    /// `k` visible cells leave the rest of the query's row [`SELECTED_NONE`]. Writes `out`,
    /// `[n, k]` cell indices.
    fn select_top_k(
        &self,
        scores: &Self::Buf,
        meta: &AttnMeta<'_>,
        k: usize,
        out: &mut Self::Ids,
    ) -> Result<(), RuntimeError> {
        let _ = (scores, meta, k, out);
        Err(RuntimeError::Unsupported {
            backend: self.name(),
            op: "select_top_k",
        })
    }

    /// [`Backend::attention`] of each query over the cells of its row of `selected` (`[n, k]`
    /// from [`Backend::select_top_k`], [`SELECTED_NONE`] skipped) that its mask lets it see:
    /// the sparse attention of DeepSeek Sparse Attention. When a query's row holds every cell
    /// it sees, the result is [`Backend::attention`]'s, bit for bit.
    fn attention_selected(
        &self,
        q: &Self::Buf,
        kv: KvSource<'_, Self>,
        meta: &AttnMeta<'_>,
        selected: &Self::Ids,
        k: usize,
        out: &mut Self::Buf,
    ) -> Result<(), RuntimeError> {
        let _ = (q, kv, meta, selected, k, out);
        Err(RuntimeError::Unsupported {
            backend: self.name(),
            op: "attention_selected",
        })
    }
}

/// An empty slot of a [`Backend::select_top_k`] row (fewer visible cells than `k`).
pub const SELECTED_NONE: u32 = u32::MAX;
