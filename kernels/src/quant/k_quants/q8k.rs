//! Q8_K: the activation format of the k-quant dot products (f32 scale, 8-bit quants, sums).

use super::BlockQ8K;
use crate::quant::{check_len, nearest_int, GgmlType, QK_K};

/// Dequantize Q8_K (`dequantize_row_q8_K`): `d * q`.
pub fn dequantize_q8k(blocks: &[BlockQ8K], out: &mut [f32]) {
    check_len(GgmlType::Q8K, blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = b.d * q as f32;
        }
    }
}

/// Quantize Q8_K (`quantize_row_q8_K_ref`): `iscale = -127 / max` from the signed absolute
/// maximum, `q = min(127, nearest_int(iscale·x))`, `d = 1 / iscale`, and `bsums` the sums of
/// `q` in groups of 16.
///
/// One deliberate difference: for an all-zero block ggml zeroes `d` and `qs` and leaves `bsums`
/// as the buffer held them; here `bsums` are zeroed too (the sums of the zero quants).
pub fn quantize_q8k(src: &[f32], out: &mut [BlockQ8K]) {
    check_len(GgmlType::Q8K, out.len(), QK_K, src.len());
    for (x, b) in src.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (mut max, mut amax) = (0.0f32, 0.0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            b.d = 0.0;
            b.qs = [0; QK_K];
            b.bsums = [0; QK_K / 16];
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i16).sum();
        }
        b.d = 1.0 / iscale;
    }
}
