//! Compute kernels for plumbline.
//!
//! - [`quant`]: the GGML weight formats. One `#[repr(C)]` block struct per type with a `const`
//!   size assertion, the [`quant::GgmlType`] enum (type ids, block size, bytes per block, name),
//!   and dequantize / quantize beside the struct they read. This is the one definition of every
//!   block format in the workspace.
//! - [`cpu`]: quantized matrix products on the CPU as ggml computes them (activations quantized
//!   to the weight type's `vec_dot_type`, per-block integer dots), scalar + AVX2 + AVX-512 with
//!   the instruction set chosen once in [`cpu::CpuKernels::new`].
//!
//! Architecture invariants:
//! - `kernels` depends on no other workspace crate. The engine builds on it; the verification
//!   reference (`reference`) must never depend on it, so that a bug here cannot be shared by both
//!   sides of a comparison.
//! - Every SIMD (or, later, CUDA) kernel has a plain scalar twin in the same module, used as its
//!   first test oracle and as the fallback.
//!
//! Start reading at `quant/types.rs`.

pub mod cpu;
pub mod quant;
