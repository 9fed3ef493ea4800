//! Q5_K: 5-bit quants (4 low bits + a high-bit plane), 8 sub-blocks of 32 with 6-bit scales
//! and mins.

use super::q4k::quantize_k4_like;
use super::search::get_scale_min_k4;
use super::BlockQ5K;
use crate::quant::{check_len, GgmlType, QK_K};

/// Dequantize Q5_K (`dequantize_row_q5_K`): `d·sc · (q + 16·hbit) − dmin·m`.
pub fn dequantize_q5k(blocks: &[BlockQ5K], out: &mut [f32]) {
    check_len(GgmlType::Q5K, blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        let (mut u1, mut u2) = (1u8, 2u8);
        for (c, y) in y.chunks_exact_mut(64).enumerate() {
            let ql = &b.qs[32 * c..32 * c + 32];
            let (sc, m) = get_scale_min_k4(2 * c, &b.scales);
            let (d1, m1) = (d * sc as f32, min * m as f32);
            let (sc, m) = get_scale_min_k4(2 * c + 1, &b.scales);
            let (d2, m2) = (d * sc as f32, min * m as f32);
            for l in 0..32 {
                let h = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                y[l] = d1 * ((ql[l] & 0xf) + h) as f32 - m1;
            }
            for l in 0..32 {
                let h = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                y[32 + l] = d2 * ((ql[l] >> 4) + h) as f32 - m2;
            }
            u1 <<= 2;
            u2 <<= 2;
        }
    }
}

/// Quantize Q5_K (`quantize_row_q5_K_ref`: `make_qkx2_quants(32, 31, .., -0.5, 0.1, 15)`).
pub fn quantize_q5k(src: &[f32], out: &mut [BlockQ5K]) {
    check_len(GgmlType::Q5K, out.len(), QK_K, src.len());
    for (x, b) in src.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (d, dmin, scales, l) = quantize_k4_like(x, 31, -0.5, 0.1, 15);
        b.d = d;
        b.dmin = dmin;
        b.scales = scales;
        b.qh = [0; QK_K / 8];
        let (mut m1, mut m2) = (1u8, 2u8);
        for c in 0..QK_K / 64 {
            for j in 0..32 {
                let mut l1 = l[64 * c + j];
                if l1 > 15 {
                    l1 -= 16;
                    b.qh[j] |= m1;
                }
                let mut l2 = l[64 * c + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    b.qh[j] |= m2;
                }
                b.qs[32 * c + j] = l1 | (l2 << 4);
            }
            m1 <<= 2;
            m2 <<= 2;
        }
    }
}
