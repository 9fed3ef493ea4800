//! The execution layer: a model prepared on a device and topology, and everything that drives
//! it — sessions, ragged batches, tree speculation (`crate::spec`), the verify cases and the
//! server's scheduler all go through [`BatchEngine`].
//!
//! - [`open`]: the one constructor. A [`Device`] (`cpu` with ISA and threads, `cuda:N`, the
//!   emulated `cuda-emu`) and a [`Topology`] (tensor-parallel degree, communicator) in; an
//!   [`AnyEngine`] out.
//! - [`Engine`]: a model whose weights were prepared once on one backend; [`Engine::forward`]
//!   runs a [`crate::runtime::Batch`] against a [`crate::runtime::KvCache`].
//! - [`BatchEngine`]: what every caller needs of an engine, whole ([`Engine`]), tensor-parallel
//!   ([`crate::tp::TpEngine`]) or either on any device ([`AnyEngine`]).
//! - [`Session`]: one sequence with its own cache, on any [`BatchEngine`].
//!
//! Architecture invariant: this layer sits above `runtime`, `model` and `tp` and may use them
//! all; none of them may use it (`engine/tests/layering.rs`).

mod any;
mod batch_engine;
mod device;
mod engine;
mod session;

#[cfg(feature = "cuda")]
pub use any::cuda::search as cuda_search;
pub use any::{open, AnyCache, AnyEngine, AnyHidden, OpenError};
pub use batch_engine::{BatchEngine, TpHidden};
pub use device::{Comm, Device, DeviceParseError, Topology};
pub use engine::{Engine, Hidden};
pub use session::Session;
