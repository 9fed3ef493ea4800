//! The k-quants: 256-element super-blocks with 6-bit packed sub-block scales.
//!
//! The block structs live here; each format's dequantizer and reference quantizer is in its own
//! file (`q2k.rs` ... `q8k.rs`), and the scale searches they share in `search.rs`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{GgmlType, QK_K};

mod q2k;
mod q3k;
mod q4k;
mod q5k;
mod q6k;
mod q8k;
mod search;

pub use q2k::{dequantize_q2k, quantize_q2k};
pub use q3k::{dequantize_q3k, quantize_q3k};
pub use q4k::{dequantize_q4k, quantize_q4k};
pub use q5k::{dequantize_q5k, quantize_q5k};
pub use q6k::{dequantize_q6k, quantize_q6k};
pub use q8k::{dequantize_q8k, quantize_q8k};

block_format!(BlockQ2K, GgmlType::Q2K, QK_K, dequantize_q2k, quantize_q2k);
block_format!(BlockQ3K, GgmlType::Q3K, QK_K, dequantize_q3k, quantize_q3k);
block_format!(BlockQ4K, GgmlType::Q4K, QK_K, dequantize_q4k, quantize_q4k);
block_format!(BlockQ5K, GgmlType::Q5K, QK_K, dequantize_q5k, quantize_q5k);
block_format!(BlockQ6K, GgmlType::Q6K, QK_K, dequantize_q6k, quantize_q6k);
block_format!(BlockQ8K, GgmlType::Q8K, QK_K, dequantize_q8k, quantize_q8k);

/// Pack 2-bit levels as Q2_K and Q3_K store them: in each 128-element half, byte `l` holds
/// elements `l`, `l + 32`, `l + 64`, `l + 96` in bits 0-1, 2-3, 4-5, 6-7.
fn pack_2bit(l: &[u8; QK_K]) -> [u8; QK_K / 4] {
    let mut qs = [0u8; QK_K / 4];
    for j in (0..QK_K).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] =
                l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
        }
    }
    qs
}

/// Bytes of packed 6-bit scales and mins in Q4_K and Q5_K (ggml's `K_SCALE_SIZE`).
pub const K_SCALE_SIZE: usize = 12;

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);

#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

/// The activation format of the k-quant dot products.
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    /// Sums of `qs` in groups of 16.
    pub bsums: [i16; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);
