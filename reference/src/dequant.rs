//! Plain dequantizers for the weight types candle-core 0.11 cannot read: IQ4_NL, IQ4_XS, MXFP4
//! (unknown to its GGUF reader) and Q8_1, Q8_K (known to the reader, refused by its tensor loader).
//!
//! Written from ggml's published description of the formats (`ggml-common.h` block layouts,
//! `dequantize_row_*` in `ggml-quants.c`), deliberately separately from `kernels::quant`, so that a
//! misreading of a format cannot be shared by the engine and the reference. Each function takes the
//! raw little-endian bytes of whole blocks and returns the values in storage order.

use half::f16;

/// The sixteen non-linear 4-bit levels shared by IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
const IQ4NL_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The E2M1 (FP4) code points, doubled so that they are integers (ggml's `kvalues_mxfp4`);
/// the block scale is halved to compensate.
const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// A weight type candle-core does not know, with its GGUF type id and block geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraType {
    /// id 9: 32 values, f16 scale, f16 sum (unused here), 32 signed bytes.
    Q8_1,
    /// id 15: 256 values, f32 scale, 256 signed bytes, 16 i16 block sums (unused here).
    Q8K,
    /// id 20: 32 values, f16 scale + 16 bytes of nibbles.
    Iq4Nl,
    /// id 23: 256 values, f16 scale, 8 six-bit sub-block scales, 128 bytes of nibbles.
    Iq4Xs,
    /// id 39: 32 values, one E8M0 exponent byte + 16 bytes of FP4 nibbles.
    Mxfp4,
}

impl ExtraType {
    pub fn from_id(id: u32) -> Option<Self> {
        match id {
            9 => Some(Self::Q8_1),
            15 => Some(Self::Q8K),
            20 => Some(Self::Iq4Nl),
            23 => Some(Self::Iq4Xs),
            39 => Some(Self::Mxfp4),
            _ => None,
        }
    }

    /// Values per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::Q8_1 | Self::Iq4Nl | Self::Mxfp4 => 32,
            Self::Q8K | Self::Iq4Xs => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            Self::Q8_1 => 36,
            Self::Q8K => 292,
            Self::Iq4Nl => 18,
            Self::Iq4Xs => 136,
            Self::Mxfp4 => 17,
        }
    }

    /// Dequantize whole blocks. `bytes.len()` must be a multiple of [`Self::type_size`]; a
    /// trailing partial block is ignored (the caller sizes the buffer from the element count).
    pub fn dequantize(self, bytes: &[u8]) -> Vec<f32> {
        let blocks = bytes.chunks_exact(self.type_size());
        let mut out = Vec::with_capacity(blocks.len() * self.block_size());
        for block in blocks {
            match self {
                Self::Q8_1 => {
                    let d = f16_at(block, 0);
                    out.extend(block[4..36].iter().map(|&q| d * f32::from(q as i8)));
                }
                Self::Q8K => {
                    let d = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
                    out.extend(block[4..260].iter().map(|&q| d * f32::from(q as i8)));
                }
                Self::Iq4Nl => iq4_nl_block(block, &mut out),
                Self::Iq4Xs => iq4_xs_block(block, &mut out),
                Self::Mxfp4 => mxfp4_block(block, &mut out),
            }
        }
        out
    }
}

fn f16_at(block: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([block[at], block[at + 1]])).to_f32()
}

/// 16 bytes of nibbles → 32 values: low nibbles are values 0..16, high nibbles 16..32.
fn nibbles(qs: &[u8], scale: f32, levels: &[i8; 16], out: &mut Vec<f32>) {
    for &q in qs {
        out.push(scale * f32::from(levels[usize::from(q & 0x0f)]));
    }
    for &q in qs {
        out.push(scale * f32::from(levels[usize::from(q >> 4)]));
    }
}

/// `block_iq4_nl { ggml_half d; uint8_t qs[16]; }`
fn iq4_nl_block(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    nibbles(&block[2..18], d, &IQ4NL_LEVELS, out);
}

/// `block_iq4_xs { ggml_half d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; }`.
/// Sub-block `ib` (32 values) has the 6-bit scale `ls = low nibble of scales_l[ib/2] (shifted by
/// 4·(ib%2)) | (bits 2·ib..2·ib+2 of scales_h) << 4`, applied as `d · (ls − 32)`.
fn iq4_xs_block(block: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(block, 0);
    let scales_h = u16::from_le_bytes([block[2], block[3]]);
    let scales_l = &block[4..8];
    let qs = &block[8..136];
    for ib in 0..8 {
        let low = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
        let high = ((scales_h >> (2 * ib)) & 0x03) as u8;
        let ls = i32::from(low | (high << 4));
        let dl = d * (ls - 32) as f32;
        nibbles(&qs[16 * ib..16 * ib + 16], dl, &IQ4NL_LEVELS, out);
    }
}

/// `block_mxfp4 { uint8_t e; uint8_t qs[16]; }`: the scale is the E8M0 exponent `2^(e−127)`, halved
/// because the levels are doubled: `2^(e−128)`.
fn mxfp4_block(block: &[u8], out: &mut Vec<f32>) {
    let e = u32::from(block[0]);
    // 2^(e−128) as an f32 bit pattern: a normal number for e ≥ 2, a subnormal below that.
    let d = if e >= 2 {
        f32::from_bits((e - 1) << 23)
    } else {
        f32::from_bits(0x0020_0000 << e)
    };
    nibbles(&block[1..17], d, &MXFP4_LEVELS, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected values below are worked out by hand from the format descriptions, not produced by
    // this code: each test builds a block whose decoding is easy to state.

    fn f16_bytes(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    #[test]
    fn iq4_nl_levels_and_nibble_order() {
        let mut block = Vec::from(f16_bytes(0.5));
        // byte j: low nibble j, high nibble 15 − j
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let got = ExtraType::Iq4Nl.dequantize(&block);
        assert_eq!(got.len(), 32);
        assert_eq!(got[0], -63.5); // 0.5 · −127
        assert_eq!(got[8], 0.5); // 0.5 · 1
        assert_eq!(got[15], 56.5); // 0.5 · 113
        assert_eq!(got[16], 56.5); // high nibble of byte 0 is 15
        assert_eq!(got[31], -63.5); // high nibble of byte 15 is 0
    }

    #[test]
    fn iq4_xs_sub_block_scales() {
        let mut block = Vec::from(f16_bytes(0.25));
        // sub-block ib gets ls = 32 + ib + 1 (so d·(ls−32) = 0.25·(ib+1)), except sub-block 7 which
        // gets ls = 0 (scale −8): low nibble in scales_l, high 2 bits in scales_h.
        let mut ls = [0u8; 8];
        for (ib, l) in ls.iter_mut().enumerate().take(7) {
            *l = 33 + ib as u8;
        }
        let mut scales_h = 0u16;
        let mut scales_l = [0u8; 4];
        for ib in 0..8 {
            scales_l[ib / 2] |= (ls[ib] & 0x0f) << (4 * (ib % 2));
            scales_h |= u16::from(ls[ib] >> 4) << (2 * ib);
        }
        block.extend(scales_h.to_le_bytes());
        block.extend(scales_l);
        // every nibble = 8 → level 1
        block.extend(std::iter::repeat_n(0x88u8, 128));
        let got = ExtraType::Iq4Xs.dequantize(&block);
        assert_eq!(got.len(), 256);
        for ib in 0..7 {
            let want = 0.25 * (ib as f32 + 1.0);
            assert!(
                got[32 * ib..32 * ib + 32].iter().all(|&v| v == want),
                "sub-block {ib}"
            );
        }
        assert!(got[224..].iter().all(|&v| v == -8.0));
    }

    #[test]
    fn mxfp4_exponent_and_levels() {
        // e = 127 → scale 2^−1; levels doubled, so the decoded values are the E2M1 code points.
        let mut block = vec![127u8];
        block.extend((0..16u8).map(|j| j | (j << 4)));
        let got = ExtraType::Mxfp4.dequantize(&block);
        let e2m1 = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        assert_eq!(&got[..16], &e2m1);
        assert_eq!(&got[16..], &e2m1);
        // e = 130 → E8M0 scale 2^3, code 7 is E2M1 6.0 → 48
        let mut block = vec![130u8];
        block.extend([0x07u8; 16]);
        assert_eq!(ExtraType::Mxfp4.dequantize(&block)[0], 48.0);
        // e = 0 → scale 2^−128, still representable (subnormal) in f32
        let mut block = vec![0u8];
        block.extend([0x01u8; 16]);
        assert_eq!(
            ExtraType::Mxfp4.dequantize(&block)[0],
            2f64.powi(-128) as f32
        );
    }

    #[test]
    fn q8_1_and_q8_k_are_scale_times_signed_byte() {
        // block_q8_1 { half d; half s; int8 qs[32] }: s is a precomputed sum, not a value
        let mut block = Vec::from(f16_bytes(0.5));
        block.extend(f16_bytes(1000.0));
        block.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let got = ExtraType::Q8_1.dequantize(&block);
        assert_eq!(got[0], -8.0);
        assert_eq!(got[16], 0.0);
        assert_eq!(got[31], 7.5);
        // block_q8_K { float d; int8 qs[256]; int16 bsums[16] }
        let mut block = Vec::from(0.25f32.to_le_bytes());
        block.extend((0..256).map(|j| (j % 256) as u8));
        block.extend([0xffu8; 32]);
        let got = ExtraType::Q8K.dequantize(&block);
        assert_eq!(got.len(), 256);
        assert_eq!(got[1], 0.25);
        assert_eq!(got[127], 31.75);
        assert_eq!(got[128], -32.0); // byte 0x80 is −128
        assert_eq!(got[255], -0.25);
    }

    #[test]
    fn partial_trailing_block_is_ignored() {
        let bytes = vec![0u8; 18 + 5];
        assert_eq!(ExtraType::Iq4Nl.dequantize(&bytes).len(), 32);
    }
}
