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
