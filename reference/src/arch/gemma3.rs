//! `gemma3`: Gemma 3 text decoder (llama.cpp `llm_build_gemma3`).
//!
//! - embeddings × √n_embd;
//! - RMSNorm everywhere, weights used as stored (the converter already folded Gemma's `1 + w`);
//! - per-head RMSNorm of Q and K (`attn_q_norm`, `attn_k_norm`) before NeoX RoPE;
//! - layers with `i % 6 == 5` are global (RoPE base `rope.freq_base`, linear scaling if any), the
//!   others local: sliding window `attention.sliding_window` and RoPE base `rope.freq_base_swa`
//!   (10000 when absent, as llama.cpp hard-codes);
//! - queries scaled by `1/√key_length` (by `1/√(n_embd/n_head)` for the 62-layer 27B model, as
//!   llama.cpp decides by model size), attention itself unscaled;
//! - post-attention and post-FFN RMSNorms before each residual add;
//! - GELU(tanh)-gated FFN; tied output head; final logit soft-capping when
//!   `final_logit_softcapping` is present and positive.

use std::sync::Arc;

use candle_core::Tensor;

use super::{cached_kv, Layers, Loader, Streamer, Vocab};
use crate::error::ReferenceError;
use crate::numerics::CacheDtype;
use crate::ops::{
    attention, causal_mask, gated_ffn, linear, rms_norm, tap, Activation, Result, Rope, RopeLayout,
    Taps, Weight,
};

/// Every sixth layer is global (llama.cpp `set_swa_pattern(6)`).
const SWA_PATTERN: usize = 6;

struct Layer {
    attn_norm: Tensor,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    q_norm: Tensor,
    k_norm: Tensor,
    wo: Weight,
    post_attn_norm: Tensor,
    ffn_norm: Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
    post_ffn_norm: Tensor,
}

pub(crate) struct Gemma3 {
    n_embd: usize,
    n_ff: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    eps: f64,
    q_scale: f64,
    sliding_window: Option<usize>,
    rope_global: Rope,
    rope_local: Rope,
    softcap: Option<f64>,
    vocab: Vocab,
    output_norm: Tensor,
    layers: Layers<Layer>,
    /// What attention reads back from the KV cache (exact-numerics mode may round it).
    pub(crate) cache: CacheDtype,
}

impl Gemma3 {
    /// Read the configuration and the weights (eager), or only check the weights (`src`: the
    /// streaming model's file, read again layer by layer in [`Gemma3::forward`]).
    pub fn load(ld: &mut Loader<'_>, src: Option<&Arc<Streamer>>) -> Result<Self> {
        let n_embd = ld.usize("embedding_length")?;
        let n_layer = ld.usize("block_count")?;
        let n_ff = ld.usize("feed_forward_length")?;
        let n_head = ld.usize("attention.head_count")?;
        let n_head_kv = ld.usize_or("attention.head_count_kv", n_head)?;
        let head_dim = ld.usize_or("attention.key_length", n_embd / n_head.max(1))?;
        let head_dim_v = ld.usize_or("attention.value_length", head_dim)?;
        if head_dim_v != head_dim {
            return Err(ReferenceError::Unsupported(format!(
                "gemma3 with key_length {head_dim} != value_length {head_dim_v}"
            )));
        }
        let eps = ld.f64("attention.layer_norm_rms_epsilon")?;
        let sliding_window = match ld.usize_or("attention.sliding_window", 0)? {
            0 => None,
            w => Some(w),
        };
        let q_scale_dim = if n_layer == 62 {
            n_embd / n_head.max(1)
        } else {
            head_dim
        };
        ld.refuse_rope_freqs()?;
        let n_rot = ld.usize_or("rope.dimension_count", head_dim)?;
        let rope_global = Rope {
            layout: RopeLayout::Neox,
            n_rot,
            base: ld.f64_opt("rope.freq_base")?.unwrap_or(1_000_000.0),
            freq_scale: ld.rope_freq_scale()?,
        };
        let rope_local = Rope {
            layout: RopeLayout::Neox,
            n_rot,
            base: ld.f64_opt("rope.freq_base_swa")?.unwrap_or(10_000.0),
            freq_scale: 1.0,
        };
        let softcap = ld.f64_opt("final_logit_softcapping")?.filter(|&c| c > 0.0);
        let vocab = Vocab::load(ld, n_embd, src)?;
        let output_norm = ld.resident("output_norm.weight", &[n_embd])?;
        let mut m = Self {
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            eps,
            q_scale: 1.0 / (q_scale_dim as f64).sqrt(),
            sliding_window,
            rope_global,
            rope_local,
            softcap,
            vocab,
            output_norm,
            layers: Layers::Eager(Vec::new()),
            cache: CacheDtype::F32,
        };
        m.layers = Layers::load(ld, n_layer, src, |ld, i| m.load_layer(ld, i))?;
        Ok(m)
    }

    /// The weights of layer `i`.
    fn load_layer(&self, ld: &mut Loader<'_>, i: usize) -> Result<Layer> {
        let (n_embd, n_ff, head_dim) = (self.n_embd, self.n_ff, self.head_dim);
        let (n_head, n_head_kv) = (self.n_head, self.n_head_kv);
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        Ok(Layer {
            attn_norm: ld.tensor(&b("attn_norm"), &[n_embd])?,
            wq: ld.weight(&b("attn_q"), &[n_head * head_dim, n_embd])?,
            wk: ld.weight(&b("attn_k"), &[n_head_kv * head_dim, n_embd])?,
            wv: ld.weight(&b("attn_v"), &[n_head_kv * head_dim, n_embd])?,
            q_norm: ld.tensor(&b("attn_q_norm"), &[head_dim])?,
            k_norm: ld.tensor(&b("attn_k_norm"), &[head_dim])?,
            wo: ld.weight(&b("attn_output"), &[n_embd, n_head * head_dim])?,
            post_attn_norm: ld.tensor(&b("post_attention_norm"), &[n_embd])?,
            ffn_norm: ld.tensor(&b("ffn_norm"), &[n_embd])?,
            gate: ld.weight(&b("ffn_gate"), &[n_ff, n_embd])?,
            up: ld.weight(&b("ffn_up"), &[n_ff, n_embd])?,
            down: ld.weight(&b("ffn_down"), &[n_embd, n_ff])?,
            post_ffn_norm: ld.tensor(&b("post_ffw_norm"), &[n_embd])?,
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
        let n = tokens.len();
        let mut x = (self.vocab.embed(tokens)? * (self.n_embd as f64).sqrt())?;
        tap(taps, "embed", &x)?;
        let dtype = x.dtype();
        let global_mask = causal_mask(n, None, dtype)?;
        let local_mask = match self.sliding_window {
            Some(w) => causal_mask(n, Some(w), dtype)?,
            None => global_mask.clone(),
        };
        for i in 0..self.layers.len() {
            let l = self.layers.get(i, |ld, i| self.load_layer(ld, i))?;
            let name = |s: &str| format!("blk.{i}.{s}");
            let is_global = i % SWA_PATTERN == SWA_PATTERN - 1 || self.sliding_window.is_none();
            let (rope, mask) = if is_global {
                (&self.rope_global, &global_mask)
            } else {
                (&self.rope_local, &local_mask)
            };
            let h = rms_norm(&x, &l.attn_norm, self.eps)?;
            tap(taps, &name("attn_norm"), &h)?;
            let q = linear(&h, &l.wq)?.reshape((n, self.n_head, self.head_dim))?;
            let k = linear(&h, &l.wk)?.reshape((n, self.n_head_kv, self.head_dim))?;
            let v = linear(&h, &l.wv)?.reshape((n, self.n_head_kv, self.head_dim))?;
            let q = rope.apply(&rms_norm(&q, &l.q_norm, self.eps)?)?;
            let k = rope.apply(&rms_norm(&k, &l.k_norm, self.eps)?)?;
            tap(taps, &name("q"), &q)?;
            tap(taps, &name("k"), &k)?;
            tap(taps, &name("v"), &v)?;
            let (k, v) = cached_kv(self.cache, &k, &v, i, taps)?;
            let a = attention(&q, &k, &v, self.q_scale, mask)?;
            tap(taps, &name("attn"), &a)?;
            let a = rms_norm(&linear(&a, &l.wo)?, &l.post_attn_norm, self.eps)?;
            tap(taps, &name("attn_out"), &a)?;
            let resid = (x + a)?;
            let m = rms_norm(&resid, &l.ffn_norm, self.eps)?;
            tap(taps, &name("ffn_norm"), &m)?;
            let f = gated_ffn(&m, &l.gate, &l.up, &l.down, Activation::GeluTanh)?;
            let f = rms_norm(&f, &l.post_ffn_norm, self.eps)?;
            tap(taps, &name("ffn_out"), &f)?;
            x = (resid + f)?;
            tap(taps, &name("out"), &x)?;
        }
        let x = rms_norm(&x, &self.output_norm, self.eps)?;
        tap(taps, "output_norm", &x)?;
        Ok(x)
    }

    /// The output head on normed hidden states `x: [n, n_embd]`, soft-capped if configured.
    pub fn head(&self, x: &Tensor) -> Result<Tensor> {
        // soft-capping is elementwise: applied to each chunk of head rows as it is computed
        self.vocab.logits_with(x, |l| match self.softcap {
            Some(cap) => Ok(((l / cap)?.tanh()? * cap)?),
            None => Ok(l),
        })
    }
}
