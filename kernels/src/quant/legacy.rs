//! The original 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.

use bytemuck::{Pod, Zeroable};
use half::f16;

/// Elements per block of the legacy formats (ggml's `QK4_0`, `QK8_0`, ...).
pub const QK: usize = 32;

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f16,
    /// `d * sum(qs)`.
    pub s: f16,
    pub qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 36);

use super::{check_len, GgmlType};

block_format!(
    BlockQ4_0,
    GgmlType::Q4_0,
    QK,
    dequantize_q4_0,
    quantize_q4_0
);
block_format!(
    BlockQ4_1,
    GgmlType::Q4_1,
    QK,
    dequantize_q4_1,
    quantize_q4_1
);
block_format!(
    BlockQ5_0,
    GgmlType::Q5_0,
    QK,
    dequantize_q5_0,
    quantize_q5_0
);
block_format!(
    BlockQ5_1,
    GgmlType::Q5_1,
    QK,
    dequantize_q5_1,
    quantize_q5_1
);
block_format!(
    BlockQ8_0,
    GgmlType::Q8_0,
    QK,
    dequantize_q8_0,
    quantize_q8_0
);
block_format!(
    BlockQ8_1,
    GgmlType::Q8_1,
    QK,
    dequantize_q8_1,
    quantize_q8_1
);

/// The element with the largest magnitude, sign kept (the first one on ties), as the
/// `amax`/`max` loops of ggml's symmetric quantizers find it.
#[inline(always)]
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// The minimum and maximum, as ggml's `quantize_row_q4_1_ref` finds them.
#[inline(always)]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

#[inline(always)]
fn inverse_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// Pack the 5th bits of 32 quants into ggml's `qh` (bit j for element j, little-endian u32).
#[inline(always)]
fn pack_high_bits(l: &[u8; QK]) -> [u8; 4] {
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        qh |= ((l[j] as u32 & 0x10) >> 4) << j;
        qh |= ((l[j + QK / 2] as u32 & 0x10) >> 4) << (j + QK / 2);
    }
    qh.to_le_bytes()
}

#[inline(always)]
fn pack_nibbles(l: &[u8; QK]) -> [u8; QK / 2] {
    let mut qs = [0u8; QK / 2];
    for j in 0..QK / 2 {
        qs[j] = (l[j] & 0x0f) | ((l[j + QK / 2] & 0x0f) << 4);
    }
    qs
}

/// Dequantize Q4_0 (`dequantize_row_q4_0`): `(q - 8) * d`.
pub fn dequantize_q4_0(blocks: &[BlockQ4_0], out: &mut [f32]) {
    check_len(GgmlType::Q4_0, blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for j in 0..QK / 2 {
            let x0 = (b.qs[j] & 0x0f) as i32 - 8;
            let x1 = (b.qs[j] >> 4) as i32 - 8;
            y[j] = x0 as f32 * d;
            y[j + QK / 2] = x1 as f32 * d;
        }
    }
}

/// Quantize Q4_0 (`quantize_row_q4_0_ref`): `d = max / -8` from the signed absolute maximum.
pub fn quantize_q4_0(src: &[f32], out: &mut [BlockQ4_0]) {
    check_len(GgmlType::Q4_0, out.len(), QK, src.len());
    for (x, b) in src.chunks_exact(QK).zip(out.iter_mut()) {
        let d = signed_absmax(x) / -8.0;
        let id = inverse_or_zero(d);
        b.d = f16::from_f32(d);
        let mut l = [0u8; QK];
        for (l, &v) in l.iter_mut().zip(x) {
            *l = ((v * id + 8.5) as i8).min(15) as u8;
        }
        b.qs = pack_nibbles(&l);
    }
}

/// Dequantize Q4_1 (`dequantize_row_q4_1`): `q * d + m`.
pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    check_len(GgmlType::Q4_1, blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        for j in 0..QK / 2 {
            y[j] = (b.qs[j] & 0x0f) as f32 * d + m;
            y[j + QK / 2] = (b.qs[j] >> 4) as f32 * d + m;
        }
    }
}

/// Quantize Q4_1 (`quantize_row_q4_1_ref`): `d = (max - min) / 15`, `m = min`.
pub fn quantize_q4_1(src: &[f32], out: &mut [BlockQ4_1]) {
    check_len(GgmlType::Q4_1, out.len(), QK, src.len());
    for (x, b) in src.chunks_exact(QK).zip(out.iter_mut()) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse_or_zero(d);
        b.d = f16::from_f32(d);
        b.m = f16::from_f32(min);
        let mut l = [0u8; QK];
        for (l, &v) in l.iter_mut().zip(x) {
            *l = (((v - min) * id + 0.5) as i8).min(15) as u8;
        }
        b.qs = pack_nibbles(&l);
    }
}

/// Dequantize Q5_0 (`dequantize_row_q5_0`): `(q - 16) * d` with the 5th bit from `qh`.
pub fn dequantize_q5_0(blocks: &[BlockQ5_0], out: &mut [f32]) {
    check_len(GgmlType::Q5_0, blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let qh = u32::from_le_bytes(b.qh);
        for j in 0..QK / 2 {
            let xh0 = (((qh >> j) << 4) & 0x10) as u8;
            let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
            let x0 = ((b.qs[j] & 0x0f) | xh0) as i32 - 16;
            let x1 = ((b.qs[j] >> 4) | xh1) as i32 - 16;
            y[j] = x0 as f32 * d;
            y[j + QK / 2] = x1 as f32 * d;
        }
    }
}

/// Quantize Q5_0 (`quantize_row_q5_0_ref`): `d = max / -16`.
pub fn quantize_q5_0(src: &[f32], out: &mut [BlockQ5_0]) {
    check_len(GgmlType::Q5_0, out.len(), QK, src.len());
    for (x, b) in src.chunks_exact(QK).zip(out.iter_mut()) {
        let d = signed_absmax(x) / -16.0;
        let id = inverse_or_zero(d);
        b.d = f16::from_f32(d);
        let mut l = [0u8; QK];
        for (l, &v) in l.iter_mut().zip(x) {
            *l = ((v * id + 16.5) as i8).min(31) as u8;
        }
        b.qs = pack_nibbles(&l);
        b.qh = pack_high_bits(&l);
    }
}

/// Dequantize Q5_1 (`dequantize_row_q5_1`): `q * d + m` with the 5th bit from `qh`.
pub fn dequantize_q5_1(blocks: &[BlockQ5_1], out: &mut [f32]) {
    check_len(GgmlType::Q5_1, blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        let qh = u32::from_le_bytes(b.qh);
        for j in 0..QK / 2 {
            let xh0 = (((qh >> j) << 4) & 0x10) as u8;
            let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
            let x0 = (b.qs[j] & 0x0f) | xh0;
            let x1 = (b.qs[j] >> 4) | xh1;
            y[j] = x0 as f32 * d + m;
            y[j + QK / 2] = x1 as f32 * d + m;
        }
    }
}

/// Quantize Q5_1 (`quantize_row_q5_1_ref`): `d = (max - min) / 31`, `m = min`.
pub fn quantize_q5_1(src: &[f32], out: &mut [BlockQ5_1]) {
    check_len(GgmlType::Q5_1, out.len(), QK, src.len());
    for (x, b) in src.chunks_exact(QK).zip(out.iter_mut()) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse_or_zero(d);
        b.d = f16::from_f32(d);
        b.m = f16::from_f32(min);
        let mut l = [0u8; QK];
        for (l, &v) in l.iter_mut().zip(x) {
            // ggml has no clamp here: (v - min) * id is at most 31 (+ rounding).
            *l = ((v - min) * id + 0.5) as u8;
        }
        b.qs = pack_nibbles(&l);
        b.qh = pack_high_bits(&l);
    }
}

/// Dequantize Q8_0 (`dequantize_row_q8_0`): `q * d`.
pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    check_len(GgmlType::Q8_0, blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = q as f32 * d;
        }
    }
}

/// The shared core of `quantize_row_q8_0_ref` and `quantize_row_q8_1_ref`: returns `d` (as f32,
/// before the f16 rounding) and fills `qs` with `round(x / d)`, ties away from zero (`roundf`).
#[inline(always)]
fn quantize_q8_block(x: &[f32], qs: &mut [i8; QK]) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse_or_zero(d);
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    d
}

/// Quantize Q8_0 (`quantize_row_q8_0_ref`): `d = amax / 127`, `q = round(x / d)`.
///
/// This is also the activation quantizer of the Q4_0/Q4_1/Q5_x/Q8_0 dot products.
pub fn quantize_q8_0(src: &[f32], out: &mut [BlockQ8_0]) {
    check_len(GgmlType::Q8_0, out.len(), QK, src.len());
    for (x, b) in src.chunks_exact(QK).zip(out.iter_mut()) {
        let d = quantize_q8_block(x, &mut b.qs);
        b.d = f16::from_f32(d);
    }
}

/// Dequantize Q8_1: `q * d` (`s` is a dot-product helper and plays no part).
pub fn dequantize_q8_1(blocks: &[BlockQ8_1], out: &mut [f32]) {
    check_len(GgmlType::Q8_1, blocks.len(), QK, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = q as f32 * d;
        }
    }
}

/// Quantize Q8_1 (`quantize_row_q8_1_ref`): as Q8_0, plus `s = sum(q) * d` with the f32 `d`
/// (before its f16 rounding), stored as f16.
pub fn quantize_q8_1(src: &[f32], out: &mut [BlockQ8_1]) {
    check_len(GgmlType::Q8_1, out.len(), QK, src.len());
    for (x, b) in src.chunks_exact(QK).zip(out.iter_mut()) {
        let d = quantize_q8_block(x, &mut b.qs);
        let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
        b.d = f16::from_f32(d);
        b.s = f16::from_f32(sum as f32 * d);
    }
}
