//! The [`Backend`] trait: the operations a forward pass is made of.
//!
//! Buffers are host `f32` slices, row-major, one row per token. A device backend (CUDA) will
//! implement the same operations; weights are passed as [`MatRef`]s naming the tensor, so such a
//! backend can keep its uploaded copy keyed by name.

use kernels::quant::GgmlType;

use crate::model::{Activation, RopeConfig};

use super::RuntimeError;

/// A weight matrix in its GGML format: `n_rows` rows of `k_dim` elements of `ty`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub name: &'a str,
    pub ty: GgmlType,
    pub data: &'a [u8],
    pub n_rows: usize,
    pub k_dim: usize,
}

/// Shapes and masking of one attention call.
///
/// `q` is `[n_tokens, n_head × head_dim_k]`; `k` is `[n_kv, n_head_kv × head_dim_k]` and `v`
/// `[n_kv, n_head_kv × head_dim_v]` (the whole cache, position = row); `out` is
/// `[n_tokens, n_head × head_dim_v]`. Query `t` sits at position `n_kv - n_tokens + t` and sees
/// keys `j ≤` its position, and with a window `w` only those with `position - j < w`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    pub n_tokens: usize,
    pub n_kv: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Multiplies `q·k` before the softmax.
    pub scale: f32,
    pub window: Option<usize>,
}

/// The operations of a forward pass. Every method checks its buffer lengths and fails with
/// [`RuntimeError::Shape`] rather than panic.
pub trait Backend: Send + Sync {
    /// `cpu-avx512`, `cpu-scalar`, ...
    fn name(&self) -> String;

    /// Worker threads the backend computes with.
    fn threads(&self) -> usize;

    /// `out[t, r] = Σ_k w[r, k] · x[t, k]` for `n_tokens` rows of `x`.
    fn matmul(
        &self,
        w: &MatRef<'_>,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), RuntimeError>;

    /// RMSNorm of each row of `weight.len()` values of `x`, times `weight`, into `out`.
    fn rms_norm(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), RuntimeError>;

    /// [`Self::rms_norm`] in place (per-head norms).
    fn rms_norm_inplace(&self, x: &mut [f32], weight: &[f32], eps: f32)
        -> Result<(), RuntimeError>;

    /// Rotate the first `rope.n_rot` dimensions of each head of `x` (`[n_tokens, n_heads ×
    /// head_dim]`), token `t` at position `pos0 + t`.
    fn rope(
        &self,
        x: &mut [f32],
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        pos0: usize,
        rope: &RopeConfig,
    ) -> Result<(), RuntimeError>;

    /// Causal (optionally windowed) softmax attention; see [`AttnParams`].
    fn attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        p: &AttnParams,
        out: &mut [f32],
    ) -> Result<(), RuntimeError>;

    /// `x += y`.
    fn add(&self, x: &mut [f32], y: &[f32]) -> Result<(), RuntimeError>;

    /// `x *= s`.
    fn scale(&self, x: &mut [f32], s: f32);

    /// `gate = act(gate) · up`.
    fn gated_act(&self, act: Activation, gate: &mut [f32], up: &[f32]) -> Result<(), RuntimeError>;

    /// `x = cap · tanh(x / cap)`.
    fn softcap(&self, x: &mut [f32], cap: f32);
}
