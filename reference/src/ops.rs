//! The building blocks of the three forward passes, each the textbook formula on candle tensors.
//!
//! Activations are `[n_tokens, width]` (one row per token) or `[n_tokens, n_heads, head_dim]`;
//! weights are `[out, in]` (GGUF's `ne = [in, out]` reversed), so a projection is `x · Wᵀ`.

use candle_core::{DType, Device, Tensor, D};

use crate::error::ReferenceError;
use crate::numerics::ActQuant;

pub(crate) type Result<T> = std::result::Result<T, ReferenceError>;

/// The tap observer handed to `forward`.
pub(crate) type Taps<'a> = &'a mut crate::TapObserver<'a>;

/// Hand a `[n_tokens, …]` activation to the observer as `[n_tokens, width]` f32, row-major.
pub(crate) fn tap(taps: Taps<'_>, name: &str, t: &Tensor) -> Result<()> {
    let n_tokens = t.dim(0)?;
    let width = t.elem_count() / n_tokens.max(1);
    let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    taps(name, &[n_tokens, width], &data);
    Ok(())
}

/// A matrix-product weight: the dequantized tensor, and how the activations it multiplies are
/// rounded first ([`ActQuant::None`] except in exact-numerics mode, see [`crate::numerics`]).
#[derive(Debug, Clone)]
pub(crate) struct Weight {
    pub w: Tensor,
    pub act: ActQuant,
}

impl Weight {
    /// Slice `i` of the outermost dimension (one expert, one head), same activation rounding.
    pub fn get(&self, i: usize) -> Result<Weight> {
        Ok(Weight {
            w: self.w.get(i)?,
            act: self.act,
        })
    }
}

/// `x · Wᵀ` for `x: [n, in]`, `w: [out, in]`, with `x` first rounded as `w`'s dot product reads it.
pub(crate) fn linear(x: &Tensor, w: &Weight) -> Result<Tensor> {
    Ok(w.act.apply(x)?.matmul(&w.w.t()?)?)
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) · w`.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let denom = ms.affine(1.0, eps)?.sqrt()?;
    Ok(x.broadcast_div(&denom)?.broadcast_mul(w)?)
}

/// Softmax over the last dimension (max-subtracted).
pub(crate) fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&sum)?)
}

/// The two RoPE layouts llama.cpp knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RopeLayout {
    /// `LLAMA_ROPE_TYPE_NORM`: rotate adjacent pairs `(x[2i], x[2i+1])`.
    Normal,
    /// `LLAMA_ROPE_TYPE_NEOX`: rotate `(x[i], x[i + n_rot/2])`.
    Neox,
}

/// Rotary position embedding parameters of one layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rope {
    pub layout: RopeLayout,
    /// Rotated dimensions per head (the first `n_rot` of each head); the rest pass through.
    pub n_rot: usize,
    pub base: f64,
    /// Linear position scaling (`1 / rope.scaling.factor`), 1 when the file has none.
    pub freq_scale: f64,
}

impl Rope {
    /// Apply to `x: [n_tokens, n_heads, head_dim]` at positions `0..n_tokens`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (n_tokens, n_heads, head_dim) = x.dims3()?;
        let n_rot = self.n_rot;
        if n_rot == 0 {
            return Ok(x.clone());
        }
        let half = n_rot / 2;
        // angle(p, i) = p · freq_scale · base^(−2i / n_rot), computed in f64 for both precisions
        let mut cos = Vec::with_capacity(n_tokens * half);
        let mut sin = Vec::with_capacity(n_tokens * half);
        for p in 0..n_tokens {
            for i in 0..half {
                let theta =
                    p as f64 * self.freq_scale * self.base.powf(-2.0 * i as f64 / n_rot as f64);
                cos.push(theta.cos());
                sin.push(theta.sin());
            }
        }
        let dtype = x.dtype();
        let cos = Tensor::from_vec(cos, (n_tokens, 1, half), &Device::Cpu)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (n_tokens, 1, half), &Device::Cpu)?.to_dtype(dtype)?;
        let rot = x.narrow(2, 0, n_rot)?;
        let (x0, x1) = match self.layout {
            RopeLayout::Normal => {
                let pairs = rot.reshape((n_tokens, n_heads, half, 2))?;
                (
                    pairs.narrow(3, 0, 1)?.squeeze(3)?,
                    pairs.narrow(3, 1, 1)?.squeeze(3)?,
                )
            }
            RopeLayout::Neox => (rot.narrow(2, 0, half)?, rot.narrow(2, half, half)?),
        };
        let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        let rotated = match self.layout {
            RopeLayout::Normal => {
                Tensor::stack(&[&y0, &y1], 3)?.reshape((n_tokens, n_heads, n_rot))?
            }
            RopeLayout::Neox => Tensor::cat(&[&y0, &y1], 2)?,
        };
        if n_rot == head_dim {
            Ok(rotated)
        } else {
            let pass = x.narrow(2, n_rot, head_dim - n_rot)?;
            Ok(Tensor::cat(&[&rotated, &pass], 2)?)
        }
    }
}

/// Additive causal mask `[n, n]`: 0 where query `i` may attend key `j`, −∞ elsewhere. Key `j` is
/// visible when `j ≤ i` and, with a sliding window `w`, `i − j < w` (llama.cpp's
/// `LLAMA_SWA_TYPE_STANDARD`: masked when `p_query − p_key ≥ n_swa`).
pub(crate) fn causal_mask(n: usize, window: Option<usize>, dtype: DType) -> Result<Tensor> {
    let mut m = vec![0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            let visible = j <= i && window.is_none_or(|w| i - j < w);
            if !visible {
                m[i * n + j] = f32::NEG_INFINITY;
            }
        }
    }
    Ok(Tensor::from_vec(m, (n, n), &Device::Cpu)?.to_dtype(dtype)?)
}

/// Scaled dot-product attention with grouped KV heads.
///
/// `q: [n, n_head, dk]`, `k: [n, n_head_kv, dk]`, `v: [n, n_head_kv, dv]`; query head `h` uses KV
/// head `h / (n_head / n_head_kv)` (ggml's broadcast). Returns `[n, n_head · dv]`.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &Tensor,
) -> Result<Tensor> {
    let (n, n_head, dk) = q.dims3()?;
    let n_head_kv = k.dim(1)?;
    let dv = v.dim(2)?;
    if n_head_kv == 0 || n_head % n_head_kv != 0 {
        return Err(ReferenceError::Unsupported(format!(
            "{n_head} query heads cannot share {n_head_kv} KV heads"
        )));
    }
    let group = n_head / n_head_kv;
    let expand = |t: &Tensor, d: usize| -> Result<Tensor> {
        // [n, n_head_kv, d] → [n_head_kv, n, d] → [n_head_kv, group, n, d] → [n_head, n, d]
        let t = t.transpose(0, 1)?.contiguous()?;
        Ok(t.unsqueeze(1)?
            .broadcast_as((n_head_kv, group, n, d))?
            .reshape((n_head, n, d))?)
    };
    let q = q.transpose(0, 1)?.contiguous()?; // [n_head, n, dk]
    let k = expand(k, dk)?;
    let v = expand(v, dv)?;
    let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(mask)?;
    let probs = softmax_last(&scores)?;
    let out = probs.matmul(&v)?; // [n_head, n, dv]
    Ok(out
        .transpose(0, 1)?
        .contiguous()?
        .reshape((n, n_head * dv))?)
}

/// Gated FFN `down(act(gate(x)) ⊙ up(x))` (llama.cpp's `LLM_FFN_PAR`).
pub(crate) fn gated_ffn(
    x: &Tensor,
    gate: &Weight,
    up: &Weight,
    down: &Weight,
    act: Activation,
) -> Result<Tensor> {
    let g = linear(x, gate)?;
    let g = match act {
        Activation::Silu => g.silu()?,
        Activation::GeluTanh => g.gelu()?,
    };
    let h = (g * linear(x, up)?)?;
    linear(&h, down)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    /// `x · sigmoid(x)` (llama.cpp `LLM_FFN_SILU`).
    Silu,
    /// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))` (llama.cpp `LLM_FFN_GELU`).
    GeluTanh,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).expect("test tensor")
    }

    fn vals(t: &Tensor) -> Vec<f64> {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f64>())
            .expect("test values")
    }

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        // x = [3, 3, 3, 3]: mean(x²) = 9, so x/3 = 1 and the output is w (eps 0).
        let y = rms_norm(&t(&[3.0; 4], &[1, 4]), &t(&[1.0, 2.0, 3.0, 4.0], &[4]), 0.0)
            .expect("rms_norm");
        assert_eq!(vals(&y), vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rope_normal_rotates_adjacent_pairs_neox_rotates_halves() {
        // One head of 4 dims at position 1 with base chosen so that pair 0 turns by 1 rad and
        // pair 1 by base^(−1/2) = 0.5 rad: base = 4.
        let x = t(&[0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0], &[2, 1, 4]);
        let rope = |layout| Rope {
            layout,
            n_rot: 4,
            base: 4.0,
            freq_scale: 1.0,
        };
        let (c1, s1, c2, s2) = (1f64.cos(), 1f64.sin(), 0.5f64.cos(), 0.5f64.sin());
        let normal = vals(&rope(RopeLayout::Normal).apply(&x).expect("rope"));
        let want = [
            1.0 * c1 - 2.0 * s1,
            1.0 * s1 + 2.0 * c1,
            3.0 * c2 - 4.0 * s2,
            3.0 * s2 + 4.0 * c2,
        ];
        for (g, w) in normal[4..].iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{normal:?}");
        }
        let neox = vals(&rope(RopeLayout::Neox).apply(&x).expect("rope"));
        let want = [
            1.0 * c1 - 3.0 * s1,
            2.0 * c2 - 4.0 * s2,
            1.0 * s1 + 3.0 * c1,
            2.0 * s2 + 4.0 * c2,
        ];
        for (g, w) in neox[4..].iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{neox:?}");
        }
        // position 0 is the identity
        assert_eq!(&normal[..4], &[0.0; 4]);
    }

    #[test]
    fn partial_rope_passes_the_tail_through() {
        let x = t(
            &[0.0; 6]
                .iter()
                .chain(&[1.0, 2.0, 5.0, 6.0, 7.0, 8.0])
                .copied()
                .collect::<Vec<_>>(),
            &[2, 1, 6],
        );
        let rope = Rope {
            layout: RopeLayout::Normal,
            n_rot: 2,
            base: 10000.0,
            freq_scale: 1.0,
        };
        let y = vals(&rope.apply(&x).expect("rope"));
        assert_eq!(&y[8..], &[5.0, 6.0, 7.0, 8.0]);
    }

    #[test]
    fn sliding_window_mask() {
        let m = causal_mask(4, Some(2), DType::F64).expect("mask");
        let m = vals(&m);
        let visible: Vec<bool> = m.iter().map(|v| v.is_finite()).collect();
        #[rustfmt::skip]
        let want = [
            true, false, false, false,
            true, true, false, false,
            false, true, true, false,
            false, false, true, true,
        ];
        assert_eq!(visible, want);
    }

    #[test]
    fn attention_with_one_visible_key_returns_its_value() {
        // Query 0 sees only key 0, so its output is v[0] whatever the scores.
        let q = t(&[1.0, 0.0, 0.0, 1.0], &[2, 1, 2]);
        let k = t(&[5.0, 5.0, 1.0, 1.0], &[2, 1, 2]);
        let v = t(&[7.0, 8.0, 1.0, 2.0], &[2, 1, 2]);
        let mask = causal_mask(2, None, DType::F64).expect("mask");
        let y = vals(&attention(&q, &k, &v, 1.0, &mask).expect("attention"));
        assert_eq!(&y[..2], &[7.0, 8.0]);
        // query 1 = [0, 1]: scores 5 and 1 → weights e⁵/(e⁵+e), e/(e⁵+e)
        let (a, b) = (5f64.exp(), 1f64.exp());
        let want = [(7.0 * a + b) / (a + b), (8.0 * a + 2.0 * b) / (a + b)];
        assert!((y[2] - want[0]).abs() < 1e-12 && (y[3] - want[1]).abs() < 1e-12);
    }

    #[test]
    fn grouped_heads_share_kv_in_blocks() {
        // 2 query heads, 1 KV head: both heads read the same single key/value.
        let q = t(&[1.0, 2.0], &[1, 2, 1]);
        let k = t(&[3.0], &[1, 1, 1]);
        let v = t(&[4.0], &[1, 1, 1]);
        let mask = causal_mask(1, None, DType::F64).expect("mask");
        let y = vals(&attention(&q, &k, &v, 1.0, &mask).expect("attention"));
        assert_eq!(y, vec![4.0, 4.0]);
    }
}
