//! Q2_K: 2-bit quants, 16 sub-blocks of 16 with 4-bit scales and mins.

use half::f16;

use super::search::make_qkx2_quants;
use super::{pack_2bit, BlockQ2K};
use crate::quant::{check_len, nearest_int, GgmlType, QK_K};

/// Dequantize Q2_K (`dequantize_row_q2_K`): `d·sc · q − dmin·m`.
pub fn dequantize_q2k(blocks: &[BlockQ2K], out: &mut [f32]) {
    check_len(GgmlType::Q2K, blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        let mut yi = 0;
        let mut is = 0;
        for half in 0..2 {
            let q = &b.qs[32 * half..32 * half + 32];
            for shift in [0u8, 2, 4, 6] {
                for part in 0..2 {
                    let sc = b.scales[is];
                    is += 1;
                    let dl = d * (sc & 0xf) as f32;
                    let ml = min * (sc >> 4) as f32;
                    for &ql in &q[16 * part..16 * part + 16] {
                        y[yi] = dl * ((ql >> shift) & 3) as f32 - ml;
                        yi += 1;
                    }
                }
            }
        }
    }
}

/// Quantize Q2_K (`quantize_row_q2_K_ref`): `make_qkx2_quants(16, 3, .., -0.5, 0.1, 15,
/// use_mad)` with weights `|x|` per sub-block, scales and mins quantized to 4 bits, then every
/// element re-quantized against its rounded scale and min.
pub fn quantize_q2k(src: &[f32], out: &mut [BlockQ2K]) {
    check_len(GgmlType::Q2K, out.len(), QK_K, src.len());
    const Q4SCALE: f32 = 15.0;
    for (x, b) in src.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let mut mins = [0f32; QK_K / 16];
        let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
        for j in 0..QK_K / 16 {
            let r = 16 * j..16 * j + 16;
            let mut weights = [0f32; 16];
            for (w, &v) in weights.iter_mut().zip(&x[r.clone()]) {
                *w = v.abs();
            }
            let (scale, min) =
                make_qkx2_quants(3, &x[r.clone()], &weights, &mut l[r], -0.5, 0.1, 15, true);
            scales[j] = scale;
            mins[j] = min;
            if scale > max_scale {
                max_scale = scale;
            }
            if min > max_min {
                max_min = min;
            }
        }
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for j in 0..QK_K / 16 {
                b.scales[j] = nearest_int(iscale * scales[j]) as u8;
            }
            b.d = f16::from_f32(max_scale / Q4SCALE);
        } else {
            b.scales = [0; QK_K / 16];
            b.d = f16::from_f32(0.0);
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for j in 0..QK_K / 16 {
                let m = nearest_int(iscale * mins[j]);
                b.scales[j] |= (m << 4) as u8;
            }
            b.dmin = f16::from_f32(max_min / Q4SCALE);
        } else {
            b.dmin = f16::from_f32(0.0);
        }
        let (d_all, dmin_all) = (b.d.to_f32(), b.dmin.to_f32());
        for j in 0..QK_K / 16 {
            let d = d_all * (b.scales[j] & 0xf) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin_all * (b.scales[j] >> 4) as f32;
            for ii in 0..16 {
                l[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3) as u8;
            }
        }
        b.qs = pack_2bit(&l);
    }
}
