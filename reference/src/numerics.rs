//! Exact-numerics mode ([`crate::Precision::Exact`]): the activations of every matrix product are
//! rounded to the form ggml's dot product for that weight type reads (its `vec_dot_type`), then
//! multiplied in f32 with the dequantized weights.
//!
//! ggml (and the engine, which follows ggml) never multiplies f32 activations by a quantized
//! weight: it first quantizes each activation row to Q8_0, Q8_1 or Q8_K (or rounds it to F16/BF16
//! for float weights) and takes integer block dot products. That integer dot product is, exactly,
//! `Σ dequant(w)·dequant(a)` regrouped by block; so rounding the activations here ("fake
//! quantization") and multiplying in f32 computes the same mathematical value, and what is left
//! between the two sides is f32 rounding in another summation order. Written here from ggml's
//! description of its formats (`ggml-quants.c`: `quantize_row_q8_0_ref`, `quantize_row_q8_1_ref`,
//! `quantize_row_q8_K_ref`; `ggml.c` `type_traits[].vec_dot_type`), not from the engine's kernels.
//!
//! Not reproduced: Q8_1's stored block sum `s = f16(d·Σq)` (Q4_1/Q5_1 weights add `m·s` with `s`
//! rounded to f16, the fake quantization uses the exact `d·Σq`), so those two weight types are
//! exact only up to that f16 rounding ([`ActQuant::Q8_1`]).

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use half::{bf16, f16};

use crate::dequant::ExtraType;
use crate::error::ReferenceError;

/// What a weight type's dot product reads as activations (ggml's `vec_dot_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActQuant {
    /// F32 weights: f32 activations as they are.
    None,
    F16,
    Bf16,
    /// Blocks of 32, `d = amax/127` stored as f16, `q = round(x/d)`.
    Q8_0,
    /// As Q8_0, plus a block sum ggml stores rounded to f16 (not reproduced, module docs).
    Q8_1,
    /// Blocks of 256, `d = −max/127` (max: the value of largest magnitude) stored as f32,
    /// `q = min(127, round_half_even(x/d))`.
    Q8K,
}

impl ActQuant {
    /// ggml's `vec_dot_type` for a type candle reads.
    pub fn for_candle(t: GgmlDType) -> ActQuant {
        use GgmlDType as G;
        match t {
            G::F32 => ActQuant::None,
            G::F16 => ActQuant::F16,
            G::BF16 => ActQuant::Bf16,
            G::Q4_0 | G::Q5_0 | G::Q8_0 | G::Q8_1 => ActQuant::Q8_0,
            G::Q4_1 | G::Q5_1 => ActQuant::Q8_1,
            G::Q2K | G::Q3K | G::Q4K | G::Q5K | G::Q6K | G::Q8K => ActQuant::Q8K,
        }
    }

    /// ggml's `vec_dot_type` for a type only [`crate::dequant`] reads.
    pub fn for_extra(t: ExtraType) -> ActQuant {
        match t {
            ExtraType::Q8_1 | ExtraType::Iq4Nl | ExtraType::Mxfp4 => ActQuant::Q8_0,
            ExtraType::Q8K | ExtraType::Iq4Xs => ActQuant::Q8K,
        }
    }

    /// Round every row of `x: [.., k]` (k a multiple of the block) to this form, back in f32.
    pub fn apply(self, x: &Tensor) -> Result<Tensor, ReferenceError> {
        if self == ActQuant::None {
            return Ok(x.clone());
        }
        let dims = x.dims().to_vec();
        let k = dims.last().copied().unwrap_or(0);
        let block = match self {
            ActQuant::Q8_0 | ActQuant::Q8_1 => 32,
            ActQuant::Q8K => 256,
            _ => 1,
        };
        if k % block != 0 {
            return Err(ReferenceError::Unsupported(format!(
                "exact numerics: a row of {k} activations is not a whole number of {self:?} blocks of {block}"
            )));
        }
        let dtype = x.dtype();
        let mut v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for b in v.chunks_mut(block) {
            match self {
                ActQuant::None => {}
                ActQuant::F16 => b.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
                ActQuant::Bf16 => b.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32()),
                ActQuant::Q8_0 | ActQuant::Q8_1 => q8_0_block(b),
                ActQuant::Q8K => q8k_block(b),
            }
        }
        Ok(Tensor::from_vec(v, dims, x.device())?.to_dtype(dtype)?)
    }
}

/// `quantize_row_q8_0_ref` then dequantize: `d = amax/127`, `q = round(x·(1/d))` (half away from
/// zero, C `roundf`), value `f16(d)·q`.
fn q8_0_block(b: &mut [f32]) {
    let amax = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let dh = f16::from_f32(d).to_f32();
    for x in b.iter_mut() {
        *x = dh * (*x * id).round();
    }
}

/// `quantize_row_q8_K_ref` then dequantize: `max` is the first value of largest magnitude,
/// `iscale = −127/max` (ggml's comment: −128 would suit the format, −127 keeps its AVX path
/// simple), `q = min(127, nearest_int(iscale·x))` (round half to even), value `(1/iscale)·q`
/// with the scale kept in f32.
fn q8k_block(b: &mut [f32]) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &x in b.iter() {
        if x.abs() > amax {
            amax = x.abs();
            max = x;
        }
    }
    if amax == 0.0 {
        b.iter_mut().for_each(|x| *x = 0.0);
        return;
    }
    let iscale = -127.0 / max;
    let d = 1.0 / iscale;
    for x in b.iter_mut() {
        let q = (iscale * *x).round_ties_even().min(127.0);
        *x = d * q;
    }
}

/// How the KV cache holds what attention reads back: the engine keeps it in f32 (exact) or in
/// f16 (`--kv-dtype f16`), rounding every value to nearest, ties to even, when the row is written
/// and widening it exactly when attention reads it. In exact-numerics mode the reference rounds
/// the same rows the same way ([`crate::ReferenceModel::with_cache_dtype`]), so the two sides
/// again compute the same numbers up to f32 rounding. Which rows, by architecture (what the
/// engine writes with `kv_write`, `engine/src/model/forward.rs`, checked there, not assumed):
///
/// - `llama`, `gemma3`: each token's K row after its norm and RoPE, and its V row; attention
///   reads both from the cache, the current token's included. The query is never cached, and
///   the `k`/`v` taps are emitted before the write (unrounded on both sides).
/// - `deepseek2` (MLA): the latent row `[rmsnorm(c)·kv_a_norm | rope(k_pe)]`; every cell's keys
///   and values are expanded from the cached latent with `attn_kv_b`, so the `k` and `v` taps
///   (and everything after) see the rounded latent.
/// - `glm-dsa`: the latent row as `deepseek2`, and on a full indexer layer the lightning
///   indexer's key row (LayerNorm, then RoPE), which its scores read back from its own cache.
///
/// Nothing else is rounded: the query, the scores, the softmax and the weighted sum stay f32,
/// as in the engine (f32 query · f16 key widened is the same product as in f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheDtype {
    /// The cache holds exactly what was computed.
    #[default]
    F32,
    /// Every cached value rounded to f16 ([`round_to_f16`]).
    F16,
}

impl CacheDtype {
    /// A tensor of rows as this cache would hand them back: unchanged for f32, every value
    /// through [`round_to_f16`] for f16 (computed on the host in f32, back in `x`'s dtype).
    pub fn apply(self, x: &Tensor) -> Result<Tensor, ReferenceError> {
        match self {
            CacheDtype::F32 => Ok(x.clone()),
            CacheDtype::F16 => {
                let dims = x.dims().to_vec();
                let dtype = x.dtype();
                let mut v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                v.iter_mut().for_each(|x| *x = round_to_f16(*x));
                Ok(Tensor::from_vec(v, dims, x.device())?.to_dtype(dtype)?)
            }
        }
    }
}

/// `x` rounded to the nearest IEEE binary16 value, ties to even, and widened back to f32 (which is
/// exact): what storing `x` in an f16 cache and reading it back gives. Written from the binary16
/// format (1 sign bit, 5 exponent bits with bias 15, 10 fraction bits; subnormals below 2⁻¹⁴ with
/// spacing 2⁻²⁴), without an f16 library:
///
/// - a magnitude is a multiple of its binade's spacing `2^(e−10)` (`e` its exponent, at least
///   −14), so rounding is `round_ties_even(x / spacing) · spacing`, both steps exact in f32
///   (a power-of-two scale, and an integer below 2²⁴); a mantissa that rounds up to 2¹¹ lands on
///   the next binade's first value, which that same product gives;
/// - a magnitude that rounds past the largest finite value 65504 (at or above 65520, halfway to
///   the next binade's 65536) overflows to ±∞, as IEEE rounding to nearest does;
/// - below 2⁻¹⁴ the spacing stays 2⁻²⁴ (gradual underflow): 2⁻²⁵ ties to even 0, just above it
///   rounds to 2⁻²⁴; the sign of a zero is kept;
/// - ±∞ stays, a NaN stays a NaN.
pub fn round_to_f16(x: f32) -> f32 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    let a = x.abs();
    // f16's largest finite value, and the midpoint to the next power of two past it.
    const MAX: f32 = 65504.0;
    const OVERFLOW: f32 = 65520.0;
    if a >= OVERFLOW {
        return f32::INFINITY.copysign(x);
    }
    // The binade's exponent (a is a normal or subnormal f32; f32 subnormals are far below f16's
    // smallest subnormal and take the subnormal spacing like any tiny value).
    let e = if a.is_normal() {
        ((a.to_bits() >> 23) & 0xff) as i32 - 127
    } else {
        -149
    };
    let spacing = 2f32.powi(e.max(-14) - 10);
    let r = ((a / spacing).round_ties_even() * spacing).min(MAX);
    r.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn apply(q: ActQuant, v: &[f32]) -> Vec<f32> {
        let t = Tensor::from_vec(v.to_vec(), (1, v.len()), &Device::Cpu).expect("tensor");
        q.apply(&t)
            .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
            .expect("apply")
    }

    #[test]
    fn q8_0_by_hand() {
        // amax 127 → d = 1 (exact in f16), values round half away from zero.
        let mut v = vec![0f32; 32];
        v[0] = 127.0;
        v[1] = 2.5;
        v[2] = -2.5;
        v[3] = 0.49;
        let y = apply(ActQuant::Q8_0, &v);
        assert_eq!(&y[..4], &[127.0, 3.0, -3.0, 0.0]);
        // d = 1/127 is stored as f16: the dequantized max is f16(1/127)·127, not 1.
        let mut v = vec![0f32; 32];
        v[0] = 1.0;
        let y = apply(ActQuant::Q8_0, &v);
        assert_eq!(y[0], f16::from_f32(1.0 / 127.0).to_f32() * 127.0);
        assert_ne!(y[0], 1.0);
    }

    #[test]
    fn q8k_by_hand() {
        // max = −127 (largest magnitude, negative): iscale = 1, d = 1.
        let mut v = vec![0f32; 256];
        v[0] = -127.0;
        v[1] = 2.5; // ties to even: 2
        v[2] = 3.5; // 4
        v[3] = 126.6; // 127
        let y = apply(ActQuant::Q8K, &v);
        assert_eq!(&y[..4], &[-127.0, 2.0, 4.0, 127.0]);
        // Positive max: iscale = −1, so 127 → −127 → value 127, and the sign flips back.
        let mut v = vec![0f32; 256];
        v[0] = 127.0;
        v[1] = -3.0;
        let y = apply(ActQuant::Q8K, &v);
        assert_eq!(&y[..2], &[127.0, -3.0]);
        assert_eq!(apply(ActQuant::Q8K, &[0.0; 256]), vec![0.0; 256]);
    }

    #[test]
    fn float_rounding_and_bad_rows() {
        let y = apply(ActQuant::F16, &[1.0 + 1e-4, 65504.0]);
        assert_eq!(y, vec![f16::from_f32(1.0 + 1e-4).to_f32(), 65504.0]);
        let y = apply(ActQuant::Bf16, &[1.0 + 1e-3]);
        assert_eq!(y, vec![1.0]);
        let t = Tensor::zeros((1, 48), DType::F32, &Device::Cpu).expect("tensor");
        assert!(ActQuant::Q8_0.apply(&t).is_err());
    }

    #[test]
    fn f16_rounding_ties_to_even_and_keeps_exact_values() {
        // Every f16 value is its own rounding: 1, the largest, the smallest normal and subnormal.
        for v in [
            1.0f32,
            -2.5,
            65504.0,
            2f32.powi(-14),
            2f32.powi(-24),
            0.099_975_586,
        ] {
            assert_eq!(round_to_f16(v), v, "{v}");
        }
        // Between 1 and 1 + 2⁻¹⁰ the midpoint 1 + 2⁻¹¹ ties to even (1); just above it rounds up.
        let ulp = 2f32.powi(-10);
        assert_eq!(round_to_f16(1.0 + ulp / 2.0), 1.0);
        assert_eq!(round_to_f16(1.0 + ulp / 2.0 + 2f32.powi(-20)), 1.0 + ulp);
        // 1 + 3·2⁻¹¹ lies between 1 + 2⁻¹⁰ (odd) and 1 + 2⁻⁹ (even): up to the even one.
        assert_eq!(round_to_f16(1.0 + 3.0 * ulp / 2.0), 1.0 + 2.0 * ulp);
        assert_eq!(round_to_f16(-(1.0 + 3.0 * ulp / 2.0)), -(1.0 + 2.0 * ulp));
        // A mantissa that rounds up carries into the next binade: 2 − 2⁻¹² → 2.
        assert_eq!(round_to_f16(2.0 - 2f32.powi(-12)), 2.0);
        // Spacing 2⁻¹³ in [2⁻³, 2⁻²): 0.1 rounds to the multiple of 2⁻¹³ nearest to it.
        assert_eq!(round_to_f16(0.1), 819.0 * 2f32.powi(-13));
    }

    #[test]
    fn f16_rounding_subnormals_overflow_and_specials() {
        let tiny = 2f32.powi(-24);
        // Subnormals keep the spacing 2⁻²⁴: 2.5 units ties to 2, 3.5 units to 4.
        assert_eq!(round_to_f16(2.5 * tiny), 2.0 * tiny);
        assert_eq!(round_to_f16(3.5 * tiny), 4.0 * tiny);
        assert_eq!(round_to_f16(-3.4 * tiny), -3.0 * tiny);
        // Half the smallest subnormal ties to even zero (its sign kept); a little more is 2⁻²⁴.
        assert_eq!(round_to_f16(tiny / 2.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(round_to_f16(-tiny / 2.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(round_to_f16(tiny * 0.500_1), tiny);
        assert_eq!(round_to_f16(1e-30), 0.0);
        assert_eq!(round_to_f16(f32::from_bits(1)), 0.0);
        // Overflow to infinity from the midpoint between 65504 and 65536 on, as the engine's
        // conversion does; just below it, the largest finite value.
        assert_eq!(round_to_f16(65519.99), 65504.0);
        assert_eq!(round_to_f16(65520.0), f32::INFINITY);
        assert_eq!(round_to_f16(-1e6), f32::NEG_INFINITY);
        assert_eq!(round_to_f16(f32::INFINITY), f32::INFINITY);
        assert!(round_to_f16(f32::NAN).is_nan());
    }

    #[test]
    fn f16_rounding_agrees_with_the_half_crate() {
        // A second, independent implementation (the `half` crate's f32 → f16 conversion, which
        // rounds to nearest even): every f32 bit pattern in a stride that visits every exponent
        // and many mantissas, and every f16 midpoint and its f32 neighbours.
        let check = |x: f32| {
            let want = f16::from_f32(x).to_f32();
            let got = round_to_f16(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x:e} ({:#010x}): {got:e} != {want:e}",
                x.to_bits()
            );
        };
        for bits in (0..=u32::MAX).step_by(4099) {
            check(f32::from_bits(bits));
        }
        for h in 0..0x7c00u16 {
            let lo = f16::from_bits(h).to_f32();
            let hi = f16::from_bits(h + 1).to_f32();
            let mid = (lo as f64 + hi as f64) / 2.0;
            let mid = mid as f32;
            for x in [
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                check(x);
                check(-x);
            }
        }
    }

    #[test]
    fn cache_dtype_rounds_only_f16() {
        let v = [1.0f32 + 2f32.powi(-12), 0.1, -3.0];
        let t = Tensor::from_vec(v.to_vec(), (1, 3), &Device::Cpu).expect("tensor");
        let got = |c: CacheDtype| {
            c.apply(&t)
                .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
                .expect("apply")
        };
        assert_eq!(got(CacheDtype::F32), v.to_vec());
        assert_eq!(
            got(CacheDtype::F16),
            v.iter().map(|&x| round_to_f16(x)).collect::<Vec<_>>()
        );
    }
}
