//! The errors of the CPU kernels.

use thiserror::Error;

use super::Isa;
use crate::quant::GgmlType;

/// What can go wrong in a CPU kernel call. Every size is checked before any work starts.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KernelError {
    #[error("instruction set {isa} is not available on this CPU (missing {})", missing.join(", "))]
    IsaUnavailable {
        isa: Isa,
        missing: Vec<&'static str>,
    },

    #[error("no CPU matrix product for weight type {ty}")]
    UnsupportedType { ty: GgmlType },

    #[error("{ty} is not an activation type (expected f32, f16, bf16, q8_0, q8_1 or q8_K)")]
    NotAnActivationType { ty: GgmlType },

    #[error("k_dim {k_dim} is not a multiple of the {ty} block size {block_size}")]
    KDimNotBlockMultiple {
        ty: GgmlType,
        k_dim: usize,
        block_size: usize,
    },

    #[error(
        "weights for {n_rows} rows of {k_dim} {ty} elements should be {expected} bytes, found {found}"
    )]
    WeightLen {
        ty: GgmlType,
        n_rows: usize,
        k_dim: usize,
        expected: usize,
        found: usize,
    },

    #[error("input of {n_tokens} tokens × {k_dim} should be {expected} f32 values, found {found}")]
    InputLen {
        n_tokens: usize,
        k_dim: usize,
        expected: usize,
        found: usize,
    },

    #[error("output of {n_tokens} tokens × {n_rows} rows should be {expected} f32 values, found {found}")]
    OutputLen {
        n_tokens: usize,
        n_rows: usize,
        expected: usize,
        found: usize,
    },

    #[error("weight type {weight} reads {expected} activations, found {}", found.map_or("none", |t| t.name()))]
    ActivationType {
        weight: GgmlType,
        expected: GgmlType,
        found: Option<GgmlType>,
    },

    #[error("activations have k_dim {found}, the weights expect {expected}")]
    ActivationKDim { expected: usize, found: usize },

    #[error("token {token} is out of range for {n_tokens} activation rows")]
    TokenOutOfRange { token: usize, n_tokens: usize },

    #[error("size overflow computing {what}")]
    Overflow { what: &'static str },
}
