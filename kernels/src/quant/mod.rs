//! GGML weight formats: block structs, dequantization and quantization.
//!
//! Layouts and arithmetic follow ggml (`ggml-common.h`, `ggml-quants.c`) so that dequantized
//! values match ggml bit for bit.

mod types;

pub mod k_quants;
pub mod legacy;
pub mod iq;
pub mod mxfp4;

pub use types::{GgmlType, QK_K};
