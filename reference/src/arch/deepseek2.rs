//! `deepseek2`: multi-head latent attention (MLA) and a mixture of experts with shared experts
//! (llama.cpp `llm_build_deepseek2` and `build_moe_ffn`), computed in the plain "decompressed"
//! form: the latent KV is expanded to full per-head keys and values and attention is ordinary MHA.
//!
//! Attention of one layer, with `n = rmsnorm(x)·attn_norm`:
//! - `q = Wq_b · (rmsnorm(Wq_a·n)·q_a_norm)` (or `Wq·n` when `q_lora_rank` is 0), per head
//!   `[nope | rope]`;
//! - `[c | k_pe] = Wkv_a_mqa·n`, `c` of width `kv_lora_rank`, `k_pe` one shared rope head;
//! - normal (adjacent-pair) RoPE on `q_pe` and `k_pe`;
//! - `[k_nope | v] = Wkv_b · (rmsnorm(c)·kv_a_norm)` per head (or `attn_k_b` / `attn_v_b` when
//!   the file stores the split form); `k = [k_nope | k_pe]`, `k_pe` broadcast to every head;
//! - scale `1/√(nope + rope)`.
//!
//! MoE (layers from `leading_dense_block_count` on), with `m = rmsnorm(h)·ffn_norm`:
//! router logits `Wr·m`; probabilities by softmax or sigmoid (`expert_gating_func` 1 or 2; absent
//! means softmax); experts chosen by top-k of `probs + exp_probs_b` (the bias steers selection
//! only); weights are the unbiased `probs` of the chosen experts, divided by their sum (clamped
//! below at 2⁻¹⁴) when `expert_weights_norm`, times `expert_weights_scale`; output
//! `Σ wₑ·expertₑ(m) + shared(m)`.
//!
//! `glm-dsa` (GLM-5) is this architecture with DeepSeek Sparse Attention: each layer's attention
//! sees only the positions its lightning indexer selected ([`super::glm_dsa`]).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::glm_dsa::{Dsa, Indexer, IndexerScores};
use super::{Experts, Layers, Loader, Streamer, Vocab};
use crate::error::ReferenceError;
use crate::numerics::CacheDtype;
use crate::ops::{
    attention, causal_mask, gated_ffn, linear, rms_norm, tap, Activation, Result, Rope, RopeLayout,
    Taps, Weight,
};

/// llama.cpp's floor for the sum of selected expert weights before normalizing (the smallest
/// normal f16, `6.103515625e-5`).
const WEIGHT_SUM_FLOOR: f64 = 6.103_515_625e-5;

enum Query {
    Direct(Weight),
    LowRank { a: Weight, norm: Tensor, b: Weight },
}

enum KvUp {
    /// `attn_kv_b`: `[n_head·(nope + v), kv_lora_rank]`.
    Fused(Weight),
    /// `attn_k_b` `[n_head, kv_lora_rank, nope]` and `attn_v_b` `[n_head, v, kv_lora_rank]`.
    Split { k_b: Weight, v_b: Weight },
}

struct Moe {
    router: Weight,
    probs_bias: Option<Tensor>,
    gate: Experts,
    up: Experts,
    down: Experts,
    shared: Option<(Weight, Weight, Weight)>,
}

enum Ffn {
    Dense {
        gate: Weight,
        up: Weight,
        down: Weight,
    },
    Moe(Box<Moe>),
}

struct Layer {
    attn_norm: Tensor,
    q: Query,
    kv_a: Weight,
    kv_a_norm: Tensor,
    kv_b: KvUp,
    wo: Weight,
    ffn_norm: Tensor,
    ffn: Ffn,
    /// `glm-dsa`: the layer's lightning indexer (`None` on a shared layer without one).
    indexer: Option<Indexer>,
}

use crate::{ForcedRoutes as Forced, ForcedSelections, Gating, Routing};

pub(crate) struct Deepseek2 {
    /// The streaming model's file (routed experts are read one by one from it).
    src: Option<Arc<Streamer>>,
    n_embd: usize,
    q_lora_rank: usize,
    n_dense_lead: usize,
    n_ff: usize,
    n_shared: usize,
    n_ff_exp: usize,
    n_head: usize,
    kv_lora_rank: usize,
    nope: usize,
    rope_dim: usize,
    v_dim: usize,
    eps: f64,
    rope: Rope,
    n_expert: usize,
    n_expert_used: usize,
    gating: Gating,
    norm_weights: bool,
    weights_scale: f64,
    vocab: Vocab,
    output_norm: Tensor,
    layers: Layers<Layer>,
    /// `glm-dsa`: DeepSeek Sparse Attention.
    dsa: Option<Dsa>,
    /// What attention (and the indexer) reads back from the KV cache (exact-numerics mode may
    /// round it): the latent row, and the indexer's key row.
    pub(crate) cache: CacheDtype,
}

impl Deepseek2 {
    /// Read the configuration and the weights (eager), or only check the weights (`src`: the
    /// streaming model's file, read again layer by layer in [`Deepseek2::forward`]).
    pub fn load(ld: &mut Loader<'_>, src: Option<&Arc<Streamer>>) -> Result<Self> {
        let glm = ld.prefix == "glm-dsa.";
        let n_embd = ld.usize("embedding_length")?;
        // glm-dsa: `block_count` includes the NextN blocks after the trunk (llama.cpp).
        let n_nextn = if glm {
            ld.usize_or("nextn_predict_layers", 0)?
        } else {
            0
        };
        let n_layer = ld
            .usize("block_count")?
            .checked_sub(n_nextn)
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                ReferenceError::Unsupported(format!(
                    "{n_nextn} NextN blocks of a model with no more blocks than that"
                ))
            })?;
        let n_head = ld.usize("attention.head_count")?;
        let q_lora_rank = ld.usize_or("attention.q_lora_rank", 0)?;
        let kv_lora_rank = ld.usize("attention.kv_lora_rank")?;
        // Files converted for llama.cpp's absorbed MLA store the per-head sizes under `_mla`.
        let key_length = match ld.usize_or("attention.key_length_mla", 0)? {
            0 => ld.usize("attention.key_length")?,
            k => k,
        };
        let v_dim = match ld.usize_or("attention.value_length_mla", 0)? {
            0 => ld.usize("attention.value_length")?,
            v => v,
        };
        let rope_dim = ld.usize("rope.dimension_count")?;
        if rope_dim > key_length || rope_dim % 2 != 0 {
            return Err(ReferenceError::Unsupported(format!(
                "deepseek2 rope dimension {rope_dim} with key length {key_length}"
            )));
        }
        let nope = key_length - rope_dim;
        let eps = ld.f64("attention.layer_norm_rms_epsilon")?;
        let freq_scale = ld.rope_freq_scale()?;
        if freq_scale != 1.0 {
            return Err(ReferenceError::Unsupported(
                "deepseek2 with RoPE scaling (the reference implements unscaled RoPE only)"
                    .to_string(),
            ));
        }
        let rope = Rope {
            layout: RopeLayout::Normal,
            n_rot: rope_dim,
            base: ld.f64_opt("rope.freq_base")?.unwrap_or(10_000.0),
            freq_scale,
        };
        let n_dense_lead = ld.usize_or("leading_dense_block_count", 0)?;
        let n_ff = ld.usize_or("feed_forward_length", 0)?;
        let n_expert = ld.usize_or("expert_count", 0)?;
        let n_expert_used = ld.usize_or("expert_used_count", 0)?;
        let n_shared = ld.usize_or("expert_shared_count", 0)?;
        let n_ff_exp = ld.usize_or("expert_feed_forward_length", 0)?;
        if n_dense_lead < n_layer
            && (n_expert == 0 || n_expert_used == 0 || n_expert_used > n_expert)
        {
            return Err(ReferenceError::Unsupported(format!(
                "deepseek2 MoE with {n_expert} experts, {n_expert_used} used per token"
            )));
        }
        let gating = match ld.usize_or("expert_gating_func", 0)? {
            // llama.cpp: "none" (or absent) is sigmoid for glm-dsa, softmax for DeepSeek-V2.
            0 if glm => Gating::Sigmoid,
            0 | 1 => Gating::Softmax,
            2 => Gating::Sigmoid,
            other => {
                return Err(ReferenceError::Unsupported(format!(
                    "expert_gating_func {other} (1 softmax and 2 sigmoid are implemented)"
                )))
            }
        };
        let norm_weights = ld.bool_or("expert_weights_norm", false)?;
        let weights_scale = ld.f64_opt("expert_weights_scale")?.unwrap_or(1.0);

        let dsa = if glm {
            if q_lora_rank == 0 {
                return Err(ReferenceError::Unsupported(
                    "glm-dsa without a query latent (q_lora_rank 0)".to_string(),
                ));
            }
            Some(Dsa::load(ld, n_layer, rope_dim, rope.base, freq_scale)?)
        } else {
            None
        };
        let vocab = Vocab::load(ld, n_embd, src)?;
        let output_norm = ld.resident("output_norm.weight", &[n_embd])?;
        let mut m = Self {
            src: src.cloned(),
            n_embd,
            q_lora_rank,
            n_dense_lead,
            n_ff,
            n_shared,
            n_ff_exp,
            n_head,
            kv_lora_rank,
            nope,
            rope_dim,
            v_dim,
            eps,
            rope,
            n_expert,
            n_expert_used,
            gating,
            norm_weights,
            weights_scale,
            vocab,
            output_norm,
            layers: Layers::Eager(Vec::new()),
            dsa,
            cache: CacheDtype::F32,
        };
        m.layers = Layers::load(ld, n_layer, src, |ld, i| m.load_layer(ld, i))?;
        Ok(m)
    }

    /// The weights of layer `i`.
    fn load_layer(&self, ld: &mut Loader<'_>, i: usize) -> Result<Layer> {
        let (n_embd, n_head, q_lora_rank) = (self.n_embd, self.n_head, self.q_lora_rank);
        let (kv_lora_rank, nope, v_dim, rope_dim) =
            (self.kv_lora_rank, self.nope, self.v_dim, self.rope_dim);
        let key_length = nope + rope_dim;
        let (n_dense_lead, n_ff, n_shared, n_ff_exp) =
            (self.n_dense_lead, self.n_ff, self.n_shared, self.n_ff_exp);
        let n_expert = self.n_expert;
        let src = self.src.as_ref();
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        let q = if q_lora_rank == 0 {
            Query::Direct(ld.weight(&b("attn_q"), &[n_head * key_length, n_embd])?)
        } else {
            Query::LowRank {
                a: ld.weight(&b("attn_q_a"), &[q_lora_rank, n_embd])?,
                norm: ld.tensor(&b("attn_q_a_norm"), &[q_lora_rank])?,
                b: ld.weight(&b("attn_q_b"), &[n_head * key_length, q_lora_rank])?,
            }
        };
        let kv_b = if ld.file.has_tensor(&b("attn_kv_b")) {
            KvUp::Fused(ld.weight(&b("attn_kv_b"), &[n_head * (nope + v_dim), kv_lora_rank])?)
        } else {
            KvUp::Split {
                k_b: ld.weight(&b("attn_k_b"), &[n_head, kv_lora_rank, nope])?,
                v_b: ld.weight(&b("attn_v_b"), &[n_head, v_dim, kv_lora_rank])?,
            }
        };
        let ffn = if i < n_dense_lead {
            Ffn::Dense {
                gate: ld.weight(&b("ffn_gate"), &[n_ff, n_embd])?,
                up: ld.weight(&b("ffn_up"), &[n_ff, n_embd])?,
                down: ld.weight(&b("ffn_down"), &[n_embd, n_ff])?,
            }
        } else {
            let shared = if n_shared > 0 {
                let w = n_ff_exp * n_shared;
                Some((
                    ld.weight(&b("ffn_gate_shexp"), &[w, n_embd])?,
                    ld.weight(&b("ffn_up_shexp"), &[w, n_embd])?,
                    ld.weight(&b("ffn_down_shexp"), &[n_embd, w])?,
                ))
            } else {
                None
            };
            Ffn::Moe(Box::new(Moe {
                router: ld.weight(&b("ffn_gate_inp"), &[n_expert, n_embd])?,
                probs_bias: ld.optional(&format!("blk.{i}.exp_probs_b.bias"), &[n_expert])?,
                gate: Experts::load(ld, &b("ffn_gate_exps"), &[n_expert, n_ff_exp, n_embd], src)?,
                up: Experts::load(ld, &b("ffn_up_exps"), &[n_expert, n_ff_exp, n_embd], src)?,
                down: Experts::load(ld, &b("ffn_down_exps"), &[n_expert, n_embd, n_ff_exp], src)?,
                shared,
            }))
        };
        let indexer = match &self.dsa {
            Some(dsa) => dsa.load_indexer(ld, i, q_lora_rank, n_embd, dsa.is_full(i))?,
            None => None,
        };
        Ok(Layer {
            indexer,
            attn_norm: ld.tensor(&b("attn_norm"), &[n_embd])?,
            q,
            kv_a: ld.weight(&b("attn_kv_a_mqa"), &[kv_lora_rank + rope_dim, n_embd])?,
            kv_a_norm: ld.tensor(&b("attn_kv_a_norm"), &[kv_lora_rank])?,
            kv_b,
            wo: ld.weight(&b("attn_output"), &[n_embd, n_head * v_dim])?,
            ffn_norm: ld.tensor(&b("ffn_norm"), &[n_embd])?,
            ffn,
        })
    }

    pub fn vocab_mut(&mut self) -> &mut Vocab {
        &mut self.vocab
    }

    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.n_vocab()
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Every tap up to `output_norm`; returns the normed final hidden states `[n, n_embd]`.
    pub fn hidden(&self, tokens: &[u32], taps: Taps<'_>) -> Result<Tensor> {
        self.hidden_routed(tokens, taps, &Forced::new())
    }

    /// The indexer scores of full layer `layer` on `tokens` (see
    /// [`crate::ReferenceModel::indexer_scores`]): the forward runs up to that layer.
    pub fn indexer_scores(&self, tokens: &[u32], layer: usize) -> Result<Vec<Vec<f64>>> {
        let Some(dsa) = &self.dsa else {
            return Err(ReferenceError::Unsupported(
                "indexer scores of a model without a lightning indexer".to_string(),
            ));
        };
        if !dsa.is_full(layer) || layer >= self.layers.len() {
            return Err(ReferenceError::Unsupported(format!(
                "indexer scores of layer {layer}: not a full indexer layer"
            )));
        }
        dsa.record(Some(layer));
        let run = self.hidden_routed(tokens, &mut |_, _, _| {}, &Forced::new());
        let scores = dsa.take_recorded().remove(&layer);
        run?;
        scores.ok_or_else(|| {
            ReferenceError::Unsupported(format!("layer {layer}'s indexer did not run"))
        })
    }

    /// [`Self::hidden_forced`], and the indexer scores of every full layer of that forward
    /// (empty without an indexer).
    pub fn hidden_forced_scored(
        &self,
        tokens: &[u32],
        taps: Taps<'_>,
        forced: &Forced,
        selections: &ForcedSelections,
    ) -> Result<(Tensor, IndexerScores)> {
        let Some(dsa) = &self.dsa else {
            return Ok((
                self.hidden_forced(tokens, taps, forced, selections)?,
                IndexerScores::new(),
            ));
        };
        dsa.record(None);
        let run = self.hidden_forced(tokens, taps, forced, selections);
        let scores = dsa.take_recorded();
        Ok((run?, scores))
    }

    /// The routing of layer `i`: `None` for a dense layer.
    pub fn routing(&self, i: usize) -> Result<Option<Routing>> {
        if i >= self.layers.len() {
            return Err(ReferenceError::Unsupported(format!(
                "layer {i} of a model of {} layers",
                self.layers.len()
            )));
        }
        let l = self.layers.get(i, |ld, i| self.load_layer(ld, i))?;
        let Ffn::Moe(moe) = &l.ffn else {
            return Ok(None);
        };
        Ok(Some(self.routing_of(moe)?))
    }

    fn routing_of(&self, moe: &Moe) -> Result<Routing> {
        let bias = match &moe.probs_bias {
            Some(b) => b.to_dtype(DType::F64)?.to_vec1::<f64>()?,
            None => vec![0.0; self.n_expert],
        };
        Ok(Routing {
            gating: self.gating,
            bias,
            n_expert_used: self.n_expert_used,
        })
    }

    /// [`Self::hidden`] with the experts of some `(layer, token)`s chosen by `forced` instead
    /// of by the router (their weights are still the router's probabilities of those experts).
    pub fn hidden_routed(&self, tokens: &[u32], taps: Taps<'_>, forced: &Forced) -> Result<Tensor> {
        self.hidden_forced(tokens, taps, forced, &ForcedSelections::new())
    }

    /// [`Self::hidden_routed`] with the indexer's selection of some `(layer, query)`s forced
    /// (see [`crate::ReferenceModel::forward_hidden_selected`]).
    pub fn hidden_forced(
        &self,
        tokens: &[u32],
        taps: Taps<'_>,
        forced: &Forced,
        selections: &ForcedSelections,
    ) -> Result<Tensor> {
        if self.dsa.is_none() && !selections.is_empty() {
            return Err(ReferenceError::Unsupported(
                "forced indexer selections for a model without a lightning indexer".to_string(),
            ));
        }
        let n = tokens.len();
        let (h, nope, rd, vd) = (self.n_head, self.nope, self.rope_dim, self.v_dim);
        let mut x = self.vocab.embed(tokens)?;
        tap(taps, "embed", &x)?;
        let mask = causal_mask(n, None, x.dtype())?;
        let scale = 1.0 / ((nope + rd) as f64).sqrt();
        let mut sparse: Option<Tensor> = None;
        for i in 0..self.layers.len() {
            let l = self.layers.get(i, |ld, i| self.load_layer(ld, i))?;
            let name = |s: &str| format!("blk.{i}.{s}");
            let a_in = rms_norm(&x, &l.attn_norm, self.eps)?;
            tap(taps, &name("attn_norm"), &a_in)?;

            let (q, q_latent) = match &l.q {
                Query::Direct(w) => (linear(&a_in, w)?, None),
                Query::LowRank { a, norm, b } => {
                    let qr = rms_norm(&linear(&a_in, a)?, norm, self.eps)?;
                    (linear(&qr, b)?, Some(qr))
                }
            };
            let q = q.reshape((n, h, nope + rd))?;
            let q_nope = q.narrow(2, 0, nope)?;
            let q_pe = self.rope.apply(&q.narrow(2, nope, rd)?)?;
            let q = Tensor::cat(&[&q_nope, &q_pe], 2)?;

            let kv_a = linear(&a_in, &l.kv_a)?;
            let c = rms_norm(
                &kv_a.narrow(1, 0, self.kv_lora_rank)?,
                &l.kv_a_norm,
                self.eps,
            )?;
            let k_pe = self
                .rope
                .apply(&kv_a.narrow(1, self.kv_lora_rank, rd)?.reshape((n, 1, rd))?)?;
            // The cache holds the latent row [c | k_pe]; keys and values are expanded from what
            // it hands back (rounded to f16 with an f16 cache, CacheDtype).
            let (c, k_pe) = if self.cache == CacheDtype::F32 {
                (c, k_pe)
            } else {
                let (c, k_pe) = (self.cache.apply(&c)?, self.cache.apply(&k_pe)?);
                let latent = Tensor::cat(&[&c, &k_pe.reshape((n, rd))?], 1)?;
                tap(taps, &name("kv_cache"), &latent)?;
                (c, k_pe)
            };
            let (k_nope, v) = match &l.kv_b {
                KvUp::Fused(w) => {
                    let kv = linear(&c, w)?.reshape((n, h, nope + vd))?;
                    (
                        kv.narrow(2, 0, nope)?,
                        kv.narrow(2, nope, vd)?.contiguous()?,
                    )
                }
                KvUp::Split { k_b, v_b } => {
                    // per head: k_nope = c · k_b[h] ([r, nope]); v = c · v_b[h]ᵀ
                    let mut ks = Vec::with_capacity(h);
                    let mut vs = Vec::with_capacity(h);
                    for head in 0..h {
                        ks.push(k_b.act.apply(&c)?.matmul(&k_b.w.get(head)?)?);
                        vs.push(linear(&c, &v_b.get(head)?)?);
                    }
                    (Tensor::stack(&ks, 1)?, Tensor::stack(&vs, 1)?)
                }
            };
            let k = Tensor::cat(&[&k_nope, &k_pe.broadcast_as((n, h, rd))?], 2)?;
            tap(taps, &name("q"), &q)?;
            tap(taps, &name("k"), &k)?;
            tap(taps, &name("v"), &v)?;
            // glm-dsa: a full layer's indexer selects each query's positions; a shared layer
            // keeps the last full layer's selection.
            if let Some(dsa) = &self.dsa {
                if dsa.is_full(i) {
                    let (Some(ix), Some(qr)) = (&l.indexer, &q_latent) else {
                        return Err(ReferenceError::Unsupported(format!(
                            "glm-dsa full layer {i} without its indexer or query latent"
                        )));
                    };
                    let selected = dsa.select(ix, &a_in, qr, i, selections, self.cache, taps)?;
                    sparse = Some(Dsa::mask(&selected, x.dtype())?);
                }
            }
            let layer_mask = match (&self.dsa, &sparse) {
                (None, _) => &mask,
                (Some(_), Some(m)) => m,
                (Some(_), None) => {
                    return Err(ReferenceError::Unsupported(format!(
                        "glm-dsa shared layer {i} before any full layer"
                    )))
                }
            };
            let att = attention(&q, &k, &v, scale, layer_mask)?;
            tap(taps, &name("attn"), &att)?;
            let att = linear(&att, &l.wo)?;
            tap(taps, &name("attn_out"), &att)?;
            let resid = (x + att)?;
            let m = rms_norm(&resid, &l.ffn_norm, self.eps)?;
            tap(taps, &name("ffn_norm"), &m)?;
            let f = match &l.ffn {
                Ffn::Dense { gate, up, down } => gated_ffn(&m, gate, up, down, Activation::Silu)?,
                Ffn::Moe(moe) => {
                    let logits = linear(&m, &moe.router)?;
                    tap(taps, &name("router"), &logits)?;
                    self.moe(&m, &logits, moe, i, forced)?
                }
            };
            tap(taps, &name("ffn_out"), &f)?;
            x = (resid + f)?;
            tap(taps, &name("out"), &x)?;
        }
        let x = rms_norm(&x, &self.output_norm, self.eps)?;
        tap(taps, "output_norm", &x)?;
        Ok(x)
    }

    /// The output head on normed hidden states `x: [n, n_embd]`.
    pub fn head(&self, x: &Tensor) -> Result<Tensor> {
        self.vocab.logits(x)
    }

    /// Routed experts plus shared experts for `m: [n, n_embd]` given router `logits: [n, n_expert]`.
    ///
    /// Routing (a discrete choice and a handful of weights per token) is computed on the host in
    /// f64 for both precisions; the expert FFNs run in the model's dtype.
    fn moe(
        &self,
        m: &Tensor,
        logits: &Tensor,
        moe: &Moe,
        layer: usize,
        forced: &Forced,
    ) -> Result<Tensor> {
        let n = m.dim(0)?;
        let dtype = m.dtype();
        let logits = logits.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        let routing = self.routing_of(moe)?;
        // per expert: which tokens chose it, and with what weight
        let mut routes: Vec<(Vec<u32>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); self.n_expert];
        for (t, row) in logits.iter().enumerate() {
            let probs = routing.probs(row);
            let chosen = match forced.get(&(layer, t)) {
                Some(experts) => {
                    if experts.len() != self.n_expert_used
                        || experts.iter().any(|&e| e >= self.n_expert)
                    {
                        return Err(ReferenceError::Unsupported(format!(
                            "forced route of layer {layer}, token {t}: expected {} experts below \
                             {}, found {experts:?}",
                            self.n_expert_used, self.n_expert
                        )));
                    }
                    experts.clone()
                }
                None => routing.choose_from_probs(&probs),
            };
            let mut weights: Vec<f64> = chosen.iter().map(|&e| probs[e]).collect();
            if self.norm_weights {
                let sum = weights.iter().sum::<f64>().max(WEIGHT_SUM_FLOOR);
                weights.iter_mut().for_each(|w| *w /= sum);
            }
            if self.weights_scale != 0.0 {
                weights.iter_mut().for_each(|w| *w *= self.weights_scale);
            }
            for (&e, &w) in chosen.iter().zip(&weights) {
                routes[e].0.push(t as u32);
                routes[e].1.push(w);
            }
        }
        let mut out = m.zeros_like()?;
        for (e, (tokens, weights)) in routes.iter().enumerate() {
            if tokens.is_empty() {
                continue;
            }
            let idx = Tensor::new(tokens.as_slice(), &Device::Cpu)?;
            let xe = m.index_select(&idx, 0)?;
            let ye = gated_ffn(
                &xe,
                &moe.gate.get(e)?,
                &moe.up.get(e)?,
                &moe.down.get(e)?,
                Activation::Silu,
            )?;
            let w = Tensor::from_vec(weights.clone(), (tokens.len(), 1), &Device::Cpu)?
                .to_dtype(dtype)?;
            out = out.index_add(&idx, &ye.broadcast_mul(&w)?, 0)?;
        }
        if let Some((gate, up, down)) = &moe.shared {
            out = (out + gated_ffn(m, gate, up, down, Activation::Silu)?)?;
        }
        debug_assert_eq!(out.dim(0)?, n);
        Ok(out)
    }
}
