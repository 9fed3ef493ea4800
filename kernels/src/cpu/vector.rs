//! Vector kernels of the forward pass outside the matrix products: the gated GELU of the
//! feed-forward block, and the f32 · f32/f16 dot products and `y += a·x` updates of attention
//! over the KV cache. Scalar twins first (the oracle and the fallback), then AVX2 and AVX-512;
//! [`VectorFns::select`] picks one set per ISA, once, at backend construction.

use half::f16;

use crate::quant::{BlockQ8K, BlockQ8_0};

/// `gate[i] = gelu_tanh(gate[i]) · up[i]`.
pub type GeluMul = fn(&mut [f32], &[f32]);
/// `Σ a[i] · b[i]` over `a.len()` elements (`b` at least as long).
pub type Dot<T> = fn(&[f32], &[T]) -> f32;
/// `y[i] += a · x[i]` over `y.len()` elements (`x` at least as long).
pub type Axpy<T> = fn(&mut [f32], f32, &[T]);
/// Attention's weighted sum of value rows: `out[i] = Σ_j w[j] · v[cells[j]·stride + offset + i]`
/// over `out.len()` elements, summed in the order of `cells` and rounded per element exactly as
/// that many [`Axpy`] calls of the same ISA into a zeroed `out` (so the two agree bit for bit),
/// but with `out` held in registers across the cells instead of read and written per cell.
/// `w` holds at least `cells.len()` weights; every row named must lie inside `v`.
pub type WSum<T> = fn(&mut [f32], &[f32], &[T], WRows<'_>);

/// Attention scores of `n_q` query rows against the key rows named by `rows`: `q` is
/// `n_q × d` (`d = q.len() / n_q`), `out[i · m + j] = q_i · k[row j]` for the `m` cells, each
/// bit-identical to the ISA's [`Dot`] of the same two rows. The query heads that share a KV head
/// (grouped-query attention) go through one call, so each key row is read once for all of them.
pub type Scores<T> = fn(&[f32], usize, &[T], WRows<'_>, &mut [f32]);
/// [`WSum`] for `n_q` rows of weights at once: `out` is `n_q × d`, `w` is `n_q × m`, and output
/// row `i` is bit-identical to [`WSum`] with weights `w[i · m..]`; each value row is read once
/// for all `n_q`.
pub type WSumN<T> = fn(&mut [f32], usize, &[f32], &[T], WRows<'_>);

/// Quantize f32 rows to activation blocks (`src.len()` = blocks × block size): bit-identical to
/// [`crate::quant::quantize_q8_0`] / [`crate::quant::quantize_q8k`], whose rounding it repeats.
pub type Quantize<B> = fn(&[f32], &mut [B]);

/// Which value rows a [`WSum`] reads: row `cells[j]` of `stride` elements, from `offset` on.
#[derive(Clone, Copy, Debug)]
pub struct WRows<'a> {
    pub cells: &'a [u32],
    pub stride: usize,
    pub offset: usize,
}

impl WRows<'_> {
    #[inline(always)]
    fn start(&self, j: usize) -> usize {
        self.cells[j] as usize * self.stride + self.offset
    }
}

/// One ISA's vector kernels.
#[derive(Clone, Copy)]
pub struct VectorFns {
    pub gelu_mul: GeluMul,
    pub dot_f32: Dot<f32>,
    pub dot_f16: Dot<f16>,
    pub axpy_f32: Axpy<f32>,
    pub axpy_f16: Axpy<f16>,
    pub wsum_f32: WSum<f32>,
    pub wsum_f16: WSum<f16>,
    pub scores_f32: Scores<f32>,
    pub scores_f16: Scores<f16>,
    pub wsum_n_f32: WSumN<f32>,
    pub wsum_n_f16: WSumN<f16>,
    pub quantize_q8_0: Quantize<BlockQ8_0>,
    pub quantize_q8k: Quantize<BlockQ8K>,
}

impl VectorFns {
    /// The kernels for `isa`; only called with an ISA the CPU has (the SIMD functions are safe
    /// wrappers that rely on it).
    pub(super) fn select(isa: super::Isa) -> VectorFns {
        #[cfg(target_arch = "x86_64")]
        {
            match isa {
                super::Isa::Avx512 => return x86::AVX512,
                super::Isa::Avx2 => return x86::AVX2,
                super::Isa::Scalar => {}
            }
        }
        let _ = isa;
        SCALAR
    }
}

pub(super) const SCALAR: VectorFns = VectorFns {
    gelu_mul: gelu_mul_scalar,
    dot_f32: dot_scalar::<f32>,
    dot_f16: dot_scalar::<f16>,
    axpy_f32: axpy_scalar::<f32>,
    axpy_f16: axpy_scalar::<f16>,
    wsum_f32: wsum_scalar::<f32>,
    wsum_f16: wsum_scalar::<f16>,
    scores_f32: scores_scalar_f32,
    scores_f16: scores_scalar_f16,
    wsum_n_f32: wsum_n_scalar_f32,
    wsum_n_f16: wsum_n_scalar_f16,
    quantize_q8_0: crate::quant::quantize_q8_0,
    quantize_q8k: crate::quant::quantize_q8k,
};

/// [`Scores`] and [`WSumN`] as loops over an ISA's [`Dot`] and [`WSum`] (one query row at a
/// time): the ISAs without a grouped kernel, bit-identical by construction.
macro_rules! grouped_by_rows {
    ($scores:ident, $wsum_n:ident, $t:ty, $dot:expr, $wsum:expr) => {
        fn $scores(q: &[f32], n_q: usize, k: &[$t], rows: WRows<'_>, out: &mut [f32]) {
            let (d, m) = (q.len() / n_q.max(1), rows.cells.len());
            for i in 0..n_q {
                let qi = &q[i * d..(i + 1) * d];
                for j in 0..m {
                    let s = rows.start(j);
                    out[i * m + j] = $dot(qi, &k[s..s + d]);
                }
            }
        }

        fn $wsum_n(out: &mut [f32], n_q: usize, w: &[f32], v: &[$t], rows: WRows<'_>) {
            let (d, m) = (out.len() / n_q.max(1), rows.cells.len());
            for i in 0..n_q {
                $wsum(
                    &mut out[i * d..(i + 1) * d],
                    &w[i * m..(i + 1) * m],
                    v,
                    rows,
                );
            }
        }
    };
}

grouped_by_rows!(
    scores_scalar_f32,
    wsum_n_scalar_f32,
    f32,
    dot_scalar::<f32>,
    wsum_scalar::<f32>
);
grouped_by_rows!(
    scores_scalar_f16,
    wsum_n_scalar_f16,
    f16,
    dot_scalar::<f16>,
    wsum_scalar::<f16>
);

/// √(2/π) and the cubic coefficient of GELU's tanh approximation (ggml's `GELU_COEF_A`).
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044_715;

/// GELU, tanh approximation, written as `x · σ(2z)` with `z = √(2/π)·x·(1 + a·x²)`: the same
/// function as `0.5·x·(1 + tanh z)` (since `1 + tanh z = 2σ(2z)`), without the cancellation of
/// `1 + tanh z` for large negative `x`. `exp` overflowing to +∞ gives the right limit, −0.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    let z = SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x);
    x / (1.0 + (-2.0 * z).exp())
}

fn gelu_mul_scalar(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

/// Widening to f32 (exact for f16).
pub trait Elem: Copy {
    fn f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

fn dot_scalar<T: Elem>(a: &[f32], b: &[T]) -> f32 {
    let b = &b[..a.len()];
    a.iter().zip(b).map(|(&x, &y)| x * y.f32()).sum()
}

fn axpy_scalar<T: Elem>(y: &mut [f32], a: f32, x: &[T]) {
    let x = &x[..y.len()];
    for (o, &v) in y.iter_mut().zip(x) {
        *o += a * v.f32();
    }
}

fn wsum_scalar<T: Elem>(out: &mut [f32], w: &[f32], v: &[T], rows: WRows<'_>) {
    out.fill(0.0);
    for j in 0..rows.cells.len() {
        let s = rows.start(j);
        axpy_scalar(out, w[j], &v[s..s + out.len()]);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{VectorFns, WRows, GELU_COEF_A, SQRT_2_OVER_PI};
    use crate::quant::{BlockQ8K, BlockQ8_0};

    pub(in crate::cpu) const AVX512: VectorFns = VectorFns {
        gelu_mul: gelu_mul_avx512,
        dot_f32: dot_f32_avx512,
        dot_f16: dot_f16_avx512,
        axpy_f32: axpy_f32_avx512,
        axpy_f16: axpy_f16_avx512,
        wsum_f32: wsum_f32_avx512,
        wsum_f16: wsum_f16_avx512,
        scores_f32: scores_f32_avx512,
        scores_f16: scores_f16_avx512,
        wsum_n_f32: wsum_n_f32_avx512,
        wsum_n_f16: wsum_n_f16_avx512,
        quantize_q8_0: quantize_q8_0_avx512,
        quantize_q8k: quantize_q8k_avx512,
    };

    pub(in crate::cpu) const AVX2: VectorFns = VectorFns {
        gelu_mul: gelu_mul_avx2,
        dot_f32: dot_f32_avx2,
        dot_f16: dot_f16_avx2,
        axpy_f32: axpy_f32_avx2,
        axpy_f16: axpy_f16_avx2,
        wsum_f32: wsum_f32_avx2,
        wsum_f16: wsum_f16_avx2,
        scores_f32: scores_f32_avx2,
        scores_f16: scores_f16_avx2,
        wsum_n_f32: wsum_n_f32_avx2,
        wsum_n_f16: wsum_n_f16_avx2,
        quantize_q8_0: crate::quant::quantize_q8_0,
        quantize_q8k: crate::quant::quantize_q8k,
    };

    grouped_by_rows!(
        scores_f32_avx2,
        wsum_n_f32_avx2,
        f32,
        dot_f32_avx2,
        wsum_f32_avx2
    );
    grouped_by_rows!(
        scores_f16_avx2,
        wsum_n_f16_avx2,
        f16,
        dot_f16_avx2,
        wsum_f16_avx2
    );

    // The safe wrappers: `VectorFns::select` hands them out only for an ISA the CPU has.
    macro_rules! wrap {
        ($name:ident, $inner:ident, ($($arg:ident: $ty:ty),*) $(-> $ret:ty)?) => {
            fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: only reachable through the table of an ISA this CPU supports
                // (`CpuKernels::new` checked it).
                unsafe { $inner($($arg),*) }
            }
        };
    }
    wrap!(gelu_mul_avx512, gelu_mul_512, (g: &mut [f32], u: &[f32]));
    wrap!(gelu_mul_avx2, gelu_mul_256, (g: &mut [f32], u: &[f32]));
    wrap!(dot_f32_avx512, dot_f32_512, (a: &[f32], b: &[f32]) -> f32);
    wrap!(dot_f16_avx512, dot_f16_512, (a: &[f32], b: &[f16]) -> f32);
    wrap!(dot_f32_avx2, dot_f32_256, (a: &[f32], b: &[f32]) -> f32);
    wrap!(dot_f16_avx2, dot_f16_256, (a: &[f32], b: &[f16]) -> f32);
    wrap!(axpy_f32_avx512, axpy_f32_512, (y: &mut [f32], s: f32, x: &[f32]));
    wrap!(axpy_f16_avx512, axpy_f16_512, (y: &mut [f32], s: f32, x: &[f16]));
    wrap!(axpy_f32_avx2, axpy_f32_256, (y: &mut [f32], s: f32, x: &[f32]));
    wrap!(axpy_f16_avx2, axpy_f16_256, (y: &mut [f32], s: f32, x: &[f16]));
    wrap!(wsum_f32_avx512, wsum_f32_512, (o: &mut [f32], w: &[f32], v: &[f32], r: WRows<'_>));
    wrap!(wsum_f16_avx512, wsum_f16_512, (o: &mut [f32], w: &[f32], v: &[f16], r: WRows<'_>));
    wrap!(wsum_f32_avx2, wsum_f32_256, (o: &mut [f32], w: &[f32], v: &[f32], r: WRows<'_>));
    wrap!(wsum_f16_avx2, wsum_f16_256, (o: &mut [f32], w: &[f32], v: &[f16], r: WRows<'_>));
    wrap!(quantize_q8_0_avx512, quantize_q8_0_512, (x: &[f32], o: &mut [BlockQ8_0]));
    wrap!(quantize_q8k_avx512, quantize_q8k_512, (x: &[f32], o: &mut [BlockQ8K]));
    wrap!(scores_f32_avx512, scores_f32_512, (q: &[f32], n: usize, k: &[f32], r: WRows<'_>, o: &mut [f32]));
    wrap!(scores_f16_avx512, scores_f16_512, (q: &[f32], n: usize, k: &[f16], r: WRows<'_>, o: &mut [f32]));
    wrap!(wsum_n_f32_avx512, wsum_n_f32_512, (o: &mut [f32], n: usize, w: &[f32], v: &[f32], r: WRows<'_>));
    wrap!(wsum_n_f16_avx512, wsum_n_f16_512, (o: &mut [f32], n: usize, w: &[f32], v: &[f16], r: WRows<'_>));

    /// exp(x) for x ≤ 88.7 (larger gives +∞): x = n·ln2 + r with |r| ≤ ln2/2 (ln 2 split in
    /// two for an exact reduction), then Cephes' degree-6 polynomial for e^r (≈ 1 ulp), scaled by
    /// 2^n with `scalef`. Below −87.3 the result flushes towards 0, as expf does.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    fn exp512(x: __m512) -> __m512 {
        let x = _mm512_min_ps(x, _mm512_set1_ps(88.7));
        let x = _mm512_max_ps(x, _mm512_set1_ps(-103.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let r2 = _mm512_mul_ps(r, r);
        let e = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
        _mm512_scalef_ps(e, n)
    }

    /// [`exp512`] on eight lanes; 2^n built in the exponent bits (n clamped to the normal range,
    /// so the result flushes to 0 below about −87 and saturates to 2^127·e^r above 88).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn exp256(x: __m256) -> __m256 {
        let x = _mm256_min_ps(x, _mm256_set1_ps(88.3));
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.3));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let r2 = _mm256_mul_ps(r, r);
        let e = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(e, _mm256_castsi256_ps(bits))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    fn gelu_mul_512(gate: &mut [f32], up: &[f32]) {
        let n = gate.len();
        let up = &up[..n];
        let main = n / 16 * 16;
        for i in (0..main).step_by(16) {
            let g = &mut gate[i..i + 16];
            // SAFETY: `g` and `up[i..i + 16]` are 16 in-bounds f32; `loadu` has no alignment
            // requirement.
            let (x, u) = unsafe {
                (
                    _mm512_loadu_ps(g.as_ptr()),
                    _mm512_loadu_ps(up[i..i + 16].as_ptr()),
                )
            };
            let x2 = _mm512_mul_ps(x, x);
            let inner = _mm512_fmadd_ps(_mm512_set1_ps(GELU_COEF_A), x2, _mm512_set1_ps(1.0));
            let z = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(SQRT_2_OVER_PI), x), inner);
            let e = exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0), z));
            let y = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e));
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(g.as_mut_ptr(), _mm512_mul_ps(y, u)) };
        }
        super::gelu_mul_scalar(&mut gate[main..], &up[main..]);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn gelu_mul_256(gate: &mut [f32], up: &[f32]) {
        let n = gate.len();
        let up = &up[..n];
        let main = n / 8 * 8;
        for i in (0..main).step_by(8) {
            let g = &mut gate[i..i + 8];
            // SAFETY: `g` and `up[i..i + 8]` are 8 in-bounds f32.
            let (x, u) = unsafe {
                (
                    _mm256_loadu_ps(g.as_ptr()),
                    _mm256_loadu_ps(up[i..i + 8].as_ptr()),
                )
            };
            let x2 = _mm256_mul_ps(x, x);
            let inner = _mm256_fmadd_ps(_mm256_set1_ps(GELU_COEF_A), x2, _mm256_set1_ps(1.0));
            let z = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(SQRT_2_OVER_PI), x), inner);
            let e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0), z));
            let y = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(g.as_mut_ptr(), _mm256_mul_ps(y, u)) };
        }
        super::gelu_mul_scalar(&mut gate[main..], &up[main..]);
    }

    /// Sixteen f32 from `b` widened from f16 (`i` + 16 ≤ `b.len()`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    fn ld16_f16(b: &[f16], i: usize) -> __m512 {
        let s = &b[i..i + 16];
        // SAFETY: `s` is 16 in-bounds f16 (32 bytes).
        _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(s.as_ptr().cast()) })
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    fn ld16_f32(b: &[f32], i: usize) -> __m512 {
        let s = &b[i..i + 16];
        // SAFETY: `s` is 16 in-bounds f32.
        unsafe { _mm512_loadu_ps(s.as_ptr()) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn ld8_f16(b: &[f16], i: usize) -> __m256 {
        let s = &b[i..i + 8];
        // SAFETY: `s` is 8 in-bounds f16 (16 bytes).
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(s.as_ptr().cast()) })
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn ld8_f32(b: &[f32], i: usize) -> __m256 {
        let s = &b[i..i + 8];
        // SAFETY: `s` is 8 in-bounds f32.
        unsafe { _mm256_loadu_ps(s.as_ptr()) }
    }

    /// Whether any of the sixteen lanes of `a` (absolute values) is NaN or infinite.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    fn non_finite(a: __m512) -> bool {
        _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(a, _mm512_set1_ps(f32::INFINITY)) != 0
    }

    /// `roundf` (halves away from zero) of each lane, exactly: the truncation plus ±1 where the
    /// fraction it dropped (exact, below 2²³) is at least one half.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    fn round_half_away(x: __m512) -> __m512 {
        let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
        let frac = _mm512_abs_ps(_mm512_sub_ps(x, t));
        let half = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
        let sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN));
        let one = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x3F80_0000)));
        _mm512_mask_add_ps(t, half, t, one)
    }

    /// [`crate::quant::quantize_q8_0`] sixteen lanes at a time: the same `amax`, `d`, `1/d` and
    /// `roundf(x / d)` saturated to i8. A block with a NaN or infinity goes through the scalar
    /// quantizer (its casts of NaN differ from the vector conversion's).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    fn quantize_q8_0_512(src: &[f32], out: &mut [BlockQ8_0]) {
        for (x, b) in src.chunks_exact(32).zip(out.iter_mut()) {
            let v = [ld16_f32(x, 0), ld16_f32(x, 16)];
            let a = [_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])];
            if non_finite(a[0]) || non_finite(a[1]) {
                crate::quant::quantize_q8_0(x, std::slice::from_mut(b));
                continue;
            }
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a[0], a[1]));
            let d = amax / 127.0;
            let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            for (h, v) in v.into_iter().enumerate() {
                let q = _mm512_cvtps_epi32(round_half_away(_mm512_mul_ps(v, id)));
                let dst = &mut b.qs[16 * h..16 * (h + 1)];
                // SAFETY: `dst` is 16 writable bytes; `storeu` has no alignment requirement.
                unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(q)) };
            }
            b.d = f16::from_f32(d);
        }
    }

    /// [`crate::quant::quantize_q8k`] sixteen lanes at a time: the same signed maximum (the
    /// first element of largest magnitude), `iscale`, round-half-even codes capped at 127, sums
    /// per sixteen and `d`. A block with a NaN or infinity goes through the scalar quantizer.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    fn quantize_q8k_512(src: &[f32], out: &mut [BlockQ8K]) {
        for (x, b) in src.chunks_exact(256).zip(out.iter_mut()) {
            let mut v = [_mm512_setzero_ps(); 16];
            let mut m = _mm512_setzero_ps();
            let mut bad = false;
            for (i, v) in v.iter_mut().enumerate() {
                *v = ld16_f32(x, 16 * i);
                let a = _mm512_abs_ps(*v);
                bad |= non_finite(a);
                m = _mm512_max_ps(a, m);
            }
            if bad {
                crate::quant::quantize_q8k(x, std::slice::from_mut(b));
                continue;
            }
            let amax = _mm512_reduce_max_ps(m);
            if amax == 0.0 {
                *b = bytemuck::Zeroable::zeroed();
                continue;
            }
            let first = v.iter().enumerate().find_map(|(i, &v)| {
                let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(v), _mm512_set1_ps(amax));
                (hit != 0).then(|| 16 * i + hit.trailing_zeros() as usize)
            });
            let Some(first) = first else {
                crate::quant::quantize_q8k(x, std::slice::from_mut(b));
                continue;
            };
            let iscale = -127.0 / x[first];
            let s = _mm512_set1_ps(iscale);
            for (i, v) in v.into_iter().enumerate() {
                let p = _mm512_mul_ps(s, v);
                let r =
                    _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p);
                let q = _mm512_min_epi32(_mm512_cvtps_epi32(r), _mm512_set1_epi32(127));
                b.bsums[i] = _mm512_reduce_add_epi32(q) as i16;
                let dst = &mut b.qs[16 * i..16 * (i + 1)];
                // SAFETY: `dst` is 16 writable bytes; `storeu` has no alignment requirement.
                unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(q)) };
            }
            b.d = 1.0 / iscale;
        }
    }

    macro_rules! dot512 {
        ($name:ident, $t:ty, $ld:ident) => {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            fn $name(a: &[f32], b: &[$t]) -> f32 {
                let n = a.len();
                let b = &b[..n];
                let mut acc = [_mm512_setzero_ps(); 2];
                let main = n / 32 * 32;
                for i in (0..main).step_by(32) {
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let o = i + 16 * h;
                        *acc = _mm512_fmadd_ps(ld16_f32(a, o), $ld(b, o), *acc);
                    }
                }
                let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
                s += super::dot_scalar(&a[main..], &b[main..]);
                s
            }
        };
    }
    dot512!(dot_f32_512, f32, ld16_f32);
    dot512!(dot_f16_512, f16, ld16_f16);

    /// [`super::Scores`] at 512 bits: up to four query rows against two key rows at a time, each
    /// (query, key) pair with the two accumulators, the reduction and the scalar tail of
    /// `dot512`, so every score is bit-identical to [`dot_f32_512`] / [`dot_f16_512`].
    macro_rules! scores512 {
        ($name:ident, $block:ident, $t:ty, $ld:ident) => {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            #[inline]
            fn $block<const G: usize, const C: usize>(
                q: [&[f32]; G],
                k: [&[$t]; C],
            ) -> [[f32; C]; G] {
                let n = q[0].len();
                let main = n / 32 * 32;
                let mut acc = [[[_mm512_setzero_ps(); 2]; C]; G];
                for i in (0..main).step_by(32) {
                    for h in 0..2 {
                        let o = i + 16 * h;
                        let mut kv = [_mm512_setzero_ps(); C];
                        for c in 0..C {
                            kv[c] = $ld(k[c], o);
                        }
                        for g in 0..G {
                            let qv = ld16_f32(q[g], o);
                            for c in 0..C {
                                acc[g][c][h] = _mm512_fmadd_ps(qv, kv[c], acc[g][c][h]);
                            }
                        }
                    }
                }
                let mut out = [[0f32; C]; G];
                for g in 0..G {
                    for c in 0..C {
                        let v = _mm512_add_ps(acc[g][c][0], acc[g][c][1]);
                        out[g][c] = _mm512_reduce_add_ps(v)
                            + super::dot_scalar(&q[g][main..], &k[c][main..n]);
                    }
                }
                out
            }

            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            fn $name(q: &[f32], n_q: usize, k: &[$t], rows: WRows<'_>, out: &mut [f32]) {
                let (d, m) = (q.len() / n_q.max(1), rows.cells.len());
                let row = |j: usize| &k[rows.start(j)..rows.start(j) + d];
                let qr = |i: usize| &q[i * d..(i + 1) * d];
                let mut i = 0;
                while i < n_q {
                    let g = (n_q - i).min(4);
                    let mut j = 0;
                    while j < m {
                        let c = (m - j).min(2);
                        macro_rules! go {
                            ($g:literal, $c:literal) => {{
                                let v = $block::<$g, $c>(
                                    std::array::from_fn(|a| qr(i + a)),
                                    std::array::from_fn(|b| row(j + b)),
                                );
                                for a in 0..$g {
                                    for b in 0..$c {
                                        out[(i + a) * m + j + b] = v[a][b];
                                    }
                                }
                            }};
                        }
                        match (g, c) {
                            (4, 2) => go!(4, 2),
                            (4, _) => go!(4, 1),
                            (3, 2) => go!(3, 2),
                            (3, _) => go!(3, 1),
                            (2, 2) => go!(2, 2),
                            (2, _) => go!(2, 1),
                            (_, 2) => go!(1, 2),
                            _ => go!(1, 1),
                        }
                        j += c;
                    }
                    i += g;
                }
            }
        };
    }
    scores512!(scores_f32_512, scores_block_f32, f32, ld16_f32);
    scores512!(scores_f16_512, scores_block_f16, f16, ld16_f16);

    /// [`super::WSumN`] at 512 bits: for up to four weight rows at once, each 64-element block of
    /// the outputs is held in sixteen registers across the cells and each value row's block is
    /// loaded once for all of them, with the operations of `wsum` per output element; the rest of
    /// the row (under 64 elements) goes through the one-row kernel, which splits it as `wsum`
    /// would. Bit-identical to `wsum` per row.
    macro_rules! wsum_n512 {
        ($name:ident, $block:ident, $one:ident, $t:ty, $ld:ident) => {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            #[inline]
            fn $block<const G: usize>(
                out: &mut [f32],
                d: usize,
                w: &[f32],
                v: &[$t],
                rows: WRows<'_>,
                i: usize,
            ) {
                // `out`: G rows of `d`; `w`: G rows of one weight per cell.
                let m = rows.cells.len();
                let mut acc = [[_mm512_setzero_ps(); 4]; G];
                for j in 0..m {
                    let s = rows.start(j) + i;
                    let row = &v[s..s + 64];
                    let x = [$ld(row, 0), $ld(row, 16), $ld(row, 32), $ld(row, 48)];
                    for g in 0..G {
                        let a = _mm512_set1_ps(w[g * m + j]);
                        for h in 0..4 {
                            acc[g][h] = _mm512_fmadd_ps(a, x[h], acc[g][h]);
                        }
                    }
                }
                for (g, acc) in acc.into_iter().enumerate() {
                    for (h, acc) in acc.into_iter().enumerate() {
                        let o = &mut out[g * d + i + 16 * h..g * d + i + 16 * (h + 1)];
                        // SAFETY: `o` is 16 in-bounds f32.
                        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), acc) };
                    }
                }
            }

            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            fn $name(out: &mut [f32], n_q: usize, w: &[f32], v: &[$t], rows: WRows<'_>) {
                let (d, m) = (out.len() / n_q.max(1), rows.cells.len());
                if d == 0 {
                    return;
                }
                let block = d / 64 * 64;
                // Query rows four at a time (a decode step's lone head is a group of one).
                for (gi, group) in out.chunks_mut(4 * d).enumerate() {
                    let g = group.len() / d;
                    let wg = &w[4 * gi * m..(4 * gi + g) * m];
                    for i in (0..block).step_by(64) {
                        match g {
                            4 => $block::<4>(group, d, wg, v, rows, i),
                            3 => $block::<3>(group, d, wg, v, rows, i),
                            2 => $block::<2>(group, d, wg, v, rows, i),
                            _ => $block::<1>(group, d, wg, v, rows, i),
                        }
                    }
                    if block < d {
                        let rest = WRows {
                            offset: rows.offset + block,
                            ..rows
                        };
                        for (a, o) in group.chunks_exact_mut(d).enumerate() {
                            $one(&mut o[block..], &wg[a * m..(a + 1) * m], v, rest);
                        }
                    }
                }
            }
        };
    }
    wsum_n512!(
        wsum_n_f32_512,
        wsum_n_block_f32,
        wsum_f32_512,
        f32,
        ld16_f32
    );
    wsum_n512!(
        wsum_n_f16_512,
        wsum_n_block_f16,
        wsum_f16_512,
        f16,
        ld16_f16
    );

    macro_rules! dot256 {
        ($name:ident, $t:ty, $ld:ident) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            fn $name(a: &[f32], b: &[$t]) -> f32 {
                let n = a.len();
                let b = &b[..n];
                let mut acc = [_mm256_setzero_ps(); 2];
                let main = n / 16 * 16;
                for i in (0..main).step_by(16) {
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let o = i + 8 * h;
                        *acc = _mm256_fmadd_ps(ld8_f32(a, o), $ld(b, o), *acc);
                    }
                }
                let v = _mm256_add_ps(acc[0], acc[1]);
                let v = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
                let v = _mm_add_ss(v, _mm_movehdup_ps(v));
                _mm_cvtss_f32(v) + super::dot_scalar(&a[main..], &b[main..])
            }
        };
    }
    dot256!(dot_f32_256, f32, ld8_f32);
    dot256!(dot_f16_256, f16, ld8_f16);

    macro_rules! axpy512 {
        ($name:ident, $t:ty, $ld:ident) => {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            fn $name(y: &mut [f32], s: f32, x: &[$t]) {
                let n = y.len();
                let x = &x[..n];
                let sv = _mm512_set1_ps(s);
                let main = n / 16 * 16;
                for i in (0..main).step_by(16) {
                    let v = _mm512_fmadd_ps(sv, $ld(x, i), ld16_f32(y, i));
                    let o = &mut y[i..i + 16];
                    // SAFETY: `o` is 16 in-bounds f32.
                    unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
                }
                super::axpy_scalar(&mut y[main..], s, &x[main..]);
            }
        };
    }
    axpy512!(axpy_f32_512, f32, ld16_f32);
    axpy512!(axpy_f16_512, f16, ld16_f16);

    macro_rules! axpy256 {
        ($name:ident, $t:ty, $ld:ident) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            fn $name(y: &mut [f32], s: f32, x: &[$t]) {
                let n = y.len();
                let x = &x[..n];
                let sv = _mm256_set1_ps(s);
                let main = n / 8 * 8;
                for i in (0..main).step_by(8) {
                    let v = _mm256_fmadd_ps(sv, $ld(x, i), ld8_f32(y, i));
                    let o = &mut y[i..i + 8];
                    // SAFETY: `o` is 8 in-bounds f32.
                    unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
                }
                super::axpy_scalar(&mut y[main..], s, &x[main..]);
            }
        };
    }
    axpy256!(axpy_f32_256, f32, ld8_f32);
    axpy256!(axpy_f16_256, f16, ld8_f16);

    // The weighted sums: `out` in blocks of four vectors held in registers across every cell,
    // then single vectors, then the scalar tail (as the ISA's axpy splits a row: vector lanes
    // fused, the tail unfused), so each element sees the same operations as in the axpy loop.
    macro_rules! wsum {
        ($name:ident, $feat:literal, $t:ty, $lanes:literal, $zero:ident, $set1:ident,
         $fma:ident, $store:ident, $ld:ident) => {
            #[target_feature(enable = $feat)]
            fn $name(out: &mut [f32], w: &[f32], v: &[$t], rows: WRows<'_>) {
                let n = out.len();
                let m = rows.cells.len();
                let w = &w[..m];
                let (block, main) = (n / (4 * $lanes) * (4 * $lanes), n / $lanes * $lanes);
                let mut i = 0;
                while i < block {
                    let mut acc = [$zero(); 4];
                    for (j, &wj) in w.iter().enumerate() {
                        let s = rows.start(j) + i;
                        let row = &v[s..s + 4 * $lanes];
                        let a = $set1(wj);
                        for (h, acc) in acc.iter_mut().enumerate() {
                            *acc = $fma(a, $ld(row, $lanes * h), *acc);
                        }
                    }
                    for (h, acc) in acc.into_iter().enumerate() {
                        let o = &mut out[i + $lanes * h..i + $lanes * (h + 1)];
                        // SAFETY: `o` is `$lanes` in-bounds f32.
                        unsafe { $store(o.as_mut_ptr(), acc) };
                    }
                    i += 4 * $lanes;
                }
                while i < main {
                    let mut acc = $zero();
                    for (j, &wj) in w.iter().enumerate() {
                        let s = rows.start(j) + i;
                        acc = $fma($set1(wj), $ld(&v[s..s + $lanes], 0), acc);
                    }
                    let o = &mut out[i..i + $lanes];
                    // SAFETY: `o` is `$lanes` in-bounds f32.
                    unsafe { $store(o.as_mut_ptr(), acc) };
                    i += $lanes;
                }
                let tail = &mut out[main..];
                tail.fill(0.0);
                for (j, &wj) in w.iter().enumerate() {
                    let s = rows.start(j) + main;
                    super::axpy_scalar(tail, wj, &v[s..s + (n - main)]);
                }
            }
        };
    }
    wsum!(
        wsum_f32_512,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
        f32,
        16,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_storeu_ps,
        ld16_f32
    );
    wsum!(
        wsum_f16_512,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
        f16,
        16,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_storeu_ps,
        ld16_f16
    );
    wsum!(
        wsum_f32_256,
        "avx2,fma,f16c",
        f32,
        8,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_storeu_ps,
        ld8_f32
    );
    wsum!(
        wsum_f16_256,
        "avx2,fma,f16c",
        f16,
        8,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_storeu_ps,
        ld8_f16
    );
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::{gelu_tanh, VectorFns, SCALAR};
    use crate::cpu::Isa;

    /// GELU-tanh in f64. The textbook form 0.5·x·(1 + tanh z) loses every digit of `1 + tanh z`
    /// for x < −7 even in f64 (tanh z rounds to −1), so it is the oracle only above −3; below, the
    /// identity 1 + tanh z = 2 / (1 + e^(−2z)) is evaluated in f64.
    fn gelu_f64(x: f64) -> f64 {
        let z = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044_715 * x * x * x);
        if x > -3.0 {
            0.5 * x * (1.0 + z.tanh())
        } else {
            x / (1.0 + (-2.0 * z).exp())
        }
    }

    /// |z| of GELU's tanh argument at `x`.
    fn z_abs(x: f32) -> f64 {
        let x = f64::from(x);
        ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044_715 * x * x * x)).abs()
    }

    fn inputs(n: usize) -> Vec<f32> {
        // −12 … 12 unevenly, plus the special points.
        let mut v: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % n) as f32 / n as f32 - 0.5) * 24.0)
            .collect();
        v.extend([
            0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 100.0, -100.0, 1e-3, -1e-3,
        ]);
        v
    }

    fn sets() -> Vec<(Isa, VectorFns)> {
        Isa::available()
            .into_iter()
            .map(|i| (i, VectorFns::select(i)))
            .collect()
    }

    #[test]
    fn gelu_matches_f64_on_every_isa() {
        // Bound: a few f32 roundings of each step (z, exp, 1 + e, the division): 8 ulp of the
        // result; plus the f32 rounding of z itself (a few ulp of |z|), which e^(−2z) turns into
        // a relative error of |2z| times that: 4·|z| ulp (the function's own conditioning in f32
        // for x ≪ 0, where the result is e^(2z)·x). Plus an absolute 1e-30 for results that
        // underflow (the AVX2 exp saturates at 2^127 instead of +∞, leaving |x| / 2^127 ≈ 1e-36
        // instead of −0).
        for (isa, f) in sets() {
            for n in [0, 1, 15, 16, 17, 333] {
                let x = inputs(n);
                let mut g = x.clone();
                let up = vec![1.0f32; g.len()];
                (f.gelu_mul)(&mut g, &up);
                for (&xi, &gi) in x.iter().zip(&g) {
                    let want = gelu_f64(f64::from(xi));
                    let ulps = 8.0 + 4.0 * z_abs(xi);
                    let tol = ulps * f64::from(f32::EPSILON) * want.abs() + 1e-30;
                    assert!(
                        (f64::from(gi) - want).abs() <= tol,
                        "{isa} gelu({xi}) = {gi}, f64 {want}"
                    );
                }
            }
        }
        // GELU-tanh(1) = 0.8411920 (computed in f64).
        approx::assert_abs_diff_eq!(gelu_tanh(1.0), 0.841_192, epsilon = 1e-6);
    }

    #[test]
    fn gelu_mul_multiplies_by_up() {
        for (isa, f) in sets() {
            let x = inputs(40);
            let up: Vec<f32> = (0..x.len()).map(|i| i as f32 * 0.25 - 3.0).collect();
            let (mut a, mut b) = (x.clone(), x.clone());
            (f.gelu_mul)(&mut a, &up);
            (SCALAR.gelu_mul)(&mut b, &up);
            for i in 0..a.len() {
                // Both within the bound of the test above of the f64 value, so within twice it of
                // each other.
                let ulps = 2.0 * (8.0 + 4.0 * z_abs(x[i])) as f32;
                let tol = ulps * f32::EPSILON * b[i].abs() + 1e-30;
                assert!(
                    (a[i] - b[i]).abs() <= tol,
                    "{isa} at {i}: {} vs {}",
                    a[i],
                    b[i]
                );
            }
        }
    }

    /// The weighted sum is the ISA's axpy loop into a zeroed row, bit for bit: every head width
    /// with each kind of tail (four-vector blocks, single vectors, scalar elements), rows read
    /// out of order from a strided store at an offset, and zero, one or many cells.
    #[test]
    fn wsum_equals_the_axpy_loop_bit_for_bit() {
        use super::WRows;
        for (isa, f) in sets() {
            for n in [1, 7, 8, 16, 24, 64, 72, 100, 256] {
                let (stride, offset) = (2 * n + 3, n + 1);
                for cells in [vec![], vec![2u32], vec![4, 0, 3, 1, 2, 4]] {
                    let v32: Vec<f32> = (0..5 * stride)
                        .map(|i| ((i * 29 % 23) as f32 - 11.0) * 0.173)
                        .collect();
                    let v16: Vec<f16> = v32.iter().map(|&x| f16::from_f32(x)).collect();
                    let w: Vec<f32> = (0..cells.len()).map(|j| 0.3 - 0.11 * j as f32).collect();
                    let rows = WRows {
                        cells: &cells,
                        stride,
                        offset,
                    };
                    let (mut a32, mut a16) = (vec![0f32; n], vec![0f32; n]);
                    for (j, &c) in cells.iter().enumerate() {
                        let s = c as usize * stride + offset;
                        (f.axpy_f32)(&mut a32, w[j], &v32[s..s + n]);
                        (f.axpy_f16)(&mut a16, w[j], &v16[s..s + n]);
                    }
                    // Garbage in `out` first: the sum overwrites it.
                    let (mut o32, mut o16) = (vec![9f32; n], vec![9f32; n]);
                    (f.wsum_f32)(&mut o32, &w, &v32, rows);
                    (f.wsum_f16)(&mut o16, &w, &v16, rows);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&o32),
                        bits(&a32),
                        "{isa} wsum_f32 n {n} cells {cells:?}"
                    );
                    assert_eq!(
                        bits(&o16),
                        bits(&a16),
                        "{isa} wsum_f16 n {n} cells {cells:?}"
                    );
                }
            }
        }
    }

    /// The grouped kernels equal their one-row kernels bit for bit: every query count up to
    /// past one group of four, odd cell counts (a last key row alone), head widths with each
    /// kind of tail, rows out of order in a strided store at an offset.
    #[test]
    fn grouped_scores_and_sums_equal_the_one_row_kernels_bit_for_bit() {
        use super::WRows;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (isa, f) in sets() {
            for d in [1, 16, 40, 64, 72, 256, 257] {
                let (stride, offset) = (2 * d + 3, d + 1);
                let v32: Vec<f32> = (0..6 * stride)
                    .map(|i| ((i * 29 % 23) as f32 - 11.0) * 0.173)
                    .collect();
                let v16: Vec<f16> = v32.iter().map(|&x| f16::from_f32(x)).collect();
                for cells in [vec![], vec![2u32], vec![4, 0, 3, 1, 2, 5, 4]] {
                    let m = cells.len();
                    let rows = WRows {
                        cells: &cells,
                        stride,
                        offset,
                    };
                    for n_q in [1, 2, 3, 4, 5, 9] {
                        let q: Vec<f32> = (0..n_q * d)
                            .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.37)
                            .collect();
                        let (mut s32, mut s16) = (vec![9f32; n_q * m], vec![9f32; n_q * m]);
                        (f.scores_f32)(&q, n_q, &v32, rows, &mut s32);
                        (f.scores_f16)(&q, n_q, &v16, rows, &mut s16);
                        let (mut w32, mut w16) = (Vec::new(), Vec::new());
                        for i in 0..n_q {
                            for &c in &cells {
                                let s = c as usize * stride + offset;
                                let qi = &q[i * d..(i + 1) * d];
                                w32.push((f.dot_f32)(qi, &v32[s..s + d]));
                                w16.push((f.dot_f16)(qi, &v16[s..s + d]));
                            }
                        }
                        let what = format!("{isa} d {d} n_q {n_q} cells {cells:?}");
                        assert_eq!(bits(&s32), bits(&w32), "scores_f32 {what}");
                        assert_eq!(bits(&s16), bits(&w16), "scores_f16 {what}");

                        let w: Vec<f32> = (0..n_q * m).map(|j| 0.3 - 0.07 * j as f32).collect();
                        let (mut o32, mut o16) = (vec![9f32; n_q * d], vec![9f32; n_q * d]);
                        (f.wsum_n_f32)(&mut o32, n_q, &w, &v32, rows);
                        (f.wsum_n_f16)(&mut o16, n_q, &w, &v16, rows);
                        for i in 0..n_q {
                            let (mut a32, mut a16) = (vec![7f32; d], vec![7f32; d]);
                            (f.wsum_f32)(&mut a32, &w[i * m..(i + 1) * m], &v32, rows);
                            (f.wsum_f16)(&mut a16, &w[i * m..(i + 1) * m], &v16, rows);
                            let r = i * d..(i + 1) * d;
                            assert_eq!(bits(&o32[r.clone()]), bits(&a32), "wsum_n_f32 {what}");
                            assert_eq!(bits(&o16[r]), bits(&a16), "wsum_n_f16 {what}");
                        }
                    }
                }
            }
        }
    }

    /// The vector quantizers equal the scalar ones byte for byte: random rows, exact halves (the
    /// rounding rules differ there: half away from zero for Q8_0, half to even for Q8_K), ties
    /// for the largest magnitude of either sign, zero and −0 blocks, and NaN / infinity.
    #[test]
    fn quantizers_equal_the_scalar_ones() {
        use bytemuck::Zeroable;

        use crate::quant::{quantize_q8_0, quantize_q8k, BlockQ8K, BlockQ8_0};
        let mut rows: Vec<Vec<f32>> = Vec::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        rows.push((0..512).map(|_| rnd() * 6.0).collect());
        // Exact halves after scaling: amax 127 makes 1/d exactly 1.
        rows.push(
            (0..512)
                .map(|i| [127.0, -127.0, 0.5, -0.5, 2.5, -3.5, 1.5, 0.0][i % 8])
                .collect(),
        );
        // Q8_K: the first of two equal magnitudes (−5 before 5) sets the sign.
        rows.push(
            (0..512)
                .map(|i| {
                    if i % 256 == 3 {
                        -5.0
                    } else if i % 256 == 9 {
                        5.0
                    } else {
                        rnd()
                    }
                })
                .collect(),
        );
        rows.push(vec![0.0; 512]);
        rows.push(vec![-0.0; 512]);
        let mut special: Vec<f32> = (0..512).map(|_| rnd()).collect();
        special[5] = f32::NAN;
        special[300] = f32::INFINITY;
        special[40] = f32::NEG_INFINITY;
        rows.push(special);
        for (isa, f) in sets() {
            for (k, row) in rows.iter().enumerate() {
                let (mut a, mut b) = (vec![BlockQ8_0::zeroed(); 16], vec![BlockQ8_0::zeroed(); 16]);
                (f.quantize_q8_0)(row, &mut a);
                quantize_q8_0(row, &mut b);
                assert_eq!(
                    bytemuck::cast_slice::<_, u8>(&a),
                    bytemuck::cast_slice::<_, u8>(&b),
                    "{isa} q8_0 row {k}"
                );
                let (mut a, mut b) = (vec![BlockQ8K::zeroed(); 2], vec![BlockQ8K::zeroed(); 2]);
                (f.quantize_q8k)(row, &mut a);
                quantize_q8k(row, &mut b);
                assert_eq!(
                    bytemuck::cast_slice::<_, u8>(&a),
                    bytemuck::cast_slice::<_, u8>(&b),
                    "{isa} q8k row {k}"
                );
            }
        }
    }

    #[test]
    fn dots_and_axpys_match_f64_with_tails() {
        for (isa, f) in sets() {
            for n in [0, 1, 7, 8, 15, 16, 31, 32, 33, 256, 257] {
                let a: Vec<f32> = (0..n)
                    .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.37)
                    .collect();
                let b32: Vec<f32> = (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.61).collect();
                let b16: Vec<f16> = b32.iter().map(|&v| f16::from_f32(v)).collect();
                let want32: f64 = a
                    .iter()
                    .zip(&b32)
                    .map(|(&x, &y)| f64::from(x) * f64::from(y))
                    .sum();
                let want16: f64 = a
                    .iter()
                    .zip(&b16)
                    .map(|(&x, &y)| f64::from(x) * f64::from(y.to_f32()))
                    .sum();
                // n f32 additions: each adds at most ε · Σ|a·b| of error.
                let scale: f64 = a
                    .iter()
                    .zip(&b32)
                    .map(|(&x, &y)| f64::from((x * y).abs()))
                    .sum();
                let tol = (n as f64 + 2.0) * f64::from(f32::EPSILON) * scale * 1.01 + 1e-30;
                let got32 = f64::from((f.dot_f32)(&a, &b32));
                let got16 = f64::from((f.dot_f16)(&a, &b16));
                assert!(
                    (got32 - want32).abs() <= tol,
                    "{isa} dot_f32 n {n}: {got32} vs {want32}"
                );
                assert!(
                    (got16 - want16).abs() <= tol,
                    "{isa} dot_f16 n {n}: {got16} vs {want16}"
                );

                // axpy: one fused or two roundings per element.
                let mut y32 = a.clone();
                let mut y16 = a.clone();
                (f.axpy_f32)(&mut y32, 0.75, &b32);
                (f.axpy_f16)(&mut y16, 0.75, &b16);
                for i in 0..n {
                    let w32 = f64::from(a[i]) + 0.75 * f64::from(b32[i]);
                    let w16 = f64::from(a[i]) + 0.75 * f64::from(b16[i].to_f32());
                    let t = 2.0
                        * f64::from(f32::EPSILON)
                        * (f64::from(a[i].abs()) + f64::from(b32[i].abs()))
                        + 1e-30;
                    assert!(
                        (f64::from(y32[i]) - w32).abs() <= t,
                        "{isa} axpy_f32 n {n} at {i}"
                    );
                    assert!(
                        (f64::from(y16[i]) - w16).abs() <= t,
                        "{isa} axpy_f16 n {n} at {i}"
                    );
                }
            }
        }
    }
}
