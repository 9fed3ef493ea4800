//! AVX-512 (F + BW + VL) kernels, 512 bits wide, for the types of the real models: F32, F16,
//! Q4_0, Q5_0, Q8_0 (two blocks per register), Q4_K and Q6_K (64 elements per register). The
//! other types run the AVX2 kernels on this ISA (see [`super`]). The legacy and k-quant kernels
//! also come in a four-activation-row form (prefill: each weight block unpacked once for four
//! tokens) that gives bit-identical results to the one-row form. Each kernel computes the same
//! exact integer block sums as its scalar twin in [`super::scalar`].
//!
//! Safe `#[target_feature]` functions, as in [`super::avx2`]: only the CPU features are a
//! precondition, checked once in [`super::CpuKernels::new`].

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use half::f16;

use super::avx2::{
    bytes_from_bits_32, f16_to_f32, fp16, hsum_ps, hsum_ps128, ld128, ld_i8, ld_u8,
    mins_i16_dot_bsums, nibbles_32, q6k_bias, q6k_unpack,
};
use super::scalar::scales_mins_k4;
use super::{RowDot, RowDot4, RowPanel, RowRows};
use crate::quant::{BlockQ8K, BlockQ8_0, GgmlType};

/// The AVX-512 kernel for weights of type `ty`, if there is one; `vnni`: the CPU has AVX-512
/// VNNI (the k-quant kernels then use it).
pub(super) fn select(ty: GgmlType, vnni: bool) -> Option<RowDot> {
    use GgmlType as T;
    Some(match ty {
        T::Q4K if vnni => RowDot::Q8K(dot_q4k_vnni),
        T::Q6K if vnni => RowDot::Q8K(dot_q6k_vnni),
        T::F32 => RowDot::F32(dot_f32),
        T::F16 => RowDot::F16(dot_f16),
        T::Q4_0 => RowDot::Q8_0(dot_q4_0),
        T::Q5_0 => RowDot::Q8_0(dot_q5_0),
        T::Q8_0 => RowDot::Q8_0(dot_q8_0),
        T::Q4K => RowDot::Q8K(dot_q4k),
        T::Q6K => RowDot::Q8K(dot_q6k),
        _ => return None,
    })
}

/// The AVX-512 four-row kernel for weights of type `ty`, if there is one (see
/// [`super::RowDot4`]); `vnni` as in [`select`].
pub(super) fn select4(ty: GgmlType, vnni: bool) -> Option<RowDot4> {
    use GgmlType as T;
    Some(match ty {
        T::Q4K if vnni => RowDot4::Q8K(dot4_q4k_vnni),
        T::Q6K if vnni => RowDot4::Q8K(dot4_q6k_vnni),
        T::Q4_0 => RowDot4::Q8_0(dot4_q4_0),
        T::Q5_0 => RowDot4::Q8_0(dot4_q5_0),
        T::Q8_0 => RowDot4::Q8_0(dot4_q8_0),
        T::Q4K => RowDot4::Q8K(dot4_q4k),
        T::Q6K => RowDot4::Q8K(dot4_q6k),
        _ => return None,
    })
}

/// 64 bytes from the front of `s` (any alignment).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn ld512(s: &[u8]) -> __m512i {
    let s = &s[..64];
    // SAFETY: `s` is 64 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
}

/// 64 signed bytes from the front of `s`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn ld512_i8(s: &[i8]) -> __m512i {
    let s = &s[..64];
    // SAFETY: `s` is 64 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
}

/// `lo` in bits 0..256, `hi` in bits 256..512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn cat(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The low and high 256-bit halves of the i32 lanes, added.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn fold_epi32(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot_f32(w: &[u8], y: &[f32]) -> f32 {
    let n = y.len();
    let w = &w[..4 * n];
    let yb: &[u8] = bytemuck::cast_slice(y);
    let mut acc = [_mm512_setzero_ps(); 4];
    let main = n / 64 * 64;
    for i in (0..main).step_by(64) {
        for (a, accv) in acc.iter_mut().enumerate() {
            let o = 4 * (i + 16 * a);
            let wv = _mm512_castsi512_ps(ld512(&w[o..]));
            let xv = _mm512_castsi512_ps(ld512(&yb[o..]));
            *accv = _mm512_fmadd_ps(wv, xv, *accv);
        }
    }
    let mut rest = 0f32;
    for i in main..n {
        let wv = f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]);
        rest += wv * y[i];
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(s) + rest
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot_f16(w: &[u8], y: &[f16]) -> f32 {
    let n = y.len();
    let w = &w[..2 * n];
    let yb: &[u8] = bytemuck::cast_slice(y);
    let mut acc = [_mm512_setzero_ps(); 4];
    let main = n / 64 * 64;
    for i in (0..main).step_by(64) {
        for (a, accv) in acc.iter_mut().enumerate() {
            let o = 2 * (i + 16 * a);
            let wv = _mm512_cvtph_ps(ld_u8(&w[o..]));
            let xv = _mm512_cvtph_ps(ld_u8(&yb[o..]));
            *accv = _mm512_fmadd_ps(wv, xv, *accv);
        }
    }
    let mut rest = 0f32;
    for i in main..n {
        rest += fp16(&w[2 * i..]) * f16_to_f32(y[i]);
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(s) + rest
}

/// Shared loop of the Q8_0-activation kernels, two blocks per 512-bit register, for `N`
/// activation rows at once: `unpack2` turns two consecutive `TS`-byte weight blocks into 64
/// signed bytes and their f32 scales (`unpack` one block, for an odd last one), once for all `N`
/// rows. An odd last block runs at 256 bits.
///
/// The activation scales are read sixteen blocks at a time per row (one gather and one f16
/// conversion), and each pair's two scales are then spread over its lanes with one permutation,
/// instead of two scalar conversions and two broadcasts per pair and row: in a product over
/// several tokens those per-row scale operations, not the integer dot products, were most of
/// the time. The products `dx · dy` and the fused multiply-adds are the same f32 operations,
/// in the same order, as one scalar product per block, for every `N`, so the multi-row kernels
/// give bit-identical results to the one-row kernel.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn dot_blocks_q8_0<const TS: usize, const N: usize>(
    w: &[u8],
    ys: [&[BlockQ8_0]; N],
    unpack: impl Fn(&[u8]) -> (__m256i, f32),
    unpack2: impl Fn(&[u8]) -> (__m512i, f32, f32),
) -> [f32; N] {
    let nb = w.len() / TS;
    let ys = ys.map(|y| &y[..nb]);
    let mut acc = [_mm512_setzero_ps(); N];
    let pairs = nb / 2;
    // Lane l of a pair's scale vector takes block 2p + l / 8 of the group's sixteen scales.
    let half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let mut p0 = 0;
    while p0 < pairs {
        let g = (pairs - p0).min(8);
        // Loops, not `array::map`: a closure handed to `map` is not inlined into a
        // `#[target_feature]` function, and the call spills every accumulator.
        let mut dy = [_mm512_setzero_ps(); N];
        for (d, y) in dy.iter_mut().zip(ys) {
            *d = act_scales16(&y[2 * p0..2 * (p0 + g)]);
        }
        for k in 0..g {
            let i = p0 + k;
            let (qx, d0, d1) = unpack2(&w[2 * TS * i..2 * TS * (i + 1)]);
            let ax = _mm512_abs_epi8(qx);
            let neg = _mm512_movepi8_mask(qx);
            let dx = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
            let idx = _mm512_add_epi32(half, _mm512_set1_epi32(2 * k as i32));
            for ((a, y), dy) in acc.iter_mut().zip(ys).zip(&dy) {
                let (y0, y1) = (&y[2 * i], &y[2 * i + 1]);
                let qy = cat(ld_i8(&y0.qs), ld_i8(&y1.qs));
                let sy = _mm512_mask_sub_epi8(qy, neg, _mm512_setzero_si512(), qy);
                let p16 = _mm512_maddubs_epi16(ax, sy);
                let sumi = _mm512_madd_epi16(p16, _mm512_set1_epi16(1));
                // Lanes 0..8 hold the first block's sums, lanes 8..16 the second's.
                let d = _mm512_mul_ps(dx, _mm512_permutexvar_ps(idx, *dy));
                *a = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), *a);
            }
        }
        p0 += g;
    }
    let mut tail = [_mm256_setzero_ps(); N];
    if nb % 2 == 1 {
        let (q, dx) = unpack(&w[(nb - 1) * TS..]);
        for (t, y) in tail.iter_mut().zip(ys) {
            *t = tail_block(q, dx, &y[nb - 1]);
        }
    }
    let mut out = [0f32; N];
    for n in 0..N {
        out[n] = _mm512_reduce_add_ps(acc[n]) + hsum_ps(tail[n]);
    }
    out
}

/// One odd last block of a Q8_0-activation product at 256 bits: `q` the weight block's signed
/// values, `dx` its scale. Shared by every kernel of that family, so that they agree bit for bit.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn tail_block(q: __m256i, dx: f32, yb: &BlockQ8_0) -> __m256 {
    let ax = _mm256_sign_epi8(q, q);
    let sy = _mm256_sign_epi8(ld_i8(&yb.qs), q);
    let sumi = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
    let d = _mm256_set1_ps(dx * f16_to_f32(yb.d));
    _mm256_mul_ps(d, _mm256_cvtepi32_ps(sumi))
}

/// The f16 scales of up to sixteen activation blocks as f32 lanes (lanes past `y.len()` are 0).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn act_scales16(y: &[BlockQ8_0]) -> __m512 {
    let n = y.len().min(16);
    scales16::<{ std::mem::size_of::<BlockQ8_0>() }>(bytemuck::cast_slice(&y[..n]), n)
}

/// The f16 scales at the front of `n ≤ 16` consecutive `STRIDE`-byte blocks of `bytes`, as f32
/// lanes (lanes from `n` on are 0): one masked gather and one conversion.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn scales16<const STRIDE: usize>(bytes: &[u8], n: usize) -> __m512 {
    let n = n.min(16).min(bytes.len() / STRIDE);
    let bytes = &bytes[..n * STRIDE];
    let lanes = ((1u32 << n) - 1) as __mmask16;
    let offsets = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(STRIDE as i32),
    );
    // SAFETY: lane j < n reads the four bytes at STRIDE·j, which lie inside `bytes` (every block
    // is STRIDE ≥ 4 bytes long and `bytes` holds n of them); masked-off lanes read nothing.
    let raw = unsafe {
        _mm512_mask_i32gather_epi32::<1>(
            _mm512_setzero_si512(),
            lanes,
            offsets,
            bytes.as_ptr().cast(),
        )
    };
    // Each lane's low 16 bits are the block's `d`; lanes past the end gathered 0 (f16 +0).
    _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn q8_0_unpack(b: &[u8]) -> (__m256i, f32) {
    (ld_u8(&b[2..]), fp16(b))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn q4_0_unpack(b: &[u8]) -> (__m256i, f32) {
    let q = _mm256_sub_epi8(nibbles_32(&b[2..]), _mm256_set1_epi8(8));
    (q, fp16(b))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn q5_0_unpack(b: &[u8]) -> (__m256i, f32) {
    let qh = le_u32(&b[2..]);
    let hi = _mm256_andnot_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0xF0u8 as i8));
    (_mm256_or_si256(nibbles_32(&b[6..]), hi), fp16(b))
}

/// Two blocks unpacked one at a time and concatenated.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn pair<const TS: usize>(
    b: &[u8],
    unpack: impl Fn(&[u8]) -> (__m256i, f32),
) -> (__m512i, f32, f32) {
    let (q0, d0) = unpack(&b[..TS]);
    let (q1, d1) = unpack(&b[TS..]);
    (cat(q0, q1), d0, d1)
}

/// Two Q5_0 blocks at once: the 64 high bits become a byte mask in one instruction (AVX-512BW),
/// and the nibbles of both blocks are split in one pass. The same bytes as two
/// [`q5_0_unpack`]s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn q5_0_unpack2(b: &[u8]) -> (__m512i, f32, f32) {
    let high = q5_0_high2(b);
    let x = nibbles2(&b[6..], &b[28..]);
    // (nibble | h << 4) − 16 as a signed byte is the nibble with 0xF0 set where h is 0.
    let h = _mm512_maskz_mov_epi8(!high, _mm512_set1_epi8(0xF0u8 as i8));
    (_mm512_or_si512(x, h), fp16(b), fp16(&b[22..]))
}

/// The 64 high bits of two consecutive Q5_0 blocks (`b` holds both), block 0's in bits 0..32.
#[inline]
fn q5_0_high2(b: &[u8]) -> u64 {
    u64::from(le_u32(&b[2..])) | u64::from(le_u32(&b[24..])) << 32
}

/// The little-endian u32 at the front of `b` (one load; a byte-by-byte `from_le_bytes` of four
/// indexed bytes compiles to four).
#[inline]
fn le_u32(b: &[u8]) -> u32 {
    let mut four = [0u8; 4];
    four.copy_from_slice(&b[..4]);
    u32::from_le_bytes(four)
}

/// The 64 nibbles of two 16-byte nibble arrays `a` and `b` (each low nibbles first, then high,
/// as in Q4_0 / Q5_0 blocks), as 64 bytes in element order: `a`'s 32 elements, then `b`'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn nibbles2(a: &[u8], b: &[u8]) -> __m512i {
    // [a, a, b, b] in 128-bit lanes, lanes 1 and 3 shifted right by four, then masked: each
    // block's low nibbles followed by its high ones. Five instructions where two 256-bit halves
    // put together took seven: Q5_0 decode 28.0 → 26.0 ns per in-cache row of 640 (Zen 4,
    // `kernels/examples/rows_cost.rs`).
    let ab = _mm512_castsi256_si512(_mm256_set_m128i(ld128(b), ld128(a)));
    let x = _mm512_shuffle_i64x2::<0b01_01_00_00>(ab, ab);
    let shifts = _mm512_set_epi64(
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0,
        0,
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0,
        0,
    );
    _mm512_and_si512(_mm512_srlv_epi16(x, shifts), _mm512_set1_epi8(0x0F))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot_q8_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<34, 1>(
        w,
        [y],
        |b| q8_0_unpack(b),
        |b| pair::<34>(b, |b| q8_0_unpack(b)),
    )[0]
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot_q4_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<18, 1>(
        w,
        [y],
        |b| q4_0_unpack(b),
        |b| pair::<18>(b, |b| q4_0_unpack(b)),
    )[0]
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot_q5_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<22, 1>(w, [y], |b| q5_0_unpack(b), |b| q5_0_unpack2(b))[0]
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot4_q8_0(w: &[u8], y: &[&[BlockQ8_0]; 4]) -> [f32; 4] {
    dot_blocks_q8_0::<34, 4>(
        w,
        *y,
        |b| q8_0_unpack(b),
        |b| pair::<34>(b, |b| q8_0_unpack(b)),
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot4_q4_0(w: &[u8], y: &[&[BlockQ8_0]; 4]) -> [f32; 4] {
    dot_blocks_q8_0::<18, 4>(
        w,
        *y,
        |b| q4_0_unpack(b),
        |b| pair::<18>(b, |b| q4_0_unpack(b)),
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot4_q5_0(w: &[u8], y: &[&[BlockQ8_0]; 4]) -> [f32; 4] {
    dot_blocks_q8_0::<22, 4>(w, *y, |b| q5_0_unpack(b), |b| q5_0_unpack2(b))
}

/// Two Q8_0 blocks' values plus 128: the bytes with the top bit flipped.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn q8_0_unpack2u(b: &[u8]) -> __m512i {
    _mm512_xor_si512(
        cat(ld_u8(&b[2..]), ld_u8(&b[36..])),
        _mm512_set1_epi8(i8::MIN),
    )
}

/// Two Q4_0 blocks' values plus 8: their nibbles.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn q4_0_unpack2u(b: &[u8]) -> __m512i {
    nibbles2(&b[2..], &b[20..])
}

/// Two Q5_0 blocks' values plus 16: their five bits, the nibble and 0x10 where the high bit is
/// set.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn q5_0_unpack2u(b: &[u8]) -> __m512i {
    let n = nibbles2(&b[6..], &b[28..]);
    _mm512_mask_add_epi8(n, q5_0_high2(b), n, _mm512_set1_epi8(0x10))
}

/// The AVX-512 VNNI panel kernel (a prefill task's weight rows × its tokens, see
/// [`super::Panel`]) for weights of type `ty`, if there is one. Only for a CPU with AVX-512
/// VNNI (checked by the caller).
pub(super) fn select_panel(ty: GgmlType) -> Option<RowPanel> {
    use GgmlType as T;
    Some(match ty {
        T::Q4_0 => RowPanel::Q8_0(panel_q4_0),
        T::Q5_0 => RowPanel::Q8_0(panel_q5_0),
        T::Q8_0 => RowPanel::Q8_0(panel_q8_0),
        T::Q4K => RowPanel::Q8K(panel_blocks_kquant::<false>),
        T::Q6K => RowPanel::Q8K(panel_blocks_kquant::<true>),
        _ => return None,
    })
}

/// A panel's registers: the activation side of every (token, pair) of a task, and the weight
/// side of four rows. One per thread, reused across products.
#[derive(Default)]
struct Panels {
    /// Per token, per pair of blocks: the bytes, the offset's starting sums, the scales
    /// (see [`act_pair`]).
    acts: Vec<__m512i>,
    /// Per pair, per row of four: the values plus `OFFSET`, the scales (see [`pair_scales`]).
    weights: Vec<__m512i>,
}

std::thread_local! {
    static PANELS: std::cell::RefCell<Panels> = std::cell::RefCell::default();
}

/// Registers per (token, pair) in [`Panels::acts`] and per (pair, row) in [`Panels::weights`].
const ACT_REGS: usize = 3;
const W_REGS: usize = 2;

/// A prefill task of a Q8_0-activation product with AVX-512 VNNI: `w`'s rows (`row_bytes`
/// each) against the `acts.len() / nb` activation rows in `acts` (`nb` blocks each), output
/// `(row r, token t)` to `out[t * out_stride + r]`.
///
/// What the tile kernel did per four rows and four tokens — unpack each weight pair, prepare
/// each activation pair — is done here once per task: every token's pairs are prepared into a
/// panel first, then each four rows are unpacked into a panel once and run against all the
/// task's tokens, four at a time. What is left per (row, token, pair) is one `vpdpbusd`, one
/// scale product, one conversion and one multiply-add, on operands already in registers or L1.
///
/// `unpack2u` turns two consecutive `TS`-byte weight blocks into their 64 values plus `OFFSET`
/// (all in 0..=255, so unsigned bytes for `vpdpbusd`), `unpack` one block into signed values
/// (for an odd last block). `vpdpbusd` starts from −`OFFSET`·Σy over the same four bytes, so each
/// i32 lane holds exactly the lane sum of the sign-trick kernel, and the f32 operations
/// (`dx · dy`, the conversion, the multiply-add, the final reduction) are those of
/// [`dot_blocks_q8_0`] in the same order: every output is bit-identical to the one-row kernel.
///
/// Measured on a Zen 4 (Gemma 3 270M, 574-token prompt, one thread, alternating runs): prefill
/// 234 → 294 tok/s against the four-rows × four-tokens tile kernel it replaced, which unpacked
/// each weight pair once per four tokens and prepared each activation pair once per four rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_blocks_q8_0<const TS: usize, const OFFSET: i8>(
    w: &[u8],
    row_bytes: usize,
    acts: &[BlockQ8_0],
    nb: usize,
    out: *mut f32,
    out_stride: usize,
    unpack: impl Fn(&[u8]) -> (__m256i, f32),
    unpack2u: impl Fn(&[u8]) -> __m512i,
) {
    if nb == 0 || row_bytes == 0 {
        return;
    }
    let n_rows = w.len() / row_bytes;
    let n_tok = acts.len() / nb;
    let pairs = nb / 2;
    const YS: usize = std::mem::size_of::<BlockQ8_0>();
    let act = |t: usize| &acts[t * nb..(t + 1) * nb];
    let mut panels = PANELS.with(|p| p.take());
    let zero = _mm512_setzero_si512();
    panels.acts.clear();
    panels.acts.resize(n_tok * pairs * ACT_REGS, zero);
    for t in 0..n_tok {
        let yb: &[u8] = bytemuck::cast_slice(act(t));
        let dst = &mut panels.acts[t * pairs * ACT_REGS..(t + 1) * pairs * ACT_REGS];
        for (i, d) in dst.chunks_exact_mut(ACT_REGS).enumerate() {
            let (qy, start, dy) = act_pair::<OFFSET>(&yb[2 * YS * i..2 * YS * (i + 1)]);
            d[0] = qy;
            d[1] = start;
            d[2] = _mm512_castps_si512(dy);
        }
    }
    panels.weights.clear();
    panels.weights.resize(pairs * 4 * W_REGS, zero);
    let a_panel = |t: usize| &panels.acts[t * pairs * ACT_REGS..(t + 1) * pairs * ACT_REGS];
    let mut r = 0;
    while r < n_rows {
        let nr = if r + 4 <= n_rows { 4 } else { 1 };
        let wr = |k: usize| &w[(r + k) * row_bytes..(r + k) * row_bytes + nb * TS];
        for i in 0..pairs {
            for k in 0..nr {
                let b = &wr(k)[2 * TS * i..2 * TS * (i + 1)];
                let d = &mut panels.weights[(i * 4 + k) * W_REGS..];
                d[0] = unpack2u(b);
                d[1] = _mm512_castps_si512(pair_scales::<TS>(b));
            }
        }
        let wp = &panels.weights[..pairs * 4 * W_REGS];
        // Each row's odd last block, unpacked once for all the tokens.
        let mut last = [None; 4];
        if nb % 2 == 1 {
            for (k, l) in last.iter_mut().enumerate().take(nr) {
                *l = Some(unpack(&wr(k)[(nb - 1) * TS..]));
            }
        }
        let mut t = 0;
        while t < n_tok {
            let nt = if t + 4 <= n_tok { 4 } else { 1 };
            // Each (row, token)'s sum, reduced as `_mm512_reduce_add_ps` reduces (sixteen at
            // once for a full tile).
            let mut sums = [[0f32; 4]; 4];
            let ap4 = |t: usize| [a_panel(t), a_panel(t + 1), a_panel(t + 2), a_panel(t + 3)];
            match (nr, nt) {
                (4, 4) => sums = reduce_add_4x4(&panel_micro::<4, 4>(wp, ap4(t))),
                (4, _) => {
                    let v = panel_micro::<4, 1>(wp, [a_panel(t)]);
                    for k in 0..4 {
                        sums[k][0] = _mm512_reduce_add_ps(v[k][0]);
                    }
                }
                (_, 4) => {
                    let v = panel_micro::<1, 4>(wp, ap4(t));
                    for j in 0..4 {
                        sums[0][j] = _mm512_reduce_add_ps(v[0][j]);
                    }
                }
                _ => sums[0][0] = _mm512_reduce_add_ps(panel_micro::<1, 1>(wp, [a_panel(t)])[0][0]),
            }
            for (k, &q) in last.iter().enumerate().take(nr) {
                for j in 0..nt {
                    let tail = match q {
                        Some((q, dx)) => tail_block(q, dx, &act(t + j)[nb - 1]),
                        None => _mm256_setzero_ps(),
                    };
                    // SAFETY: the caller's contract (see `super::Panel`): the output element of
                    // every (row, token) of the task is writable.
                    unsafe { *out.add((t + j) * out_stride + r + k) = sums[k][j] + hsum_ps(tail) };
                }
            }
            t += nt;
        }
        r += nr;
    }
    PANELS.with(|p| p.replace(panels));
}

/// `R` weight rows of a panel (`wp`, pair-major, four rows per pair) against `T` tokens' panels:
/// the per-lane sums of every (row, token), before the final reduction.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn panel_micro<const R: usize, const T: usize>(
    wp: &[__m512i],
    ap: [&[__m512i]; T],
) -> [[__m512; T]; R] {
    let pairs = wp.len() / (4 * W_REGS);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut xu = [_mm512_setzero_si512(); R];
    let mut dx = [_mm512_setzero_ps(); R];
    for i in 0..pairs {
        let wi = &wp[i * 4 * W_REGS..(i + 1) * 4 * W_REGS];
        for k in 0..R {
            xu[k] = wi[k * W_REGS];
            dx[k] = _mm512_castsi512_ps(wi[k * W_REGS + 1]);
        }
        for t in 0..T {
            let a = &ap[t][i * ACT_REGS..(i + 1) * ACT_REGS];
            let (qy, start, dy) = (a[0], a[1], _mm512_castsi512_ps(a[2]));
            for k in 0..R {
                let sumi = _mm512_dpbusd_epi32(start, xu[k], qy);
                let d = _mm512_mul_ps(dx[k], dy);
                acc[k][t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc[k][t]);
            }
        }
    }
    acc
}

/// `_mm512_reduce_add_ps` of four vectors at once, with the same additions in the same order
/// per vector (lane i + lane i + 8, then i + 4 within the eight, then 0 + 2 and 1 + 3, then
/// those two), each instruction doing the work of two or four vectors: about a quarter of the
/// instructions of four separate reductions.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn reduce_add_x4(v: [__m512; 4]) -> [f32; 4] {
    // Halves: [a.lo256 + a.hi256 | b.lo256 + b.hi256] for the pairs (0, 1) and (2, 3).
    let half = |a: __m512, b: __m512| {
        let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
        _mm512_add_ps(lo, hi)
    };
    let (a, b) = (half(v[0], v[1]), half(v[2], v[3]));
    // Quarters: 128-bit lane i holds vector i's four partial sums.
    let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
    let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
    let q = _mm512_add_ps(lo, hi);
    // Within each 128-bit lane: (0 + 2, 1 + 3), then their sum in element 0.
    let q = _mm512_add_ps(q, _mm512_permute_ps::<0b01_00_11_10>(q));
    let q = _mm512_add_ps(q, _mm512_movehdup_ps(q));
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` is 16 writable f32s; `storeu` has no alignment requirement.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), q) };
    [lanes[0], lanes[4], lanes[8], lanes[12]]
}

/// [`reduce_add_x4`] of a 4 × 4 tile of sums, a row at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn reduce_add_4x4(v: &[[__m512; 4]; 4]) -> [[f32; 4]; 4] {
    let mut out = [[0f32; 4]; 4];
    for (o, &row) in out.iter_mut().zip(v) {
        *o = reduce_add_x4(row);
    }
    out
}

/// A [`super::Panel`] kernel for one weight type: `panel_blocks_q8_0` with the type's block size,
/// offset and unpackers.
macro_rules! panel_fn {
    ($name:ident, $ts:literal, $offset:expr, $unpack:ident, $unpack2u:ident) => {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        unsafe fn $name(
            w: &[u8],
            row_bytes: usize,
            acts: &[BlockQ8_0],
            nb: usize,
            out: *mut f32,
            stride: usize,
        ) {
            let (u, u2) = (|b: &[u8]| $unpack(b), |b: &[u8]| $unpack2u(b));
            // SAFETY: the caller upholds `super::Panel`'s contract.
            unsafe {
                panel_blocks_q8_0::<$ts, { $offset }>(w, row_bytes, acts, nb, out, stride, u, u2)
            }
        }
    };
}

panel_fn!(panel_q8_0, 34, i8::MIN, q8_0_unpack, q8_0_unpack2u);
panel_fn!(panel_q4_0, 18, 8, q4_0_unpack, q4_0_unpack2u);
panel_fn!(panel_q5_0, 22, 16, q5_0_unpack, q5_0_unpack2u);

/// The AVX-512 VNNI rows kernel (a task's weight rows × up to eight activation rows, see
/// [`super::Rows`]) for weights of type `ty`, if there is one. Only for a CPU with
/// AVX-512 VNNI (checked by the caller).
pub(super) fn select_rows(ty: GgmlType) -> Option<RowRows> {
    use GgmlType as T;
    Some(match ty {
        T::Q4_0 => RowRows::Q8_0(rows_q4_0),
        T::Q5_0 => RowRows::Q8_0(rows_q5_0),
        T::Q8_0 => RowRows::Q8_0(rows_q8_0),
        _ => return None,
    })
}

/// Consecutive weight rows against `T` activation rows of a Q8_0-activation product (a decode
/// step, a small batch), with AVX-512 VNNI; `unpack2u` turns two consecutive
/// `TS`-byte weight blocks into their 64 values plus `OFFSET` (all of them then lie in 0..=255,
/// so they are unsigned bytes), `unpack` one block into signed values (for an odd last block).
///
/// The activation side of each pair of blocks (its bytes, the offset's correction, the pair's
/// scales) is prepared once, in chunks of up to `CHUNK` pairs, for all the rows; then each row
/// streams its bytes of the chunk, one row after another. What is left per row and pair is the
/// weight load, one `vpdpbusd`, the pair's scales from the bytes just loaded, one conversion
/// and one multiply-add. The i32 lanes equal the sign-trick lanes and the f32 operations
/// (`dx · dy`, the conversion, the multiply-add, the final reduction) are the same as in
/// [`dot_blocks_q8_0`], in the same order: every output is bit-identical to the one-row kernel.
///
/// Measured on a Zen 4 (the Gemma 3 head, 262144 × 640 Q8_0, one thread): the earlier kernel
/// gathered each row's sixteen scales at the start of a group (a gather that is a row's first
/// touch waits for all its cache lines at once: 64% of its samples) and interleaved four rows
/// pair by pair (four streams 680 bytes apart read at less than half the bandwidth of one).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
// Not inlined: each token count keeps its own stack frame. Inlined into one dispatcher, the
// eight instances' arrays made one frame of hundreds of KiB that every decode call set up, and
// decode fell from about 49 to 40 tok/s (Gemma 3, one thread, Zen 4, alternating runs).
#[inline(never)]
fn rows_blocks_q8_0<const TS: usize, const OFFSET: i8, const T: usize>(
    w: &[u8],
    row_bytes: usize,
    ys: &[&[BlockQ8_0]],
    out: &mut [f32],
    out_stride: usize,
    unpack: impl Fn(&[u8]) -> (__m256i, f32),
    unpack2u: impl Fn(&[u8]) -> __m512i,
) {
    let nb = row_bytes / TS;
    let n_rows = w.len() / row_bytes;
    let ys: [&[BlockQ8_0]; T] = std::array::from_fn(|t| &ys[t][..nb]);
    let pairs = nb / 2;
    const YS: usize = std::mem::size_of::<BlockQ8_0>();
    let y_bytes: [&[u8]; T] = ys.map(bytemuck::cast_slice);
    const CHUNK: usize = 16;
    // The chunk's prepared activations: written for pairs 0..m before they are read. Left
    // uninitialized rather than zeroed: zeroing them (and the sums below) on every call was
    // about 1.5% of a decode step, and 24 KiB per call at eight tokens.
    let mut qy = [[MaybeUninit::<__m512i>::uninit(); T]; CHUNK];
    let mut start = [[MaybeUninit::<__m512i>::uninit(); T]; CHUNK];
    let mut dyp = [[MaybeUninit::<__m512>::uninit(); T]; CHUNK];
    // Each (row, token)'s running sum between chunks (rows wider than CHUNK pairs), for up to
    // MAX_ROWS rows at a time: written at the end of one chunk before the next reads it.
    const MAX_ROWS: usize = 64;
    let mut acc = [[MaybeUninit::<__m512>::uninit(); T]; MAX_ROWS];
    // Finished rows (sums, odd last block's sums, row index) awaiting a four-row reduction.
    let mut pending = [([_mm512_setzero_ps(); T], [0f32; T], 0usize); 4];
    let mut np = 0;
    for r0 in (0..n_rows).step_by(MAX_ROWS) {
        let rows = |r: usize| &w[(r0 + r) * row_bytes..(r0 + r) * row_bytes + nb * TS];
        let n = (n_rows - r0).min(MAX_ROWS);
        let mut c0 = 0;
        while c0 < pairs {
            let m = (pairs - c0).min(CHUNK);
            for k in 0..m {
                let i = c0 + k;
                for t in 0..T {
                    let (q, st, dy) = act_pair::<OFFSET>(&y_bytes[t][2 * YS * i..2 * YS * (i + 1)]);
                    qy[k][t] = MaybeUninit::new(q);
                    start[k][t] = MaybeUninit::new(st);
                    dyp[k][t] = MaybeUninit::new(dy);
                }
            }
            let last = c0 + m == pairs;
            for r in 0..n {
                let wr = rows(r);
                let mut a = if c0 == 0 {
                    [_mm512_setzero_ps(); T]
                } else {
                    // SAFETY: row r's sums were written at the end of the previous chunk.
                    acc[r].map(|a| unsafe { a.assume_init() })
                };
                for k in 0..m {
                    let i = c0 + k;
                    let b = &wr[2 * TS * i..2 * TS * (i + 1)];
                    prefetch(b.as_ptr().wrapping_add(PREFETCH_AHEAD));
                    let xu = unpack2u(b);
                    let dx = pair_scales::<TS>(b);
                    for t in 0..T {
                        // SAFETY: entries k < m were written for this chunk above.
                        let (q, st, dy) = unsafe {
                            (
                                qy[k][t].assume_init(),
                                start[k][t].assume_init(),
                                dyp[k][t].assume_init(),
                            )
                        };
                        let sumi = _mm512_dpbusd_epi32(st, xu, q);
                        let d = _mm512_mul_ps(dx, dy);
                        a[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), a[t]);
                    }
                }
                if last {
                    // The row's sums wait for three more rows, to be reduced four at a time.
                    let mut tail = [0f32; T];
                    if nb % 2 == 1 {
                        let (q, dx) = unpack(&wr[(nb - 1) * TS..]);
                        for t in 0..T {
                            tail[t] = hsum_ps(tail_block(q, dx, &ys[t][nb - 1]));
                        }
                    }
                    pending[np] = (a, tail, r0 + r);
                    np += 1;
                    if np == 4 {
                        flush_rows(&pending, out, out_stride);
                        np = 0;
                    }
                } else {
                    acc[r] = a.map(MaybeUninit::new);
                }
            }
            for &(a, tail, row) in &pending[..np] {
                for t in 0..T {
                    out[t * out_stride + row] = _mm512_reduce_add_ps(a[t]) + tail[t];
                }
            }
            np = 0;
            c0 += m;
        }
        if pairs == 0 {
            for r in 0..n {
                let (q, dx) = unpack(&rows(r)[..TS]);
                for t in 0..T {
                    out[t * out_stride + r0 + r] = _mm512_reduce_add_ps(_mm512_setzero_ps())
                        + hsum_ps(tail_block(q, dx, &ys[t][0]));
                }
            }
        }
    }
}

/// Write four finished rows' outputs: `reduce_add_x4` per token, plus each row's odd last block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn flush_rows<const T: usize>(
    pending: &[([__m512; T], [f32; T], usize); 4],
    out: &mut [f32],
    out_stride: usize,
) {
    for t in 0..T {
        let sums = reduce_add_x4([
            pending[0].0[t],
            pending[1].0[t],
            pending[2].0[t],
            pending[3].0[t],
        ]);
        for (k, &(_, tail, row)) in pending.iter().enumerate() {
            out[t * out_stride + row] = sums[k] + tail[t];
        }
    }
}

/// `rows_blocks_q8_0` for `ys.len()` (1 ..= `super::ROWS_MAX_TOKENS`, 8) tokens, each count its
/// own instance so that the accumulators stay in registers.
macro_rules! rows_fn {
    ($name:ident, $ts:literal, $offset:expr, $unpack:ident, $unpack2u:ident) => {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        fn $name(w: &[u8], row_bytes: usize, ys: &[&[BlockQ8_0]], out: &mut [f32], stride: usize) {
            let (u, u2) = (|b: &[u8]| $unpack(b), |b: &[u8]| $unpack2u(b));
            debug_assert!((1..=8).contains(&ys.len()), "{} tokens", ys.len());
            match ys.len() {
                1 => rows_blocks_q8_0::<$ts, { $offset }, 1>(w, row_bytes, ys, out, stride, u, u2),
                2 => rows_blocks_q8_0::<$ts, { $offset }, 2>(w, row_bytes, ys, out, stride, u, u2),
                3 => rows_blocks_q8_0::<$ts, { $offset }, 3>(w, row_bytes, ys, out, stride, u, u2),
                4 => rows_blocks_q8_0::<$ts, { $offset }, 4>(w, row_bytes, ys, out, stride, u, u2),
                5 => rows_blocks_q8_0::<$ts, { $offset }, 5>(w, row_bytes, ys, out, stride, u, u2),
                6 => rows_blocks_q8_0::<$ts, { $offset }, 6>(w, row_bytes, ys, out, stride, u, u2),
                7 => rows_blocks_q8_0::<$ts, { $offset }, 7>(w, row_bytes, ys, out, stride, u, u2),
                8 => rows_blocks_q8_0::<$ts, { $offset }, 8>(w, row_bytes, ys, out, stride, u, u2),
                _ => {}
            }
        }
    };
}

/// The activation side of one pair of Q8_0 blocks (`yb`, 68 bytes) for a VNNI product with
/// weights stored as values plus `OFFSET`: the 64 signed bytes, the starting sums
/// −`OFFSET`·(each lane's four bytes), and the two scales spread as [`pair_scales`] spreads them
/// (activation blocks are laid out as Q8_0 weight blocks).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn act_pair<const OFFSET: i8>(yb: &[u8]) -> (__m512i, __m512i, __m512) {
    const YS: usize = std::mem::size_of::<BlockQ8_0>();
    let zero = _mm512_setzero_si512();
    let qy = cat(ld_u8(&yb[2..]), ld_u8(&yb[YS + 2..]));
    let start = _mm512_sub_epi32(
        zero,
        _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(OFFSET), qy),
    );
    (qy, start, pair_scales::<YS>(yb))
}

/// The f16 scales at the front of the two `TS`-byte blocks in `b` as f32 lanes, the first
/// block's in lanes 0..8 and the second's in 8..16 (the lane layout of a pair's sums): two word
/// broadcasts, one blend, one conversion. It runs once per weight pair in decode, so its cost
/// shows: it replaced a masked load of the whole pair and a word permutation, and the one-thread
/// decode kernels went from 21.4 to 20.2 ns per in-cache Q8_0 row of 640 (34 to 26 ns per row,
/// 20 to 26 GB/s, on a 90 MB matrix streamed from memory) and Q5_0 from 30.2 to 28.0 ns (Zen 4,
/// `kernels/examples/rows_cost.rs`, best of 40).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn pair_scales<const TS: usize>(b: &[u8]) -> __m512 {
    const { assert!(TS.is_multiple_of(2) && TS + 2 <= 64) };
    let wa = _mm256_set1_epi16(u16::from_le_bytes([b[0], b[1]]) as i16);
    let wb = _mm256_set1_epi16(u16::from_le_bytes([b[TS], b[TS + 1]]) as i16);
    _mm512_cvtph_ps(_mm256_blend_epi32::<0xF0>(wa, wb))
}

/// How far ahead of the bytes it reads the decode kernel asks for weights: a decode product
/// streams its matrix once, so the rows after the current ones are wanted next. Measured on the
/// Gemma 3 head (262144 × 640 Q8_0) with the row-after-row decode kernel on a 2-core Zen 4,
/// medians of five alternating runs, GB/s on one / two threads: 512 B (T0 hint) 18.0 / 27.8,
/// 1 KiB 18.0 / 29.8, 1.5 KiB 17.8 / 29.6, 2 KiB 12.0 / 21.8, 4 KiB 11.7 / 22.5. (With the
/// earlier four-rows-interleaved kernel on an Intel AVX-512 machine, 4 KiB had been best.)
const PREFETCH_AHEAD: usize = 1024;

/// A hint to bring the cache line at `p` into L2; `p` need not point into an allocation (a
/// prefetch never faults).
#[inline(always)]
fn prefetch(p: *const u8) {
    // SAFETY: a prefetch reads nothing architecturally and cannot fault.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
}

rows_fn!(rows_q8_0, 34, i8::MIN, q8_0_unpack, q8_0_unpack2u);
rows_fn!(rows_q4_0, 18, 8, q4_0_unpack, q4_0_unpack2u);
rows_fn!(rows_q5_0, 22, 16, q5_0_unpack, q5_0_unpack2u);

/// Sub-block scales for 64 elements as 32 i16 lanes: `a` for lanes 0..16, `b` for 16..32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn scale_pair(a: i16, b: i16) -> __m512i {
    _mm512_mask_blend_epi16(0xFFFF_0000, _mm512_set1_epi16(a), _mm512_set1_epi16(b))
}

/// Q4_K against `N` activation rows: each block's nibbles and scales are unpacked once for all
/// rows; per row the operations are those of the one-row kernel, in the same order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn dot_q4k_n<const N: usize, const VNNI: bool>(w: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let nb = w.len() / 144;
    let ys = ys.map(|y| &y[..nb]);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut acc_m = [_mm_setzero_ps(); N];
    for i in 0..nb {
        let xb = &w[144 * i..144 * (i + 1)];
        for l in 0..144usize.div_ceil(64) {
            prefetch(xb.as_ptr().wrapping_add(64 * l + PREFETCH_AHEAD));
        }
        let KRow {
            q,
            s,
            extra: mins,
            d: dw,
            dmin: dminw,
        } = krow_q4k(xb);
        let mins = _mm256_castsi256_si128(mins);
        for n in 0..N {
            let yb = &ys[n][i];
            let d = yb.d * dw;
            let dmin = -yb.d * dminw;
            let prod = mins_i16_dot_bsums(mins, &yb.bsums);
            acc_m[n] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[n]);
            let mut sumi = _mm512_setzero_si512();
            for j in 0..4 {
                let p = _mm512_maddubs_epi16(q[j], ld512_i8(&yb.qs[64 * j..]));
                sumi = madd_acc::<VNNI>(sumi, p, s[j]);
            }
            let v = _mm256_cvtepi32_ps(fold_epi32(sumi));
            acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d), v, acc[n]);
        }
    }
    let mut out = [0f32; N];
    for n in 0..N {
        out[n] = hsum_ps(acc[n]) + hsum_ps128(acc_m[n]);
    }
    out
}

/// Q6_K against `N` activation rows, each block unpacked once (see [`dot_q4k_n`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn dot_q6k_n<const N: usize, const VNNI: bool>(w: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let nb = w.len() / 210;
    let ys = ys.map(|y| &y[..nb]);
    let mut acc = [_mm256_setzero_ps(); N];
    for i in 0..nb {
        let xb = &w[210 * i..210 * (i + 1)];
        for l in 0..210usize.div_ceil(64) {
            prefetch(xb.as_ptr().wrapping_add(64 * l + PREFETCH_AHEAD));
        }
        let KRow { q, s, d: dw, .. } = krow_q6k(xb);
        let scales = &xb[192..208];
        for t in 0..N {
            let yb = &ys[t][i];
            let d = yb.d * dw;
            let mut sumi = _mm512_setzero_si512();
            for g in 0..4 {
                let p = _mm512_maddubs_epi16(q[g], ld512_i8(&yb.qs[64 * g..]));
                sumi = madd_acc::<VNNI>(sumi, p, s[g]);
            }
            let sumi = _mm256_sub_epi32(fold_epi32(sumi), q6k_bias(scales, &yb.bsums));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[t]);
        }
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = hsum_ps(acc[t]);
    }
    out
}

/// The one-row and four-row kernels of a k-quant type, without and with AVX-512 VNNI (with it,
/// each 64 elements' scaled pair sums go into the lane sums with one `vpdpwssd` instead of
/// `vpmaddwd` and an add: the same integers, so the same results).
macro_rules! kquant_fns {
    ($kernel:ident, $dot:ident, $dot4:ident, $dot_vnni:ident, $dot4_vnni:ident) => {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        fn $dot(w: &[u8], y: &[BlockQ8K]) -> f32 {
            $kernel::<1, false>(w, [y])[0]
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        fn $dot4(w: &[u8], y: &[&[BlockQ8K]; 4]) -> [f32; 4] {
            $kernel::<4, false>(w, *y)
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        fn $dot_vnni(w: &[u8], y: &[BlockQ8K]) -> f32 {
            $kernel::<1, true>(w, [y])[0]
        }

        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
        fn $dot4_vnni(w: &[u8], y: &[&[BlockQ8K]; 4]) -> [f32; 4] {
            $kernel::<4, true>(w, *y)
        }
    };
}

kquant_fns!(dot_q4k_n, dot_q4k, dot4_q4k, dot_q4k_vnni, dot4_q4k_vnni);
kquant_fns!(dot_q6k_n, dot_q6k, dot4_q6k, dot_q6k_vnni, dot4_q6k_vnni);

/// `sumi` plus the i16 pair products of `p` and `s` summed into i32 lanes: with `VNNI` one
/// `vpdpwssd` (only instantiated inside functions compiled with AVX-512 VNNI), else
/// `vpmaddwd` and an add.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn madd_acc<const VNNI: bool>(sumi: __m512i, p: __m512i, s: __m512i) -> __m512i {
    if VNNI {
        // SAFETY: `VNNI` is only true in the `*_vnni` kernels, which `select` hands out for a
        // CPU with AVX-512 VNNI.
        unsafe { _mm512_dpwssd_epi32(sumi, p, s) }
    } else {
        _mm512_add_epi32(sumi, _mm512_madd_epi16(p, s))
    }
}

/// Lane i of 32 → i / 8: the index pattern that spreads four scales over 64 elements.
const SPREAD4: [i16; 32] = {
    let mut a = [0i16; 32];
    let mut i = 0;
    while i < 32 {
        a[i] = (i / 8) as i16;
        i += 1;
    }
    a
};

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn spread4() -> __m512i {
    let b: &[u8; 64] = bytemuck::cast_ref(&SPREAD4);
    ld512(b)
}

/// A weight row's block of a k-quant panel: what [`dot_q4k_n`] / [`dot_q6k_n`] unpack per block,
/// unpacked once per task.
#[derive(Clone, Copy)]
#[repr(C)]
struct KRow {
    /// The values of each 64 elements (unsigned: Q4_K nibbles, Q6_K six bits).
    q: [__m512i; 4],
    /// Their scales as i16 lanes, spread as the kernels spread them.
    s: [__m512i; 4],
    /// Q4_K: the eight mins as i16 (low half); Q6_K: the sixteen scales as i16.
    extra: __m256i,
    /// The block's `d`, and Q4_K's `dmin`.
    d: f32,
    dmin: f32,
}

/// A token's block of a k-quant panel: its scale, and its group sums as the epilogue reads them
/// (Q4_K: pairs added, eight i16 in the low half; Q6_K: the sixteen i16 as stored).
#[derive(Clone, Copy)]
#[repr(C)]
struct KTok {
    sums: __m256i,
    d: f32,
}

#[derive(Default)]
struct KPanels {
    rows: Vec<KRow>,
    toks: Vec<KTok>,
}

std::thread_local! {
    static K_PANELS: std::cell::RefCell<KPanels> = std::cell::RefCell::default();
}

/// Q4_K or Q6_K (`Q6`) prefill task with AVX-512 VNNI: `w`'s rows against every activation row
/// in `acts` (`nb` blocks each), output `(row r, token t)` to `out[t * out_stride + r]`.
///
/// As for the Q8_0 family's [`panel_blocks_q8_0`]: each weight row's blocks are unpacked once
/// per task (nibbles or six-bit values, the scales spread to lanes, the mins) and each token's
/// block sums prepared once, then four rows × four tokens run through a register micro-kernel
/// per block: `vpmaddubsw` and `vpdpwssd` per 64 elements, then the block's epilogue. The i32
/// lane sums are the one-row kernel's integers and the f32 operations per (row, token) are its
/// operations in its order (`d = dy·dx`, the conversion, the multiply-add per block; Q4_K's mins
/// term beside it; the final reductions), so every output is bit-identical to the one-row
/// kernel.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline(never)]
unsafe fn panel_blocks_kquant<const Q6: bool>(
    w: &[u8],
    row_bytes: usize,
    acts: &[BlockQ8K],
    nb: usize,
    out: *mut f32,
    out_stride: usize,
) {
    if nb == 0 || row_bytes == 0 {
        return;
    }
    let bs = if Q6 { 210 } else { 144 };
    let n_rows = w.len() / row_bytes;
    let n_tok = acts.len() / nb;
    let mut p = K_PANELS.with(|p| p.take());
    let zero_tok = KTok {
        sums: _mm256_setzero_si256(),
        d: 0.0,
    };
    p.toks.clear();
    p.toks.resize(n_tok * nb, zero_tok);
    for (k, yb) in p.toks.iter_mut().zip(acts) {
        let b: &[u8; 32] = bytemuck::cast_ref(&yb.bsums);
        let s = ld_u8(b);
        k.sums = if Q6 {
            s
        } else {
            let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
            _mm256_castsi128_si256(pairs)
        };
        k.d = yb.d;
    }
    let zero_row = KRow {
        q: [_mm512_setzero_si512(); 4],
        s: [_mm512_setzero_si512(); 4],
        extra: _mm256_setzero_si256(),
        d: 0.0,
        dmin: 0.0,
    };
    p.rows.clear();
    p.rows.resize(4 * nb, zero_row);
    let mut r = 0;
    while r < n_rows {
        let nr = if r + 4 <= n_rows { 4 } else { 1 };
        for k in 0..nr {
            let row = &w[(r + k) * row_bytes..(r + k + 1) * row_bytes];
            for i in 0..nb {
                let xb = &row[bs * i..bs * (i + 1)];
                p.rows[4 * i + k] = if Q6 { krow_q6k(xb) } else { krow_q4k(xb) };
            }
        }
        let mut t = 0;
        while t < n_tok {
            let nt = if t + 4 <= n_tok { 4 } else { 1 };
            let ys = |j: usize| &acts[(t + j) * nb..(t + j + 1) * nb];
            let tk = |j: usize| &p.toks[(t + j) * nb..(t + j + 1) * nb];
            let mut v = [[0f32; 4]; 4];
            match (nr, nt) {
                (4, 4) => {
                    v = kpanel_micro::<Q6, 4, 4>(
                        &p.rows,
                        [ys(0), ys(1), ys(2), ys(3)],
                        [tk(0), tk(1), tk(2), tk(3)],
                    )
                }
                (4, _) => {
                    let o = kpanel_micro::<Q6, 4, 1>(&p.rows, [ys(0)], [tk(0)]);
                    for k in 0..4 {
                        v[k][0] = o[k][0];
                    }
                }
                (_, 4) => {
                    v[0] = kpanel_micro::<Q6, 1, 4>(
                        &p.rows,
                        [ys(0), ys(1), ys(2), ys(3)],
                        [tk(0), tk(1), tk(2), tk(3)],
                    )[0]
                }
                _ => v[0][0] = kpanel_micro::<Q6, 1, 1>(&p.rows, [ys(0)], [tk(0)])[0][0],
            }
            for k in 0..nr {
                for j in 0..nt {
                    // SAFETY: as in `panel_blocks_q8_0`.
                    unsafe { *out.add((t + j) * out_stride + r + k) = v[k][j] };
                }
            }
            t += nt;
        }
        r += nr;
    }
    K_PANELS.with(|k| k.replace(p));
}

/// One Q4_K block of a weight row, unpacked: by [`dot_q4k_n`] per block, by the panel once per
/// task.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn krow_q4k(xb: &[u8]) -> KRow {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut s12 = [0u8; 12];
    s12.copy_from_slice(&xb[4..16]);
    let (sc, mn) = scales_mins_k4(&s12);
    let qs = &xb[16..144];
    let mut q = [_mm512_setzero_si512(); 4];
    let mut s = [_mm512_setzero_si512(); 4];
    for j in 0..4 {
        let bits = ld_u8(&qs[32 * j..]);
        let lo = _mm256_and_si256(bits, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
        q[j] = cat(lo, hi);
        s[j] = scale_pair(i16::from(sc[2 * j]), i16::from(sc[2 * j + 1]));
    }
    let mut m8 = [0u8; 16];
    m8[..8].copy_from_slice(&mn);
    KRow {
        q,
        s,
        extra: _mm256_castsi128_si256(_mm_cvtepu8_epi16(ld128(&m8))),
        d: fp16(&xb[0..]),
        dmin: fp16(&xb[2..]),
    }
}

/// One Q6_K block of a weight row, unpacked: by [`dot_q6k_n`] per block, by the panel once per
/// task.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn krow_q6k(xb: &[u8]) -> KRow {
    let spread = spread4();
    let scales = &xb[192..208];
    let sc16_256 = _mm256_cvtepi8_epi16(ld128(scales));
    let sc16 = _mm512_castsi256_si512(sc16_256);
    let mut q = [_mm512_setzero_si512(); 4];
    let mut s = [_mm512_setzero_si512(); 4];
    for n in 0..2 {
        let u = q6k_unpack(&xb[64 * n..], &xb[128 + 32 * n..]);
        for h in 0..2 {
            let base = (8 * n + 4 * h) as i16;
            let idx = _mm512_add_epi16(_mm512_set1_epi16(base), spread);
            s[2 * n + h] = _mm512_permutexvar_epi16(idx, sc16);
            q[2 * n + h] = cat(u[2 * h], u[2 * h + 1]);
        }
    }
    KRow {
        q,
        s,
        extra: sc16_256,
        d: fp16(&xb[208..]),
        dmin: 0.0,
    }
}

/// `R` rows of a k-quant panel (`rows`, block-major, four rows per block) against `T` tokens:
/// every (row, token)'s result.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn kpanel_micro<const Q6: bool, const R: usize, const T: usize>(
    rows: &[KRow],
    ys: [&[BlockQ8K]; T],
    toks: [&[KTok]; T],
) -> [[f32; T]; R] {
    let nb = toks[0].len();
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut acc_m = [[_mm_setzero_ps(); T]; R];
    for i in 0..nb {
        let rb = &rows[4 * i..4 * i + R];
        let mut sumi = [[_mm512_setzero_si512(); T]; R];
        for j in 0..4 {
            for t in 0..T {
                let y = ld512_i8(&ys[t][i].qs[64 * j..]);
                for k in 0..R {
                    let p = _mm512_maddubs_epi16(rb[k].q[j], y);
                    sumi[k][t] = _mm512_dpwssd_epi32(sumi[k][t], p, rb[k].s[j]);
                }
            }
        }
        for k in 0..R {
            for t in 0..T {
                let tk = &toks[t][i];
                let d = tk.d * rb[k].d;
                let v = if Q6 {
                    let bias = _mm256_slli_epi32::<5>(_mm256_madd_epi16(tk.sums, rb[k].extra));
                    _mm256_sub_epi32(fold_epi32(sumi[k][t]), bias)
                } else {
                    let prod = _mm_madd_epi16(
                        _mm256_castsi256_si128(rb[k].extra),
                        _mm256_castsi256_si128(tk.sums),
                    );
                    let dmin = -tk.d * rb[k].dmin;
                    acc_m[k][t] =
                        _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[k][t]);
                    fold_epi32(sumi[k][t])
                };
                acc[k][t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(v), acc[k][t]);
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for k in 0..R {
        for t in 0..T {
            out[k][t] = if Q6 {
                hsum_ps(acc[k][t])
            } else {
                hsum_ps(acc[k][t]) + hsum_ps128(acc_m[k][t])
            };
        }
    }
    out
}
