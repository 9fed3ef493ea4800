//! The scalar twins: ggml's generic per-block dot products, one weight row against one
//! activation row. They are the fallback on every CPU and the oracle the SIMD kernels are tested
//! against.
//!
//! Each `dot_*` reads `w`, the bytes of one weight row (`y.len()` blocks of the weight type, any
//! alignment), and `y`, the matching activation blocks. Integer sums are exact and in `i32`, as in
//! ggml; block results are accumulated in `f32` (quantized types) or `f64` (float types, as ggml's
//! `ggml_float`).

use bytemuck::{pod_read_unaligned, Pod};
use half::{bf16, f16};

use crate::quant::iq::{BlockIq4Nl, BlockIq4Xs, KVALUES_IQ4NL};
use crate::quant::k_quants::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use crate::quant::legacy::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1};
use crate::quant::mxfp4::{e8m0_to_f32_half, BlockMxfp4, KVALUES_MXFP4};

/// Block `i` of a row of `B`s stored at any alignment.
#[inline(always)]
fn block<B: Pod>(w: &[u8], i: usize) -> B {
    let n = std::mem::size_of::<B>();
    pod_read_unaligned(&w[i * n..(i + 1) * n])
}

/// Unpack the eight 6-bit scales and eight 6-bit mins of a Q4_K / Q5_K block (ggml's
/// `get_scale_min_k4` for every sub-block).
#[inline(always)]
pub(crate) fn scales_mins_k4(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
    }
    for j in 4..8 {
        sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    (sc, m)
}

/// Unpack the sixteen 6-bit scales of a Q3_K block, minus their bias of 32.
#[inline(always)]
pub(crate) fn scales_q3k(s: &[u8; 12]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let a0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let a1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let tmp = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut out = [0i8; 16];
    for (i, a) in aux.iter().enumerate() {
        for (j, b) in a.to_le_bytes().iter().enumerate() {
            out[4 * i + j] = *b as i8 - 32;
        }
    }
    out
}

/// The IQ4_XS sub-block scale `ib` (0..8), minus its bias of 32.
#[inline(always)]
pub(crate) fn scale_iq4xs(b: &BlockIq4Xs, ib: usize) -> i32 {
    let lo = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
    let hi = ((b.scales_h >> (2 * ib)) & 3) as u8;
    i32::from(lo | (hi << 4)) - 32
}

pub(super) fn dot_f32(w: &[u8], y: &[f32]) -> f32 {
    let mut sum = 0f64;
    for (c, &b) in w.chunks_exact(4).zip(y) {
        sum += f64::from(pod_read_unaligned::<f32>(c) * b);
    }
    sum as f32
}

pub(super) fn dot_f16(w: &[u8], y: &[f16]) -> f32 {
    let mut sum = 0f64;
    for (c, &b) in w.chunks_exact(2).zip(y) {
        sum += f64::from(pod_read_unaligned::<f16>(c).to_f32() * b.to_f32());
    }
    sum as f32
}

pub(super) fn dot_bf16(w: &[u8], y: &[bf16]) -> f32 {
    let mut sum = 0f64;
    for (c, &b) in w.chunks_exact(2).zip(y) {
        sum += f64::from(pod_read_unaligned::<bf16>(c).to_f32() * b.to_f32());
    }
    sum as f32
}

pub(super) fn dot_q4_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ4_0 = block(w, i);
        let mut sumi = 0i32;
        for j in 0..16 {
            let v0 = i32::from(x.qs[j] & 0xF) - 8;
            let v1 = i32::from(x.qs[j] >> 4) - 8;
            sumi += v0 * i32::from(yb.qs[j]) + v1 * i32::from(yb.qs[j + 16]);
        }
        sumf += sumi as f32 * (x.d.to_f32() * yb.d.to_f32());
    }
    sumf
}

pub(super) fn dot_q4_1(w: &[u8], y: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ4_1 = block(w, i);
        let mut sumi = 0i32;
        for j in 0..16 {
            let v0 = i32::from(x.qs[j] & 0xF);
            let v1 = i32::from(x.qs[j] >> 4);
            sumi += v0 * i32::from(yb.qs[j]) + v1 * i32::from(yb.qs[j + 16]);
        }
        sumf += (x.d.to_f32() * yb.d.to_f32()) * sumi as f32 + x.m.to_f32() * yb.s.to_f32();
    }
    sumf
}

pub(super) fn dot_q5_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ5_0 = block(w, i);
        let qh = u32::from_le_bytes(x.qh);
        let mut sumi = 0i32;
        for j in 0..16 {
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            let v0 = i32::from((x.qs[j] & 0xF) | h0) - 16;
            let v1 = i32::from((x.qs[j] >> 4) | h1) - 16;
            sumi += v0 * i32::from(yb.qs[j]) + v1 * i32::from(yb.qs[j + 16]);
        }
        sumf += sumi as f32 * (x.d.to_f32() * yb.d.to_f32());
    }
    sumf
}

pub(super) fn dot_q5_1(w: &[u8], y: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ5_1 = block(w, i);
        let qh = u32::from_le_bytes(x.qh);
        let mut sumi = 0i32;
        for j in 0..16 {
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            let v0 = i32::from((x.qs[j] & 0xF) | h0);
            let v1 = i32::from((x.qs[j] >> 4) | h1);
            sumi += v0 * i32::from(yb.qs[j]) + v1 * i32::from(yb.qs[j + 16]);
        }
        sumf += (x.d.to_f32() * yb.d.to_f32()) * sumi as f32 + x.m.to_f32() * yb.s.to_f32();
    }
    sumf
}

pub(super) fn dot_q8_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ8_0 = block(w, i);
        let sumi: i32 =
            x.qs.iter()
                .zip(&yb.qs)
                .map(|(&a, &b)| i32::from(a) * i32::from(b))
                .sum();
        sumf += sumi as f32 * (x.d.to_f32() * yb.d.to_f32());
    }
    sumf
}

/// Q8_1 weights (no `vec_dot` in ggml): the `s` field is not needed against Q8_0 activations.
pub(super) fn dot_q8_1(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ8_1 = block(w, i);
        let sumi: i32 =
            x.qs.iter()
                .zip(&yb.qs)
                .map(|(&a, &b)| i32::from(a) * i32::from(b))
                .sum();
        sumf += sumi as f32 * (x.d.to_f32() * yb.d.to_f32());
    }
    sumf
}

pub(super) fn dot_iq4_nl(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockIq4Nl = block(w, i);
        let mut sumi = 0i32;
        for j in 0..16 {
            sumi += i32::from(yb.qs[j]) * i32::from(KVALUES_IQ4NL[usize::from(x.qs[j] & 0xF)]);
            sumi += i32::from(yb.qs[j + 16]) * i32::from(KVALUES_IQ4NL[usize::from(x.qs[j] >> 4)]);
        }
        sumf += sumi as f32 * (x.d.to_f32() * yb.d.to_f32());
    }
    sumf
}

pub(super) fn dot_mxfp4(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockMxfp4 = block(w, i);
        let mut sumi = 0i32;
        for j in 0..16 {
            sumi += i32::from(yb.qs[j]) * i32::from(KVALUES_MXFP4[usize::from(x.qs[j] & 0xF)]);
            sumi += i32::from(yb.qs[j + 16]) * i32::from(KVALUES_MXFP4[usize::from(x.qs[j] >> 4)]);
        }
        sumf += sumi as f32 * (e8m0_to_f32_half(x.e) * yb.d.to_f32());
    }
    sumf
}

pub(super) fn dot_q2k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ2K = block(w, i);
        let mut summs = 0i32;
        for j in 0..16 {
            summs += i32::from(yb.bsums[j]) * i32::from(x.scales[j] >> 4);
        }
        let mut isum = 0i32;
        for e in 0..256 {
            let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
            let q = i32::from((x.qs[32 * n + l] >> (2 * s)) & 3);
            isum += i32::from(x.scales[e / 16] & 0xF) * q * i32::from(yb.qs[e]);
        }
        let dall = yb.d * x.d.to_f32();
        let dmin = yb.d * x.dmin.to_f32();
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

pub(super) fn dot_q3k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ3K = block(w, i);
        let scales = scales_q3k(&x.scales);
        let mut isum = 0i32;
        for e in 0..256 {
            let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
            let low = i32::from((x.qs[32 * n + l] >> (2 * s)) & 3);
            let hbit = x.hmask[l] & (1 << (4 * n + s)) != 0;
            let q = low - if hbit { 0 } else { 4 };
            isum += i32::from(scales[e / 16]) * q * i32::from(yb.qs[e]);
        }
        sumf += (x.d.to_f32() * yb.d) * isum as f32;
    }
    sumf
}

pub(super) fn dot_q4k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ4K = block(w, i);
        let (sc, mn) = scales_mins_k4(&x.scales);
        let mut summs = 0i32;
        for j in 0..16 {
            summs += i32::from(yb.bsums[j]) * i32::from(mn[j / 2]);
        }
        let mut isum = 0i32;
        for e in 0..256 {
            let (j, hi, l) = (e / 64, (e % 64) / 32, e % 32);
            let byte = x.qs[32 * j + l];
            let q = i32::from(if hi == 1 { byte >> 4 } else { byte & 0xF });
            isum += i32::from(sc[e / 32]) * q * i32::from(yb.qs[e]);
        }
        sumf += (x.d.to_f32() * yb.d) * isum as f32 - (x.dmin.to_f32() * yb.d) * summs as f32;
    }
    sumf
}

pub(super) fn dot_q5k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ5K = block(w, i);
        let (sc, mn) = scales_mins_k4(&x.scales);
        let mut summs = 0i32;
        for j in 0..16 {
            summs += i32::from(yb.bsums[j]) * i32::from(mn[j / 2]);
        }
        let mut isum = 0i32;
        for e in 0..256 {
            let (j, hi, l) = (e / 64, (e % 64) / 32, e % 32);
            let byte = x.qs[32 * j + l];
            let low = if hi == 1 { byte >> 4 } else { byte & 0xF };
            let hbit = (x.qh[l] >> (2 * j + hi)) & 1;
            let q = i32::from(low | (hbit << 4));
            isum += i32::from(sc[e / 32]) * q * i32::from(yb.qs[e]);
        }
        sumf += (x.d.to_f32() * yb.d) * isum as f32 - (x.dmin.to_f32() * yb.d) * summs as f32;
    }
    sumf
}

pub(super) fn dot_q6k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ6K = block(w, i);
        let mut isum = 0i32;
        for e in 0..256 {
            // Element e = 128 n + 32 s + l: low nibble of ql[64 n + l] (s = 0), of
            // ql[64 n + 32 + l] (s = 1), high nibbles for s = 2, 3; two high bits from qh[32 n + l]
            // at bit 2 s.
            let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
            let ql = x.ql[64 * n + 32 * (s % 2) + l];
            let low = if s >= 2 { ql >> 4 } else { ql & 0xF };
            let high = (x.qh[32 * n + l] >> (2 * s)) & 3;
            let q = i32::from(low | (high << 4)) - 32;
            isum += i32::from(x.scales[e / 16]) * q * i32::from(yb.qs[e]);
        }
        sumf += (x.d.to_f32() * yb.d) * isum as f32;
    }
    sumf
}

/// Q8_K weights (no `vec_dot` in ggml, which never stores weights as Q8_K).
pub(super) fn dot_q8k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockQ8K = block(w, i);
        let sumi: i32 =
            x.qs.iter()
                .zip(&yb.qs)
                .map(|(&a, &b)| i32::from(a) * i32::from(b))
                .sum();
        sumf += (x.d * yb.d) * sumi as f32;
    }
    sumf
}

pub(super) fn dot_iq4_xs(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut sumf = 0f32;
    for (i, yb) in y.iter().enumerate() {
        let x: BlockIq4Xs = block(w, i);
        let d4d8 = x.d.to_f32() * yb.d;
        for ib in 0..8 {
            let qs = &x.qs[16 * ib..16 * ib + 16];
            let q8 = &yb.qs[32 * ib..32 * ib + 32];
            let mut sumi = 0i32;
            for j in 0..16 {
                sumi += i32::from(q8[j]) * i32::from(KVALUES_IQ4NL[usize::from(qs[j] & 0xF)]);
                sumi += i32::from(q8[j + 16]) * i32::from(KVALUES_IQ4NL[usize::from(qs[j] >> 4)]);
            }
            sumf += (d4d8 * scale_iq4xs(&x, ib) as f32) * sumi as f32;
        }
    }
    sumf
}
