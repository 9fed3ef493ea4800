//! The float formats F32, F16 and BF16 (blocks of one element).

use half::{bf16, f16};

use super::{check_len, BlockFormat, GgmlType};

/// ggml's `ggml_compute_bf16_to_fp32`: exact (the high 16 bits of an f32).
#[inline(always)]
pub fn bf16_to_f32(h: bf16) -> f32 {
    f32::from_bits((h.to_bits() as u32) << 16)
}

/// ggml's `ggml_compute_fp32_to_bf16`: round to nearest even; NaN stays NaN (forced quiet);
/// subnormals are kept, not flushed.
#[inline(always)]
pub fn f32_to_bf16(s: f32) -> bf16 {
    let u = s.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return bf16::from_bits(((u >> 16) | 64) as u16);
    }
    bf16::from_bits((u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16)
}

/// F16 → f32 (exact, as `GGML_FP16_TO_FP32`).
pub fn dequantize_f16(src: &[f16], out: &mut [f32]) {
    check_len(GgmlType::F16, src.len(), 1, out.len());
    for (o, h) in out.iter_mut().zip(src) {
        *o = h.to_f32();
    }
}

/// f32 → F16, round to nearest even (as `GGML_FP32_TO_FP16`).
pub fn quantize_f16(src: &[f32], out: &mut [f16]) {
    check_len(GgmlType::F16, out.len(), 1, src.len());
    for (o, &x) in out.iter_mut().zip(src) {
        *o = f16::from_f32(x);
    }
}

/// BF16 → f32 (exact).
pub fn dequantize_bf16(src: &[bf16], out: &mut [f32]) {
    check_len(GgmlType::BF16, src.len(), 1, out.len());
    for (o, &h) in out.iter_mut().zip(src) {
        *o = bf16_to_f32(h);
    }
}

/// f32 → BF16 as [`f32_to_bf16`].
pub fn quantize_bf16(src: &[f32], out: &mut [bf16]) {
    check_len(GgmlType::BF16, out.len(), 1, src.len());
    for (o, &x) in out.iter_mut().zip(src) {
        *o = f32_to_bf16(x);
    }
}

impl BlockFormat for f32 {
    const TYPE: GgmlType = GgmlType::F32;
    const BLOCK_SIZE: usize = 1;
    fn dequantize(blocks: &[Self], out: &mut [f32]) {
        check_len(GgmlType::F32, blocks.len(), 1, out.len());
        out.copy_from_slice(blocks);
    }
    fn quantize(src: &[f32], out: &mut [Self]) {
        check_len(GgmlType::F32, out.len(), 1, src.len());
        out.copy_from_slice(src);
    }
}

impl BlockFormat for f16 {
    const TYPE: GgmlType = GgmlType::F16;
    const BLOCK_SIZE: usize = 1;
    fn dequantize(blocks: &[Self], out: &mut [f32]) {
        dequantize_f16(blocks, out)
    }
    fn quantize(src: &[f32], out: &mut [Self]) {
        quantize_f16(src, out)
    }
}

impl BlockFormat for bf16 {
    const TYPE: GgmlType = GgmlType::BF16;
    const BLOCK_SIZE: usize = 1;
    fn dequantize(blocks: &[Self], out: &mut [f32]) {
        dequantize_bf16(blocks, out)
    }
    fn quantize(src: &[f32], out: &mut [Self]) {
        quantize_bf16(src, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_bf16(x: f32, want_bits: u16) {
        assert_eq!(
            f32_to_bf16(x).to_bits(),
            want_bits,
            "f32_to_bf16({x:e} = {:#010x})",
            x.to_bits()
        );
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        check_bf16(1.0, 0x3f80);
        // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (down).
        check_bf16(f32::from_bits(0x3f80_8000), 0x3f80);
        // 1 + 3·2^-8 is halfway between two bf16s with odd lower one: ties to even (up).
        check_bf16(f32::from_bits(0x3f81_8000), 0x3f82);
        check_bf16(f32::from_bits(0x3f80_8001), 0x3f81);
        check_bf16(-2.0, 0xc000);
        check_bf16(f32::INFINITY, 0x7f80);
        // Largest finite f32 rounds up to infinity, as in ggml.
        check_bf16(f32::MAX, 0x7f80);
        // Subnormals are kept (current ggml does not flush them).
        check_bf16(f32::from_bits(0x0001_8000), 0x0002);
        // A signalling NaN comes out quiet.
        check_bf16(f32::from_bits(0x7f80_0001), 0x7fc0);
    }

    #[test]
    fn bf16_to_f32_is_exact() {
        for bits in [0u16, 0x3f80, 0xc000, 0x0001, 0x7f7f, 0xff80] {
            let x = bf16_to_f32(bf16::from_bits(bits));
            assert_eq!(x.to_bits(), (bits as u32) << 16);
            assert_eq!(f32_to_bf16(x).to_bits(), bits);
        }
    }
}
