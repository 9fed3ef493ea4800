//! The backend-ops suite: every op of the `Backend` trait against the CPU backend (the
//! `CpuBackend` op of the same name) on random data — every weight type, odd and edge shapes,
//! attention masks — and the real model, on three devices:
//!
//! - `gpu`: a real GPU, device 0 (the `gpu` nextest profile only; each test fails without one);
//! - `emu`: the CUDA emulator (`kernels/cuda/emu`), on every machine with g++ and the NVRTC
//!   wheel;
//! - `cpu_scalar`: the CPU backend's scalar kernels against its best ISA.
//!
//! An integration test: it drives the backends through the engine's public API only, so the
//! runtime layer's own tests never reach up to the model or the execution layer.

#![cfg(feature = "cuda")]

mod cpu_scalar;
mod emu;
mod gpu;
mod suite;
