//! GGML weight formats: block structs, dequantization and quantization.
//!
//! Layouts and arithmetic follow ggml (`ggml-common.h`, `ggml-quants.c`) so that dequantized
//! values match ggml bit for bit: the same operation order, and f16 → f32 conversions where ggml
//! does them. Quantizers are ggml's round-to-nearest reference paths (`quantize_row_*_ref`,
//! no importance matrix), so a file quantized here matches one written by `llama-quantize`
//! without `--imatrix` (see each function for the exceptions).
//!
//! Entry points:
//! - [`dequantize`], [`quantize`], [`quantize_into`]: by [`GgmlType`], on raw bytes (what the
//!   GGUF loader and fixture writer use);
//! - the per-format slice functions (`dequantize_q4k`, `quantize_q8_0`, ...) and the
//!   [`BlockFormat`] trait: on typed blocks (what the CPU kernels use);
//! - [`as_blocks`]: view GGUF bytes as typed blocks without copying when they are aligned;
//! - [`accuracy`]: quantization error against ggml's published thresholds.

/// Implement [`BlockFormat`] for a block struct from its two slice functions.
macro_rules! block_format {
    ($block:ty, $ty:expr, $block_size:expr, $dequantize:ident, $quantize:ident) => {
        impl $crate::quant::BlockFormat for $block {
            const TYPE: $crate::quant::GgmlType = $ty;
            const BLOCK_SIZE: usize = $block_size;
            fn dequantize(blocks: &[Self], out: &mut [f32]) {
                $dequantize(blocks, out)
            }
            fn quantize(src: &[f32], out: &mut [Self]) {
                $quantize(src, out)
            }
        }
    };
}

mod types;

pub mod accuracy;
pub mod float;
pub mod iq;
pub mod k_quants;
pub mod legacy;
pub mod mxfp4;

use std::borrow::Cow;

use half::{bf16, f16};

pub use iq::{
    dequantize_iq4_nl, dequantize_iq4_xs, quantize_iq4_nl, quantize_iq4_xs, BlockIq4Nl, BlockIq4Xs,
};
pub use k_quants::{
    dequantize_q2k, dequantize_q3k, dequantize_q4k, dequantize_q5k, dequantize_q6k, dequantize_q8k,
    quantize_q2k, quantize_q3k, quantize_q4k, quantize_q5k, quantize_q6k, quantize_q8k, BlockQ2K,
    BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K,
};
pub use legacy::{
    dequantize_q4_0, dequantize_q4_1, dequantize_q5_0, dequantize_q5_1, dequantize_q8_0,
    dequantize_q8_1, quantize_q4_0, quantize_q4_1, quantize_q5_0, quantize_q5_1, quantize_q8_0,
    quantize_q8_1, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1,
};
pub use mxfp4::{dequantize_mxfp4, quantize_mxfp4, BlockMxfp4};
pub use types::{GgmlType, QK_K};

/// Why a (de)quantization request was refused.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum QuantError {
    /// The type has no dequantizer/quantizer here (see [`GgmlType::SUPPORTED`]).
    #[error("unsupported weight type: expected one of {supported}, found {0}", supported = supported_names())]
    UnsupportedType(GgmlType),
    /// A length that must be a whole number of blocks is not.
    #[error("{ty}: expected a multiple of {multiple_of} {unit} (whole blocks), found {found}")]
    NotWholeBlocks {
        ty: GgmlType,
        /// `"bytes"` for quantized input, `"elements"` for f32 input.
        unit: &'static str,
        multiple_of: usize,
        found: usize,
    },
    /// The output buffer does not have the size the input implies.
    #[error("{ty}: expected an output of {expected} {unit}, found {found}")]
    LengthMismatch {
        ty: GgmlType,
        unit: &'static str,
        expected: usize,
        found: usize,
    },
    /// Raw bytes are not a whole number of block structs.
    #[error("expected a byte length that is a multiple of the {block_bytes}-byte block, found {found} bytes")]
    NotWholeStructs { block_bytes: usize, found: usize },
    /// Quantizing a non-finite value would give a meaningless block.
    #[error("{ty}: expected finite input, found {value} at element {index}")]
    NonFinite {
        ty: GgmlType,
        index: usize,
        value: f32,
    },
}

fn supported_names() -> String {
    GgmlType::SUPPORTED
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A GGML block format: one `#[repr(C)]` block of [`BlockFormat::BLOCK_SIZE`] elements with
/// ggml's dequantizer and reference quantizer.
///
/// Implemented by every block struct, and by `f32`, [`f16`] and [`bf16`] (blocks of one element).
pub trait BlockFormat: bytemuck::Pod {
    /// The GGML type this block encodes.
    const TYPE: GgmlType;
    /// Elements per block.
    const BLOCK_SIZE: usize;

    /// Dequantize `blocks` into `out`.
    ///
    /// # Panics
    /// If `out.len() != blocks.len() * Self::BLOCK_SIZE` (a caller bug, not a data error; the
    /// byte-level [`dequantize`] checks lengths and returns an error instead).
    fn dequantize(blocks: &[Self], out: &mut [f32]);

    /// Quantize `src` into `out` with ggml's reference quantizer.
    ///
    /// # Panics
    /// If `src.len() != out.len() * Self::BLOCK_SIZE` (a caller bug; the byte-level
    /// [`quantize_into`] checks lengths and returns an error instead).
    fn quantize(src: &[f32], out: &mut [Self]);
}

/// The one length check behind every slice function: a caller bug if it fails.
#[inline]
#[track_caller]
pub(crate) fn check_len(ty: GgmlType, blocks: usize, block_size: usize, elements: usize) {
    assert!(
        blocks.checked_mul(block_size) == Some(elements),
        "{ty}: expected {blocks} blocks x {block_size} = {} elements, found {elements}",
        blocks.saturating_mul(block_size)
    );
}

/// ggml's `nearest_int`: round to nearest, ties to even, for |x| ≤ 2²² (the magic-number trick
/// `x + 1.5·2²³`). Outside that range ggml asserts; here the result is defined but meaningless,
/// which only non-finite or absurdly scaled input can reach.
#[inline(always)]
pub(crate) fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    let i = val.to_bits() as i32;
    (i & 0x007f_ffff) - 0x0040_0000
}

/// Reinterpret bytes as blocks: borrowed when aligned, copied when not.
pub fn as_blocks<B: bytemuck::Pod>(bytes: &[u8]) -> Result<Cow<'_, [B]>, QuantError> {
    let size = std::mem::size_of::<B>();
    if size == 0 || !bytes.len().is_multiple_of(size) {
        return Err(QuantError::NotWholeStructs {
            block_bytes: size,
            found: bytes.len(),
        });
    }
    match bytemuck::try_cast_slice::<u8, B>(bytes) {
        Ok(blocks) => Ok(Cow::Borrowed(blocks)),
        Err(_) => {
            let mut owned = vec![B::zeroed(); bytes.len() / size];
            bytemuck::cast_slice_mut::<B, u8>(&mut owned).copy_from_slice(bytes);
            Ok(Cow::Owned(owned))
        }
    }
}

/// Check the byte-level lengths for dequantizing `src_len` bytes of `ty` into `dst_len` floats.
fn check_dequant_lengths(ty: GgmlType, src_len: usize, dst_len: usize) -> Result<(), QuantError> {
    let ts = ty.type_size();
    if !src_len.is_multiple_of(ts) {
        return Err(QuantError::NotWholeBlocks {
            ty,
            unit: "bytes",
            multiple_of: ts,
            found: src_len,
        });
    }
    let expected = (src_len / ts).checked_mul(ty.block_size());
    if expected != Some(dst_len) {
        return Err(QuantError::LengthMismatch {
            ty,
            unit: "elements",
            expected: expected.unwrap_or(usize::MAX),
            found: dst_len,
        });
    }
    Ok(())
}

fn dequantize_as<B: BlockFormat>(src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let blocks = as_blocks::<B>(src)?;
    B::dequantize(&blocks, dst);
    Ok(())
}

/// Dequantize `src` (raw GGUF bytes of type `ty`) into `dst`, exactly as ggml does.
///
/// `src` must hold whole blocks and `dst` exactly the elements they encode.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !ty.is_supported() {
        return Err(QuantError::UnsupportedType(ty));
    }
    check_dequant_lengths(ty, src.len(), dst.len())?;
    match ty {
        GgmlType::F32 => dequantize_as::<f32>(src, dst),
        GgmlType::F16 => dequantize_as::<f16>(src, dst),
        GgmlType::BF16 => dequantize_as::<bf16>(src, dst),
        GgmlType::Q4_0 => dequantize_as::<BlockQ4_0>(src, dst),
        GgmlType::Q4_1 => dequantize_as::<BlockQ4_1>(src, dst),
        GgmlType::Q5_0 => dequantize_as::<BlockQ5_0>(src, dst),
        GgmlType::Q5_1 => dequantize_as::<BlockQ5_1>(src, dst),
        GgmlType::Q8_0 => dequantize_as::<BlockQ8_0>(src, dst),
        GgmlType::Q8_1 => dequantize_as::<BlockQ8_1>(src, dst),
        GgmlType::Q2K => dequantize_as::<BlockQ2K>(src, dst),
        GgmlType::Q3K => dequantize_as::<BlockQ3K>(src, dst),
        GgmlType::Q4K => dequantize_as::<BlockQ4K>(src, dst),
        GgmlType::Q5K => dequantize_as::<BlockQ5K>(src, dst),
        GgmlType::Q6K => dequantize_as::<BlockQ6K>(src, dst),
        GgmlType::Q8K => dequantize_as::<BlockQ8K>(src, dst),
        GgmlType::Iq4Nl => dequantize_as::<BlockIq4Nl>(src, dst),
        GgmlType::Iq4Xs => dequantize_as::<BlockIq4Xs>(src, dst),
        GgmlType::Mxfp4 => dequantize_as::<BlockMxfp4>(src, dst),
        other => Err(QuantError::UnsupportedType(other)),
    }
}

fn quantize_as<B: BlockFormat>(src: &[f32], dst: &mut [u8]) {
    let n_blocks = dst.len() / std::mem::size_of::<B>();
    match bytemuck::try_cast_slice_mut::<u8, B>(dst) {
        Ok(blocks) => B::quantize(src, blocks),
        Err(_) => {
            // Unaligned output: quantize into aligned blocks, then copy the bytes.
            let mut blocks = vec![B::zeroed(); n_blocks];
            B::quantize(src, &mut blocks);
            dst.copy_from_slice(bytemuck::cast_slice(&blocks));
        }
    }
}

/// Quantize `src` to `ty` with ggml's reference quantizer into `dst`, which must be exactly
/// `ty.bytes_for(src.len())` bytes.
pub fn quantize_into(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !ty.is_supported() {
        return Err(QuantError::UnsupportedType(ty));
    }
    let bs = ty.block_size();
    if !src.len().is_multiple_of(bs) {
        return Err(QuantError::NotWholeBlocks {
            ty,
            unit: "elements",
            multiple_of: bs,
            found: src.len(),
        });
    }
    let expected = (src.len() / bs).checked_mul(ty.type_size());
    if expected != Some(dst.len()) {
        return Err(QuantError::LengthMismatch {
            ty,
            unit: "bytes",
            expected: expected.unwrap_or(usize::MAX),
            found: dst.len(),
        });
    }
    let is_float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    if !is_float {
        if let Some((index, &value)) = src.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(QuantError::NonFinite { ty, index, value });
        }
    }
    match ty {
        GgmlType::F32 => quantize_as::<f32>(src, dst),
        GgmlType::F16 => quantize_as::<f16>(src, dst),
        GgmlType::BF16 => quantize_as::<bf16>(src, dst),
        GgmlType::Q4_0 => quantize_as::<BlockQ4_0>(src, dst),
        GgmlType::Q4_1 => quantize_as::<BlockQ4_1>(src, dst),
        GgmlType::Q5_0 => quantize_as::<BlockQ5_0>(src, dst),
        GgmlType::Q5_1 => quantize_as::<BlockQ5_1>(src, dst),
        GgmlType::Q8_0 => quantize_as::<BlockQ8_0>(src, dst),
        GgmlType::Q8_1 => quantize_as::<BlockQ8_1>(src, dst),
        GgmlType::Q2K => quantize_as::<BlockQ2K>(src, dst),
        GgmlType::Q3K => quantize_as::<BlockQ3K>(src, dst),
        GgmlType::Q4K => quantize_as::<BlockQ4K>(src, dst),
        GgmlType::Q5K => quantize_as::<BlockQ5K>(src, dst),
        GgmlType::Q6K => quantize_as::<BlockQ6K>(src, dst),
        GgmlType::Q8K => quantize_as::<BlockQ8K>(src, dst),
        GgmlType::Iq4Nl => quantize_as::<BlockIq4Nl>(src, dst),
        GgmlType::Iq4Xs => quantize_as::<BlockIq4Xs>(src, dst),
        GgmlType::Mxfp4 => quantize_as::<BlockMxfp4>(src, dst),
        other => return Err(QuantError::UnsupportedType(other)),
    }
    Ok(())
}

/// Quantize `src` to `ty` with ggml's reference quantizer; returns the raw GGUF bytes.
pub fn quantize(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    if !ty.is_supported() {
        return Err(QuantError::UnsupportedType(ty));
    }
    let bs = ty.block_size();
    if !src.len().is_multiple_of(bs) {
        return Err(QuantError::NotWholeBlocks {
            ty,
            unit: "elements",
            multiple_of: bs,
            found: src.len(),
        });
    }
    let mut out = vec![0u8; (src.len() / bs) * ty.type_size()];
    quantize_into(ty, src, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        for (x, want) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (0.49, 0),
            (-7.6, -8),
            (127.0, 127),
            (4_194_303.0, 4_194_303),
        ] {
            assert_eq!(nearest_int(x), want, "nearest_int({x})");
        }
    }

    #[test]
    fn as_blocks_borrows_aligned_and_copies_unaligned() {
        let words = [0x3c00_3c00u32; 9]; // 36 bytes, 4-aligned
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let b = as_blocks::<BlockQ4_0>(&bytes[..36]).map(|c| matches!(c, Cow::Borrowed(_)));
        assert_eq!(b, Ok(true));
        let shifted = as_blocks::<BlockQ4_0>(&bytes[1..19]);
        let shifted = match shifted {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(shifted.len(), 1);
        assert_eq!(
            bytemuck::cast_slice::<BlockQ4_0, u8>(&shifted),
            &bytes[1..19]
        );
        assert_eq!(
            as_blocks::<BlockQ4_0>(&bytes[..20]).map(|c| c.len()),
            Err(QuantError::NotWholeStructs {
                block_bytes: 18,
                found: 20
            })
        );
    }

    #[test]
    fn errors_say_expected_and_found() {
        let mut out = [0f32; 32];
        let cases: Vec<(Result<(), QuantError>, &str)> = vec![
            (
                dequantize(GgmlType::Q4_0, &[0u8; 17], &mut out),
                "q4_0: expected a multiple of 18 bytes (whole blocks), found 17",
            ),
            (
                dequantize(GgmlType::Q4_0, &[0u8; 36], &mut out),
                "q4_0: expected an output of 64 elements, found 32",
            ),
            (
                quantize(GgmlType::Q4K, &[0.0; 32]).map(drop),
                "q4_K: expected a multiple of 256 elements (whole blocks), found 32",
            ),
            (
                quantize_into(GgmlType::Q8_0, &[0.0; 32], &mut [0u8; 33]),
                "q8_0: expected an output of 34 bytes, found 33",
            ),
            (
                quantize(GgmlType::Q8_0, &[f32::NAN; 32]).map(drop),
                "q8_0: expected finite input, found NaN at element 0",
            ),
        ];
        for (res, want) in cases {
            match res {
                Err(e) => assert_eq!(e.to_string(), want),
                Ok(()) => panic!("expected error {want:?}"),
            }
        }
        let e = dequantize(GgmlType::Iq2Xxs, &[], &mut []);
        match e {
            Err(e @ QuantError::UnsupportedType(GgmlType::Iq2Xxs)) => {
                let s = e.to_string();
                assert!(s.starts_with("unsupported weight type: expected one of f32, f16"));
                assert!(s.ends_with("found iq2_xxs"), "{s}");
            }
            other => panic!("expected UnsupportedType, found {other:?}"),
        }
    }

    #[test]
    fn every_supported_type_round_trips_through_bytes() {
        for ty in GgmlType::SUPPORTED {
            let n = 2 * QK_K;
            let src: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let bytes = match quantize(ty, &src) {
                Ok(b) => b,
                Err(e) => panic!("{ty}: {e}"),
            };
            assert_eq!(Some(bytes.len() as u64), ty.bytes_for(n as u64), "{ty}");
            let mut back = vec![0f32; n];
            if let Err(e) = dequantize(ty, &bytes, &mut back) {
                panic!("{ty}: {e}");
            }
            // Unaligned input and output buffers give the same answer.
            let mut shifted = vec![0u8; bytes.len() + 1];
            shifted[1..].copy_from_slice(&bytes);
            let mut back2 = vec![0f32; n];
            if let Err(e) = dequantize(ty, &shifted[1..], &mut back2) {
                panic!("{ty}: {e}");
            }
            assert_eq!(back, back2, "{ty}");
            let mut out = vec![0u8; bytes.len() + 1];
            if let Err(e) = quantize_into(ty, &src, &mut out[1..]) {
                panic!("{ty}: {e}");
            }
            assert_eq!(&out[1..], &bytes[..], "{ty}");
        }
    }
}
