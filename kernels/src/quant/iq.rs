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
