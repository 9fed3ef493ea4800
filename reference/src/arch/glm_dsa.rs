//! `glm-dsa` (GLM-5): `deepseek2`'s MLA and MoE ([`super::deepseek2`]) plus DeepSeek Sparse
//! Attention — a "lightning indexer" per layer that scores every earlier position and keeps the
//! `top_k` best for the attention — and multi-token-prediction (NextN) blocks stored after the
//! trunk, which a forward pass does not run.
//!
//! Written from the published description, each choice with its source:
//! - the indexer (DeepSeek-V3.2 report §2.1 and `inference/model.py`, `Indexer.forward`):
//!   `q = W_qb^I · q_latent` per indexer head (`q_latent` the normed MLA query latent),
//!   `k = LayerNorm(W_k^I · x)` one key head shared by all heads (`x` the attention's normed
//!   input), `w = W_proj^I · x`, and the index score `I(t, s) = Σ_h w_h · ReLU(q_h · k_s)`;
//! - the head weights scaled by `n_head^-½ · head_dim^-½` (`model.py`: `weights_proj(x) ·
//!   n_heads^-½`, then `· softmax_scale`, `softmax_scale = head_dim^-½`);
//! - RoPE on the first `rope.dimension_count` values of each indexer head and of the key
//!   (`model.py` splits `[q_pe, q_nope]`, pe first), interleaved pairs for GLM-5 (the GLM-MoE-DSA
//!   modeling code applies interleaved RoPE to the indexer, unlike DeepSeek-V3.2's half-split;
//!   llama.cpp's `glm-dsa.cpp` uses `LLAMA_ROPE_TYPE_NORM` there);
//! - the key's LayerNorm with weight and bias, eps 1e-6 (`model.py`'s `LayerNorm(head_dim)`
//!   default), or the file's `attention.layer_norm_epsilon`;
//! - per query, the `min(top_k, visible)` causally visible positions of highest score
//!   (`model.py`: `index_score += mask; topk(min(index_topk, end_pos))`), ties to the earlier
//!   position (a convention of this project, docs/TAPS.md: neither source defines one);
//! - the attention of the layer over the selected positions only (the MLA softmax with every
//!   other position masked out);
//! - GGUF names and per-layer types as llama.cpp writes them (`llama-arch.cpp`,
//!   `glm-dsa.cpp`): `blk.N.indexer.{attn_q_b, attn_k, k_norm (weight, bias), proj}`,
//!   `{arch}.attention.indexer.{head_count, key_length, top_k, types}`; a layer whose type is 0
//!   ("shared", GLM-5.2's `indexer_types`) reuses the selection of the last full layer before
//!   it; without the key every layer is full below a 1M context (GLM-5, 5.1) and GLM-5.2's
//!   pattern (layers 0, 1, then every fourth from 2) above it;
//! - `block_count` counts the NextN blocks (`nextn_predict_layers`); the trunk is the rest
//!   (llama.cpp `n_layer_all` / `n_layer()`).

use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, D};

use super::Loader;
use crate::error::ReferenceError;
use crate::numerics::CacheDtype;
use crate::ops::{linear, tap, Result, Rope, RopeLayout, Taps, Weight};
use crate::ForcedSelections;

/// The indexer's configuration, shared by every layer.
pub(crate) struct Dsa {
    n_head: usize,
    head_dim: usize,
    top_k: usize,
    rope: Rope,
    /// Per trunk layer: computes a fresh selection (true) or reuses the last one (false).
    full: Vec<bool>,
    eps: f64,
    /// The layers whose scores the next forwards keep, and what they kept
    /// ([`Dsa::record`], [`Dsa::take_recorded`]).
    recorded: Mutex<Recorded>,
}

/// Which full layers' scores to keep (`None`: every one), and the scores kept by layer
/// (`[query][position ≤ query]`); nothing is kept while `active` is false.
#[derive(Default)]
struct Recorded {
    active: bool,
    layer: Option<usize>,
    scores: IndexerScores,
}

/// A forward's indexer scores by full layer, `[query][key position ≤ query]` in f64.
pub type IndexerScores = std::collections::BTreeMap<usize, Vec<Vec<f64>>>;

/// One layer's indexer weights.
pub(crate) struct Indexer {
    q_b: Weight,
    k: Weight,
    k_norm: Tensor,
    k_norm_b: Tensor,
    proj: Weight,
}

impl Dsa {
    /// Read the `attention.indexer.*` keys for a trunk of `n_layer` layers.
    pub fn load(
        ld: &Loader<'_>,
        n_layer: usize,
        rope_dim: usize,
        base: f64,
        freq_scale: f64,
    ) -> Result<Dsa> {
        let n_head = ld.usize("attention.indexer.head_count")?;
        let head_dim = ld.usize("attention.indexer.key_length")?;
        let top_k = ld.usize("attention.indexer.top_k")?;
        if n_head == 0 || top_k == 0 || head_dim <= rope_dim {
            return Err(ReferenceError::Unsupported(format!(
                "glm-dsa indexer with {n_head} heads of {head_dim} (rope {rope_dim}), top-k {top_k}"
            )));
        }
        let key = format!("{}attention.indexer.types", ld.prefix);
        let full = match ld.file.metadata(&key) {
            Some(_) => {
                let flags = ld.file.get_flags(&key)?;
                if flags.len() < n_layer {
                    return Err(ReferenceError::BadKey {
                        key,
                        expected: "one flag per trunk layer",
                        found: format!("{} flags for {n_layer} layers", flags.len()),
                    });
                }
                flags[..n_layer].to_vec()
            }
            None if ld.usize_or("context_length", 0)? < 1 << 20 => vec![true; n_layer],
            None => (0..n_layer)
                .map(|i| i < 78 && (i < 2 || (i - 2) % 4 == 0))
                .collect(),
        };
        if full.first() == Some(&false) {
            return Err(ReferenceError::BadKey {
                key,
                expected: "layer 0 full",
                found: "shared".to_string(),
            });
        }
        Ok(Dsa {
            n_head,
            head_dim,
            top_k,
            rope: Rope {
                layout: RopeLayout::Normal,
                n_rot: rope_dim,
                base,
                freq_scale,
            },
            full,
            eps: ld.f64_opt("attention.layer_norm_epsilon")?.unwrap_or(1e-6),
            recorded: Mutex::new(Recorded::default()),
        })
    }

    /// Keep the scores of full layer `layer` (`None`: of every full layer) when the next
    /// forward computes them.
    pub fn record(&self, layer: Option<usize>) {
        *self.recorded.lock().unwrap_or_else(|p| p.into_inner()) = Recorded {
            active: true,
            layer,
            scores: IndexerScores::new(),
        };
    }

    /// The scores kept since [`Dsa::record`], by layer, and stop keeping.
    pub fn take_recorded(&self) -> IndexerScores {
        std::mem::take(&mut *self.recorded.lock().unwrap_or_else(|p| p.into_inner())).scores
    }

    /// Whether trunk layer `i` computes its own selection.
    pub fn is_full(&self, i: usize) -> bool {
        self.full.get(i).copied().unwrap_or(false)
    }

    /// Layer `i`'s indexer: required on a full layer, read when present on a shared one.
    pub fn load_indexer(
        &self,
        ld: &mut Loader<'_>,
        i: usize,
        q_lora_rank: usize,
        n_embd: usize,
        required: bool,
    ) -> Result<Option<Indexer>> {
        let b = |s: &str| format!("blk.{i}.indexer.{s}.weight");
        if !required && !ld.file.has_tensor(&b("attn_k")) {
            return Ok(None);
        }
        let hd = self.head_dim;
        Ok(Some(Indexer {
            q_b: ld.weight(&b("attn_q_b"), &[self.n_head * hd, q_lora_rank])?,
            k: ld.weight(&b("attn_k"), &[hd, n_embd])?,
            k_norm: ld.tensor(&b("k_norm"), &[hd])?,
            k_norm_b: ld.tensor(&format!("blk.{i}.indexer.k_norm.bias"), &[hd])?,
            proj: ld.weight(&b("proj"), &[self.n_head, n_embd])?,
        }))
    }

    /// The indexer of layer `i` on the attention input `x` `[n, n_embd]` and the normed query
    /// latent `q_latent` `[n, q_lora_rank]`: each query's selected positions (ascending), and
    /// the tap `blk.{i}.indexer_top_k`. A query of `forced` takes its given positions instead.
    /// The keys are scored as the indexer's cache hands them back (`cache`: rounded to f16,
    /// and then also the tap `blk.{i}.indexer_k_cache`, with an f16 cache).
    #[allow(clippy::too_many_arguments)]
    pub fn select(
        &self,
        ix: &Indexer,
        x: &Tensor,
        q_latent: &Tensor,
        i: usize,
        forced: &ForcedSelections,
        cache: CacheDtype,
        taps: Taps<'_>,
    ) -> Result<Vec<Vec<usize>>> {
        let n = x.dim(0)?;
        let (h, hd) = (self.n_head, self.head_dim);
        let q = self
            .rope
            .apply(&linear(q_latent, &ix.q_b)?.reshape((n, h, hd))?)?;
        let k = layer_norm(&linear(x, &ix.k)?, &ix.k_norm, &ix.k_norm_b, self.eps)?;
        let k = self.rope.apply(&k.reshape((n, 1, hd))?)?.reshape((n, hd))?;
        let k = if cache == CacheDtype::F32 {
            k
        } else {
            let k = cache.apply(&k)?;
            tap(taps, &format!("blk.{i}.indexer_k_cache"), &k)?;
            k
        };
        let w = (linear(x, &ix.proj)? * (1.0 / ((h * hd) as f64).sqrt()))?; // [n, h]
                                                                            // [h, n, hd] · [hd, n] → [h, n_query, n_key]; ReLU; weighted by w[query, h]; summed.
        let dots = q
            .transpose(0, 1)?
            .contiguous()?
            .broadcast_matmul(&k.t()?.contiguous()?)?
            .relu()?;
        let w = w.t()?.contiguous()?.reshape((h, n, 1))?;
        let scores = dots
            .broadcast_mul(&w)?
            .sum(0)?
            .to_dtype(DType::F64)?
            .to_vec2::<f64>()?;
        {
            let mut r = self.recorded.lock().unwrap_or_else(|p| p.into_inner());
            if r.active && r.layer.is_none_or(|l| l == i) {
                let visible = scores
                    .iter()
                    .enumerate()
                    .map(|(t, row)| row[..=t].to_vec())
                    .collect();
                r.scores.insert(i, visible);
            }
        }
        let mut selected = Vec::with_capacity(n);
        for (t, row) in scores.iter().enumerate() {
            if let Some(f) = forced.get(&(i, t)) {
                let mut f = f.clone();
                f.sort_unstable();
                f.dedup();
                if f.len() != self.top_k.min(t + 1) || f.iter().any(|&p| p > t) {
                    return Err(ReferenceError::Unsupported(format!(
                        "forced selection of layer {i}, query {t}: expected {} distinct \
                         positions at most {t}, found {:?}",
                        self.top_k.min(t + 1),
                        forced.get(&(i, t))
                    )));
                }
                selected.push(f);
                continue;
            }
            let mut cand: Vec<usize> = (0..=t).collect();
            // Highest score first, ties to the earlier position.
            cand.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            cand.truncate(self.top_k);
            cand.sort_unstable();
            selected.push(cand);
        }
        let mut tap_rows = Vec::with_capacity(n * self.top_k);
        for s in &selected {
            tap_rows.extend(s.iter().map(|&p| p as f32));
            tap_rows.extend(std::iter::repeat_n(-1f32, self.top_k - s.len()));
        }
        let t = Tensor::from_vec(tap_rows, (n, self.top_k), &Device::Cpu)?;
        tap(taps, &format!("blk.{i}.indexer_top_k"), &t)?;
        Ok(selected)
    }

    /// The additive mask `[n, n]` of a selection: 0 at each query's selected positions, −∞
    /// elsewhere.
    pub fn mask(selected: &[Vec<usize>], dtype: DType) -> Result<Tensor> {
        let n = selected.len();
        let mut m = vec![f32::NEG_INFINITY; n * n];
        for (t, s) in selected.iter().enumerate() {
            for &p in s {
                m[t * n + p] = 0.0;
            }
        }
        Ok(Tensor::from_vec(m, (n, n), &Device::Cpu)?.to_dtype(dtype)?)
    }
}

/// LayerNorm over the last dimension: `(x − mean) / sqrt(var + eps) · w + b`, biased variance.
fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let c = x.broadcast_sub(&mean)?;
    let var = c.sqr()?.mean_keepdim(D::Minus1)?;
    let y = c.broadcast_div(&var.affine(1.0, eps)?.sqrt()?)?;
    Ok(y.broadcast_mul(w)?.broadcast_add(b)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).expect("test tensor")
    }

    #[test]
    fn layer_norm_centres_and_scales() {
        // x = [1, 2, 3, 4]: mean 2.5, biased variance 1.25.
        let y = layer_norm(
            &t(&[1.0, 2.0, 3.0, 4.0], &[1, 4]),
            &t(&[1.0, 1.0, 2.0, 2.0], &[4]),
            &t(&[0.0, 0.5, 0.0, 0.5], &[4]),
            0.0,
        )
        .expect("layer_norm");
        let y = y
            .flatten_all()
            .and_then(|y| y.to_vec1::<f64>())
            .expect("values");
        let s = 1.25f64.sqrt();
        let want = [-1.5 / s, -0.5 / s + 0.5, 2.0 * 0.5 / s, 2.0 * 1.5 / s + 0.5];
        for (g, w) in y.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{y:?}");
        }
    }

    #[test]
    fn selection_mask_shows_only_selected_positions() {
        let m = Dsa::mask(&[vec![0], vec![1], vec![0, 2]], DType::F64).expect("mask");
        let v = m
            .flatten_all()
            .and_then(|m| m.to_vec1::<f64>())
            .expect("values");
        let vis: Vec<bool> = v.iter().map(|x| x.is_finite()).collect();
        #[rustfmt::skip]
        let want = [
            true, false, false,
            false, true, false,
            true, false, true,
        ];
        assert_eq!(vis, want);
    }
}
