//! Activations in the form a weight type's dot product reads (ggml's `vec_dot_type`).
//!
//! ggml quantizes the f32 activations once per matrix product to the format its per-block
//! integer dot product pairs with the weight type; [`QuantizedActivations`] holds that form for
//! `n_tokens` rows of `k_dim` elements and keeps its buffers between calls.

use bytemuck::Zeroable;
use half::{bf16, f16};
use rayon::prelude::*;

use super::KernelError;
use crate::quant::float::{quantize_bf16, quantize_f16};
use crate::quant::legacy::QK;
use crate::quant::{quantize_q8_1, BlockQ8K, BlockQ8_0, BlockQ8_1, GgmlType, QK_K};

/// The activation type ggml's dot product for weight type `ty` reads (`vec_dot_type`), or `None`
/// when there is no CPU matrix product for `ty`.
///
/// Q8_1 and Q8_K weights have no dot product in ggml; here Q8_1 weights pair with Q8_0
/// activations (the `s` field is not needed) and Q8_K weights with Q8_K activations.
pub fn vec_dot_type(ty: GgmlType) -> Option<GgmlType> {
    use GgmlType::*;
    Some(match ty {
        F32 => F32,
        F16 => F16,
        BF16 => BF16,
        Q4_0 | Q5_0 | Q8_0 | Q8_1 | Iq4Nl | Mxfp4 => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | Iq4Xs => Q8K,
        _ => return None,
    })
}

/// The activation rows a matrix product reads, quantized to one `vec_dot_type`.
///
/// Reuse one value across calls: its buffers keep their capacity, so a steady decode loop does
/// not allocate.
#[derive(Debug, Default, Clone)]
pub struct QuantizedActivations {
    ty: Option<GgmlType>,
    k_dim: usize,
    n_tokens: usize,
    f32s: Vec<f32>,
    f16s: Vec<f16>,
    bf16s: Vec<bf16>,
    q8_0: Vec<BlockQ8_0>,
    q8_1: Vec<BlockQ8_1>,
    q8k: Vec<BlockQ8K>,
}

/// A borrowed view of the activations of one type (all tokens, row-major).
#[derive(Clone, Copy)]
pub(crate) enum ActSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    Q8_0(&'a [BlockQ8_0]),
    Q8_1(&'a [BlockQ8_1]),
    Q8K(&'a [BlockQ8K]),
}

impl QuantizedActivations {
    /// An empty set; the first quantization sizes its buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// The activation type held (`None` before the first quantization).
    pub fn ty(&self) -> Option<GgmlType> {
        self.ty
    }

    /// Elements per token row.
    pub fn k_dim(&self) -> usize {
        self.k_dim
    }

    /// Token rows held.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// Quantize `n_tokens` rows of `k_dim` f32 values (`x`, row-major) to `act_ty`, one of F32,
    /// F16, BF16, Q8_0, Q8_1, Q8_K, with ggml's reference rounding. Rows are quantized in
    /// parallel on rayon's current pool, with
    /// `kernels::quant`'s quantizers.
    pub fn quantize(
        &mut self,
        act_ty: GgmlType,
        x: &[f32],
        n_tokens: usize,
        k_dim: usize,
    ) -> Result<(), KernelError> {
        self.quantize_with(&super::vector::SCALAR, act_ty, x, n_tokens, k_dim)
    }

    /// [`Self::quantize`] with an ISA's quantizers for Q8_0 and Q8_K (the same bytes).
    pub(crate) fn quantize_with(
        &mut self,
        vf: &super::vector::VectorFns,
        act_ty: GgmlType,
        x: &[f32],
        n_tokens: usize,
        k_dim: usize,
    ) -> Result<(), KernelError> {
        let n = n_tokens.checked_mul(k_dim).ok_or(KernelError::Overflow {
            what: "n_tokens * k_dim",
        })?;
        if x.len() != n {
            return Err(KernelError::InputLen {
                n_tokens,
                k_dim,
                expected: n,
                found: x.len(),
            });
        }
        let bs = act_ty.block_size();
        if !k_dim.is_multiple_of(bs) {
            return Err(KernelError::KDimNotBlockMultiple {
                ty: act_ty,
                k_dim,
                block_size: bs,
            });
        }
        // Rows are independent; a task per few rows keeps tiny decode calls serial.
        let min_len = (4096 / k_dim.max(1)).max(1);
        match act_ty {
            GgmlType::F32 => {
                self.f32s.clear();
                self.f32s.extend_from_slice(x);
            }
            GgmlType::F16 => {
                resize(&mut self.f16s, n);
                self.f16s
                    .par_chunks_mut(4096)
                    .zip(x.par_chunks(4096))
                    .for_each(|(d, s)| quantize_f16(s, d));
            }
            GgmlType::BF16 => {
                resize(&mut self.bf16s, n);
                self.bf16s
                    .par_chunks_mut(4096)
                    .zip(x.par_chunks(4096))
                    .for_each(|(d, s)| quantize_bf16(s, d));
            }
            GgmlType::Q8_0 => {
                let nb = k_dim / QK;
                resize(&mut self.q8_0, n / QK);
                if nb > 0 {
                    self.q8_0
                        .par_chunks_mut(nb)
                        .zip(x.par_chunks(k_dim))
                        .with_min_len(min_len)
                        .for_each(|(y, xr)| (vf.quantize_q8_0)(xr, y));
                }
            }
            GgmlType::Q8_1 => {
                let nb = k_dim / QK;
                resize(&mut self.q8_1, n / QK);
                if nb > 0 {
                    self.q8_1
                        .par_chunks_mut(nb)
                        .zip(x.par_chunks(k_dim))
                        .with_min_len(min_len)
                        .for_each(|(y, xr)| quantize_q8_1(xr, y));
                }
            }
            GgmlType::Q8K => {
                let nb = k_dim / QK_K;
                resize(&mut self.q8k, n / QK_K);
                if nb > 0 {
                    self.q8k
                        .par_chunks_mut(nb)
                        .zip(x.par_chunks(k_dim))
                        .with_min_len(min_len)
                        .for_each(|(y, xr)| (vf.quantize_q8k)(xr, y));
                }
            }
            other => return Err(KernelError::NotAnActivationType { ty: other }),
        }
        self.ty = Some(act_ty);
        self.k_dim = k_dim;
        self.n_tokens = n_tokens;
        Ok(())
    }

    /// The activations of the current type, all tokens.
    pub(crate) fn slice(&self) -> Option<ActSlice<'_>> {
        Some(match self.ty? {
            GgmlType::F32 => ActSlice::F32(&self.f32s),
            GgmlType::F16 => ActSlice::F16(&self.f16s),
            GgmlType::BF16 => ActSlice::Bf16(&self.bf16s),
            GgmlType::Q8_0 => ActSlice::Q8_0(&self.q8_0),
            GgmlType::Q8_1 => ActSlice::Q8_1(&self.q8_1),
            GgmlType::Q8K => ActSlice::Q8K(&self.q8k),
            _ => return None,
        })
    }

    /// The Q8_0 blocks held (empty unless [`Self::ty`] is Q8_0).
    pub fn q8_0(&self) -> &[BlockQ8_0] {
        if self.ty == Some(GgmlType::Q8_0) {
            &self.q8_0
        } else {
            &[]
        }
    }

    /// The Q8_1 blocks held (empty unless [`Self::ty`] is Q8_1).
    pub fn q8_1(&self) -> &[BlockQ8_1] {
        if self.ty == Some(GgmlType::Q8_1) {
            &self.q8_1
        } else {
            &[]
        }
    }

    /// The Q8_K blocks held (empty unless [`Self::ty`] is Q8_K).
    pub fn q8k(&self) -> &[BlockQ8K] {
        if self.ty == Some(GgmlType::Q8K) {
            &self.q8k
        } else {
            &[]
        }
    }
}

fn resize<T: Zeroable + Clone>(v: &mut Vec<T>, n: usize) {
    // Every element is overwritten by the quantizer; zeroing only what is new is enough.
    v.resize(n, T::zeroed());
}
