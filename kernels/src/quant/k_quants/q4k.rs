//! Q4_K: 4-bit quants, 8 sub-blocks of 32 with 6-bit scales and mins.

use half::f16;

use super::search::{get_scale_min_k4, make_qkx2_quants, pack_scale_min_k4};
use super::BlockQ4K;
use crate::quant::{check_len, nearest_int, GgmlType, QK_K};

/// Dequantize Q4_K (`dequantize_row_q4_K`): `d·sc · q − dmin·m`.
pub fn dequantize_q4k(blocks: &[BlockQ4K], out: &mut [f32]) {
    check_len(GgmlType::Q4K, blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for (c, y) in y.chunks_exact_mut(64).enumerate() {
            let q = &b.qs[32 * c..32 * c + 32];
            let (sc, m) = get_scale_min_k4(2 * c, &b.scales);
            let (d1, m1) = (d * sc as f32, min * m as f32);
            let (sc, m) = get_scale_min_k4(2 * c + 1, &b.scales);
            let (d2, m2) = (d * sc as f32, min * m as f32);
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0xf) as f32 - m1;
            }
            for l in 0..32 {
                y[32 + l] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

/// The scale search shared by Q4_K and Q5_K (`quantize_row_q{4,5}_K_ref`): per sub-block of 32,
/// weights `sqrt(mean(x²)) + |x|` and `make_qkx2_quants(32, nmax, ..)`; scales and mins
/// quantized to 6 bits against their maxima; then every element re-quantized against its
/// rounded scale and min. Returns `(d, dmin, packed scales, levels)`.
pub(super) fn quantize_k4_like(
    x: &[f32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f16, f16, [u8; 12], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; QK_K / 32];
    let mut mins = [0f32; QK_K / 32];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..QK_K / 32 {
        let r = 32 * j..32 * j + 32;
        let xs = &x[r.clone()];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (scale, min) =
            make_qkx2_quants(nmax, xs, &weights, &mut l[r], rmin, rdelta, nstep, false);
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..QK_K / 32 {
        // ggml stores nearest_int into a uint8_t (wrapping), then clamps to 63.
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    let packed = pack_scale_min_k4(&ls, &lm);
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    for j in 0..QK_K / 32 {
        let (sc, m) = get_scale_min_k4(j, &packed);
        let dd = d.to_f32() * sc as f32;
        if dd == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / dd).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, packed, l)
}

/// Quantize Q4_K (`quantize_row_q4_K_ref`: `make_qkx2_quants(32, 15, .., -1, 0.1, 20)`).
pub fn quantize_q4k(src: &[f32], out: &mut [BlockQ4K]) {
    check_len(GgmlType::Q4K, out.len(), QK_K, src.len());
    for (x, b) in src.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (d, dmin, scales, l) = quantize_k4_like(x, 15, -1.0, 0.1, 20);
        b.d = d;
        b.dmin = dmin;
        b.scales = scales;
        for c in 0..QK_K / 64 {
            for i in 0..32 {
                b.qs[32 * c + i] = l[64 * c + i] | (l[64 * c + i + 32] << 4);
            }
        }
    }
}
