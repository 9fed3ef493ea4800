//! MXFP4 (OCP microscaling FP4): 32 E2M1 values sharing one E8M0 exponent.

use bytemuck::{Pod, Zeroable};

/// Elements per MXFP4 block.
pub const QK_MXFP4: usize = 32;

/// ggml's `kvalues_mxfp4`: E2M1 values doubled, so they fit in `i8`.
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockMxfp4 {
    /// E8M0 shared exponent.
    pub e: u8,
    pub qs: [u8; QK_MXFP4 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockMxfp4>() == 17);

use super::{check_len, GgmlType};

block_format!(
    BlockMxfp4,
    GgmlType::Mxfp4,
    QK_MXFP4,
    dequantize_mxfp4,
    quantize_mxfp4
);

/// ggml's `GGML_E8M0_TO_FP32_HALF`: `2^(e − 128)`, i.e. half the E8M0 scale (the kvalues are
/// doubled), built from bits so that it is exact down to the subnormal `e = 0, 1`.
#[inline(always)]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

/// Dequantize MXFP4 (`dequantize_row_mxfp4`): `kvalues[q] * 2^(e − 128)`.
pub fn dequantize_mxfp4(blocks: &[BlockMxfp4], out: &mut [f32]) {
    check_len(GgmlType::Mxfp4, blocks.len(), QK_MXFP4, out.len());
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_MXFP4)) {
        let d = e8m0_to_f32_half(b.e);
        for j in 0..QK_MXFP4 / 2 {
            y[j] = KVALUES_MXFP4[(b.qs[j] & 0xf) as usize] as f32 * d;
            y[j + QK_MXFP4 / 2] = KVALUES_MXFP4[(b.qs[j] >> 4) as usize] as f32 * d;
        }
    }
}

/// ggml's `best_index_mxfp4`: the level with the smallest `|kvalue·d − x|`, first on ties.
#[inline(always)]
fn best_index_mxfp4(x: f32, d: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (KVALUES_MXFP4[0] as f32 * d - x).abs();
    for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
        let err = (k as f32 * d - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

/// Quantize MXFP4 (`quantize_row_mxfp4_ref`): `e = floor(log2(amax)) − 2 + 127` (so the largest
/// magnitude lands near the top level 6), then each element to its nearest level.
pub fn quantize_mxfp4(src: &[f32], out: &mut [BlockMxfp4]) {
    check_len(GgmlType::Mxfp4, out.len(), QK_MXFP4, src.len());
    for (x, b) in src.chunks_exact(QK_MXFP4).zip(out.iter_mut()) {
        let amax = x
            .iter()
            .fold(0.0f32, |a, v| if a < v.abs() { v.abs() } else { a });
        // Float to u8 saturates here; ggml's cast is undefined outside 0..=255 (only reachable
        // for |x| < 2^-125).
        b.e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_to_f32_half(b.e);
        for j in 0..QK_MXFP4 / 2 {
            let x0 = best_index_mxfp4(x[j], d);
            let x1 = best_index_mxfp4(x[j + QK_MXFP4 / 2], d);
            b.qs[j] = x0 | (x1 << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_half_is_a_power_of_two() {
        assert_eq!(e8m0_to_f32_half(128), 1.0);
        assert_eq!(e8m0_to_f32_half(127), 0.5);
        assert_eq!(e8m0_to_f32_half(2), 2f32.powi(-126));
        assert_eq!(e8m0_to_f32_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_to_f32_half(254), 2f32.powi(126));
    }
}
