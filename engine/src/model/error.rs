//! Errors of model loading.

use kernels::quant::{GgmlType, QuantError};
use thiserror::Error;

use crate::gguf::GgufError;
use crate::runtime::RuntimeError;

/// Why a GGUF file could not be turned into a model. Every variant names the key or tensor.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),

    #[error("general.architecture: expected one of llama, qwen2, mistral, gemma3, deepseek2, glm-dsa, found {found:?}")]
    UnsupportedArchitecture { found: String },

    #[error("metadata {key}: expected {expected}, found {found}")]
    InvalidConfig {
        key: String,
        expected: String,
        found: String,
    },

    #[error("tensor {name}: expected it in the file, found nothing")]
    MissingTensor { name: String },

    #[error("tensor {name}: expected dims {expected:?} (ne0 first), found {found:?}")]
    Shape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },

    #[error("tensor {name}: expected a weight type the CPU matrix product supports, found {ty}")]
    UnsupportedType { name: String, ty: GgmlType },

    #[error("tensor {name}: expected {expected} bytes of {ty} data, found {found}")]
    DataLen {
        name: String,
        ty: GgmlType,
        expected: u64,
        found: u64,
    },

    #[error("tensor {name}: dequantizing: {source}")]
    Dequantize {
        name: String,
        #[source]
        source: QuantError,
    },
}

impl ModelError {
    pub(crate) fn invalid(
        key: impl Into<String>,
        expected: impl Into<String>,
        found: impl ToString,
    ) -> Self {
        ModelError::InvalidConfig {
            key: key.into(),
            expected: expected.into(),
            found: found.to_string(),
        }
    }
}

/// A model error met while running ops (a weight that cannot be prepared or read) travels
/// through the runtime as [`RuntimeError::Layer`]: the runtime never names the model's types.
impl From<ModelError> for RuntimeError {
    fn from(e: ModelError) -> RuntimeError {
        RuntimeError::Layer(Box::new(e))
    }
}
