//! The forward pass of every architecture, on any [`Backend`], over a [`Batch`].
//!
//! One function for all: the layer structure is llama's (norm → attention → residual, norm →
//! FFN → residual) and the differences come from the configuration (embedding scale, RoPE
//! style and bases, sliding window, soft-capping) and from which weights a layer has (QK-norm,
//! post-norms, biases, MLA, MoE). Taps are emitted in `docs/TAPS.md` order.
//!
//! The pass only calls backend ops on backend tensors ([`Weights`], prepared once); the host
//! computes nothing but the batch's metadata (positions, cells, ancestor sets). Data comes back
//! to the host for the logits, and for taps only when an observer is attached.

use crate::faults::{self, Fault};
use crate::runtime::{
    AttnMeta, Backend, Batch, KvCache, KvDtype, KvSource, Mask, QueryMeta, RuntimeError, Strided,
    SELECTED_NONE,
};
use crate::taps::{blk, Taps};

use super::{Attention, Ffn, Indexer, Layer, Model, ModelConfig, Weight};

/// Where the forward pass meets the other ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReducePoint {
    /// After the row-parallel attention output projection, before its post-norm.
    Attn,
    /// After a dense FFN's row-parallel down projection, before its post-norm.
    Ffn,
    /// After an MoE FFN (routed experts and the shared expert), before its post-norm.
    Moe,
}

/// What one rank does at the forward pass's communication points.
/// A tensor-parallel rank implements it (`crate::tp`); the forward pass only calls it, so the
/// model layer never depends on tensor parallelism.
pub trait RankOps<B: Backend> {
    /// All-reduce `x` if the plan split the block that ends at `point`.
    fn reduce(
        &self,
        be: &B,
        x: &mut B::Buf,
        il: usize,
        point: ReducePoint,
    ) -> Result<(), RuntimeError>;
    /// Vocabulary rows this rank's head computes.
    fn vocab_rows(&self) -> usize;
    /// The full logits `[n_rows, n_vocab]` from this rank's `[n_rows, vocab_rows]`.
    fn gather_logits(&self, be: &B, local: B::Buf, n_rows: usize) -> Result<B::Buf, RuntimeError>;
    /// Expert parallel: route slots to this rank's experts (ids local to its stack) and weight
    /// the other ranks' slots zero.
    fn route_local(
        &self,
        be: &B,
        ids: &mut B::Ids,
        wts: &mut B::Buf,
        n: usize,
        k: usize,
    ) -> Result<(), RuntimeError>;
}

/// A gated FFN's prepared weights.
pub(crate) struct DenseW<'w, B: Backend + 'w> {
    gate: B::Mat<'w>,
    up: B::Mat<'w>,
    down: B::Mat<'w>,
}

pub(crate) enum AttnW<'w, B: Backend + 'w> {
    Std {
        wq: B::Mat<'w>,
        wk: B::Mat<'w>,
        wv: B::Mat<'w>,
        bq: Option<B::Buf>,
        bk: Option<B::Buf>,
        bv: Option<B::Buf>,
        q_norm: Option<B::Buf>,
        k_norm: Option<B::Buf>,
    },
    Mla {
        /// `(attn_q_a, attn_q_a_norm, attn_q_b)`, or `attn_q` alone.
        q: MlaQ<'w, B>,
        wkv_a_mqa: B::Mat<'w>,
        kv_a_norm: B::Buf,
        wkv_b: B::Mat<'w>,
    },
}

pub(crate) enum MlaQ<'w, B: Backend + 'w> {
    LowRank(B::Mat<'w>, B::Buf, B::Mat<'w>),
    Full(B::Mat<'w>),
}

/// A lightning indexer's prepared weights (`glm-dsa`).
pub(crate) struct IndexerW<'w, B: Backend + 'w> {
    q_b: B::Mat<'w>,
    k: B::Mat<'w>,
    k_norm: B::Buf,
    k_norm_b: B::Buf,
    proj: B::Mat<'w>,
}

pub(crate) enum FfnW<'w, B: Backend + 'w> {
    Dense(DenseW<'w, B>),
    Moe {
        gate_inp: B::Mat<'w>,
        exp_probs_b: Option<B::Buf>,
        gate_exps: B::Mat<'w>,
        up_exps: B::Mat<'w>,
        down_exps: B::Mat<'w>,
        shared: Option<DenseW<'w, B>>,
    },
}

pub(crate) struct LayerW<'w, B: Backend + 'w> {
    attn_norm: B::Buf,
    attn: AttnW<'w, B>,
    wo: B::Mat<'w>,
    post_attn_norm: Option<B::Buf>,
    ffn_norm: B::Buf,
    ffn: FfnW<'w, B>,
    post_ffn_norm: Option<B::Buf>,
}

/// Every weight of a model, prepared on one backend.
pub struct Weights<'w, B: Backend + 'w> {
    token_embd: B::Mat<'w>,
    output: B::Mat<'w>,
    output_norm: B::Buf,
    layers: Vec<LayerW<'w, B>>,
    /// Per layer, its lightning indexer (replicated whole on every tensor-parallel rank).
    indexers: Vec<Option<IndexerW<'w, B>>>,
}

impl<'w, B: Backend + 'w> Weights<'w, B> {
    /// Prepare every weight of `m` on `be` (the CPU borrows the map; a GPU uploads).
    pub fn prepare(m: &'w Model, be: &B) -> Result<Weights<'w, B>, RuntimeError> {
        Weights::prepare_parts(m, &m.layers, &m.output, be)
    }

    /// [`Weights::prepare`] of the first `n_layers` layers only (with the embedding, output norm
    /// and head): the target's own first layers as a self-draft model.
    pub fn prepare_layers(
        m: &'w Model,
        be: &B,
        n_layers: usize,
    ) -> Result<Weights<'w, B>, RuntimeError> {
        let n_layers = n_layers.min(m.layers.len());
        Weights::prepare_parts(m, &m.layers[..n_layers], &m.output, be)
    }

    /// Prepare `layers` and the head `output` (one tensor-parallel rank's shard views of `m`'s
    /// weights, or `m`'s own), with `m`'s embedding table and output norm.
    pub(crate) fn prepare_parts(
        m: &'w Model,
        model_layers: &[Layer],
        output: &Weight,
        be: &B,
    ) -> Result<Weights<'w, B>, RuntimeError> {
        let mat = |w: &Weight| be.prepare(m.weight_data(w));
        let vec = |v: &[f32]| be.upload(v);
        let opt = |v: &Option<Vec<f32>>| v.as_deref().map(vec).transpose();
        let dense = |f: &super::DenseFfn| -> Result<DenseW<'w, B>, RuntimeError> {
            Ok(DenseW {
                gate: mat(&f.gate)?,
                up: mat(&f.up)?,
                down: mat(&f.down)?,
            })
        };
        let mut layers = Vec::with_capacity(model_layers.len());
        for l in model_layers {
            let attn = match &l.attn {
                Attention::Std(a) => AttnW::Std {
                    wq: mat(&a.wq)?,
                    wk: mat(&a.wk)?,
                    wv: mat(&a.wv)?,
                    bq: opt(&a.bq)?,
                    bk: opt(&a.bk)?,
                    bv: opt(&a.bv)?,
                    q_norm: opt(&a.q_norm)?,
                    k_norm: opt(&a.k_norm)?,
                },
                Attention::Mla(a) => AttnW::Mla {
                    q: match (&a.wq_a, &a.wq) {
                        (Some((wa, norm, wb)), _) => MlaQ::LowRank(mat(wa)?, vec(norm)?, mat(wb)?),
                        (None, Some(wq)) => MlaQ::Full(mat(wq)?),
                        (None, None) => {
                            return Err(RuntimeError::Shape {
                                op: "MLA queries: attn_q_a/attn_q_b or attn_q",
                                expected: 1,
                                found: 0,
                            })
                        }
                    },
                    wkv_a_mqa: mat(&a.wkv_a_mqa)?,
                    kv_a_norm: vec(&a.kv_a_norm)?,
                    wkv_b: mat(&a.wkv_b)?,
                },
            };
            let ffn = match &l.ffn {
                Ffn::Dense(f) => FfnW::Dense(dense(f)?),
                Ffn::Moe(f) => FfnW::Moe {
                    gate_inp: mat(&f.gate_inp)?,
                    exp_probs_b: opt(&f.exp_probs_b)?,
                    gate_exps: mat(&f.gate_exps)?,
                    up_exps: mat(&f.up_exps)?,
                    down_exps: mat(&f.down_exps)?,
                    shared: f.shared.as_ref().map(dense).transpose()?,
                },
            };
            layers.push(LayerW {
                attn_norm: vec(&l.attn_norm)?,
                attn,
                wo: mat(&l.wo)?,
                post_attn_norm: opt(&l.post_attn_norm)?,
                ffn_norm: vec(&l.ffn_norm)?,
                ffn,
                post_ffn_norm: opt(&l.post_ffn_norm)?,
            });
        }
        let indexer = |ix: &Indexer| -> Result<IndexerW<'w, B>, RuntimeError> {
            Ok(IndexerW {
                q_b: mat(&ix.q_b)?,
                k: mat(&ix.k)?,
                k_norm: vec(&ix.k_norm)?,
                k_norm_b: vec(&ix.k_norm_b)?,
                proj: mat(&ix.proj)?,
            })
        };
        let indexers = m
            .indexers
            .iter()
            .take(model_layers.len())
            .map(|ix| ix.as_ref().map(indexer).transpose())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Weights {
            token_embd: be.prepare(m.embedding_data())?,
            output: mat(output)?,
            output_norm: vec(&m.output_norm)?,
            layers,
            indexers,
        })
    }
}

impl<B: Backend> Weights<'_, B> {
    /// Layers prepared (all of the model's, or the first few of a self-draft).
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
}

/// What every layer of one forward shares: the batch's metadata and the cells it writes.
struct Step<'a> {
    n: usize,
    /// RoPE positions (the batch's, unless a fault shifts them).
    rope_pos: Vec<u32>,
    queries: Vec<QueryMeta>,
    slots: &'a [u32],
    ancestors: Vec<u64>,
    anc_words: usize,
    tree: bool,
}

/// Copy a backend buffer to the observer, only when one is attached.
fn tap<'n, B: Backend>(
    be: &B,
    taps: &mut Taps<'_>,
    name: impl FnOnce() -> std::borrow::Cow<'n, str>,
    n: usize,
    width: usize,
    buf: &B::Buf,
) -> Result<(), RuntimeError> {
    if taps.enabled() {
        let mut host = Vec::new();
        be.download(buf, &mut host)?;
        taps.emit(name, n, width, &host);
    }
    Ok(())
}

/// `x · wᵀ` for `n` rows into a new buffer of `n × rows`.
fn matmul<B: Backend>(
    be: &B,
    w: &B::Mat<'_>,
    rows: usize,
    x: &B::Buf,
    n: usize,
) -> Result<B::Buf, RuntimeError> {
    let mut out = be.alloc(n * rows)?;
    be.matmul(w, x, n, &mut out)?;
    Ok(out)
}

/// The residual stream an observer handed back ([`crate::taps::TapObserver::replace`]), checked
/// to be `len` values.
fn replaced<B: Backend>(be: &B, r: &[f32], len: usize) -> Result<B::Buf, RuntimeError> {
    if r.len() != len {
        return Err(RuntimeError::Shape {
            op: "replaced residual stream",
            expected: len,
            found: r.len(),
        });
    }
    be.upload(r)
}

fn missing(op: &'static str) -> RuntimeError {
    RuntimeError::Shape {
        op,
        expected: 1,
        found: 0,
    }
}

/// Run `batch`, writing its keys and values to new pending cells of `cache` (the caller
/// commits, compacts or rolls back). Returns the logits of the batch's logit rows, on the host,
/// and those rows' batch indices.
pub(crate) fn forward<B: Backend>(
    m: &Model,
    w: &Weights<'_, B>,
    be: &B,
    cache: &mut KvCache<B>,
    batch: &Batch,
    taps: &mut Taps<'_>,
) -> Result<(Vec<f32>, Vec<u32>), RuntimeError> {
    forward_on(m.config(), w, be, cache, batch, taps, None)
}

/// [`forward`] as one tensor-parallel rank runs it: `c` is the rank's configuration (its head
/// and FFN widths), `w` its shard views, and `rank` does the communication (all-reduce after
/// the row-parallel attention output and FFN, before any post-norm; logits gather; expert
/// routing). `None` is the whole model on one device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_on<B: Backend>(
    c: &ModelConfig,
    w: &Weights<'_, B>,
    be: &B,
    cache: &mut KvCache<B>,
    batch: &Batch,
    taps: &mut Taps<'_>,
    rank: Option<&dyn RankOps<B>>,
) -> Result<(Vec<f32>, Vec<u32>), RuntimeError> {
    let x = forward_hidden_on(c, w, be, cache, batch, taps, rank)?;
    head_on(c, w, be, &x, batch.len(), &batch.logit_rows(), taps, rank)
}

/// The layers of [`forward`]: the residual stream after the last layer, `batch.len() × n_embd`
/// (the output norm and head not applied), with the batch's keys and values pending in `cache`.
pub(crate) fn forward_hidden<B: Backend>(
    m: &Model,
    w: &Weights<'_, B>,
    be: &B,
    cache: &mut KvCache<B>,
    batch: &Batch,
    taps: &mut Taps<'_>,
) -> Result<B::Buf, RuntimeError> {
    forward_hidden_on(m.config(), w, be, cache, batch, taps, None)
}

/// [`forward_hidden`] as one tensor-parallel rank runs it (see [`forward_on`]).
fn forward_hidden_on<B: Backend>(
    c: &ModelConfig,
    w: &Weights<'_, B>,
    be: &B,
    cache: &mut KvCache<B>,
    batch: &Batch,
    taps: &mut Taps<'_>,
    rank: Option<&dyn RankOps<B>>,
) -> Result<B::Buf, RuntimeError> {
    batch.validate(c.n_vocab)?;
    let n = batch.len();
    let d = c.n_embd;

    // A token without a parent in the batch starts its sequence's new positions.
    let mut next = std::collections::HashMap::new();
    for (index, (&seq, parent)) in batch.seqs().iter().zip(batch.parents()).enumerate() {
        let first = *next.entry(seq).or_insert_with(|| cache.next_pos(seq));
        if parent.is_none() && batch.positions()[index] != first {
            return Err(RuntimeError::BadBatch {
                index,
                reason: format!(
                    "a token without a parent must sit at sequence {seq}'s next position {first}, not {}",
                    batch.positions()[index]
                ),
            });
        }
    }
    let slots = cache.allocate(be, batch.seqs(), batch.positions())?;
    let shift = u32::from(faults::is_active(Fault::RopePositionOffByOne));
    let (ancestors, anc_words) = if batch.is_tree() {
        batch.ancestors()
    } else {
        (Vec::new(), 0)
    };
    let step = Step {
        n,
        rope_pos: batch.positions().iter().map(|&p| p + shift).collect(),
        queries: batch
            .positions()
            .iter()
            .zip(batch.seqs())
            .map(|(&pos, &seq)| {
                let late_decode = n == 1 && !batch.is_tree() && pos > 300;
                if late_decode && faults::is_active(Fault::DecodeLateKvOffByOne) {
                    // Attends as one position earlier: its own newest cell is masked out.
                    return QueryMeta { pos: pos - 1, seq };
                }
                QueryMeta { pos, seq }
            })
            .collect(),
        slots: &slots,
        ancestors,
        anc_words,
        tree: batch.is_tree(),
    };

    let ids = be.upload_ids(batch.tokens())?;
    let mut x = be.alloc(n * d)?;
    be.embed(&w.token_embd, &ids, n, &mut x)?;
    if let Some(s) = c.embed_scale {
        be.scale(&mut x, s)?;
    }
    tap(be, taps, || "embed".into(), n, d, &x)?;
    if let Some(r) = taps.replacement(|| "embed".into()) {
        x = replaced(be, r, n * d)?;
    }

    let mut h = be.alloc(n * d)?;
    // The lightning indexer's selection of the last full layer (`glm-dsa`), which shared layers
    // reuse.
    let mut selection: Option<B::Ids> = None;
    for (il, layer) in w.layers.iter().enumerate() {
        be.rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h)?;
        tap(be, taps, || blk(il, "attn_norm"), n, d, &h)?;

        let attn = match &layer.attn {
            AttnW::Std { .. } => std_attention(c, be, cache, &layer.attn, il, &h, &step, taps)?,
            AttnW::Mla { .. } => {
                let ix = w.indexers.get(il).and_then(Option::as_ref);
                let sparse = Sparse {
                    indexer: ix,
                    selection: &mut selection,
                };
                mla_attention(c, be, cache, &layer.attn, il, &h, &step, sparse, taps)?
            }
        };
        tap(
            be,
            taps,
            || blk(il, "attn"),
            n,
            c.n_head * c.head_dim_v,
            &attn,
        )?;

        let mut o = matmul(be, &layer.wo, d, &attn, n)?;
        if let Some(r) = rank {
            r.reduce(be, &mut o, il, ReducePoint::Attn)?;
        }
        if let Some(nw) = &layer.post_attn_norm {
            be.rms_norm_inplace(&mut o, nw, c.rms_eps)?;
        }
        tap(be, taps, || blk(il, "attn_out"), n, d, &o)?;
        if faults::is_active(Fault::SkipResidualAdd) && il == 0 {
            be.copy(&o, &mut x)?;
        } else {
            be.add(&mut x, &o)?;
        }

        be.rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h)?;
        tap(be, taps, || blk(il, "ffn_norm"), n, d, &h)?;
        let mut f = match &layer.ffn {
            FfnW::Dense(ffn) => dense_ffn(c, be, ffn, c.n_ff, &h, n)?,
            FfnW::Moe { .. } => moe_ffn(c, be, &layer.ffn, il, &h, n, taps, rank)?,
        };
        if let Some(r) = rank {
            let point = match &layer.ffn {
                FfnW::Dense(_) => ReducePoint::Ffn,
                FfnW::Moe { .. } => ReducePoint::Moe,
            };
            r.reduce(be, &mut f, il, point)?;
        }
        if let Some(nw) = &layer.post_ffn_norm {
            be.rms_norm_inplace(&mut f, nw, c.rms_eps)?;
        }
        tap(be, taps, || blk(il, "ffn_out"), n, d, &f)?;
        be.add(&mut x, &f)?;
        tap(be, taps, || blk(il, "out"), n, d, &x)?;
        if let Some(r) = taps.replacement(|| blk(il, "out")) {
            x = replaced(be, r, n * d)?;
        }
    }
    Ok(x)
}

/// The output norm and head of [`forward`] for rows `rows` (batch indices, ascending) of the
/// hidden states `x` of `n` tokens, in one pass over the head's weights. Returns the logits on
/// the host and `rows`.
pub(crate) fn head<B: Backend>(
    m: &Model,
    w: &Weights<'_, B>,
    be: &B,
    x: &B::Buf,
    n: usize,
    rows: &[u32],
    taps: &mut Taps<'_>,
) -> Result<(Vec<f32>, Vec<u32>), RuntimeError> {
    head_on(m.config(), w, be, x, n, rows, taps, None)
}

/// [`head`] as one tensor-parallel rank runs it: the rank's rows of the vocabulary, then the
/// logits gathered from every rank (see [`forward_on`]).
#[allow(clippy::too_many_arguments)]
fn head_on<B: Backend>(
    c: &ModelConfig,
    w: &Weights<'_, B>,
    be: &B,
    x: &B::Buf,
    n: usize,
    rows: &[u32],
    taps: &mut Taps<'_>,
    rank: Option<&dyn RankOps<B>>,
) -> Result<(Vec<f32>, Vec<u32>), RuntimeError> {
    let d = c.n_embd;
    if be.buf_len(x) != n * d {
        return Err(RuntimeError::Shape {
            op: "head input (tokens × n_embd)",
            expected: n * d,
            found: be.buf_len(x),
        });
    }
    if let Some(&bad) = rows.iter().find(|&&r| r as usize >= n) {
        return Err(RuntimeError::Shape {
            op: "head row (< tokens in the batch)",
            expected: n,
            found: bad as usize,
        });
    }
    let rows = rows.to_vec();
    // Only the rows whose logits are wanted go through the head (all of them for taps).
    let all = rows.len() == n;
    let sel;
    let head_in = if all || taps.enabled() {
        x
    } else {
        let mut s = be.alloc(rows.len() * d)?;
        be.gather_rows(x, d, &rows, &mut s)?;
        sel = s;
        &sel
    };
    let n_head_rows = be.buf_len(head_in) / d;
    let mut xn = be.alloc(n_head_rows * d)?;
    be.rms_norm(head_in, &w.output_norm, c.rms_eps, &mut xn)?;
    tap(be, taps, || "output_norm".into(), n_head_rows, d, &xn)?;
    let vocab_rows = rank.map_or(c.n_vocab, |r| r.vocab_rows());
    let mut logits = matmul(be, &w.output, vocab_rows, &xn, n_head_rows)?;
    if let Some(r) = rank {
        logits = r.gather_logits(be, logits, n_head_rows)?;
    }
    if let Some(cap) = c.final_logit_softcap {
        be.softcap(&mut logits, cap)?;
    }
    tap(
        be,
        taps,
        || "logits".into(),
        n_head_rows,
        c.n_vocab,
        &logits,
    )?;
    if n_head_rows != rows.len() {
        let mut sel = be.alloc(rows.len() * c.n_vocab)?;
        be.gather_rows(&logits, c.n_vocab, &rows, &mut sel)?;
        logits = sel;
    }
    Ok((be.take_host(logits)?, rows))
}

/// The sliding window of layer `il`, if it has one.
fn window(c: &ModelConfig, il: usize) -> Option<usize> {
    if c.is_swa_layer(il) {
        let extra = usize::from(faults::is_active(Fault::SlidingWindowOffByOne));
        c.sliding_window.map(|w| w + extra)
    } else {
        None
    }
}

fn attn_meta<'a, B: Backend>(
    c: &ModelConfig,
    cache: &'a KvCache<B>,
    il: usize,
    step: &'a Step<'_>,
    n_head_kv: usize,
) -> AttnMeta<'a> {
    AttnMeta {
        n_head: c.n_head,
        n_head_kv,
        head_dim_k: c.head_dim_k,
        head_dim_v: c.head_dim_v,
        scale: c.attn_scale,
        mask: Mask {
            causal: true,
            window: window(c, il),
            tree: step.tree,
        },
        queries: &step.queries,
        cells: cache.cells(),
        ancestors: &step.ancestors,
        anc_words: step.anc_words,
    }
}

#[allow(clippy::too_many_arguments)]
fn std_attention<B: Backend>(
    c: &ModelConfig,
    be: &B,
    cache: &mut KvCache<B>,
    weights: &AttnW<'_, B>,
    il: usize,
    h: &B::Buf,
    step: &Step<'_>,
    taps: &mut Taps<'_>,
) -> Result<B::Buf, RuntimeError> {
    let AttnW::Std {
        wq,
        wk,
        wv,
        bq,
        bk,
        bv,
        q_norm,
        k_norm,
    } = weights
    else {
        return Err(missing("standard attention weights"));
    };
    let n = step.n;
    let (nq, nk, nv) = (
        c.n_head * c.head_dim_k,
        c.n_head_kv * c.head_dim_k,
        c.n_head_kv * c.head_dim_v,
    );
    let mut q = matmul(be, wq, nq, h, n)?;
    let mut k = matmul(be, wk, nk, h, n)?;
    let mut v = matmul(be, wv, nv, h, n)?;
    for (x, b) in [(&mut q, bq), (&mut k, bk), (&mut v, bv)] {
        if let Some(b) = b {
            be.add_row(x, b)?;
        }
    }
    if let Some(nw) = q_norm {
        be.rms_norm_inplace(&mut q, nw, c.rms_eps)?;
    }
    if let Some(nw) = k_norm {
        be.rms_norm_inplace(&mut k, nw, c.rms_eps)?;
    }
    if faults::is_active(Fault::SwappedQkShards) && c.n_head.is_multiple_of(2) {
        // A loader that put the two halves of the query heads in the wrong order.
        let half = c.n_head / 2 * c.head_dim_k;
        let mut swapped = be.alloc(n * nq)?;
        be.copy_strided(
            &q,
            Strided::new(nq, 0, half),
            &mut swapped,
            Strided::new(nq, 0, 0),
            n,
            1,
            half,
        )?;
        be.copy_strided(
            &q,
            Strided::new(nq, 0, 0),
            &mut swapped,
            Strided::new(nq, 0, half),
            n,
            1,
            half,
        )?;
        q = swapped;
    }
    let rope = c.rope_for_layer(il);
    be.rope(&mut q, c.n_head, c.head_dim_k, &step.rope_pos, rope)?;
    be.rope(&mut k, c.n_head_kv, c.head_dim_k, &step.rope_pos, rope)?;
    tap(be, taps, || blk(il, "q"), n, nq, &q)?;
    tap(be, taps, || blk(il, "k"), n, nk, &k)?;
    tap(be, taps, || blk(il, "v"), n, nv, &v)?;

    let kv = cache.layer_mut(il).ok_or(missing("KV cache layer"))?;
    be.kv_write(kv, step.slots, &k, &v)?;
    let mut out = be.alloc(n * c.n_head * c.head_dim_v)?;
    let kv = cache.layer(il).ok_or(missing("KV cache layer"))?;
    if taps.enabled() && cache.dtype() == KvDtype::F16 {
        // What the cache hands back of this step's rows: [K row | V row] per token.
        let n_cells = cache.cells().len();
        let (mut ks, mut vs) = (be.alloc(n_cells * nk)?, be.alloc(n_cells * nv)?);
        be.kv_read_k(kv, n_cells, &mut ks)?;
        be.kv_read_v(kv, n_cells, &mut vs)?;
        let (mut kr, mut vr) = (be.alloc(n * nk)?, be.alloc(n * nv)?);
        be.gather_rows(&ks, nk, step.slots, &mut kr)?;
        be.gather_rows(&vs, nv, step.slots, &mut vr)?;
        let w = nk + nv;
        let mut rows = be.alloc(n * w)?;
        be.copy_strided(
            &kr,
            Strided::new(nk, 0, 0),
            &mut rows,
            Strided::new(w, 0, 0),
            n,
            1,
            nk,
        )?;
        be.copy_strided(
            &vr,
            Strided::new(nv, 0, 0),
            &mut rows,
            Strided::new(w, 0, nk),
            n,
            1,
            nv,
        )?;
        tap(be, taps, || blk(il, "kv_cache"), n, w, &rows)?;
    }
    let meta = attn_meta(c, cache, il, step, c.n_head_kv);
    be.attention(&q, KvSource::Cache(kv), &meta, &mut out)?;
    Ok(out)
}

/// What an MLA layer of a model with DeepSeek Sparse Attention (`glm-dsa`) needs beyond its
/// attention weights: its indexer (on a full layer) and the selection shared across layers.
struct Sparse<'a, 'w, B: Backend + 'w> {
    indexer: Option<&'a IndexerW<'w, B>>,
    selection: &'a mut Option<B::Ids>,
}

/// The lightning indexer of a full layer (DeepSeek-V3.2's `Indexer`, llama.cpp `glm-dsa.cpp`;
/// see [`super::DsaConfig`] for the source of each choice): queries from the normed q latent
/// `qa` through `indexer.attn_q_b`, one key head from the normed hidden state `h` through
/// `indexer.attn_k` and a LayerNorm, RoPE on the first `qk_rope` values of each head, the keys
/// of the batch written to the indexer's cache rows, every cell scored by
/// `Σ_h w_h · ReLU(q_h · k)` with `w = indexer.proj(h) · (n_head · head_dim)^-½`, and the top
/// `top_k` cells each query's mask shows selected. Returns the selection, `[n, top_k]` cells.
#[allow(clippy::too_many_arguments)]
fn indexer_select<B: Backend>(
    c: &ModelConfig,
    be: &B,
    cache: &mut KvCache<B>,
    ix: &IndexerW<'_, B>,
    il: usize,
    h: &B::Buf,
    qa: &B::Buf,
    step: &Step<'_>,
    taps: &mut Taps<'_>,
) -> Result<B::Ids, RuntimeError> {
    let Some(dsa) = &c.dsa else {
        return Err(missing("indexer without DSA configuration"));
    };
    let n = step.n;
    let (nh, hd, top_k) = (dsa.n_head, dsa.head_dim, dsa.top_k);
    let rope = crate::runtime::params::RopeConfig {
        style: dsa.rope_style,
        ..*c.rope_for_layer(il)
    };
    let mut iq = matmul(be, &ix.q_b, nh * hd, qa, n)?;
    be.rope(&mut iq, nh, hd, &step.rope_pos, &rope)?;
    let mut ik = matmul(be, &ix.k, hd, h, n)?;
    be.layer_norm(&mut ik, &ix.k_norm, &ix.k_norm_b, dsa.k_norm_eps)?;
    be.rope(&mut ik, 1, hd, &step.rope_pos, &rope)?;
    let no_values = be.alloc(0)?;
    let ikv = cache
        .index_layer_mut(il)
        .ok_or(missing("indexer key cache layer"))?;
    be.kv_write(ikv, step.slots, &ik, &no_values)?;
    let mut wts = matmul(be, &ix.proj, nh, h, n)?;
    be.scale(&mut wts, dsa.weights_scale())?;

    let n_cells = cache.cells().len();
    let ikv = cache
        .index_layer(il)
        .ok_or(missing("indexer key cache layer"))?;
    let mut keys = be.alloc(n_cells * hd)?;
    be.kv_read_k(ikv, n_cells, &mut keys)?;
    if taps.enabled() && cache.dtype() == KvDtype::F16 {
        // What the indexer's cache hands back of this step's keys.
        let mut rows = be.alloc(n * hd)?;
        be.gather_rows(&keys, hd, step.slots, &mut rows)?;
        tap(be, taps, || blk(il, "indexer_k_cache"), n, hd, &rows)?;
    }
    let mut scores = be.alloc(n * n_cells)?;
    be.indexer_scores(&iq, &keys, &wts, nh, hd, n_cells, &mut scores)?;
    if faults::is_active(Fault::IndexerTopKWrongAxis) && n == n_cells {
        // Each query ranks its column instead of its row.
        let mut t = be.alloc(n * n_cells)?;
        let (src, dst) = (Strided::new(1, n_cells, 0), Strided::new(n_cells, 1, 0));
        be.copy_strided(&scores, src, &mut t, dst, n, n_cells, 1)?;
        scores = t;
    }
    let meta = attn_meta(c, cache, il, step, c.n_head);
    let mut sel = be.upload_ids(&vec![SELECTED_NONE; n * top_k])?;
    be.select_top_k(&scores, &meta, top_k, &mut sel)?;
    if taps.enabled() {
        tap_selection(be, taps, cache, il, &sel, n, top_k)?;
    }
    Ok(sel)
}

/// `blk.{il}.indexer_top_k`: each query's selected cells as the positions they hold, ascending,
/// padded with −1 (docs/TAPS.md).
fn tap_selection<B: Backend>(
    be: &B,
    taps: &mut Taps<'_>,
    cache: &KvCache<B>,
    il: usize,
    sel: &B::Ids,
    n: usize,
    top_k: usize,
) -> Result<(), RuntimeError> {
    let mut ids = Vec::new();
    be.download_ids(sel, &mut ids)?;
    let mut rows = Vec::with_capacity(n * top_k);
    for row in ids.chunks(top_k.max(1)).take(n) {
        let mut pos: Vec<u32> = row
            .iter()
            .filter_map(|&c| cache.cells().get(c as usize).map(|m| m.pos))
            .collect();
        pos.sort_unstable();
        rows.extend(pos.iter().map(|&p| p as f32));
        rows.extend(std::iter::repeat_n(-1.0, top_k - pos.len()));
    }
    taps.emit(|| blk(il, "indexer_top_k"), n, top_k, &rows);
    Ok(())
}

/// Multi-head latent attention. The cache keeps each token's latent row `[ckv | k_pe]` (normed
/// compressed kv, roped shared key); attention expands every cell's latent with `attn_kv_b` into
/// per-head keys `[k_nope | k_pe]` and values. With DeepSeek Sparse Attention (`glm-dsa`) each
/// query attends only to the cells its layer's (or the last full layer's) indexer selected.
#[allow(clippy::too_many_arguments)]
fn mla_attention<B: Backend>(
    c: &ModelConfig,
    be: &B,
    cache: &mut KvCache<B>,
    weights: &AttnW<'_, B>,
    il: usize,
    h: &B::Buf,
    step: &Step<'_>,
    sparse: Sparse<'_, '_, B>,
    taps: &mut Taps<'_>,
) -> Result<B::Buf, RuntimeError> {
    let (
        Some(mla),
        AttnW::Mla {
            q: wq,
            wkv_a_mqa,
            kv_a_norm,
            wkv_b,
        },
    ) = (c.mla, weights)
    else {
        return Err(missing("MLA layer without MLA configuration"));
    };
    let n = step.n;
    let nh = c.n_head;
    let (nope, rd, dv, rank) = (mla.qk_nope, mla.qk_rope, mla.v_head_dim, mla.kv_lora_rank);
    let dqk = nope + rd;

    let (mut q, qa) = match wq {
        MlaQ::LowRank(wa, norm, wb) => {
            let mut qa = matmul(be, wa, mla.q_lora_rank, h, n)?;
            be.rms_norm_inplace(&mut qa, norm, c.rms_eps)?;
            (matmul(be, wb, nh * dqk, &qa, n)?, Some(qa))
        }
        MlaQ::Full(wq) => (matmul(be, wq, nh * dqk, h, n)?, None),
    };
    let lat_w = rank + rd;
    let kva = matmul(be, wkv_a_mqa, lat_w, h, n)?;
    let mut ckv = be.alloc(n * rank)?;
    be.copy_strided(
        &kva,
        Strided::new(lat_w, 0, 0),
        &mut ckv,
        Strided::new(rank, 0, 0),
        n,
        1,
        rank,
    )?;
    let mut kpe = be.alloc(n * rd)?;
    be.copy_strided(
        &kva,
        Strided::new(lat_w, 0, rank),
        &mut kpe,
        Strided::new(rd, 0, 0),
        n,
        1,
        rd,
    )?;

    // Decoupled RoPE: the last `qk_rope` values of each query head, and the one shared k_pe.
    let rope = c.rope_for_layer(il);
    let mut qpe = be.alloc(n * nh * rd)?;
    let q_heads = Strided::new(nh * dqk, dqk, nope);
    let pe_heads = Strided::new(nh * rd, rd, 0);
    be.copy_strided(&q, q_heads, &mut qpe, pe_heads, n, nh, rd)?;
    be.rope(&mut qpe, nh, rd, &step.rope_pos, rope)?;
    be.copy_strided(&qpe, pe_heads, &mut q, q_heads, n, nh, rd)?;
    be.rope(&mut kpe, 1, rd, &step.rope_pos, rope)?;
    be.rms_norm_inplace(&mut ckv, kv_a_norm, c.rms_eps)?;

    // The latent rows of the new tokens go to the cache.
    let mut latent = be.alloc(n * lat_w)?;
    be.copy_strided(
        &ckv,
        Strided::new(rank, 0, 0),
        &mut latent,
        Strided::new(lat_w, 0, 0),
        n,
        1,
        rank,
    )?;
    be.copy_strided(
        &kpe,
        Strided::new(rd, 0, 0),
        &mut latent,
        Strided::new(lat_w, 0, rank),
        n,
        1,
        rd,
    )?;
    let no_values = be.alloc(0)?;
    let kv = cache.layer_mut(il).ok_or(missing("KV cache layer"))?;
    be.kv_write(kv, step.slots, &latent, &no_values)?;

    // Expand every cell's latent row into per-head keys and values.
    let kv = cache.layer(il).ok_or(missing("KV cache layer"))?;
    let n_cells = cache.cells().len();
    let mut lat_all = be.alloc(n_cells * lat_w)?;
    be.kv_read_k(kv, n_cells, &mut lat_all)?;
    if taps.enabled() && cache.dtype() == KvDtype::F16 {
        // What the cache hands back of this step's latent rows.
        let mut rows = be.alloc(n * lat_w)?;
        be.gather_rows(&lat_all, lat_w, step.slots, &mut rows)?;
        tap(be, taps, || blk(il, "kv_cache"), n, lat_w, &rows)?;
    }
    let mut ckv_all = be.alloc(n_cells * rank)?;
    be.copy_strided(
        &lat_all,
        Strided::new(lat_w, 0, 0),
        &mut ckv_all,
        Strided::new(rank, 0, 0),
        n_cells,
        1,
        rank,
    )?;
    let kvb = matmul(be, wkv_b, nh * (nope + dv), &ckv_all, n_cells)?;
    let kvb_heads = |off| Strided::new(nh * (nope + dv), nope + dv, off);
    let mut k_all = be.alloc(n_cells * nh * dqk)?;
    be.copy_strided(
        &kvb,
        kvb_heads(0),
        &mut k_all,
        Strided::new(nh * dqk, dqk, 0),
        n_cells,
        nh,
        nope,
    )?;
    be.copy_strided(
        &lat_all,
        Strided::new(lat_w, 0, rank),
        &mut k_all,
        Strided::new(nh * dqk, dqk, nope),
        n_cells,
        nh,
        rd,
    )?;
    let mut v_all = be.alloc(n_cells * nh * dv)?;
    be.copy_strided(
        &kvb,
        kvb_heads(nope),
        &mut v_all,
        Strided::new(nh * dv, dv, 0),
        n_cells,
        nh,
        dv,
    )?;

    tap(be, taps, || blk(il, "q"), n, nh * dqk, &q)?;
    if taps.enabled() {
        for (name, buf, width) in [("k", &k_all, nh * dqk), ("v", &v_all, nh * dv)] {
            let mut rows = be.alloc(n * width)?;
            be.gather_rows(buf, width, step.slots, &mut rows)?;
            tap(be, taps, || blk(il, name), n, width, &rows)?;
        }
    }
    // DeepSeek Sparse Attention: a full layer selects afresh, a shared one reuses the last
    // full layer's selection (the cells are the same in every layer).
    let selection = match (&c.dsa, sparse.indexer) {
        (None, _) => None,
        (Some(_), Some(_))
            if c.is_indexer_full(il)
                && sparse.selection.is_some()
                && faults::is_active(Fault::IndexerFullLayerReuses) =>
        {
            // A full layer that reuses the last selection (its tap shows which).
            if taps.enabled() {
                if let (Some(sel), Some(d)) = (sparse.selection.as_ref(), &c.dsa) {
                    tap_selection(be, taps, cache, il, sel, n, d.top_k)?;
                }
            }
            sparse.selection.as_ref()
        }
        (Some(_), Some(ix)) if c.is_indexer_full(il) => {
            let qa = qa.as_ref().ok_or(missing(
                "indexer queries: the MLA q latent (q_lora_rank > 0)",
            ))?;
            *sparse.selection = Some(indexer_select(c, be, cache, ix, il, h, qa, step, taps)?);
            sparse.selection.as_ref()
        }
        (Some(_), None) if c.is_indexer_full(il) => {
            return Err(missing("indexer weights of a full indexer layer"))
        }
        (Some(_), _) => Some(sparse.selection.as_ref().ok_or(missing(
            "the selection of a full indexer layer before a shared one",
        ))?),
    };
    let mut out = be.alloc(n * nh * dv)?;
    let meta = attn_meta(c, cache, il, step, nh);
    let kv = KvSource::Bufs {
        k: &k_all,
        v: &v_all,
    };
    match (selection, &c.dsa) {
        (Some(sel), Some(dsa)) => be.attention_selected(&q, kv, &meta, sel, dsa.top_k, &mut out)?,
        _ => be.attention(&q, kv, &meta, &mut out)?,
    }
    Ok(out)
}

fn dense_ffn<B: Backend>(
    c: &ModelConfig,
    be: &B,
    f: &DenseW<'_, B>,
    n_ff: usize,
    h: &B::Buf,
    n: usize,
) -> Result<B::Buf, RuntimeError> {
    let mut g = matmul(be, &f.gate, n_ff, h, n)?;
    let u = matmul(be, &f.up, n_ff, h, n)?;
    be.gated_act(c.activation, &mut g, &u)?;
    matmul(be, &f.down, c.n_embd, &g, n)
}

#[allow(clippy::too_many_arguments)]
fn moe_ffn<B: Backend>(
    c: &ModelConfig,
    be: &B,
    weights: &FfnW<'_, B>,
    il: usize,
    h: &B::Buf,
    n: usize,
    taps: &mut Taps<'_>,
    rank: Option<&dyn RankOps<B>>,
) -> Result<B::Buf, RuntimeError> {
    let (
        Some(moe),
        FfnW::Moe {
            gate_inp,
            exp_probs_b,
            gate_exps,
            up_exps,
            down_exps,
            shared,
        },
    ) = (c.moe, weights)
    else {
        return Err(missing("MoE layer without MoE configuration"));
    };
    let d = c.n_embd;
    let (ne, k, nff) = (moe.n_expert, moe.n_expert_used, moe.n_ff_exp);
    let router = matmul(be, gate_inp, ne, h, n)?;
    tap(be, taps, || blk(il, "router"), n, ne, &router)?;

    let mut ids = be.upload_ids(&vec![0; n * k])?;
    let mut wts = be.alloc(n * k)?;
    be.route(&router, exp_probs_b.as_ref(), &moe, n, &mut ids, &mut wts)?;
    if let Some(r) = rank {
        r.route_local(be, &mut ids, &mut wts, n, k)?;
    }
    if faults::is_active(Fault::MoeWeightsSwapped) && k >= 2 {
        // Each token's first two routing weights trade places.
        let mut first = be.alloc(n)?;
        let col = |c: usize| Strided::new(k, 0, c);
        let one = Strided::new(1, 0, 0);
        be.copy_strided(&wts, col(0), &mut first, one, n, 1, 1)?;
        let mut second = be.alloc(n)?;
        be.copy_strided(&wts, col(1), &mut second, one, n, 1, 1)?;
        be.copy_strided(&second, one, &mut wts, col(0), n, 1, 1)?;
        be.copy_strided(&first, one, &mut wts, col(1), n, 1, 1)?;
    }
    let mut g = be.alloc(n * k * nff)?;
    be.matmul_experts(gate_exps, h, false, &ids, n, k, &mut g)?;
    let mut u = be.alloc(n * k * nff)?;
    be.matmul_experts(up_exps, h, false, &ids, n, k, &mut u)?;
    be.gated_act(c.activation, &mut g, &u)?;
    let mut y = be.alloc(n * k * d)?;
    be.matmul_experts(down_exps, &g, true, &ids, n, k, &mut y)?;
    if faults::is_active(Fault::NanInExpert) {
        // An expert kernel that produced NaN for every token's first-ranked expert.
        for t in 0..n {
            be.fill(&mut y, t * k * d, d, f32::NAN)?;
        }
    }
    let mut out = be.alloc(n * d)?;
    be.moe_combine(&y, &wts, n, k, &mut out)?;
    if let Some(s) = shared {
        let sh = dense_ffn(c, be, s, moe.n_ff_exp * moe.n_expert_shared, h, n)?;
        be.add(&mut out, &sh)?;
    }
    Ok(out)
}
