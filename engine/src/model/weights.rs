//! Weight handles and the loader that checks every tensor against the configuration.
//!
//! Weights stay in the GGUF map as quantized bytes; a [`Weight`] remembers where. Only small
//! vectors (norm weights, biases, the expert bias) are dequantized into memory at load.

use kernels::quant::{dequantize, GgmlType};

use crate::gguf::{Gguf, TensorInfo};

use super::ModelError;

/// One weight matrix (or stack of expert matrices) in the file.
///
/// Dims are ggml's: `dims[0]` (the reduction dimension, `k_dim`) is contiguous, `dims[1]` is the
/// number of output rows, `dims[2]` (experts) if present counts whole matrices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Weight {
    pub info: TensorInfo,
    pub ty: GgmlType,
    pub k_dim: usize,
    pub n_rows: usize,
    /// 1 for a plain matrix.
    pub n_mats: usize,
    /// Bytes of one row.
    pub row_bytes: usize,
}

impl Weight {
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// Bytes of one matrix (one expert's, for a stack).
    pub fn mat_bytes(&self) -> usize {
        self.row_bytes * self.n_rows
    }
}

/// Reads tensors from a [`Gguf`], checking names, shapes, types and byte lengths.
pub(crate) struct Loader<'a> {
    pub gguf: &'a Gguf,
}

fn to_usize(name: &str, dims: &[u64]) -> Result<Vec<usize>, ModelError> {
    dims.iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| ModelError::Shape {
                name: name.to_owned(),
                expected: vec![],
                found: dims.to_vec(),
            })
        })
        .collect()
}

impl<'a> Loader<'a> {
    fn info(&self, name: &str) -> Result<&'a TensorInfo, ModelError> {
        self.gguf
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_owned(),
            })
    }

    fn check_dims(info: &TensorInfo, expected: &[usize]) -> Result<(), ModelError> {
        let exp: Vec<u64> = expected.iter().map(|&d| d as u64).collect();
        if info.dims != exp {
            return Err(ModelError::Shape {
                name: info.name.clone(),
                expected: exp,
                found: info.dims.clone(),
            });
        }
        Ok(())
    }

    fn check_bytes(&self, info: &TensorInfo) -> Result<(), ModelError> {
        let expected =
            info.ggml_type
                .bytes_for(info.n_elements())
                .ok_or(ModelError::UnsupportedType {
                    name: info.name.clone(),
                    ty: info.ggml_type,
                })?;
        let found = self.gguf.tensor_data(info).len() as u64;
        if found != expected || info.n_bytes != expected {
            return Err(ModelError::DataLen {
                name: info.name.clone(),
                ty: info.ggml_type,
                expected,
                found,
            });
        }
        Ok(())
    }

    fn weight_from(&self, info: &TensorInfo, expected: &[usize]) -> Result<Weight, ModelError> {
        Self::check_dims(info, expected)?;
        let ty = info.ggml_type;
        if !ty.is_supported() || kernels::cpu::vec_dot_type(ty).is_none() {
            return Err(ModelError::UnsupportedType {
                name: info.name.clone(),
                ty,
            });
        }
        let dims = to_usize(&info.name, &info.dims)?;
        let k_dim = dims[0];
        if k_dim % ty.block_size() != 0 {
            return Err(ModelError::Shape {
                name: info.name.clone(),
                expected: vec![(k_dim.div_ceil(ty.block_size()) * ty.block_size()) as u64],
                found: info.dims.clone(),
            });
        }
        self.check_bytes(info)?;
        Ok(Weight {
            info: info.clone(),
            ty,
            k_dim,
            n_rows: dims.get(1).copied().unwrap_or(1),
            n_mats: dims.get(2).copied().unwrap_or(1),
            row_bytes: k_dim / ty.block_size() * ty.type_size(),
        })
    }

    /// A matrix `[k_dim, n_rows]`.
    pub fn matrix(&self, name: &str, k_dim: usize, n_rows: usize) -> Result<Weight, ModelError> {
        self.weight_from(self.info(name)?, &[k_dim, n_rows])
    }

    pub fn matrix_opt(
        &self,
        name: &str,
        k_dim: usize,
        n_rows: usize,
    ) -> Result<Option<Weight>, ModelError> {
        match self.gguf.tensor(name) {
            None => Ok(None),
            Some(info) => self.weight_from(info, &[k_dim, n_rows]).map(Some),
        }
    }

    /// A stack of `n_mats` matrices `[k_dim, n_rows, n_mats]` (MoE experts).
    pub fn experts(
        &self,
        name: &str,
        k_dim: usize,
        n_rows: usize,
        n_mats: usize,
    ) -> Result<Weight, ModelError> {
        self.weight_from(self.info(name)?, &[k_dim, n_rows, n_mats])
    }

    /// A small vector `[n]`, dequantized.
    pub fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let info = self.info(name)?;
        Self::check_dims(info, &[n])?;
        self.check_bytes(info)?;
        let mut out = vec![0f32; n];
        dequantize(info.ggml_type, self.gguf.tensor_data(info), &mut out).map_err(|source| {
            ModelError::Dequantize {
                name: name.to_owned(),
                source,
            }
        })?;
        Ok(out)
    }

    pub fn vector_opt(&self, name: &str, n: usize) -> Result<Option<Vec<f32>>, ModelError> {
        if self.gguf.tensor(name).is_none() {
            return Ok(None);
        }
        self.vector(name, n).map(Some)
    }
}
