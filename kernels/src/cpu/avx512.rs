//! AVX-512 (F + BW + VL) kernels, 512 bits wide, for the types of the real models: F32, F16,
//! Q4_0, Q5_0, Q8_0 (two blocks per register), Q4_K and Q6_K (64 elements per register). The
//! other types run the AVX2 kernels on this ISA (see [`super`]). Each kernel computes the same
//! exact integer block sums as its scalar twin in [`super::scalar`].
//!
//! Safe `#[target_feature]` functions, as in [`super::avx2`]: only the CPU features are a
//! precondition, checked once in [`super::CpuKernels::new`].

use std::arch::x86_64::*;

use half::f16;

use super::avx2::{
    bytes_from_bits_32, f16_to_f32, fp16, hsum_ps, hsum_ps128, ld128, ld_i8, ld_u8, mins_dot_bsums,
    nibbles_32, q6k_bias, q6k_unpack,
};
use super::scalar::scales_mins_k4;
use super::RowDot;
use crate::quant::{BlockQ8K, BlockQ8_0, GgmlType};

/// The AVX-512 kernel for weights of type `ty`, if there is one.
pub(super) fn select(ty: GgmlType) -> Option<RowDot> {
    use GgmlType as T;
    Some(match ty {
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

/// Σ x·y over pairs of signed bytes as sixteen i32 lanes; as [`super::avx2::dot_i8_pairs`]:
/// `y` takes the sign of `x` (negated under the mask of negative `x`) and `maddubs` multiplies
/// |x| (unsigned) by it. Exact for |y| ≤ 127.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn dot_i8_pairs_512(x: __m512i, y: __m512i) -> __m512i {
    let ax = _mm512_abs_epi8(x);
    let neg = _mm512_movepi8_mask(x);
    let sy = _mm512_mask_sub_epi8(y, neg, _mm512_setzero_si512(), y);
    let p16 = _mm512_maddubs_epi16(ax, sy);
    _mm512_madd_epi16(p16, _mm512_set1_epi16(1))
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

/// Shared loop of the Q8_0-activation kernels, two blocks per 512-bit register: `unpack` turns
/// a `TS`-byte weight block into 32 signed bytes and its f32 scale. An odd last block runs at
/// 256 bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn dot_blocks_q8_0<const TS: usize>(
    w: &[u8],
    y: &[BlockQ8_0],
    unpack: impl Fn(&[u8]) -> (__m256i, f32),
) -> f32 {
    let mut acc = _mm512_setzero_ps();
    let mut pairs_w = w.chunks_exact(2 * TS);
    let mut pairs_y = y.chunks_exact(2);
    for (xb, yb) in (&mut pairs_w).zip(&mut pairs_y) {
        let (q0, d0) = unpack(&xb[..TS]);
        let (q1, d1) = unpack(&xb[TS..]);
        let qy = cat(ld_i8(&yb[0].qs), ld_i8(&yb[1].qs));
        let sumi = dot_i8_pairs_512(cat(q0, q1), qy);
        // Lanes 0..8 hold the first block's sums, lanes 8..16 the second's.
        let d = _mm512_mask_blend_ps(
            0xFF00,
            _mm512_set1_ps(d0 * f16_to_f32(yb[0].d)),
            _mm512_set1_ps(d1 * f16_to_f32(yb[1].d)),
        );
        acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sumi), acc);
    }
    let mut tail = _mm256_setzero_ps();
    if let [yb] = pairs_y.remainder() {
        let xb = &w[(y.len() - 1) * TS..];
        let (q, dx) = unpack(xb);
        let ax = _mm256_sign_epi8(q, q);
        let sy = _mm256_sign_epi8(ld_i8(&yb.qs), q);
        let sumi = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
        let d = _mm256_set1_ps(dx * f16_to_f32(yb.d));
        tail = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sumi));
    }
    _mm512_reduce_add_ps(acc) + hsum_ps(tail)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot_q8_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<34>(w, y, |b| (ld_u8(&b[2..]), fp16(b)))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot_q4_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<18>(w, y, |b| {
        let q = _mm256_sub_epi8(nibbles_32(&b[2..]), _mm256_set1_epi8(8));
        (q, fp16(b))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot_q5_0(w: &[u8], y: &[BlockQ8_0]) -> f32 {
    dot_blocks_q8_0::<22>(w, y, |b| {
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let hi = _mm256_andnot_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0xF0u8 as i8));
        (_mm256_or_si256(nibbles_32(&b[6..]), hi), fp16(b))
    })
}

/// Sub-block scales for 64 elements as 32 i16 lanes: `a` for lanes 0..16, `b` for 16..32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
fn scale_pair(a: i16, b: i16) -> __m512i {
    _mm512_mask_blend_epi16(0xFFFF_0000, _mm512_set1_epi16(a), _mm512_set1_epi16(b))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
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
        let mut sumi = _mm512_setzero_si512();
        for j in 0..4 {
            // 64 elements: low nibbles (64j .. 64j + 32), then high nibbles.
            let bits = ld_u8(&qs[32 * j..]);
            let lo = _mm256_and_si256(bits, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            let p = _mm512_maddubs_epi16(cat(lo, hi), ld512_i8(&yb.qs[64 * j..]));
            let s = scale_pair(i16::from(sc[2 * j]), i16::from(sc[2 * j + 1]));
            sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(p, s));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(fold_epi32(sumi)), acc);
    }
    hsum_ps(acc) + hsum_ps128(acc_m)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot_q6k(w: &[u8], y: &[BlockQ8K]) -> f32 {
    let spread = spread4();
    let mut acc = _mm256_setzero_ps();
    for (xb, yb) in w.chunks_exact(210).zip(y) {
        let d = yb.d * fp16(&xb[208..]);
        let scales = &xb[192..208];
        // The sixteen scales as i16, and a permutation per 64 elements spreading four of them
        // over eight lanes each.
        let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(ld128(scales)));
        let mut sumi = _mm512_setzero_si512();
        for n in 0..2 {
            let q = q6k_unpack(&xb[64 * n..], &xb[128 + 32 * n..]);
            for h in 0..2 {
                let base = (8 * n + 4 * h) as i16;
                let idx = _mm512_add_epi16(_mm512_set1_epi16(base), spread);
                let s = _mm512_permutexvar_epi16(idx, sc16);
                let p = _mm512_maddubs_epi16(
                    cat(q[2 * h], q[2 * h + 1]),
                    ld512_i8(&yb.qs[128 * n + 64 * h..]),
                );
                sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(p, s));
            }
        }
        let sumi = _mm256_sub_epi32(fold_epi32(sumi), q6k_bias(scales, &yb.bsums));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
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
