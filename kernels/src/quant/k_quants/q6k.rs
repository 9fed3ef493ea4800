//! Q6_K: 6-bit quants, 16 sub-blocks of 16 with signed 8-bit scales.

use half::f16;

use super::search::{make_qx_quants, GROUP_MAX_EPS};
use super::BlockQ6K;
use crate::quant::{check_len, nearest_int, GgmlType, QK_K};

/// Dequantize Q6_K (`dequantize_row_q6_K`): `d * scale * (q - 32)`, evaluated left to right.
pub fn dequantize_q6k(blocks: &[BlockQ6K], out: &mut [f32]) {
    check_len(GgmlType::Q6K, blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for half in 0..2 {
            let y = &mut y[128 * half..];
            let ql = &b.ql[64 * half..];
            let qh = &b.qh[32 * half..];
            let sc = &b.scales[8 * half..];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i8 - 32;
                let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }
}

/// Quantize Q6_K (`quantize_row_q6_K_ref`): `make_qx_quants(16, 32, ..)` per sub-block, scales
/// quantized to 8 bits against `-128 / max_scale`, then every element re-quantized against its
/// rounded scale.
pub fn quantize_q6k(src: &[f32], out: &mut [BlockQ6K]) {
    check_len(GgmlType::Q6K, out.len(), QK_K, src.len());
    for (x, b) in src.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
        for ib in 0..QK_K / 16 {
            let r = 16 * ib..16 * ib + 16;
            let scale = make_qx_quants(32, &x[r.clone()], &mut l[r]);
            scales[ib] = scale;
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            *b = bytemuck::Zeroable::zeroed();
            continue;
        }
        let iscale = -128.0 / max_scale;
        b.d = f16::from_f32(1.0 / iscale);
        for ib in 0..QK_K / 16 {
            b.scales[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
        }
        let d_all = b.d.to_f32();
        for j in 0..QK_K / 16 {
            let d = d_all * b.scales[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
                l[16 * j + ii] = (q + 32) as i8;
            }
        }
        let l = l.map(|v| v as u8);
        for half in 0..2 {
            let j = 128 * half;
            let ql = &mut b.ql[64 * half..64 * half + 64];
            for i in 0..32 {
                let q1 = l[j + i] & 0xf;
                let q2 = l[j + i + 32] & 0xf;
                let q3 = l[j + i + 64] & 0xf;
                let q4 = l[j + i + 96] & 0xf;
                ql[i] = q1 | (q3 << 4);
                ql[i + 32] = q2 | (q4 << 4);
            }
            let qh = &mut b.qh[32 * half..32 * half + 32];
            for i in 0..32 {
                qh[i] = (l[j + i] >> 4)
                    | ((l[j + i + 32] >> 4) << 2)
                    | ((l[j + i + 64] >> 4) << 4)
                    | ((l[j + i + 96] >> 4) << 6);
            }
        }
    }
}
