//! `llama`: pre-norm decoder with GQA, RMSNorm, SwiGLU and normal (adjacent-pair) RoPE.
//!
//! Per layer (llama.cpp `llm_build_llama`):
//! `h = x + Wo·attn(rope(Wq·n), rope(Wk·n), Wv·n)` with `n = rmsnorm(x)·attn_norm`, scale
//! `1/√head_dim`; then `out = h + down(silu(gate·m) ⊙ up·m)` with `m = rmsnorm(h)·ffn_norm`.

use std::sync::Arc;

use candle_core::Tensor;

use super::{cached_kv, Layers, Loader, Streamer, Vocab};
use crate::numerics::CacheDtype;
use crate::ops::{
    attention, causal_mask, gated_ffn, linear, rms_norm, tap, Activation, Result, Rope, RopeLayout,
    Taps, Weight,
};

struct Layer {
    attn_norm: Tensor,
    wq: Weight,
    wk: Weight,
    wv: Weight,
    wo: Weight,
    ffn_norm: Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
}

pub(crate) struct Llama {
    n_embd: usize,
    n_ff: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim_k: usize,
    head_dim_v: usize,
    eps: f64,
    rope: Rope,
    vocab: Vocab,
    output_norm: Tensor,
    layers: Layers<Layer>,
    /// What attention reads back from the KV cache (exact-numerics mode may round it).
    pub(crate) cache: CacheDtype,
}

impl Llama {
    /// Read the configuration and the weights (eager), or only check the weights (`src`: the
    /// streaming model's file, read again layer by layer in [`Llama::forward`]).
    pub fn load(ld: &mut Loader<'_>, src: Option<&Arc<Streamer>>) -> Result<Self> {
        let n_embd = ld.usize("embedding_length")?;
        let n_layer = ld.usize("block_count")?;
        let n_ff = ld.usize("feed_forward_length")?;
        let n_head = ld.usize("attention.head_count")?;
        let n_head_kv = ld.usize_or("attention.head_count_kv", n_head)?;
        let head_dim_k = ld.usize_or("attention.key_length", n_embd / n_head.max(1))?;
        let head_dim_v = ld.usize_or("attention.value_length", head_dim_k)?;
        let eps = ld.f64("attention.layer_norm_rms_epsilon")?;
        ld.refuse_rope_freqs()?;
        let rope = Rope {
            layout: RopeLayout::Normal,
            n_rot: ld.usize_or("rope.dimension_count", head_dim_k)?,
            base: ld.f64_opt("rope.freq_base")?.unwrap_or(10_000.0),
            freq_scale: ld.rope_freq_scale()?,
        };
        let vocab = Vocab::load(ld, n_embd, src)?;
        let output_norm = ld.resident("output_norm.weight", &[n_embd])?;
        let mut m = Self {
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            eps,
            rope,
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
        let (n_embd, n_ff) = (self.n_embd, self.n_ff);
        let (n_head, n_head_kv) = (self.n_head, self.n_head_kv);
        let (head_dim_k, head_dim_v) = (self.head_dim_k, self.head_dim_v);
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        Ok(Layer {
            attn_norm: ld.tensor(&b("attn_norm"), &[n_embd])?,
            wq: ld.weight(&b("attn_q"), &[n_head * head_dim_k, n_embd])?,
            wk: ld.weight(&b("attn_k"), &[n_head_kv * head_dim_k, n_embd])?,
            wv: ld.weight(&b("attn_v"), &[n_head_kv * head_dim_v, n_embd])?,
            wo: ld.weight(&b("attn_output"), &[n_embd, n_head * head_dim_v])?,
            ffn_norm: ld.tensor(&b("ffn_norm"), &[n_embd])?,
            gate: ld.weight(&b("ffn_gate"), &[n_ff, n_embd])?,
            up: ld.weight(&b("ffn_up"), &[n_ff, n_embd])?,
            down: ld.weight(&b("ffn_down"), &[n_embd, n_ff])?,
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
        let mut x = self.vocab.embed(tokens)?;
        tap(taps, "embed", &x)?;
        let mask = causal_mask(n, None, x.dtype())?;
        let scale = 1.0 / (self.head_dim_k as f64).sqrt();
        for i in 0..self.layers.len() {
            let l = self.layers.get(i, |ld, i| self.load_layer(ld, i))?;
            let name = |s: &str| format!("blk.{i}.{s}");
            let h = rms_norm(&x, &l.attn_norm, self.eps)?;
            tap(taps, &name("attn_norm"), &h)?;
            let q = linear(&h, &l.wq)?.reshape((n, self.n_head, self.head_dim_k))?;
            let k = linear(&h, &l.wk)?.reshape((n, self.n_head_kv, self.head_dim_k))?;
            let v = linear(&h, &l.wv)?.reshape((n, self.n_head_kv, self.head_dim_v))?;
            let q = self.rope.apply(&q)?;
            let k = self.rope.apply(&k)?;
            tap(taps, &name("q"), &q)?;
            tap(taps, &name("k"), &k)?;
            tap(taps, &name("v"), &v)?;
            let (k, v) = cached_kv(self.cache, &k, &v, i, taps)?;
            let a = attention(&q, &k, &v, scale, &mask)?;
            tap(taps, &name("attn"), &a)?;
            let a = linear(&a, &l.wo)?;
            tap(taps, &name("attn_out"), &a)?;
            let resid = (x + a)?;
            let m = rms_norm(&resid, &l.ffn_norm, self.eps)?;
            tap(taps, &name("ffn_norm"), &m)?;
            let f = gated_ffn(&m, &l.gate, &l.up, &l.down, Activation::Silu)?;
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
}
