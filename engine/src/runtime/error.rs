//! Errors of the runtime (backends and sessions).

use kernels::cpu::KernelError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error("matmul {name}: {source}")]
    Kernel {
        name: String,
        #[source]
        source: KernelError,
    },

    #[error("backend: {0}")]
    Backend(#[source] KernelError),

    #[error("{op}: expected {expected} values, found {found}")]
    Shape {
        op: &'static str,
        expected: usize,
        found: usize,
    },

    #[error("building the thread pool: {0}")]
    ThreadPool(String),

    #[error("forward: expected at least one token, found none")]
    NoTokens,

    #[error("token {token} at index {index}: expected an id < n_vocab ({n_vocab})")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        n_vocab: usize,
    },

    #[error("context: {n_past} cached + {n_new} new tokens exceed the session's {n_ctx}")]
    ContextFull {
        n_past: usize,
        n_new: usize,
        n_ctx: usize,
    },

    #[error("dequantizing {name}: {source}")]
    Dequantize {
        name: String,
        #[source]
        source: kernels::quant::QuantError,
    },

    #[error("batch token {index}: {reason}")]
    BadBatch { index: usize, reason: String },

    #[error("forward: the cache holds {n} pending cells of the last forward; commit, compact or roll back first")]
    PendingCells { n: usize },

    #[error(
        "compact: index {index} is not a distinct pending token (the last forward had {n_pending})"
    )]
    BadCompact { index: usize, n_pending: usize },

    /// An error of a layer above the runtime (the model's weights, a tokenizer) met while
    /// running ops. The runtime knows nothing of those layers; each converts its own errors into
    /// this variant (the `From` impls live beside them), so errors wrap upward.
    #[error(transparent)]
    Layer(Box<dyn std::error::Error + Send + Sync>),

    #[error("{backend}: {op} is not implemented by this backend")]
    Unsupported { backend: String, op: &'static str },

    #[error("tensor-parallel rank {rank}: {source}")]
    Comm {
        rank: usize,
        /// The communicator's error (`crate::tp::CommError`).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] super::cuda::CudaError),
}

/// Check that a buffer has the length an operation expects.
#[inline]
pub(crate) fn check_len(
    op: &'static str,
    expected: usize,
    found: usize,
) -> Result<(), RuntimeError> {
    if expected != found {
        return Err(RuntimeError::Shape {
            op,
            expected,
            found,
        });
    }
    Ok(())
}
