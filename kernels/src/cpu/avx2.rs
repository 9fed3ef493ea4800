//! AVX2 + FMA (+ F16C) kernels, 256 bits wide. Each has its scalar twin in [`super::scalar`] and
//! computes the same exact integer block sums; only the order of the f32 accumulation differs
//! (eight lanes instead of one chain).
//!
//! The per-block arithmetic follows ggml's x86 kernels: signed × signed byte products through
//! `maddubs` with the sign moved onto the activations, nibbles split into two 128-bit halves,
//! the Q5 high bits expanded with a byte shuffle, non-linear levels looked up with `pshufb`, and
//! the k-quant sub-block scales applied with `madd` on the 16-bit partial sums.
//!
//! The functions are safe `#[target_feature]` functions: calling them needs only the CPU
//! features (checked once, in [`super::CpuKernels::new`]); every memory access is
//! bounds-checked through slices.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::scalar::scales_mins_k4;
use super::RowDot;
use crate::quant::iq::KVALUES_IQ4NL;
use crate::quant::mxfp4::{e8m0_to_f32_half, KVALUES_MXFP4};
use crate::quant::{BlockQ8K, BlockQ8_0, GgmlType};

/// The AVX2 kernel for weights of type `ty`, if there is one.
pub(super) fn select(ty: GgmlType) -> Option<RowDot> {
    use GgmlType as T;
    Some(match ty {
        T::F32 => RowDot::F32(dot_f32),
        T::F16 => RowDot::F16(dot_f16),
        T::BF16 => RowDot::Bf16(dot_bf16),
        T::Q4_0 => RowDot::Q8_0(dot_q4_0),
        T::Q5_0 => RowDot::Q8_0(dot_q5_0),
        T::Q8_0 => RowDot::Q8_0(dot_q8_0),
        T::Q8_1 => RowDot::Q8_0(dot_q8_1),
        T::Iq4Nl => RowDot::Q8_0(dot_iq4_nl),
        T::Mxfp4 => RowDot::Q8_0(dot_mxfp4),
        T::Q4K => RowDot::Q8K(dot_q4k),
        T::Q5K => RowDot::Q8K(dot_q5k),
        T::Q6K => RowDot::Q8K(dot_q6k),
        _ => return None,
    })
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// 32 bytes from the front of `s` (any alignment).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn ld_u8(s: &[u8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: `s` is 32 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// 32 signed bytes from the front of `s`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn ld_i8(s: &[i8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: `s` is 32 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// 16 bytes from the front of `s`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn ld128(s: &[u8]) -> __m128i {
    let s = &s[..16];
    // SAFETY: `s` is 16 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
}

/// 8 bytes from the front of `s`, in the low half of a 128-bit register.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn ld64(s: &[u8]) -> __m128i {
    let s = &s[..8];
    // SAFETY: `s` is 8 readable bytes; `loadl_epi64` has no alignment requirement.
    unsafe { _mm_loadl_epi64(s.as_ptr().cast()) }
}

/// The f16 stored little-endian in the first two bytes of `s`, as f32 (exact).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn fp16(s: &[u8]) -> f32 {
    let bits = u16::from_le_bytes([s[0], s[1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn f16_to_f32(h: f16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h.to_bits()))))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    hsum_ps128(s)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn hsum_ps128(s: __m128) -> f32 {
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Σ x·y over pairs of signed bytes, as eight i32 lanes: the sign of `x` moves onto `y` so that
/// `maddubs` (unsigned × signed) applies. Exact for |y| ≤ 127 (activations never hold −128):
/// each 16-bit pair sum is at most 2 · 128 · 127 < 2¹⁵.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn dot_i8_pairs(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    let p16 = _mm256_maddubs_epi16(ax, sy);
    _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
}

/// 32 nibbles from 16 bytes: low nibbles in bytes 0..16, high nibbles in bytes 16..32 (the
/// element order of the legacy formats).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn nibbles_32(qs: &[u8]) -> __m256i {
    let t = ld128(qs);
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(t), t);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// Byte i is 0xFF where bit i of `bits` is set, else 0.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn bytes_from_bits_32(bits: u32) -> __m256i {
    // Byte i takes source byte i / 8 (shuffles stay within 128-bit lanes, and every lane holds
    // all four source bytes after the broadcast) and tests bit i % 8.
    let shuf = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask)
}

/// A 16-entry signed byte table in both 128-bit lanes, for `pshufb` lookups.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn table16(t: &[i8; 16]) -> __m256i {
    let b: &[u8; 16] = bytemuck::cast_ref(t);
    _mm256_broadcastsi128_si256(ld128(b))
}

// ---------------------------------------------------------------------------------------------
// Float types

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f32(w: &[u8], y: &[f32]) -> f32 {
    let n = y.len();
    let w = &w[..4 * n];
    let yb: &[u8] = bytemuck::cast_slice(y);
    let mut acc = [_mm256_setzero_ps(); 4];
    let main = n / 32 * 32;
    for i in (0..main).step_by(32) {
        for (a, accv) in acc.iter_mut().enumerate() {
            let o = 4 * (i + 8 * a);
            let wv = _mm256_castsi256_ps(ld_u8(&w[o..]));
            let xv = _mm256_castsi256_ps(ld_u8(&yb[o..]));
            *accv = _mm256_fmadd_ps(wv, xv, *accv);
        }
    }
    let mut rest = 0f32;
    for i in main..n {
        let wv = f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]);
        rest += wv * y[i];
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum_ps(s) + rest
}

/// Eight f16 (little-endian bytes) as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn cvt_f16x8(b: &[u8]) -> __m256 {
    _mm256_cvtph_ps(ld128(b))
}

/// Eight bf16 (little-endian bytes) as f32: the bf16 bits are the top half of the f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn cvt_bf16x8(b: &[u8]) -> __m256 {
    let v = _mm256_cvtepu16_epi32(ld128(b));
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16(w: &[u8], y: &[f16]) -> f32 {
    let n = y.len();
    let w = &w[..2 * n];
    let yb: &[u8] = bytemuck::cast_slice(y);
    let mut acc = [_mm256_setzero_ps(); 4];
    let main = n / 32 * 32;
    for i in (0..main).step_by(32) {
        for (a, accv) in acc.iter_mut().enumerate() {
            let o = 2 * (i + 8 * a);
            *accv = _mm256_fmadd_ps(cvt_f16x8(&w[o..]), cvt_f16x8(&yb[o..]), *accv);
        }
    }
    let mut rest = 0f32;
    for i in main..n {
        rest += fp16(&w[2 * i..]) * f16_to_f32(y[i]);
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum_ps(s) + rest
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_bf16(w: &[u8], y: &[bf16]) -> f32 {
    let n = y.len();
    let w = &w[..2 * n];
    let yb: &[u8] = bytemuck::cast_slice(y);
    let mut acc = [_mm256_setzero_ps(); 4];
    let main = n / 32 * 32;
    for i in (0..main).step_by(32) {
        for (a, accv) in acc.iter_mut().enumerate() {
            let o = 2 * (i + 8 * a);
            *accv = _mm256_fmadd_ps(cvt_bf16x8(&w[o..]), cvt_bf16x8(&yb[o..]), *accv);
        }
    }
    let mut rest = 0f32;
    for i in main..n {
        let wv = f32::from_bits(u32::from(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) << 16);
        rest += wv * y[i].to_f32();
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum_ps(s) + rest
}

// ---------------------------------------------------------------------------------------------
// 32-element blocks against Q8_0

/// Shared loop of the Q8_0-activation kernels: `TS` bytes per weight block; `unpack` turns a
/// weight block into 32 signed bytes and its f32 scale. Two accumulators, so that consecutive
/// blocks do not wait on each other's FMA.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn dot_blocks_q8_0<const TS: usize>(
    w: &[u8],
    y: &[BlockQ8_0],
    unpack: impl Fn(&[u8]) -> (__m256i, f32),
) -> f32 {
    let block = |xb: &[u8], yb: &BlockQ8_0, acc: __m256| {
        let (qx, dx) = unpack(xb);
        let d = _mm256_set1_ps(dx * f16_to_f32(yb.d));
        let sumi = dot_i8_pairs(qx, ld_i8(&yb.qs));
        _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc)
    };
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut pairs_w = w.chunks_exact(2 * TS);
    let mut pairs_y = y.chunks_exact(2);
    for (xb, yb) in (&mut pairs_w).zip(&mut pairs_y) {
        acc0 = block(&xb[..TS], &yb[0], acc0);
        acc1 = block(&xb[TS..], &yb[1], acc1);
    }
    if let [yb] = pairs_y.remainder() {
        acc0 = block(&w[(y.len() - 1) * TS..], yb, acc0);
    }
    hsum_ps(_mm256_add_ps(acc0, acc1))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<34>(w, y, |b| (ld_u8(&b[2..]), fp16(b)))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q8_1(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<36>(w, y, |b| (ld_u8(&b[4..]), fp16(b)))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<18>(w, y, |b| {
        let q = _mm256_sub_epi8(nibbles_32(&b[2..]), _mm256_set1_epi8(8));
        (q, fp16(b))
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<22>(w, y, |b| {
        // (nibble | h << 4) − 16 as a signed byte is the nibble with 0xF0 set where h is 0.
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let hi = _mm256_andnot_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0xF0u8 as i8));
        (_mm256_or_si256(nibbles_32(&b[6..]), hi), fp16(b))
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_iq4_nl(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    let table = table16(&KVALUES_IQ4NL);
    dot_blocks_q8_0::<18>(w, y, |b| {
        (_mm256_shuffle_epi8(table, nibbles_32(&b[2..])), fp16(b))
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_mxfp4(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    let table = table16(&KVALUES_MXFP4);
    dot_blocks_q8_0::<17>(w, y, |b| {
        (
            _mm256_shuffle_epi8(table, nibbles_32(&b[1..])),
            e8m0_to_f32_half(b[0]),
        )
    })
}

// ---------------------------------------------------------------------------------------------
// k-quants against Q8_K

/// Σ_j mins[j] · (bsums[2j] + bsums[2j+1]) as four i32 lanes (the k-quant min correction).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn mins_dot_bsums(mins: &[u8; 8], bsums: &[i16; 16]) -> __m128i {
    mins_i16_dot_bsums(_mm_cvtepu8_epi16(ld64(mins)), bsums)
}

/// [`mins_dot_bsums`] with the eight mins already widened to i16 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn mins_i16_dot_bsums(mins: __m128i, bsums: &[i16; 16]) -> __m128i {
    let b: &[u8; 32] = bytemuck::cast_ref(bsums);
    let s = ld_u8(b);
    let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    _mm_madd_epi16(mins, pairs)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q4k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for (xb, yb) in w.chunks_exact(144).zip(y) {
        let d = yb.d * fp16(&xb[0..]);
        let dmin = -yb.d * fp16(&xb[2..]);
        let mut s12 = [0u8; 12];
        s12.copy_from_slice(&xb[4..16]);
        let (sc, mn) = scales_mins_k4(&s12);
        let prod = mins_dot_bsums(&mn, &yb.bsums);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);

        let qs = &xb[16..144];
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let bits = ld_u8(&qs[32 * j..]);
            let lo = _mm256_and_si256(bits, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            let p_lo = _mm256_maddubs_epi16(lo, ld_i8(&yb.qs[64 * j..]));
            let p_hi = _mm256_maddubs_epi16(hi, ld_i8(&yb.qs[64 * j + 32..]));
            let p_lo = _mm256_madd_epi16(_mm256_set1_epi16(i16::from(sc[2 * j])), p_lo);
            let p_hi = _mm256_madd_epi16(_mm256_set1_epi16(i16::from(sc[2 * j + 1])), p_hi);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc) + hsum_ps128(acc_m)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q5k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for (xb, yb) in w.chunks_exact(176).zip(y) {
        let d = yb.d * fp16(&xb[0..]);
        let dmin = -yb.d * fp16(&xb[2..]);
        let mut s12 = [0u8; 12];
        s12.copy_from_slice(&xb[4..16]);
        let (sc, mn) = scales_mins_k4(&s12);
        let prod = mins_dot_bsums(&mn, &yb.bsums);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);

        let qh = ld_u8(&xb[16..48]);
        let qs = &xb[48..176];
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let bits = ld_u8(&qs[32 * j..]);
            // High bit of element 64j + l is bit 2j of qh[l], of 64j + 32 + l bit 2j + 1.
            let (h_lo, h_hi) = match j {
                0 => (qh, _mm256_srli_epi16::<1>(qh)),
                1 => (_mm256_srli_epi16::<2>(qh), _mm256_srli_epi16::<3>(qh)),
                2 => (_mm256_srli_epi16::<4>(qh), _mm256_srli_epi16::<5>(qh)),
                _ => (_mm256_srli_epi16::<6>(qh), _mm256_srli_epi16::<7>(qh)),
            };
            let h_lo = _mm256_slli_epi16::<4>(_mm256_and_si256(h_lo, one));
            let h_hi = _mm256_slli_epi16::<4>(_mm256_and_si256(h_hi, one));
            let lo = _mm256_or_si256(_mm256_and_si256(bits, m4), h_lo);
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4), h_hi);
            let p_lo = _mm256_maddubs_epi16(lo, ld_i8(&yb.qs[64 * j..]));
            let p_hi = _mm256_maddubs_epi16(hi, ld_i8(&yb.qs[64 * j + 32..]));
            let p_lo = _mm256_madd_epi16(_mm256_set1_epi16(i16::from(sc[2 * j])), p_lo);
            let p_hi = _mm256_madd_epi16(_mm256_set1_epi16(i16::from(sc[2 * j + 1])), p_hi);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc) + hsum_ps128(acc_m)
}

/// The four 32-element groups of one 128-element half of a Q6_K block, as unsigned 6-bit values
/// (before the −32 bias): `ql` is the half's 64 low-nibble bytes, `qh` its 32 high-bit bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn q6k_unpack(ql: &[u8], qh: &[u8]) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(0x03);
    let h = ld_u8(qh);
    let l0 = ld_u8(ql);
    let l1 = ld_u8(&ql[32..]);
    let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(h, m2));
    let h1 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(h), m2));
    let h2 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(h), m2));
    let h3 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(h), m2));
    [
        _mm256_or_si256(_mm256_and_si256(l0, m4), h0),
        _mm256_or_si256(_mm256_and_si256(l1, m4), h1),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l0), m4), h2),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l1), m4), h3),
    ]
}

/// 32 × Σ_j scales[j] · bsums[j], as eight i32 lanes: the −32 bias of Q6_K moved out of the
/// inner loop.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn q6k_bias(scales: &[u8], bsums: &[i16; 16]) -> __m256i {
    let b: &[u8; 32] = bytemuck::cast_ref(bsums);
    let sc16 = _mm256_cvtepi8_epi16(ld128(scales));
    _mm256_slli_epi32::<5>(_mm256_madd_epi16(ld_u8(b), sc16))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_q6k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (xb, yb) in w.chunks_exact(210).zip(y) {
        let d = yb.d * fp16(&xb[208..]);
        let scales = &xb[192..208];
        let mut sumi = _mm256_sub_epi32(_mm256_setzero_si256(), q6k_bias(scales, &yb.bsums));
        for n in 0..2 {
            let q = q6k_unpack(&xb[64 * n..], &xb[128 + 32 * n..]);
            for (s, qv) in q.iter().enumerate() {
                let p = _mm256_maddubs_epi16(*qv, ld_i8(&yb.qs[128 * n + 32 * s..]));
                let is = 8 * n + 2 * s;
                let sc = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(scales[is + 1] as i8)),
                    _mm_set1_epi16(i16::from(scales[is] as i8)),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sc));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}
