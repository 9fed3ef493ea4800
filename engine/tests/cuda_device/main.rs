//! The CUDA device suite: every kernel of the CUDA backend against its CPU twin (the
//! `CpuBackend` op of the same name) on random data — every weight type, odd shapes and tails,
//! attention masks, sampling — and the real model against the CPU backend, on two devices:
//!
//! - `gpu`: a real GPU, device 0 (the `gpu` nextest profile only; each test fails without one);
//! - `emu`: the CUDA emulator (`kernels/cuda/emu`), on every machine with g++ and the NVRTC
//!   wheel.
//!
//! An integration test: it drives the backend through the engine's public API only, so the
//! runtime layer's own tests never reach up to the model or the execution layer.

#![cfg(feature = "cuda")]

mod emu;
mod gpu;
mod suite;
