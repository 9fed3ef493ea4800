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
}
