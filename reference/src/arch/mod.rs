//! The architectures, one module each (`glm-dsa` extends `deepseek2`), sharing the loader and [`crate::ops`].
//!
//! Each architecture reads its configuration once, then its weights layer by layer through one
//! function (`load_layer`). [`Layers`] and [`Vocab`] decide when that happens: all at load time
//! ([`crate::Residency::Eager`]), or when the forward pass reaches the layer, dropping it after
//! ([`crate::Residency::Streaming`]). Both run the same reads, the same dequantization and the same
//! products in the same order, so their results are the same bits.

pub(crate) mod deepseek2;
pub(crate) mod gemma3;
pub(crate) mod glm_dsa;
pub(crate) mod llama;

use std::ops::Deref;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

use crate::error::ReferenceError;
use crate::gguf::GgufFile;
use crate::numerics::{ActQuant, CacheDtype};
use crate::ops::{Result, Weight};

/// A dense layer's keys `[n, n_head_kv, dk]` and values `[n, n_head_kv, dv]` as attention reads
/// them back from a cache holding `cache` (each token's K row after RoPE and its V row are what
/// the engine writes, [`CacheDtype`]). With an f16 cache the rounded rows are also the tap
/// `blk.{layer}.kv_cache`, `[n, n_head_kv·(dk + dv)]`: each token's K row, then its V row.
pub(crate) fn cached_kv(
    cache: CacheDtype,
    k: &Tensor,
    v: &Tensor,
    layer: usize,
    taps: crate::ops::Taps<'_>,
) -> Result<(Tensor, Tensor)> {
    if cache == CacheDtype::F32 {
        return Ok((k.clone(), v.clone()));
    }
    let (k, v) = (cache.apply(k)?, cache.apply(v)?);
    let n = k.dim(0)?;
    let row = Tensor::cat(&[&k.reshape((n, ()))?, &v.reshape((n, ()))?], 1)?;
    crate::ops::tap(taps, &format!("blk.{layer}.kv_cache"), &row)?;
    Ok((k, v))
}

/// Reads weights from a [`GgufFile`], checking each shape and converting to the compute dtype.
pub(crate) struct Loader<'a> {
    pub file: &'a mut GgufFile,
    pub dtype: DType,
    /// The metadata key prefix, `general.architecture` followed by a dot.
    pub prefix: String,
    /// Exact-numerics mode: matrix-product weights round their activations as ggml does.
    pub exact: bool,
    /// Only check that each tensor is present, has its shape and lies inside its file; hand out
    /// empty placeholders instead of reading (a streaming model's up-front check).
    pub check_only: bool,
}

/// The open file of a streaming model and how to read from it; shared by [`Layers`] and
/// [`Vocab`].
pub(crate) struct Streamer {
    file: Mutex<GgufFile>,
    dtype: DType,
    prefix: String,
    exact: bool,
}

impl Streamer {
    pub fn new(file: GgufFile, dtype: DType, prefix: String, exact: bool) -> Streamer {
        Streamer {
            file: Mutex::new(file),
            dtype,
            prefix,
            exact,
        }
    }

    /// Run `f` with a loader that reads from the file.
    pub fn with<T>(
        &self,
        check_only: bool,
        f: impl FnOnce(&mut Loader<'_>) -> Result<T>,
    ) -> Result<T> {
        // A poisoned lock only means another forward pass panicked; the file itself is fine.
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let mut ld = Loader {
            file: &mut file,
            dtype: self.dtype,
            prefix: self.prefix.clone(),
            exact: self.exact,
            check_only,
        };
        f(&mut ld)
    }
}

/// A model's layers: all in memory, or read from the file when the forward pass reaches them.
pub(crate) enum Layers<L> {
    Eager(Vec<L>),
    Streaming { n: usize, src: Arc<Streamer> },
}

/// A layer borrowed from memory or read for this pass (dropped when the pass leaves it).
pub(crate) enum LayerRef<'a, L> {
    Borrowed(&'a L),
    Owned(L),
}

impl<L> Deref for LayerRef<'_, L> {
    type Target = L;
    fn deref(&self) -> &L {
        match self {
            LayerRef::Borrowed(l) => l,
            LayerRef::Owned(l) => l,
        }
    }
}

impl<L> Layers<L> {
    /// `n` layers through `load`: read now (eager, `src` is `None`), or only checked now and read
    /// by [`Layers::get`] (streaming; `ld` is then a checking loader).
    pub fn load(
        ld: &mut Loader<'_>,
        n: usize,
        src: Option<&Arc<Streamer>>,
        mut load: impl FnMut(&mut Loader<'_>, usize) -> Result<L>,
    ) -> Result<Layers<L>> {
        let mut layers = Vec::with_capacity(if src.is_some() { 0 } else { n });
        for i in 0..n {
            let layer = load(ld, i)?;
            if src.is_none() {
                layers.push(layer);
            }
        }
        Ok(match src {
            None => Layers::Eager(layers),
            Some(src) => Layers::Streaming {
                n,
                src: Arc::clone(src),
            },
        })
    }

    pub fn len(&self) -> usize {
        match self {
            Layers::Eager(v) => v.len(),
            Layers::Streaming { n, .. } => *n,
        }
    }

    /// Layer `i`: borrowed, or read from the file now through `load` (the same function that
    /// read it in eager mode).
    pub fn get(
        &self,
        i: usize,
        load: impl FnOnce(&mut Loader<'_>, usize) -> Result<L>,
    ) -> Result<LayerRef<'_, L>> {
        match self {
            Layers::Eager(v) => v
                .get(i)
                .map(LayerRef::Borrowed)
                .ok_or_else(|| ReferenceError::Unsupported(format!("layer {i} of {}", v.len()))),
            Layers::Streaming { src, .. } => src.with(false, |ld| load(ld, i)).map(LayerRef::Owned),
        }
    }
}

impl Loader<'_> {
    /// A tensor with the given shape (outermost first, i.e. `[out, in]` for a matrix).
    pub fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if self.check_only {
            self.file.check(name, shape)?;
            return Ok(Tensor::zeros(0, self.dtype, &Device::Cpu)?);
        }
        self.file.tensor(name, shape, self.dtype)
    }

    /// A tensor read now even by a checking loader: the small tensors outside the layers
    /// (`output_norm.weight`) that a streaming model keeps.
    pub fn resident(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.file.tensor(name, shape, self.dtype)
    }

    /// A matrix-product weight; in exact-numerics mode it carries its type's activation rounding.
    pub fn weight(&mut self, name: &str, shape: &[usize]) -> Result<Weight> {
        let w = self.tensor(name, shape)?;
        Ok(Weight {
            w,
            act: self.act_quant(name),
        })
    }

    /// How a product with weight `name` rounds its activations ([`ActQuant::None`] unless in
    /// exact-numerics mode).
    pub fn act_quant(&self, name: &str) -> ActQuant {
        if self.exact {
            self.file.act_quant(name).unwrap_or(ActQuant::None)
        } else {
            ActQuant::None
        }
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

/// The routed experts of one layer, a `[n_expert, rows, cols]` tensor. Eager: dequantized with
/// the layer. Streaming: only the experts some token was routed to are read, one at a time when
/// the MoE block gets to them, so a layer of hundreds of experts never sits whole in memory.
pub(crate) enum Experts {
    Loaded(Weight),
    Streamed {
        name: String,
        shape: Vec<usize>,
        act: ActQuant,
        src: Arc<Streamer>,
    },
}

impl Experts {
    /// Expert tensor `name` of `shape`: read now (eager, `src` is `None`), or checked now and
    /// read expert by expert by [`Experts::get`].
    pub fn load(
        ld: &mut Loader<'_>,
        name: &str,
        shape: &[usize],
        src: Option<&Arc<Streamer>>,
    ) -> Result<Experts> {
        match src {
            None => Ok(Experts::Loaded(ld.weight(name, shape)?)),
            Some(src) => {
                ld.file.check(name, shape)?;
                Ok(Experts::Streamed {
                    name: name.to_string(),
                    shape: shape.to_vec(),
                    act: ld.act_quant(name),
                    src: Arc::clone(src),
                })
            }
        }
    }

    /// Expert `e`'s `[rows, cols]` matrix: the same values and layout either way.
    pub fn get(&self, e: usize) -> Result<Weight> {
        match self {
            Experts::Loaded(w) => w.get(e),
            Experts::Streamed {
                name,
                shape,
                act,
                src,
            } => {
                let w = src.with(false, |ld| {
                    ld.file.tensor_outer(name, shape, e..e + 1, ld.dtype)
                })?;
                Ok(Weight {
                    w: w.get(0)?,
                    act: *act,
                })
            }
        }
    }
}

/// Bytes of f32 output head dequantized per matrix product. The head is applied in row chunks
/// of this size in both residencies (so that a streaming model never holds the whole f32 head,
/// and both compute the same products): 16 MiB is a layer's order of magnitude on small models and
/// well under one on large ones.
const HEAD_CHUNK_BYTES: usize = 16 << 20;

/// A `[rows, cols]` matrix read in row ranges: in memory, or from the file.
enum Rows {
    Loaded(Weight),
    Streamed { name: String, act: ActQuant },
}

/// The token embedding and the output head. Eager: both dequantized at load. Streaming: the
/// embedding rows of the tokens are read when they are looked up, the head one chunk of rows at a
/// time.
pub(crate) struct Vocab {
    n_vocab: usize,
    n_embd: usize,
    embd: Rows,
    /// `None`: tied to the embedding (`output.weight` absent).
    head: Option<Rows>,
    src: Option<Arc<Streamer>>,
    /// Head rows per product; see [`HEAD_CHUNK_BYTES`].
    chunk_rows: usize,
}

impl Vocab {
    /// The embedding `token_embd.weight` `[n_vocab, n_embd]` and the head (`output.weight`, or the
    /// embedding itself when the file ties them).
    pub fn load(ld: &mut Loader<'_>, n_embd: usize, src: Option<&Arc<Streamer>>) -> Result<Vocab> {
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
        let tied = !ld.file.has_tensor("output.weight");
        let mut rows = |name: &str| -> Result<Rows> {
            let w = ld.weight(name, &[n_vocab, n_embd])?;
            Ok(if src.is_some() {
                Rows::Streamed {
                    name: name.to_string(),
                    act: w.act,
                }
            } else {
                Rows::Loaded(w)
            })
        };
        let embd = rows("token_embd.weight")?;
        let head = if tied {
            None
        } else {
            Some(rows("output.weight")?)
        };
        Ok(Vocab {
            n_vocab,
            n_embd,
            embd,
            head,
            src: src.cloned(),
            chunk_rows: (HEAD_CHUNK_BYTES / 4 / n_embd.max(1)).max(1),
        })
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    pub fn n_embd(&self) -> usize {
        self.n_embd
    }

    /// Head rows per matrix product (tests set small values to exercise the chunking).
    pub fn set_chunk_rows(&mut self, rows: usize) {
        self.chunk_rows = rows.max(1);
    }

    /// Rows `range` of a matrix, from memory or from the file.
    fn rows(&self, m: &Rows, range: std::ops::Range<usize>) -> Result<Weight> {
        match (m, &self.src) {
            (Rows::Loaded(w), _) => Ok(Weight {
                w: w.w.narrow(0, range.start, range.len())?,
                act: w.act,
            }),
            (Rows::Streamed { name, act }, Some(src)) => {
                let shape = [self.n_vocab, self.n_embd];
                let w = src.with(false, |ld| {
                    ld.file.tensor_outer(name, &shape, range, ld.dtype)
                })?;
                Ok(Weight { w, act: *act })
            }
            (Rows::Streamed { name, .. }, None) => Err(ReferenceError::Unsupported(format!(
                "`{name}` is streamed but the model has no open file"
            ))),
        }
    }

    /// Embedding rows for `tokens`, `[n, n_embd]`.
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        match &self.embd {
            Rows::Loaded(w) => {
                let ids = Tensor::new(tokens, w.w.device())?;
                Ok(w.w.index_select(&ids, 0)?)
            }
            Rows::Streamed { .. } => {
                let rows = tokens
                    .iter()
                    .map(|&t| {
                        let t = t as usize;
                        self.rows(&self.embd, t..t + 1).map(|w| w.w)
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::cat(&rows, 0)?)
            }
        }
    }

    /// `x · headᵀ` for `x: [n, n_embd]`, one chunk of head rows per product, `x` rounded once as
    /// the head's dot product reads it.
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        self.logits_with(x, Ok)
    }

    /// [`Vocab::logits`] with an elementwise `post` (soft-capping) applied to each chunk, so that
    /// its temporaries are one chunk's size, not the whole `[n, n_vocab]`.
    pub fn logits_with(
        &self,
        x: &Tensor,
        post: impl Fn(Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let head = self.head.as_ref().unwrap_or(&self.embd);
        let act = match head {
            Rows::Loaded(w) => w.act,
            Rows::Streamed { act, .. } => *act,
        };
        let xa = act.apply(x)?;
        let mut parts = Vec::with_capacity(self.n_vocab.div_ceil(self.chunk_rows));
        let mut start = 0;
        while start < self.n_vocab {
            let end = (start + self.chunk_rows).min(self.n_vocab);
            let w = self.rows(head, start..end)?;
            parts.push(post(xa.matmul(&w.w.t()?)?)?);
            start = end;
        }
        Ok(Tensor::cat(&parts, 1)?)
    }
}
