//! The one error type of the reference.

use std::path::PathBuf;

/// Everything that can go wrong loading a model or running the reference forward pass.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("{path}: malformed GGUF: {message}")]
    Gguf { path: PathBuf, message: String },

    #[error("metadata key `{key}` is missing")]
    MissingKey { key: String },

    #[error("metadata key `{key}`: expected {expected}, found {found}")]
    BadKey {
        key: String,
        expected: &'static str,
        found: String,
    },

    #[error("tensor `{name}` is missing")]
    MissingTensor { name: String },

    #[error("tensor `{name}`: expected shape {expected:?} (row-major, outermost first), found {found:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    #[error("tensor `{name}`: {message}")]
    TensorData { name: String, message: String },

    #[error("tensor `{name}` has GGML type id {type_id}, which the reference cannot dequantize")]
    UnsupportedType { name: String, type_id: u32 },

    #[error("architecture `{0}` is not supported by the reference (expected llama, gemma3 or deepseek2)")]
    UnsupportedArchitecture(String),

    #[error("unsupported model configuration: {0}")]
    Unsupported(String),

    #[error("the token sequence is empty")]
    EmptyInput,

    #[error(
        "token id {token} at position {position} is outside the vocabulary of {vocab_size} tokens"
    )]
    TokenOutOfRange {
        token: u32,
        position: usize,
        vocab_size: usize,
    },

    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}
