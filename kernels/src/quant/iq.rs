//! The non-linear 4-bit formats: IQ4_NL and IQ4_XS.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::QK_K;

/// Elements per IQ4_NL block.
pub const QK4_NL: usize = 32;

/// ggml's `kvalues_iq4nl`: the 16 non-linear levels both formats index.
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq4Nl {
    pub d: f16,
    pub qs: [u8; QK4_NL / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIq4Nl>() == 18);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq4Xs {
    pub d: f16,
    pub scales_h: u16,
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIq4Xs>() == 136);

use super::{check_len, nearest_int, GgmlType};

block_format!(
    BlockIq4Nl,
    GgmlType::Iq4Nl,
    QK4_NL,
    dequantize_iq4_nl,
    quantize_iq4_nl
);
block_format!(
    BlockIq4Xs,
    GgmlType::Iq4Xs,
    QK_K,
    dequantize_iq4_xs,
    quantize_iq4_xs
);

/// ggml's `GROUP_MAX_EPS`.
const GROUP_MAX_EPS: f32 = 1e-15;

/// Refinement steps of ggml's IQ4 scale search as `quantize_iq4_nl`/`quantize_iq4_xs` run it
/// (what `llama-quantize` writes, with or without an importance matrix).
const NTRY: i32 = 7;

/// ggml's `best_index_int8` for the 16 IQ4 levels: the nearest level, ties to the upper one,
/// compared exactly as `2x >= a + b` against midpoints (a branch-free binary search).
#[inline(always)]
fn best_index_iq4(x: f32) -> u8 {
    let x2 = x + x;
    let mut idx = 0usize;
    let mut step = 8;
    while step > 0 {
        let j = idx + step;
        if x2 >= (KVALUES_IQ4NL[j - 1] as i32 + KVALUES_IQ4NL[j] as i32) as f32 {
            idx = j;
        }
        step >>= 1;
    }
    idx as u8
}

/// The per-block scale search of ggml's `quantize_row_iq4_nl_impl` (no importance matrix:
/// weights `x²`). Fills `l` with the levels for the returned scale's first guess and returns the
/// refined scale (0 for an all-zero block, whose levels are 0).
fn iq4_block_scale(xb: &[f32], l: &mut [u8]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in xb {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let v0 = KVALUES_IQ4NL[0] as f32;
    let mut d = -max / v0;
    let mut id = 1.0 / d;
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for (lj, &x) in l.iter_mut().zip(xb) {
        let k = best_index_iq4(id * x);
        *lj = k;
        let q = KVALUES_IQ4NL[k as usize] as f32;
        let w = x * x;
        sumqx += w * q * x;
        sumq2 += w * q * q;
    }
    d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        id = (itry + KVALUES_IQ4NL[0] as i32) as f32 / max;
        sumqx = 0.0;
        sumq2 = 0.0;
        for &x in xb {
            let q = KVALUES_IQ4NL[best_index_iq4(id * x) as usize] as f32;
            let w = x * x;
            sumqx += w * q * x;
            sumq2 += w * q * q;
        }
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// Pack 32 levels into 16 bytes: element `j` in the low nibble of byte `j`, element `j + 16`
/// in its high nibble.
#[inline(always)]
fn pack_iq4(l: &[u8], qs: &mut [u8]) {
    for (i, q) in qs.chunks_exact_mut(16).enumerate() {
        for j in 0..16 {
            q[j] = l[32 * i + j] | (l[32 * i + 16 + j] << 4);
        }
    }
}

/// Dequantize IQ4_NL (`dequantize_row_iq4_nl`): `d * kvalues[q]`.
pub fn dequantize_iq4_nl(blocks: &[BlockIq4Nl], out: &mut [f32]) {
    check_len(GgmlType::Iq4Nl, blocks.len(), QK4_NL, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK4_NL)) {
        let d = b.d.to_f32();
        for j in 0..QK4_NL / 2 {
            y[j] = d * KVALUES_IQ4NL[(b.qs[j] & 0xf) as usize] as f32;
            y[j + QK4_NL / 2] = d * KVALUES_IQ4NL[(b.qs[j] >> 4) as usize] as f32;
        }
    }
}

/// Quantize IQ4_NL as ggml's `quantize_iq4_nl` does without an importance matrix
/// (`quantize_row_iq4_nl_impl(32, 32, .., ntry = 7)`): the scale search above, then every
/// element re-assigned to its nearest level under the refined (f32) scale.
///
/// ggml's `quantize_row_iq4_nl_ref` runs the same code with `ntry = -1` (no search); we follow
/// the path `llama-quantize` takes.
pub fn quantize_iq4_nl(src: &[f32], out: &mut [BlockIq4Nl]) {
    check_len(GgmlType::Iq4Nl, out.len(), QK4_NL, src.len());
    for (x, b) in src.chunks_exact(QK4_NL).zip(out.iter_mut()) {
        let mut l = [0u8; QK4_NL];
        let scale = iq4_block_scale(x, &mut l);
        b.d = f16::from_f32(scale);
        let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        for (lj, &v) in l.iter_mut().zip(x) {
            *lj = best_index_iq4(id * v);
        }
        pack_iq4(&l, &mut b.qs);
    }
}

/// Dequantize IQ4_XS (`dequantize_row_iq4_xs`): `d·(ls − 32) · kvalues[q]` with 6-bit
/// sub-block scales `ls`.
pub fn dequantize_iq4_xs(blocks: &[BlockIq4Xs], out: &mut [f32]) {
    check_len(GgmlType::Iq4Xs, blocks.len(), QK_K, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (ib, y) in y.chunks_exact_mut(32).enumerate() {
            let ls = ((b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf) as i32
                | ((((b.scales_h >> (2 * ib)) & 3) as i32) << 4);
            let dl = d * (ls - 32) as f32;
            let qs = &b.qs[16 * ib..16 * ib + 16];
            for j in 0..16 {
                y[j] = dl * KVALUES_IQ4NL[(qs[j] & 0xf) as usize] as f32;
                y[j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
            }
        }
    }
}

/// Quantize IQ4_XS as ggml's `quantize_iq4_xs` does without an importance matrix
/// (`quantize_row_iq4_nl_impl(256, 32, .., ntry = 7)`, which `quantize_row_iq4_xs_ref` also
/// calls): per-sub-block scale search, sub-block scales quantized to 6 bits against
/// `d = -max_scale / 32`, then every element re-assigned under its quantized scale.
pub fn quantize_iq4_xs(src: &[f32], out: &mut [BlockIq4Xs]) {
    check_len(GgmlType::Iq4Xs, out.len(), QK_K, src.len());
    for (x, b) in src.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; QK_K / 32];
        let (mut max_scale, mut amax_scale) = (0.0f32, 0.0f32);
        for ib in 0..QK_K / 32 {
            let r = 32 * ib..32 * ib + 32;
            scales[ib] = iq4_block_scale(&x[r.clone()], &mut l[r]);
            if scales[ib].abs() > amax_scale {
                amax_scale = scales[ib].abs();
                max_scale = scales[ib];
            }
        }
        let d = -max_scale / 32.0;
        b.d = f16::from_f32(d);
        b.scales_h = 0;
        b.scales_l = [0; QK_K / 64];
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for ib in 0..QK_K / 32 {
            let ls = nearest_int(id * scales[ib]).clamp(-32, 31);
            let dl = d * ls as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for j in 32 * ib..32 * ib + 32 {
                l[j] = best_index_iq4(idl * x[j]);
            }
            let ls = (ls + 32) as u8;
            b.scales_l[ib / 2] |= (ls & 0xf) << (4 * (ib % 2));
            b.scales_h |= ((ls >> 4) as u16) << (2 * ib);
        }
        pack_iq4(&l, &mut b.qs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_index_picks_nearest_level_ties_up() {
        for (x, want) in [
            (-200.0f32, 0u8),
            (-127.0, 0),
            (-115.5, 1), // midpoint of -127 and -104: ties go to the upper level
            (-115.6, 0),
            (0.0, 8),
            (-4.5, 8),
            (-4.6, 7),
            (113.0, 15),
            (1e9, 15),
        ] {
            assert_eq!(best_index_iq4(x), want, "best_index({x})");
        }
    }
}
