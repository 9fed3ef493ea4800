//! [`CpuBackend`]: the forward-pass operations on the CPU.
//!
//! Matrix products are `kernels::cpu`'s quantized dot products (activations quantized as ggml
//! does); everything else is plain f32 here, written after ggml's CPU ops (RMSNorm sums in f64,
//! RoPE angles by repeated multiplication in f32, softmax sums in f64). Work runs on the
//! backend's own rayon pool, sized at construction; the ISA is chosen once, at construction.

use kernels::cpu::{CpuKernels, Isa};
use rayon::prelude::*;

use crate::model::{Activation, RopeConfig, RopeStyle};

use super::backend::{AttnParams, Backend, MatRef};
use super::error::check_len;
use super::RuntimeError;

/// The CPU backend: one ISA, one thread pool.
pub struct CpuBackend {
    kernels: CpuKernels,
    pool: rayon::ThreadPool,
    threads: usize,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("isa", &self.kernels.isa())
            .field("threads", &self.threads)
            .finish()
    }
}

impl CpuBackend {
    /// A backend for `isa` (default: the widest this CPU has) on `threads` workers (default:
    /// every available core). Fails if the CPU lacks the ISA.
    pub fn new(isa: Option<Isa>, threads: Option<usize>) -> Result<CpuBackend, RuntimeError> {
        let isa = isa.unwrap_or_else(Isa::detect);
        let kernels = CpuKernels::new(isa).map_err(RuntimeError::Backend)?;
        let threads = threads
            .filter(|&t| t > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("plumbline-cpu-{i}"))
            .build()
            .map_err(|e| RuntimeError::ThreadPool(e.to_string()))?;
        Ok(CpuBackend {
            kernels,
            pool,
            threads,
        })
    }

    pub fn isa(&self) -> Isa {
        self.kernels.isa()
    }
}

/// The `wrong-dequant-scale` fault: a copy of Q4_K blocks whose super-block scale `d` (the
/// block's first two bytes, an f16) reads as `d × 1.0625`, as a dequantizer that misread the
/// scale would. Only called while that fault is active.
fn q4k_with_wrong_scale(data: &[u8]) -> Vec<u8> {
    const BLOCK_BYTES: usize = 144; // size_of::<BlockQ4K>()
    let mut copy = data.to_vec();
    for block in copy.chunks_exact_mut(BLOCK_BYTES) {
        let d = half::f16::from_le_bytes([block[0], block[1]]);
        let wrong = half::f16::from_f32(d.to_f32() * 1.0625);
        block[..2].copy_from_slice(&wrong.to_le_bytes());
    }
    copy
}

/// ggml's RMSNorm of one row: the mean of squares summed in f64, then `x · 1/√(mean + eps)`,
/// then times the weight (a separate multiply in ggml, kept as a separate rounding here).
#[inline]
fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * g;
    }
}

/// YaRN's ramp between the extrapolated and interpolated angle (ggml's `rope_yarn_ramp`).
fn yarn_ramp(low: f32, high: f32, i0: usize) -> f32 {
    let y = ((i0 / 2) as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// ggml's `ggml_rope_yarn_corr_dims`.
fn yarn_corr_dims(
    n_dims: usize,
    n_ctx_orig: usize,
    base: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> [f32; 2] {
    let corr = |n_rot: f32| {
        n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let start = corr(beta_fast).floor();
    let end = corr(beta_slow).ceil();
    [start.max(0.0), end.min(n_dims as f32 - 1.0)]
}

/// The `(cos, sin)` of every pair of one position, ggml's `ggml_rope_cache_init`.
pub(crate) fn rope_cache(pos: usize, rope: &RopeConfig, cache: &mut Vec<(f32, f32)>) {
    let n_dims = rope.n_rot;
    cache.clear();
    let theta_scale = rope.freq_base.powf(-2.0 / n_dims as f32);
    let (corr, ext_factor, mut mscale) = match rope.yarn {
        Some(y) => (
            yarn_corr_dims(
                n_dims,
                y.n_ctx_orig,
                rope.freq_base,
                y.beta_fast,
                y.beta_slow,
            ),
            y.ext_factor,
            y.attn_factor,
        ),
        None => ([0.0, 0.0], 0.0, 1.0),
    };
    if ext_factor != 0.0 {
        mscale *= 1.0 + 0.1 * (1.0 / rope.freq_scale).ln();
    }
    let mut theta = pos as f32;
    for i0 in (0..n_dims).step_by(2) {
        let theta_interp = rope.freq_scale * theta;
        let t = if ext_factor != 0.0 {
            let mix = yarn_ramp(corr[0], corr[1], i0) * ext_factor;
            theta_interp * (1.0 - mix) + theta * mix
        } else {
            theta_interp
        };
        cache.push((t.cos() * mscale, t.sin() * mscale));
        theta *= theta_scale;
    }
}

#[inline]
fn rope_head(x: &mut [f32], cache: &[(f32, f32)], style: RopeStyle) {
    let n_dims = cache.len() * 2;
    match style {
        RopeStyle::Normal => {
            for (i, &(c, s)) in cache.iter().enumerate() {
                let (x0, x1) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = x0 * c - x1 * s;
                x[2 * i + 1] = x0 * s + x1 * c;
            }
        }
        RopeStyle::Neox => {
            let half = n_dims / 2;
            for (i, &(c, s)) in cache.iter().enumerate() {
                let (x0, x1) = (x[i], x[i + half]);
                x[i] = x0 * c - x1 * s;
                x[i + half] = x0 * s + x1 * c;
            }
        }
    }
}

#[inline]
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const GELU_COEF_A: f32 = 0.044_715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// One query head against the cache: scores, masked softmax, weighted sum of values.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_head: usize,
    pos: usize,
    p: &AttnParams,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let k_stride = p.n_head_kv * p.head_dim_k;
    let v_stride = p.n_head_kv * p.head_dim_v;
    let first = match p.window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    };
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for j in first..=pos {
        let kr = &k[j * k_stride + kv_head * p.head_dim_k..][..p.head_dim_k];
        let s = q.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * p.scale;
        max = max.max(s);
        scores.push(s);
    }
    let mut sum = 0f64;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += f64::from(*s);
    }
    let inv = (1.0 / sum) as f32;
    out.fill(0.0);
    for (idx, j) in (first..=pos).enumerate() {
        let w = scores[idx] * inv;
        let vr = &v[j * v_stride + kv_head * p.head_dim_v..][..p.head_dim_v];
        for (o, &x) in out.iter_mut().zip(vr) {
            *o += w * x;
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu-{}", self.kernels.isa().name())
    }

    fn threads(&self) -> usize {
        self.threads
    }

    fn matmul(
        &self,
        w: &MatRef<'_>,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let faulty;
        let data = if crate::faults::is_active(crate::faults::Fault::WrongDequantScale)
            && w.ty == kernels::quant::GgmlType::Q4K
        {
            faulty = q4k_with_wrong_scale(w.data);
            &faulty[..]
        } else {
            w.data
        };
        self.pool
            .install(|| {
                self.kernels
                    .matmul(w.ty, data, w.n_rows, w.k_dim, x, n_tokens, out)
            })
            .map_err(|source| RuntimeError::Kernel {
                name: w.name.to_owned(),
                source,
            })
    }

    fn rms_norm(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), RuntimeError> {
        let n = weight.len();
        check_len("rms_norm output", x.len(), out.len())?;
        if n == 0 || !x.len().is_multiple_of(n) {
            return Err(RuntimeError::Shape {
                op: "rms_norm input (a multiple of the weight length)",
                expected: n,
                found: x.len(),
            });
        }
        for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            rms_norm_row(xr, weight, eps, or);
        }
        Ok(())
    }

    fn rms_norm_inplace(
        &self,
        x: &mut [f32],
        weight: &[f32],
        eps: f32,
    ) -> Result<(), RuntimeError> {
        let n = weight.len();
        if n == 0 || !x.len().is_multiple_of(n) {
            return Err(RuntimeError::Shape {
                op: "rms_norm input (a multiple of the weight length)",
                expected: n,
                found: x.len(),
            });
        }
        let mut row = vec![0f32; n];
        for xr in x.chunks_exact_mut(n) {
            row.copy_from_slice(xr);
            rms_norm_row(&row, weight, eps, xr);
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut [f32],
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        rope: &RopeConfig,
    ) -> Result<(), RuntimeError> {
        check_len("rope input", n_tokens * n_heads * head_dim, x.len())?;
        if rope.n_rot > head_dim || !rope.n_rot.is_multiple_of(2) {
            return Err(RuntimeError::Shape {
                op: "rope dimensions (even, at most the head width)",
                expected: head_dim,
                found: rope.n_rot,
            });
        }
        let mut cache = Vec::with_capacity(rope.n_rot / 2);
        for (t, row) in x.chunks_exact_mut(n_heads * head_dim).enumerate() {
            rope_cache(pos0 + t, rope, &mut cache);
            for head in row.chunks_exact_mut(head_dim) {
                rope_head(&mut head[..rope.n_rot], &cache, rope.style);
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        p: &AttnParams,
        out: &mut [f32],
    ) -> Result<(), RuntimeError> {
        check_len("attention q", p.n_tokens * p.n_head * p.head_dim_k, q.len())?;
        check_len("attention k", p.n_kv * p.n_head_kv * p.head_dim_k, k.len())?;
        check_len("attention v", p.n_kv * p.n_head_kv * p.head_dim_v, v.len())?;
        check_len(
            "attention out",
            p.n_tokens * p.n_head * p.head_dim_v,
            out.len(),
        )?;
        if p.n_tokens > p.n_kv || p.n_head_kv == 0 || !p.n_head.is_multiple_of(p.n_head_kv) {
            return Err(RuntimeError::Shape {
                op: "attention (n_tokens <= n_kv, n_head a multiple of n_head_kv)",
                expected: p.n_kv,
                found: p.n_tokens,
            });
        }
        let group = p.n_head / p.n_head_kv;
        let pos0 = p.n_kv - p.n_tokens;
        self.pool.install(|| {
            out.par_chunks_mut(p.head_dim_v).enumerate().for_each_init(
                Vec::new,
                |scores, (i, o)| {
                    let (t, h) = (i / p.n_head, i % p.n_head);
                    let qh = &q[(t * p.n_head + h) * p.head_dim_k..][..p.head_dim_k];
                    attend_one(qh, k, v, h / group, pos0 + t, p, scores, o);
                },
            );
        });
        Ok(())
    }

    fn add(&self, x: &mut [f32], y: &[f32]) -> Result<(), RuntimeError> {
        check_len("add", x.len(), y.len())?;
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
        Ok(())
    }

    fn scale(&self, x: &mut [f32], s: f32) {
        for a in x.iter_mut() {
            *a *= s;
        }
    }

    fn gated_act(&self, act: Activation, gate: &mut [f32], up: &[f32]) -> Result<(), RuntimeError> {
        check_len("gated activation", gate.len(), up.len())?;
        match act {
            Activation::Silu => gate.iter_mut().zip(up).for_each(|(g, u)| *g = silu(*g) * u),
            Activation::GeluTanh => gate
                .iter_mut()
                .zip(up)
                .for_each(|(g, u)| *g = gelu_tanh(*g) * u),
        }
        Ok(())
    }

    fn softcap(&self, x: &mut [f32], cap: f32) {
        let inv = 1.0 / cap;
        for a in x.iter_mut() {
            *a = (*a * inv).tanh() * cap;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend() -> CpuBackend {
        CpuBackend::new(Some(Isa::Scalar), Some(1)).unwrap_or_else(|e| panic!("{e}"))
    }

    fn rope_cfg(style: RopeStyle, n_rot: usize) -> RopeConfig {
        RopeConfig {
            style,
            n_rot,
            freq_base: 10_000.0,
            freq_scale: 1.0,
            yarn: None,
        }
    }

    #[test]
    fn rms_norm_unit_rows() {
        // A row of equal values v has mean square v², so every output is w (up to eps).
        let b = backend();
        let x = [3.0f32; 8];
        let w = [0.5f32; 4];
        let mut out = [0f32; 8];
        b.rms_norm(&x, &w, 0.0, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        for o in out {
            approx::assert_abs_diff_eq!(o, 0.5, epsilon = 1e-6);
        }
    }

    #[test]
    fn rope_position_zero_is_identity_and_rotation_preserves_norm() {
        let b = backend();
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            let cfg = rope_cfg(style, 8);
            let x0: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.7).collect();
            let mut x = x0.clone();
            b.rope(&mut x, 1, 2, 8, 0, &cfg)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(x, x0);
            b.rope(&mut x, 1, 2, 8, 7, &cfg)
                .unwrap_or_else(|e| panic!("{e}"));
            let n0: f32 = x0.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            // A rotation keeps the norm; 1e-5 relative is f32 rounding over 16 values.
            approx::assert_relative_eq!(n0, n1, max_relative = 1e-5);
        }
    }

    #[test]
    fn rope_pairs_follow_the_style() {
        // Position 1, first pair: angle 1 radian (theta_scale^0). Normal rotates (x0, x1),
        // NeoX rotates (x0, x_{n/2}).
        let b = backend();
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        b.rope(&mut x, 1, 1, 4, 1, &rope_cfg(RopeStyle::Normal, 4))
            .unwrap_or_else(|e| panic!("{e}"));
        approx::assert_abs_diff_eq!(x[0], 1f32.cos(), epsilon = 1e-6);
        approx::assert_abs_diff_eq!(x[1], 1f32.sin(), epsilon = 1e-6);
        assert_eq!(x[2], 0.0);
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        b.rope(&mut x, 1, 1, 4, 1, &rope_cfg(RopeStyle::Neox, 4))
            .unwrap_or_else(|e| panic!("{e}"));
        approx::assert_abs_diff_eq!(x[0], 1f32.cos(), epsilon = 1e-6);
        approx::assert_abs_diff_eq!(x[2], 1f32.sin(), epsilon = 1e-6);
        assert_eq!(x[1], 0.0);
    }

    #[test]
    fn attention_window_masks_old_keys() {
        // One head, dim 1, keys all equal: the output is the mean of the visible values.
        let b = backend();
        let v: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let k = vec![1.0f32; 6];
        let q = vec![1.0f32; 1];
        let mut p = AttnParams {
            n_tokens: 1,
            n_kv: 6,
            n_head: 1,
            n_head_kv: 1,
            head_dim_k: 1,
            head_dim_v: 1,
            scale: 1.0,
            window: None,
        };
        let mut out = [0f32];
        b.attention(&q, &k, &v, &p, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        approx::assert_abs_diff_eq!(out[0], 2.5, epsilon = 1e-6);
        // Window 2 at position 5: keys 4 and 5 (llama.cpp masks p - j >= window).
        p.window = Some(2);
        b.attention(&q, &k, &v, &p, &mut out)
            .unwrap_or_else(|e| panic!("{e}"));
        approx::assert_abs_diff_eq!(out[0], 4.5, epsilon = 1e-6);
    }

    #[test]
    fn gelu_matches_known_values() {
        // GELU-tanh(1) = 0.8411920 (tanh approximation, computed in f64).
        approx::assert_abs_diff_eq!(gelu_tanh(1.0), 0.841_192, epsilon = 1e-6);
        approx::assert_abs_diff_eq!(gelu_tanh(0.0), 0.0);
        approx::assert_abs_diff_eq!(silu(0.0), 0.0);
    }

    #[test]
    fn shape_errors_are_reported() {
        let b = backend();
        let mut out = [0f32; 3];
        assert!(matches!(
            b.rms_norm(&[1.0; 4], &[1.0; 2], 1e-6, &mut out),
            Err(RuntimeError::Shape { .. })
        ));
    }
}
