//! Weight handles and the loader that checks every tensor against the configuration.
//!
//! Weights stay in the GGUF map as quantized bytes; a [`Weight`] remembers where. Only small
//! vectors (norm weights, biases, the expert bias) are dequantized into memory at load.
//!
//! A weight may be a *shard view* ([`Weight::shard`]): a range of rows and a range of columns
//! of each matrix, cut on block boundaries, so tensor parallelism can prepare only its part.
//! [`Weight::bytes`] cuts the view's bytes out of the tensor (borrowed when they are one
//! contiguous range, gathered otherwise).

use std::borrow::Cow;
use std::ops::Range;

use kernels::quant::{dequantize, GgmlType};
use thiserror::Error;

use crate::faults::{self, Fault};
use crate::gguf::{Gguf, TensorInfo};

use super::ModelError;

/// Which part of each matrix of a tensor a [`Weight`] is: rows and columns in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardView {
    pub rows: Range<usize>,
    pub cols: Range<usize>,
}

/// A shard view that cannot be cut.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ShardError {
    #[error("shard of {tensor} ({ty}): column offset {offset} cuts a block of {block} values")]
    CutsBlock {
        tensor: String,
        ty: GgmlType,
        offset: usize,
        block: usize,
    },
    #[error("shard of {tensor}: {axis} {start}..{end} is empty or outside 0..{len}")]
    OutOfRange {
        tensor: String,
        axis: &'static str,
        start: usize,
        end: usize,
        len: usize,
    },
}

/// The column granularity of a shard of a `ty` matrix: a column range must start and end on a
/// multiple of this (the weight's block, or the block its activations are quantized to, a
/// K-quant's 256, whichever is larger) or it cuts a block ([`Weight::shard`]).
pub fn shard_block(ty: GgmlType) -> usize {
    ty.block_size().max(
        kernels::cpu::vec_dot_type(ty)
            .map(|t| t.block_size())
            .unwrap_or(1),
    )
}

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
    /// Bytes of one row (of the view, for a shard).
    pub row_bytes: usize,
    /// The part of the tensor this weight is; `None` for the whole tensor. `k_dim` and
    /// `n_rows` are the view's.
    pub view: Option<ShardView>,
}

impl Weight {
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// Bytes of one matrix (one expert's, for a stack).
    pub fn mat_bytes(&self) -> usize {
        self.row_bytes * self.n_rows
    }

    /// The whole tensor's `(k_dim, n_rows)`.
    fn full_dims(&self) -> (usize, usize) {
        let d = |i: usize| {
            self.info
                .dims
                .get(i)
                .and_then(|&v| usize::try_from(v).ok())
                .unwrap_or(1)
        };
        (d(0), d(1))
    }

    /// A view of rows `rows` and columns `cols` of every matrix of this (whole) tensor.
    /// Columns must start and end on a block boundary of the weight type and of the type its
    /// activations are quantized to (a K-quant's 256), or the view would cut a block.
    pub fn shard(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Weight, ShardError> {
        let (full_k, full_rows) = self.full_dims();
        let tensor = self.info.name.clone();
        let check = |axis, r: &Range<usize>, len| {
            if r.start >= r.end || r.end > len {
                return Err(ShardError::OutOfRange {
                    tensor: tensor.clone(),
                    axis,
                    start: r.start,
                    end: r.end,
                    len,
                });
            }
            Ok(())
        };
        check("rows", &rows, full_rows)?;
        check("columns", &cols, full_k)?;
        let block = shard_block(self.ty);
        for offset in [cols.start, cols.end] {
            if offset % block != 0 && offset != full_k {
                return Err(ShardError::CutsBlock {
                    tensor: tensor.clone(),
                    ty: self.ty,
                    offset,
                    block,
                });
            }
        }
        let k_dim = cols.len();
        Ok(Weight {
            k_dim,
            n_rows: rows.len(),
            row_bytes: k_dim / self.ty.block_size() * self.ty.type_size(),
            view: Some(ShardView { rows, cols }),
            ..self.clone()
        })
    }

    /// This weight's bytes out of its tensor's `data` (all matrices, contiguous), as a
    /// backend's `prepare` takes them for a matrix product. Loader faults
    /// (`permuted-experts`, `wrong-dequant-scale`) act here, as a loader bug would.
    pub fn bytes<'a>(&self, data: &'a [u8]) -> Cow<'a, [u8]> {
        let mut out = self.view_bytes(data);
        if self.n_mats > 1 && faults::is_active(Fault::PermutedExperts) {
            // A loader that laid out the 3-D expert tensor in the wrong order.
            let size = self.mat_bytes();
            let mut o = out.into_owned();
            if size > 0 && o.len() == size * self.n_mats {
                o.rotate_left(size);
            }
            out = Cow::Owned(o);
        }
        if self.info.name.ends_with(".indexer.attn_q_b.weight")
            && faults::is_active(Fault::IndexerWeightsShardOrder)
        {
            // The indexer's query heads loaded half-swapped (whole rows: `n_rows` is the heads
            // times their width, an even number of heads in every glm-dsa file).
            let half = self.n_rows / 2 * self.row_bytes;
            let mut o = out.into_owned();
            if half > 0 && o.len() == 2 * half {
                o.rotate_left(half);
            }
            out = Cow::Owned(o);
        }
        if self.ty == GgmlType::Q4K && faults::is_active(Fault::WrongDequantScale) {
            out = Cow::Owned(q4k_with_wrong_scale(&out));
        }
        out
    }

    /// [`Weight::bytes`] without the loader faults (the embedding table's gather path, which
    /// dequantizes with its own code).
    pub fn view_bytes<'a>(&self, data: &'a [u8]) -> Cow<'a, [u8]> {
        let Some(v) = &self.view else {
            return Cow::Borrowed(data);
        };
        let (full_k, full_rows) = self.full_dims();
        let bs = self.ty.block_size();
        let ts = self.ty.type_size();
        let full_row = full_k / bs * ts;
        let full_mat = full_row * full_rows;
        let c0 = v.cols.start / bs * ts;
        if self.n_mats == 1 && v.cols.len() == full_k {
            let r = v.rows.start * full_row..v.rows.end * full_row;
            return Cow::Borrowed(data.get(r).unwrap_or(&[]));
        }
        let mut o = Vec::with_capacity(self.n_mats * self.mat_bytes());
        for m in 0..self.n_mats {
            for r in v.rows.clone() {
                let at = m * full_mat + r * full_row + c0;
                o.extend_from_slice(data.get(at..at + self.row_bytes).unwrap_or(&[]));
            }
        }
        Cow::Owned(o)
    }
}

/// The `wrong-dequant-scale` fault: a copy of Q4_K blocks whose super-block scale `d` (the
/// block's first two bytes, an f16) reads as `d × 1.0625`, as a dequantizer that misread the
/// scale would. Only called while that fault is active.
fn q4k_with_wrong_scale(data: &[u8]) -> Vec<u8> {
    const BLOCK_BYTES: usize = 144; // size_of::<BlockQ4K>()
    let mut copy = data.to_vec();
    for block in copy.chunks_exact_mut(BLOCK_BYTES) {
        let d = half::f16::from_le_bytes([block[0], block[1]]);
        let wrong = half::f16::from_f32(d.to_f32() * 1.0625);
        block[..2].copy_from_slice(&wrong.to_le_bytes());
    }
    copy
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
            view: None,
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
