//! Tensor parallelism: the shard plan, the communicators and the ranks.
//!
//! - [`plan`]: a pure function from the model's configuration, its tensor table and the degree
//!   to each tensor's placement (column-, row-parallel, replicated, expert-parallel) with the
//!   byte ranges every rank holds, never cutting a quantized block.
//! - [`comm`]: the [`Communicator`] trait (all-reduce sum, all-gather, barrier) and its `shm`
//!   implementation (ranks as threads); where the CUDA ones go.
//! - [`runner`]: [`TpModel`] (every rank's shard views), [`TpEngine`] (prepared on one backend
//!   per rank; the ordinary forward pass per rank, meeting at the all-reduces); `crate::exec` drives it as a `BatchEngine`.
//!   Taps are gathered to full shape before the observer sees them.
//!
//! Why TP = N equals TP = 1 up to summation order: every column split lands on a block of the
//! weight *and* of its activations' quantization type ([`crate::model::shard_block`]), so each
//! rank quantizes exactly the activation blocks TP 1 quantizes, and each partial dot product is
//! a contiguous run of TP 1's blocks. Norms, residuals and post-norms act on the all-reduced,
//! full vector only (the reduction comes before any post-norm), so the only difference is
//! where the f32 partial sums are added.
//!
//! Start reading at [`plan::ShardPlan::new`], then [`TpEngine::forward`].

pub mod comm;
pub mod cost;
pub mod plan;
pub mod runner;

pub use crate::model::forward::ReducePoint;
pub use comm::{CommError, CommKind, CommStats, Communicator, ShmComm, ShmGroup};
pub use plan::{
    Decision, Decisions, MoeMode, Placement, PlanError, RankPart, ShardPlan, TensorDesc, TensorPlan,
};
pub use runner::{TpCache, TpEngine, TpError, TpModel};
