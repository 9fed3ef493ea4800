//! The three architectures, one module each, sharing the loader and [`crate::ops`].

pub(crate) mod deepseek2;
pub(crate) mod gemma3;
pub(crate) mod llama;

use candle_core::{DType, Tensor};

use crate::error::ReferenceError;
use crate::gguf::GgufFile;
use crate::numerics::ActQuant;
use crate::ops::{Result, Weight};

/// Reads weights from a [`GgufFile`], checking each shape and converting to the compute dtype.
pub(crate) struct Loader<'a> {
    pub file: &'a mut GgufFile,
    pub dtype: DType,
    /// The metadata key prefix, `general.architecture` followed by a dot.
    pub prefix: String,
    /// Exact-numerics mode: matrix-product weights round their activations as ggml does.
    pub exact: bool,
}

impl Loader<'_> {
    /// A tensor with the given shape (outermost first, i.e. `[out, in]` for a matrix).
    pub fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.file.tensor(name, shape, self.dtype)
    }

    /// A matrix-product weight; in exact-numerics mode it carries its type's activation rounding.
    pub fn weight(&mut self, name: &str, shape: &[usize]) -> Result<Weight> {
        let w = self.tensor(name, shape)?;
        let act = if self.exact {
            self.file.act_quant(name).unwrap_or(ActQuant::None)
        } else {
            ActQuant::None
        };
        Ok(Weight { w, act })
    }

    /// A tensor that may be absent.
    pub fn optional(&mut self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.file.has_tensor(name) {
            self.tensor(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// `{arch}.{key}` as an integer.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.file.get_usize(&format!("{}{key}", self.prefix))
    }

    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        self.file
            .get_usize_or(&format!("{}{key}", self.prefix), default)
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        self.file.get_f64(&format!("{}{key}", self.prefix))
    }

    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        self.file.get_f64_opt(&format!("{}{key}", self.prefix))
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        self.file
            .get_bool_or(&format!("{}{key}", self.prefix), default)
    }

    /// The linear RoPE position scale: `1 / rope.scaling.factor` for `linear` scaling, 1 without
    /// scaling. Other scaling types (YaRN, LongRoPE) are refused rather than approximated.
    pub fn rope_freq_scale(&self) -> Result<f64> {
        let type_key = format!("{}rope.scaling.type", self.prefix);
        let kind = match self.file.metadata(&type_key) {
            None => "none",
            Some(_) => self.file.get_string(&type_key)?,
        };
        match kind {
            "none" => Ok(1.0),
            "linear" => {
                let factor = self.f64("rope.scaling.factor")?;
                if factor > 0.0 {
                    Ok(1.0 / factor)
                } else {
                    Err(ReferenceError::BadKey {
                        key: format!("{}rope.scaling.factor", self.prefix),
                        expected: "a positive number",
                        found: factor.to_string(),
                    })
                }
            }
            other => Err(ReferenceError::Unsupported(format!(
                "RoPE scaling `{other}` (the reference implements none and linear)"
            ))),
        }
    }

    /// Refuse files that carry per-dimension RoPE frequency factors (`rope_freqs.weight`, Llama
    /// 3.1 style), which this reference does not apply.
    pub fn refuse_rope_freqs(&self) -> Result<()> {
        if self.file.has_tensor("rope_freqs.weight") {
            return Err(ReferenceError::Unsupported(
                "per-dimension RoPE frequency factors (rope_freqs.weight)".to_string(),
            ));
        }
        Ok(())
    }
}

/// The token embedding `[n_vocab, n_embd]` and the output head (`output.weight`, or the
/// embedding itself when the file ties them).
pub(crate) fn embedding_and_head(ld: &mut Loader<'_>, n_embd: usize) -> Result<(Tensor, Weight)> {
    let n_vocab = match ld.file.tensor_shape("token_embd.weight") {
        Some(shape) if shape.len() == 2 => shape[0],
        Some(shape) => {
            return Err(ReferenceError::TensorShape {
                name: "token_embd.weight".to_string(),
                expected: vec![0, n_embd],
                found: shape,
            })
        }
        None => {
            return Err(ReferenceError::MissingTensor {
                name: "token_embd.weight".to_string(),
            })
        }
    };
    let embd = ld.weight("token_embd.weight", &[n_vocab, n_embd])?;
    let head = if ld.file.has_tensor("output.weight") {
        ld.weight("output.weight", &[n_vocab, n_embd])?
    } else {
        embd.clone()
    };
    Ok((embd.w, head))
}

/// Look up embedding rows for `tokens`.
pub(crate) fn embed(embd: &Tensor, tokens: &[u32]) -> Result<Tensor> {
    let ids = Tensor::new(tokens, embd.device())?;
    Ok(embd.index_select(&ids, 0)?)
}
