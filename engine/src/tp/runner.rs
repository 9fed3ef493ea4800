//! The ranks: each holds its shard views of the weights ([`TpModel`]), prepared on its own
//! backend, and runs the ordinary forward pass (`model/forward.rs`, `forward_on`) on them in its
//! own thread, meeting the others at the communication points through a [`Communicator`].
//!
//! Every rank embeds every token and keeps the full residual stream; only the heads, the FFN
//! width, the experts and the vocabulary rows are split. Each rank has its own KV cache (its
//! KV heads; MLA: the whole latent), with the same cells as every other rank.
//!
//! Taps are gathered to their full shape before the observer sees them: a head-split tap
//! (`q`, `k`, `v`, `attn`) is put together from every rank's columns, every other tap is
//! replicated after its all-reduce and taken from rank 0. So the harness compares a TP run with
//! the reference exactly as it compares TP 1. A replicated tap whose bits differ on another rank
//! is reported to the observer (`TapObserver::ranks_disagree`).

use std::ops::Range;

use crate::faults::{self, Fault};
use crate::model::forward::{forward_on, RankOps, ReducePoint, Weights};
use crate::model::{
    Attention, DenseFfn, Ffn, Layer, MlaAttention, Model, ModelConfig, MoeFfn, StdAttention, Weight,
};
use crate::runtime::{
    Backend, Batch, CellMeta, KvCache, KvDtype, Logits, RuntimeError, SeqCache, SeqId, Shared,
};
use crate::taps::{RankDisagreement, TapObserver, TapRecorder, Taps};

use super::comm::{CommStats, Communicator};
use super::plan::{Decisions, MoeMode, Placement, PlanError, ShardPlan};

/// Why a tensor-parallel model cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("shard plan has no entry for tensor {0}")]
    Unplanned(String),
    #[error(transparent)]
    Shard(#[from] crate::model::ShardError),
    #[error("tensor parallelism needs one backend per rank: degree {degree}, {found} backends")]
    Backends { degree: usize, found: usize },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// One rank's part of the model: its configuration (local head and FFN widths) and its shard
/// views of every layer and of the head.
pub struct RankShard {
    pub config: ModelConfig,
    layers: Vec<Layer>,
    output: Weight,
}

/// A model cut for `degree` ranks by a [`ShardPlan`].
pub struct TpModel<'m> {
    model: &'m Model,
    plan: ShardPlan,
    ranks: Vec<RankShard>,
}

/// Experts `e` of a stacked expert tensor, as a weight of its own (same file bytes).
fn expert_range(w: &Weight, e: &Range<usize>) -> Weight {
    if e.start == 0 && e.end == w.n_mats {
        return w.clone();
    }
    let full_mat = w.info.n_bytes / w.n_mats.max(1) as u64;
    let mut info = w.info.clone();
    info.offset += e.start as u64 * full_mat;
    info.n_bytes = e.len() as u64 * full_mat;
    if let Some(d) = info.dims.get_mut(2) {
        *d = e.len() as u64;
    }
    Weight {
        info,
        n_mats: e.len(),
        ..w.clone()
    }
}

/// Slice of a per-row vector (a bias) for output rows `rows`.
fn slice_vec(v: &Option<Vec<f32>>, rows: &Range<usize>) -> Option<Vec<f32>> {
    v.as_ref()
        .map(|v| v.get(rows.clone()).unwrap_or_default().to_vec())
}

struct Cutter<'a> {
    plan: &'a ShardPlan,
    rank: usize,
}

impl Cutter<'_> {
    /// This rank's view of `w` under the plan of `plan_name`; `None` when the rank holds none.
    fn cut_as(&self, w: &Weight, plan_name: &str) -> Result<Option<Weight>, TpError> {
        let p = self
            .plan
            .tensor(plan_name)
            .ok_or_else(|| TpError::Unplanned(plan_name.to_owned()))?;
        let part = &p.ranks[self.rank];
        match p.placement {
            Placement::Replicated => return Ok(Some(w.clone())),
            Placement::RankZero if part.bytes == 0 => return Ok(None),
            _ => {}
        }
        let w = expert_range(w, &part.experts);
        if part.rows == (0..w.n_rows) && part.cols == (0..w.k_dim) {
            return Ok(Some(w));
        }
        Ok(Some(w.shard(part.rows.clone(), part.cols.clone())?))
    }

    fn cut(&self, w: &Weight) -> Result<Weight, TpError> {
        self.cut_as(w, w.name())?
            .ok_or_else(|| TpError::Unplanned(w.name().to_owned()))
    }

    /// The output rows this rank holds of `w` (for its bias).
    fn rows(&self, w: &Weight) -> Range<usize> {
        self.plan
            .tensor(w.name())
            .map(|p| p.ranks[self.rank].rows.clone())
            .unwrap_or(0..w.n_rows)
    }

    fn dense(&self, f: &DenseFfn) -> Result<Option<DenseFfn>, TpError> {
        let (Some(gate), Some(up), Some(down)) = (
            self.cut_as(&f.gate, f.gate.name())?,
            self.cut_as(&f.up, f.up.name())?,
            self.cut_as(&f.down, f.down.name())?,
        ) else {
            return Ok(None);
        };
        Ok(Some(DenseFfn { gate, up, down }))
    }

    fn layer(&self, l: &Layer) -> Result<Layer, TpError> {
        let attn = match &l.attn {
            Attention::Std(a) => Attention::Std(StdAttention {
                wq: self.cut(&a.wq)?,
                wk: self.cut(&a.wk)?,
                wv: self.cut(&a.wv)?,
                bq: slice_vec(&a.bq, &self.rows(&a.wq)),
                bk: slice_vec(&a.bk, &self.rows(&a.wk)),
                bv: slice_vec(&a.bv, &self.rows(&a.wv)),
                q_norm: a.q_norm.clone(),
                k_norm: a.k_norm.clone(),
            }),
            Attention::Mla(a) => Attention::Mla(MlaAttention {
                wq_a: match &a.wq_a {
                    Some((wa, norm, wb)) => Some((self.cut(wa)?, norm.clone(), self.cut(wb)?)),
                    None => None,
                },
                wq: a.wq.as_ref().map(|w| self.cut(w)).transpose()?,
                wkv_a_mqa: self.cut(&a.wkv_a_mqa)?,
                kv_a_norm: a.kv_a_norm.clone(),
                wkv_b: self.cut(&a.wkv_b)?,
            }),
        };
        let ffn = match &l.ffn {
            Ffn::Dense(f) => Ffn::Dense(
                self.dense(f)?
                    .ok_or_else(|| TpError::Unplanned(f.gate.name().to_owned()))?,
            ),
            Ffn::Moe(f) => Ffn::Moe(MoeFfn {
                gate_inp: self.cut(&f.gate_inp)?,
                exp_probs_b: f.exp_probs_b.clone(),
                gate_exps: self.cut(&f.gate_exps)?,
                up_exps: self.cut(&f.up_exps)?,
                down_exps: self.cut(&f.down_exps)?,
                shared: match &f.shared {
                    Some(s) => self.dense(s)?,
                    None => None,
                },
            }),
        };
        Ok(Layer {
            attn_norm: l.attn_norm.clone(),
            attn,
            wo: self.cut(&l.wo)?,
            post_attn_norm: l.post_attn_norm.clone(),
            ffn_norm: l.ffn_norm.clone(),
            ffn,
            post_ffn_norm: l.post_ffn_norm.clone(),
        })
    }
}

/// Rank `r`'s configuration: its heads, FFN and expert widths (the vocabulary stays whole: it
/// validates token ids; the head's rows come from [`RankOps::vocab_rows`]).
fn rank_config(c: &ModelConfig, d: &Decisions, r: usize) -> ModelConfig {
    let mut lc = c.clone();
    lc.n_head = d.q_heads[r].len();
    lc.n_head_kv = if c.mla.is_some() {
        lc.n_head
    } else {
        d.kv_heads[r].len()
    };
    lc.n_ff = d.ff_rows[r].len();
    if let (Some(m), MoeMode::SplitExperts) = (lc.moe.as_mut(), &d.moe) {
        m.n_ff_exp = d.ff_exp_rows[r].len();
    }
    lc
}

impl<'m> TpModel<'m> {
    /// Plan `model` for `degree` ranks and cut every rank's views.
    pub fn new(model: &'m Model, degree: usize) -> Result<TpModel<'m>, TpError> {
        let plan = ShardPlan::for_gguf(model.config(), model.gguf(), degree)?;
        TpModel::with_plan(model, plan)
    }

    /// Cut `model` by `plan`.
    pub fn with_plan(model: &'m Model, plan: ShardPlan) -> Result<TpModel<'m>, TpError> {
        let head_plan = if plan.tensor("output.weight").is_some() {
            "output.weight"
        } else {
            "output (tied: token_embd.weight)"
        };
        let mut ranks = Vec::with_capacity(plan.degree());
        for rank in 0..plan.degree() {
            let cutter = Cutter { plan: &plan, rank };
            let layers = model
                .layers
                .iter()
                .map(|l| cutter.layer(l))
                .collect::<Result<_, _>>()?;
            let output = cutter
                .cut_as(&model.output, head_plan)?
                .ok_or_else(|| TpError::Unplanned(head_plan.to_owned()))?;
            ranks.push(RankShard {
                config: rank_config(model.config(), &plan.decisions, rank),
                layers,
                output,
            });
        }
        Ok(TpModel { model, plan, ranks })
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    pub fn degree(&self) -> usize {
        self.ranks.len()
    }

    pub fn rank(&self, r: usize) -> Option<&RankShard> {
        self.ranks.get(r)
    }
}

/// One `shm` communicator per rank, all of one group.
fn shm_comms<'t>(degree: usize) -> Vec<Box<dyn Communicator + 't>> {
    super::comm::ShmGroup::create(degree)
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator + 't>)
        .collect()
}

/// One KV cache per rank, all with the same cells.
pub struct TpCache<B: Backend> {
    caches: Vec<KvCache<B>>,
}

impl<B: Backend> TpCache<B> {
    pub fn commit(&mut self) {
        self.caches.iter_mut().for_each(KvCache::commit);
    }

    pub fn rollback(&mut self) {
        self.caches.iter_mut().for_each(KvCache::rollback);
    }

    pub fn clear(&mut self) {
        self.caches.iter_mut().for_each(KvCache::clear);
    }

    /// Forget every committed cell of `seq` on every rank.
    pub fn remove_seq(&mut self, seq: SeqId) {
        self.caches.iter_mut().for_each(|c| c.remove_seq(seq));
    }

    /// [`KvCache::compact`] on every rank, each with its own backend (`backends[r]`).
    pub fn compact(&mut self, backends: &[B], keep: &[usize]) -> Result<(), RuntimeError> {
        for (c, be) in self.caches.iter_mut().zip(backends) {
            c.compact(be, keep)?;
        }
        Ok(())
    }

    /// Rank 0's cache (every rank's has the same cells).
    pub fn rank0(&self) -> Option<&KvCache<B>> {
        self.caches.first()
    }
}

/// A [`TpModel`] prepared on one backend per rank, with one communicator per rank.
pub struct TpEngine<'t, B: Backend + 't> {
    tp: Shared<'t, TpModel<'t>>,
    backends: Shared<'t, [B]>,
    weights: Vec<Weights<'t, B>>,
    comms: Vec<Box<dyn Communicator + 't>>,
}

/// Rank `rank`'s side of the communication points.
struct RankCtx<'a> {
    rank: usize,
    d: &'a Decisions,
    comm: &'a dyn Communicator,
    n_vocab: usize,
}

impl RankCtx<'_> {
    fn err(&self, source: super::comm::CommError) -> RuntimeError {
        RuntimeError::Comm {
            rank: self.rank,
            source: Box::new(source),
        }
    }
}

impl<B: Backend> RankOps<B> for RankCtx<'_> {
    fn reduce(
        &self,
        be: &B,
        x: &mut B::Buf,
        _il: usize,
        point: ReducePoint,
    ) -> Result<(), RuntimeError> {
        let reduces = match point {
            ReducePoint::Attn => self.d.attn_reduces(),
            ReducePoint::Ffn => self.d.ffn_reduces(),
            ReducePoint::Moe => self.d.moe_reduces(),
        };
        if !reduces
            || (point == ReducePoint::Attn && faults::is_active(Fault::TpMissingAttnAllReduce))
        {
            return Ok(());
        }
        let mut host = Vec::new();
        be.download(x, &mut host)?;
        self.comm
            .all_reduce_sum(&mut host)
            .map_err(|e| self.err(e))?;
        *x = be.upload(&host)?;
        Ok(())
    }

    fn vocab_rows(&self) -> usize {
        self.d.vocab_rows[self.rank].len()
    }

    fn gather_logits(&self, be: &B, local: B::Buf, n_rows: usize) -> Result<B::Buf, RuntimeError> {
        if !self.d.vocab_gathers() {
            return Ok(local);
        }
        let mut host = Vec::new();
        be.download(&local, &mut host)?;
        let mut all = Vec::new();
        let lens = self
            .comm
            .all_gather(&host, &mut all)
            .map_err(|e| self.err(e))?;
        // Rank-major blocks [n_rows, v_r] → rows of the whole vocabulary.
        let mut starts = Vec::with_capacity(lens.len());
        let mut at = 0;
        for &l in &lens {
            starts.push(at);
            at += l;
        }
        let mut order: Vec<usize> = (0..lens.len()).collect();
        if faults::is_active(Fault::TpVocabGatherOrder) {
            order.reverse();
        }
        let mut out = Vec::with_capacity(n_rows * self.n_vocab);
        for t in 0..n_rows {
            for &r in &order {
                let v = lens[r] / n_rows.max(1);
                let s = starts[r] + t * v;
                out.extend_from_slice(all.get(s..s + v).unwrap_or_default());
            }
        }
        if out.len() != n_rows * self.n_vocab {
            return Err(RuntimeError::Shape {
                op: "tensor-parallel logits gather",
                expected: n_rows * self.n_vocab,
                found: out.len(),
            });
        }
        be.upload(&out)
    }

    fn route_local(
        &self,
        be: &B,
        ids: &mut B::Ids,
        wts: &mut B::Buf,
        n: usize,
        k: usize,
    ) -> Result<(), RuntimeError> {
        if self.d.moe != MoeMode::ExpertParallel || self.d.degree == 1 {
            return Ok(());
        }
        let mine = &self.d.experts[self.rank];
        let (mut hid, mut hw) = (Vec::new(), Vec::new());
        be.download_ids(ids, &mut hid)?;
        be.download(wts, &mut hw)?;
        if hid.len() != n * k || hw.len() != n * k {
            return Err(RuntimeError::Shape {
                op: "expert-parallel routing",
                expected: n * k,
                found: hid.len(),
            });
        }
        // Another rank's slot still runs (on local expert 0) but is weighted zero; the slot
        // order, and so the combine's summation order, is TP 1's.
        for (id, w) in hid.iter_mut().zip(hw.iter_mut()) {
            let e = *id as usize;
            if mine.contains(&e) {
                *id = (e - mine.start) as u32;
            } else {
                *id = 0;
                *w = 0.0;
            }
        }
        *ids = be.upload_ids(&hid)?;
        *wts = be.upload(&hw)?;
        Ok(())
    }
}

/// What one rank's forward returns: its logits and rows, and its taps.
type RankOut = ((Vec<f32>, Vec<u32>), TapRecorder);

/// Column layout of a tap over the ranks: `(offset, width)` per rank and the full width, or
/// `None` for a tap every rank holds whole.
fn tap_layout(c: &ModelConfig, d: &Decisions, name: &str) -> Option<(Vec<(usize, usize)>, usize)> {
    if !d.attn.is_split() || d.degree == 1 {
        return None;
    }
    let kind = name.strip_prefix("blk.")?.split_once('.')?.1;
    let (dk, dv) = match c.mla {
        Some(m) => (m.qk_nope + m.qk_rope, m.v_head_dim),
        None => (c.head_dim_k, c.head_dim_v),
    };
    let (heads, total, width) = match (kind, c.mla.is_some()) {
        ("q", _) | ("k", true) => (&d.q_heads, c.n_head, dk),
        ("v", true) | ("attn", _) => (&d.q_heads, c.n_head, dv),
        ("k", false) => (&d.kv_heads, c.n_head_kv, dk),
        ("v", false) => (&d.kv_heads, c.n_head_kv, dv),
        _ => return None,
    };
    let parts = heads
        .iter()
        .map(|h| (h.start * width, h.len() * width))
        .collect();
    Some((parts, total * width))
}

impl<'t, B: Backend + 't> TpEngine<'t, B> {
    /// Prepare every rank's views on `backends[rank]`; `comms[rank]` is its communicator.
    pub fn new(
        tp: &'t TpModel<'t>,
        backends: &'t [B],
        comms: Vec<Box<dyn Communicator + 't>>,
    ) -> Result<TpEngine<'t, B>, TpError> {
        Self::shared(Shared::Borrowed(tp), Shared::Borrowed(backends), comms)
    }

    /// [`TpEngine::new`] keeping the shard plan and the backends itself (so the engine borrows
    /// only the model).
    pub fn shared(
        tp: Shared<'t, TpModel<'t>>,
        backends: Shared<'t, [B]>,
        comms: Vec<Box<dyn Communicator + 't>>,
    ) -> Result<TpEngine<'t, B>, TpError> {
        let n = tp.degree();
        if backends.len() != n || comms.len() != n {
            return Err(TpError::Backends {
                degree: n,
                found: backends.len().min(comms.len()),
            });
        }
        let weights = tp
            .ranks
            .iter()
            .zip(backends.iter())
            .map(|(r, be)| Weights::prepare_parts(tp.model, &r.layers, &r.output, be))
            .collect::<Result<_, _>>()?;
        Ok(TpEngine {
            tp,
            backends,
            weights,
            comms,
        })
    }

    /// Every rank's backend, in rank order.
    pub fn backends(&self) -> &[B] {
        &self.backends
    }

    pub fn tp_model(&self) -> &TpModel<'t> {
        &self.tp
    }

    /// The communicator kind (`shm`, ...).
    pub fn comm_kind(&self) -> &'static str {
        self.comms.first().map_or("none", |c| c.kind())
    }

    /// Every rank's collective counters so far.
    pub fn comm_stats(&self) -> Vec<CommStats> {
        self.comms.iter().map(|c| c.stats()).collect()
    }

    /// [`TpEngine::new`] with the ranks talking over one `shm` group (threads of this process).
    pub fn over_shm(tp: &'t TpModel<'t>, backends: &'t [B]) -> Result<TpEngine<'t, B>, TpError> {
        TpEngine::new(tp, backends, shm_comms(tp.degree()))
    }

    /// [`TpEngine::over_shm`] keeping the shard plan and the backends.
    pub fn over_shm_owned(tp: TpModel<'t>, backends: Vec<B>) -> Result<TpEngine<'t, B>, TpError> {
        let comms = shm_comms(tp.degree());
        TpEngine::shared(
            Shared::Owned(std::sync::Arc::new(tp)),
            Shared::Owned(backends.into()),
            comms,
        )
    }

    /// One empty cache per rank.
    pub fn new_cache(&self, capacity: usize, dtype: KvDtype) -> Result<TpCache<B>, RuntimeError> {
        let caches = self
            .tp
            .ranks
            .iter()
            .zip(self.backends.iter())
            .map(|(r, be)| KvCache::new(be, r.config.kv_layout(r.config.n_layer), capacity, dtype))
            .collect::<Result<_, _>>()?;
        Ok(TpCache { caches })
    }

    /// [`crate::exec::Engine::forward`] over the ranks: each runs its part in its own
    /// thread; the logits (gathered) are rank 0's; taps are gathered to full shape.
    pub fn forward(
        &self,
        cache: &mut TpCache<B>,
        batch: &Batch,
        taps: Option<&mut dyn TapObserver>,
    ) -> Result<Logits, RuntimeError> {
        if let Some(c) = cache.caches.iter().find(|c| !c.pending().is_empty()) {
            return Err(RuntimeError::PendingCells {
                n: c.pending().len(),
            });
        }
        let want_taps = taps.is_some();
        let d = &self.tp.plan.decisions;
        let n_vocab = self.tp.model.config().n_vocab;
        let results: Vec<Result<RankOut, RuntimeError>> = std::thread::scope(|s| {
            let handles: Vec<_> = cache
                .caches
                .iter_mut()
                .enumerate()
                .map(|(r, kv)| {
                    let comm = self.comms[r].as_ref();
                    let (shard, w, be) = (&self.tp.ranks[r], &self.weights[r], &self.backends[r]);
                    s.spawn(move || {
                        let ctx = RankCtx {
                            rank: r,
                            d,
                            comm,
                            n_vocab,
                        };
                        let mut rec = TapRecorder::new();
                        let mut t = Taps::new(if want_taps {
                            Some(&mut rec as &mut dyn TapObserver)
                        } else {
                            None
                        });
                        let out = forward_on(&shard.config, w, be, kv, batch, &mut t, Some(&ctx));
                        if out.is_err() {
                            comm.abort();
                        }
                        out.map(|o| (o, rec))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or(Err(RuntimeError::Unsupported {
                        backend: "tensor-parallel rank".into(),
                        op: "a rank thread panicked",
                    }))
                })
                .collect()
        });
        let mut outs = Vec::with_capacity(results.len());
        let mut first_err = None;
        for r in results {
            match r {
                Ok(o) => outs.push(o),
                // A rank's own failure beats the "another rank failed" of the others.
                Err(e @ RuntimeError::Comm { .. }) => {
                    first_err.get_or_insert(e);
                }
                Err(e) => {
                    if matches!(first_err, None | Some(RuntimeError::Comm { .. })) {
                        first_err = Some(e);
                    }
                }
            }
        }
        if let Some(e) = first_err {
            cache.rollback();
            return Err(e);
        }
        if let Some(obs) = taps {
            self.emit_gathered(&outs, obs);
        }
        let Some(((data, rows), _)) = outs.into_iter().next() else {
            return Err(RuntimeError::NoTokens);
        };
        Ok(Logits {
            data,
            n_rows: rows.len(),
            n_vocab,
            tokens: rows.into_iter().map(|r| r as usize).collect(),
        })
    }

    /// Hand every rank-0 tap to `obs`, head-split ones put together from every rank.
    fn emit_gathered(&self, outs: &[RankOut], obs: &mut dyn TapObserver) {
        let c = self.tp.model.config();
        let d = &self.tp.plan.decisions;
        let Some((_, rank0)) = outs.first() else {
            return;
        };
        for (i, t) in rank0.taps.iter().enumerate() {
            let Some((parts, full)) = tap_layout(c, d, &t.name) else {
                obs.tap(&t.name, &t.shape, &t.data);
                // Every rank holds it whole: the same bits on every rank, or a finding.
                for (r, (_, rec)) in outs.iter().enumerate().skip(1) {
                    let other = rec.taps.get(i).filter(|o| o.name == t.name);
                    let data = other.map_or(&[][..], |o| o.data.as_slice());
                    if let Some(dis) = RankDisagreement::between(&t.name, r, &t.data, data) {
                        obs.ranks_disagree(dis);
                    }
                }
                continue;
            };
            let n = t.shape.first().copied().unwrap_or(0);
            let mut data = vec![0f32; n * full];
            for ((_, rec), &(off, w)) in outs.iter().zip(&parts) {
                let Some(rt) = rec.taps.get(i) else { continue };
                for (row, src) in rt.data.chunks_exact(w.max(1)).enumerate().take(n) {
                    data[row * full + off..row * full + off + w].copy_from_slice(src);
                }
            }
            obs.tap(&t.name, &[n, full], &data);
        }
    }
}

impl<B: Backend> SeqCache for TpCache<B> {
    fn cells(&self) -> &[CellMeta] {
        self.rank0().map_or(&[], |c| c.cells())
    }
    fn pending(&self) -> &[u32] {
        self.rank0().map_or(&[], |c| c.pending())
    }
    fn next_pos(&self, seq: SeqId) -> u32 {
        self.rank0().map_or(0, |c| c.next_pos(seq))
    }
    fn seq_len(&self, seq: SeqId) -> usize {
        self.rank0().map_or(0, |c| c.seq_len(seq))
    }
    fn capacity(&self) -> usize {
        self.rank0().map_or(0, |c| c.capacity())
    }
    fn used(&self) -> usize {
        self.rank0().map_or(0, |c| c.used())
    }
    fn dtype(&self) -> KvDtype {
        self.rank0().map_or(KvDtype::F32, |c| c.dtype())
    }
    fn commit(&mut self) {
        TpCache::commit(self)
    }
    fn rollback(&mut self) {
        TpCache::rollback(self)
    }
    fn truncate(&mut self, seq: SeqId, from: u32) {
        self.caches.iter_mut().for_each(|c| c.truncate(seq, from));
    }
    fn forget_before(&mut self, seq: SeqId, before: u32) {
        self.caches
            .iter_mut()
            .for_each(|c| c.forget_before(seq, before));
    }
    fn remove_seq(&mut self, seq: SeqId) {
        TpCache::remove_seq(self, seq)
    }
    fn clear(&mut self) {
        TpCache::clear(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_layouts_put_each_rank_at_its_heads() {
        let d = Decisions {
            degree: 2,
            attn: super::super::Decision::Split,
            q_heads: vec![0..2, 2..4],
            kv_heads: vec![0..1, 0..1],
            kv_note: Some("1 KV head".into()),
            ffn: super::super::Decision::Split,
            ff_rows: vec![],
            moe: MoeMode::None,
            ff_exp_rows: vec![],
            experts: vec![],
            expert_weights: vec![],
            vocab: super::super::Decision::Split,
            vocab_rows: vec![],
        };
        let c = crate::tp::plan::tests::dense(
            crate::model::Architecture::Llama,
            10,
            32,
            1,
            4,
            1,
            8,
            64,
        );
        assert_eq!(
            tap_layout(&c, &d, "blk.3.q"),
            Some((vec![(0, 16), (16, 16)], 32))
        );
        // The one KV head is whole on both ranks: both write columns 0..8.
        assert_eq!(
            tap_layout(&c, &d, "blk.3.k"),
            Some((vec![(0, 8), (0, 8)], 8))
        );
        assert_eq!(tap_layout(&c, &d, "blk.0.attn_out"), None);
        assert_eq!(tap_layout(&c, &d, "logits"), None);
    }
}
