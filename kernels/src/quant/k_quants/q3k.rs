//! Q3_K: 3-bit quants (2 low bits + a high-bit mask), 16 sub-blocks of 16 with 6-bit scales.

use half::f16;

use super::search::make_q3_quants;
use super::{pack_2bit, BlockQ3K};
use crate::quant::{check_len, nearest_int, GgmlType, QK_K};

/// The 16 signed 6-bit scales of a Q3_K block, unpacked (what ggml's `kmask` shuffle yields).
#[inline(always)]
fn unpack_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xf } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Dequantize Q3_K (`dequantize_row_q3_K`): `d·(sc − 32) · (q − (hbit ? 0 : 4))`.
pub fn dequantize_q3k(blocks: &[BlockQ3K], out: &mut [f32]) {
    check_len(GgmlType::Q3K, blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d_all = b.d.to_f32();
        let scales = unpack_scales(&b.scales);
        let mut m = 1u8;
        let mut is = 0;
        let mut yi = 0;
        for half in 0..2 {
            let q = &b.qs[32 * half..32 * half + 32];
            for shift in [0u8, 2, 4, 6] {
                for part in 0..2 {
                    let dl = d_all * scales[is] as f32;
                    is += 1;
                    for l in 16 * part..16 * part + 16 {
                        let low = ((q[l] >> shift) & 3) as i8;
                        let sub = if b.hmask[l] & m != 0 { 0 } else { 4 };
                        y[yi] = dl * (low - sub) as f32;
                        yi += 1;
                    }
                }
                m <<= 1;
            }
        }
    }
}

/// Quantize Q3_K (`quantize_row_q3_K_ref`): `make_q3_quants(16, 4, .., do_rmse)` per
/// sub-block, scales quantized to 6 bits against `-32 / max_scale`, then every element
/// re-quantized against its rounded scale.
pub fn quantize_q3k(src: &[f32], out: &mut [BlockQ3K]) {
    check_len(GgmlType::Q3K, out.len(), QK_K, src.len());
    for (x, b) in src.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; QK_K / 16];
        let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
        for j in 0..QK_K / 16 {
            let r = 16 * j..16 * j + 16;
            scales[j] = make_q3_quants(4, &x[r.clone()], &mut l[r]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        b.scales = [0; 12];
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for j in 0..QK_K / 16 {
                let q = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) + 32;
                let q = q as u8;
                if j < 8 {
                    b.scales[j] = q & 0xf;
                } else {
                    b.scales[j - 8] |= (q & 0xf) << 4;
                }
                b.scales[j % 4 + 8] |= (q >> 4) << (2 * (j / 4));
            }
            b.d = f16::from_f32(1.0 / iscale);
        } else {
            b.d = f16::from_f32(0.0);
        }
        let d_all = b.d.to_f32();
        let sc = unpack_scales(&b.scales);
        for j in 0..QK_K / 16 {
            let d = d_all * sc[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / d).clamp(-4, 3);
                l[16 * j + ii] = (q + 4) as i8;
            }
        }
        // High bits: element j goes to bit j / 32 of hmask[j % 32].
        b.hmask = [0; QK_K / 8];
        let mut low = [0u8; QK_K];
        for j in 0..QK_K {
            let mut v = l[j] as u8;
            if v > 3 {
                b.hmask[j % 32] |= 1 << (j / 32);
                v -= 4;
            }
            low[j] = v;
        }
        b.qs = pack_2bit(&low);
    }
}
