//! The plumbline oracle: a plain, obvious CPU forward pass of every supported architecture
//! (`llama`, `gemma3`, `deepseek2`), built from candle-core tensors, emitting the taps of
//! `docs/TAPS.md`.
//!
//! Architecture invariants:
//! - **`reference` never depends on `engine` or `kernels`**, directly or through another crate,
//!   dev-dependencies included (`tests/independence.rs` checks `Cargo.lock`). Weights are read by
//!   candle-core's GGUF reader and dequantized by candle; the types candle lacks (IQ4_NL, IQ4_XS,
//!   MXFP4) have their own plain dequantizer in [`dequant`], written from ggml's description.
//!   A bug shared with the engine would make both sides agree, and hide it.
//! - Slow and obvious on purpose: full-sequence, teacher-forced evaluation with a causal (and
//!   sliding-window) mask, no KV cache, every formula written the way a paper would. No fusions,
//!   no shortcuts that need an argument to be right.
//! - Two residencies, the same numbers ([`Residency`]): every weight dequantized once at load, or
//!   (for models larger than memory) the file kept open and each layer read and dequantized when
//!   the forward pass reaches it, then dropped; embedding rows are read when looked up and the
//!   output head one chunk of rows at a time. Both run the same reads and the same products in
//!   the same order, so their taps and logits are equal bit for bit (golden/tests checks it).
//! - A split set (`PREFIX-NNNNN-of-NNNNN.gguf`) is read in place, each tensor from its shard, the
//!   shards ordered by their own `split.no`.
//! - Computes in one dtype end to end ([`Precision::F32`] or [`Precision::F64`]); taps and logits
//!   are handed out as f32. (MoE routing weights are computed on the host in f64 for both.)
//!
//! Start reading at [`ReferenceModel::forward`], then `arch/llama.rs` and `ops.rs`.

mod arch;
pub mod dequant;
mod error;
mod gguf;
pub mod numerics;
mod ops;
pub mod tokenizer;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::DType;

pub use error::ReferenceError;
pub use numerics::CacheDtype;
pub use tokenizer::Tokenizer;

use arch::{deepseek2::Deepseek2, gemma3::Gemma3, llama::Llama, Loader, Streamer};

/// The tap observer: called with `(name, [n_tokens, width], data)` for every tap, in forward
/// order (docs/TAPS.md).
pub type TapObserver<'a> = dyn FnMut(&str, &[usize], &[f32]) + 'a;

/// The dtype the reference computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    #[default]
    F32,
    F64,
    /// f32, with the activations of every matrix product rounded to the form ggml's dot product
    /// for that weight type reads (Q8_0, Q8_1, Q8_K, F16, BF16), as the engine does: the two sides
    /// then agree to f32 summation-order error ([`numerics`] explains what is reproduced).
    Exact,
}

impl Precision {
    fn dtype(self) -> DType {
        match self {
            Self::F32 | Self::Exact => DType::F32,
            Self::F64 => DType::F64,
        }
    }
}

/// How a mixture-of-experts layer turns router logits into probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// How one MoE layer chooses its experts from a token's router logits (DeepSeek V3 style):
/// probabilities by [`Gating`], then the top `n_expert_used` of `probability + bias` (the bias
/// steers the choice only), ties to the lower expert index.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub gating: Gating,
    /// `exp_probs_b` (zeros when the layer has none).
    pub bias: Vec<f64>,
    pub n_expert_used: usize,
}

impl Routing {
    /// The gate probabilities of one token's router logits.
    pub fn probs(&self, logits: &[f64]) -> Vec<f64> {
        match self.gating {
            Gating::Softmax => {
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = logits.iter().map(|&z| (z - max).exp()).collect();
                let s: f64 = e.iter().sum();
                e.iter().map(|&v| v / s).collect()
            }
            Gating::Sigmoid => logits.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect(),
        }
    }

    /// The selection score of every expert: probability plus bias.
    pub fn scores(&self, logits: &[f64]) -> Vec<f64> {
        let probs = self.probs(logits);
        probs
            .iter()
            .enumerate()
            .map(|(e, p)| p + self.bias.get(e).copied().unwrap_or(0.0))
            .collect()
    }

    /// Every expert, highest selection score first (ties: lower index first).
    pub fn ranking(&self, logits: &[f64]) -> Vec<usize> {
        self.rank_scores(&self.scores(logits))
    }

    /// The chosen experts of one token, in rank order.
    pub fn choose(&self, logits: &[f64]) -> Vec<usize> {
        self.choose_from_probs(&self.probs(logits))
    }

    pub(crate) fn choose_from_probs(&self, probs: &[f64]) -> Vec<usize> {
        let scores: Vec<f64> = probs
            .iter()
            .enumerate()
            .map(|(e, p)| p + self.bias.get(e).copied().unwrap_or(0.0))
            .collect();
        let mut order = self.rank_scores(&scores);
        order.truncate(self.n_expert_used);
        order
    }

    fn rank_scores(&self, scores: &[f64]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..scores.len()).collect();
        // highest biased score first; a stable sort keeps the lower expert index first on ties
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        order
    }
}

/// Forced expert choices for [`ReferenceModel::forward_hidden_routed`]: `(layer, token)` → the
/// experts to use, in rank order.
pub type ForcedRoutes = std::collections::BTreeMap<(usize, usize), Vec<usize>>;

/// Forced lightning-indexer selections for [`ReferenceModel::forward_hidden_selected`]:
/// `(full layer, query)` → the key positions that query attends to (any order; each at most the
/// query's position, `min(top_k, query + 1)` distinct ones). Shared layers after that full layer
/// reuse the forced selection, as they reuse a computed one.
pub type ForcedSelections = std::collections::BTreeMap<(usize, usize), Vec<usize>>;

pub use arch::glm_dsa::IndexerScores;

/// When the weights are read and dequantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Residency {
    /// Every weight dequantized at load and kept: fast repeated forward passes, memory of the
    /// whole model in the compute dtype.
    #[default]
    Eager,
    /// Weights read from the open file when the forward pass needs them and dropped after: the
    /// weights in memory are one layer's (plus one chunk of output-head rows and the embedding
    /// rows of the tokens), whatever the model's size; every forward pass reads the file again.
    Streaming,
}

/// How much memory the model's weights take in f32, from its tensor directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footprint {
    /// Σ elements × 4 over every tensor of the model.
    pub total_f32_bytes: u64,
    /// The layer (`blk.{i}.*`) whose tensors take the most f32 bytes, and that size.
    pub largest_layer: Option<(usize, u64)>,
    /// The largest tensor outside the layers (often `token_embd.weight`), and its f32 bytes.
    pub largest_global: Option<(String, u64)>,
    /// Files the model is read from.
    pub n_files: usize,
}

impl Footprint {
    fn of(file: &gguf::GgufFile) -> Footprint {
        let mut total = 0u64;
        let mut layers: std::collections::BTreeMap<usize, u64> = Default::default();
        let mut largest_global: Option<(String, u64)> = None;
        for (name, elems) in file.tensor_sizes() {
            let bytes = elems.saturating_mul(4);
            total = total.saturating_add(bytes);
            let layer = name
                .strip_prefix("blk.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(i, _)| i.parse::<usize>().ok());
            match layer {
                Some(i) => *layers.entry(i).or_default() += bytes,
                None => {
                    if largest_global
                        .as_ref()
                        .is_none_or(|(n, b)| bytes > *b || (bytes == *b && name < n.as_str()))
                    {
                        largest_global = Some((name.to_string(), bytes));
                    }
                }
            }
        }
        let largest_layer = layers
            .into_iter()
            .fold(None, |best: Option<(usize, u64)>, (i, b)| match best {
                Some((_, bb)) if bb >= b => best,
                _ => Some((i, b)),
            });
        Footprint {
            total_f32_bytes: total,
            largest_layer,
            largest_global,
            n_files: file.n_files(),
        }
    }
}

enum Arch {
    Llama(Llama),
    Gemma3(Gemma3),
    Deepseek2(Deepseek2),
}

/// A model loaded for reference evaluation: all weights dequantized in memory
/// ([`Residency::Eager`]), or read layer by layer from the open file ([`Residency::Streaming`]).
pub struct ReferenceModel {
    architecture: String,
    precision: Precision,
    residency: Residency,
    footprint: Footprint,
    pieces: Vec<String>,
    bos_token_id: Option<u32>,
    add_bos: bool,
    /// The tokenizer, or why this file has none the reference can use.
    tokenizer: Result<Tokenizer, String>,
    arch: Arch,
}

impl std::fmt::Debug for ReferenceModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReferenceModel")
            .field("architecture", &self.architecture)
            .field("precision", &self.precision)
            .field("vocab_size", &self.vocab_size())
            .finish_non_exhaustive()
    }
}

impl ReferenceModel {
    /// Read `path` (GGUF v2/v3) and dequantize every weight to `precision`
    /// ([`Residency::Eager`]). A shard of a split set opens the whole set (see [`Self::open`]).
    pub fn load(path: &Path, precision: Precision) -> Result<Self, ReferenceError> {
        Self::open(path, precision, Residency::Eager)
    }

    /// Open `path` (GGUF v2/v3) with the weights read now or as the forward pass needs them.
    /// A shard of a split set (a file with `split.count` above 1, named
    /// `PREFIX-NNNNN-of-NNNNN.gguf`) opens every shard of the set from the same directory, read
    /// in place; a missing shard is an error naming its path. In streaming mode every tensor
    /// the forward pass will read is checked now (present, its shape, inside its file), so a
    /// bad file fails here rather than halfway through a pass.
    pub fn open(
        path: &Path,
        precision: Precision,
        residency: Residency,
    ) -> Result<Self, ReferenceError> {
        Self::from_file(gguf::GgufFile::open(path)?, precision, residency)
    }

    /// Open a split set from its shard files listed in any order, read in place (each shard
    /// placed by its own `split.no`).
    pub fn open_listed(
        paths: &[PathBuf],
        precision: Precision,
        residency: Residency,
    ) -> Result<Self, ReferenceError> {
        Self::from_file(gguf::GgufFile::open_listed(paths)?, precision, residency)
    }

    fn from_file(
        file: gguf::GgufFile,
        precision: Precision,
        residency: Residency,
    ) -> Result<Self, ReferenceError> {
        let architecture = file.get_string("general.architecture")?.to_string();
        let pieces = file.token_pieces()?;
        let bos_token_id = match file.metadata("tokenizer.ggml.bos_token_id") {
            None => None,
            Some(v) => Some(
                gguf::as_u64(v)
                    .and_then(|id| u32::try_from(id).ok())
                    .ok_or_else(|| ReferenceError::BadKey {
                        key: "tokenizer.ggml.bos_token_id".to_string(),
                        expected: "an unsigned integer that fits in u32",
                        found: format!("{v:?}"),
                    })?,
            ),
        };
        let add_bos = file.get_bool_or("tokenizer.ggml.add_bos_token", false)?;
        let tokenizer = match Tokenizer::from_gguf(&file) {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err("the file has no vocabulary (tokenizer.ggml.tokens)".to_string()),
            Err(e) => Err(e.to_string()),
        };
        let footprint = Footprint::of(&file);
        if !matches!(
            architecture.as_str(),
            "llama" | "gemma3" | "deepseek2" | "glm-dsa"
        ) {
            return Err(ReferenceError::UnsupportedArchitecture(architecture));
        }
        let streaming = residency == Residency::Streaming;
        let src = Arc::new(Streamer::new(
            file,
            precision.dtype(),
            format!("{architecture}."),
            precision == Precision::Exact,
        ));
        // Eager: everything read now, and the file closed when `src` goes. Streaming: only
        // checked now; the architecture keeps `src` and reads each layer when it gets there.
        let keep = streaming.then_some(&src);
        let arch = src.with(streaming, |ld: &mut Loader<'_>| {
            Ok(match architecture.as_str() {
                "llama" => Arch::Llama(Llama::load(ld, keep)?),
                "gemma3" => Arch::Gemma3(Gemma3::load(ld, keep)?),
                _ => Arch::Deepseek2(Deepseek2::load(ld, keep)?),
            })
        })?;
        let model = Self {
            architecture,
            precision,
            residency,
            footprint,
            pieces,
            bos_token_id,
            add_bos,
            tokenizer,
            arch,
        };
        if !model.pieces.is_empty() && model.pieces.len() != model.vocab_size() {
            return Err(ReferenceError::BadKey {
                key: "tokenizer.ggml.tokens".to_string(),
                expected: "one piece per row of the output head",
                found: format!(
                    "{} pieces for {} rows",
                    model.pieces.len(),
                    model.vocab_size()
                ),
            });
        }
        Ok(model)
    }

    /// `general.architecture`: `llama`, `gemma3` or `deepseek2`.
    pub fn architecture(&self) -> &str {
        &self.architecture
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    pub fn residency(&self) -> Residency {
        self.residency
    }

    /// The f32 size of the whole model and of its largest layer, from the tensor directory.
    pub fn footprint(&self) -> &Footprint {
        &self.footprint
    }

    /// [`Self::set_cache_dtype`], by value.
    pub fn with_cache_dtype(mut self, cache: CacheDtype) -> Result<Self, ReferenceError> {
        self.set_cache_dtype(cache)?;
        Ok(self)
    }

    /// Round what attention reads from the KV cache as an engine whose cache holds `cache`
    /// (see [`CacheDtype`] for which rows, by architecture). Only in [`Precision::Exact`]: the
    /// exact-numerics reference reproduces what the engine computes, and an f16 cache is part of
    /// that; the f32 and f64 references stay the unrounded forward pass the engine's end-to-end
    /// error is measured against. With [`CacheDtype::F16`] the forward pass also emits the
    /// rounded cache rows as taps (`blk.{i}.kv_cache`, `blk.{i}.indexer_k_cache`, docs/TAPS.md),
    /// as the engine does with an f16 cache.
    pub fn set_cache_dtype(&mut self, cache: CacheDtype) -> Result<(), ReferenceError> {
        if cache != CacheDtype::F32 && self.precision != Precision::Exact {
            return Err(ReferenceError::Unsupported(format!(
                "a {cache:?} KV cache in {:?} precision: the reference rounds its cache only in \
                 exact-numerics mode (Precision::Exact)",
                self.precision
            )));
        }
        match &mut self.arch {
            Arch::Llama(m) => m.cache = cache,
            Arch::Gemma3(m) => m.cache = cache,
            Arch::Deepseek2(m) => m.cache = cache,
        }
        Ok(())
    }

    /// How the forward pass rounds what attention reads from its cache ([`CacheDtype`]).
    pub fn cache_dtype(&self) -> CacheDtype {
        match &self.arch {
            Arch::Llama(m) => m.cache,
            Arch::Gemma3(m) => m.cache,
            Arch::Deepseek2(m) => m.cache,
        }
    }

    /// Apply the output head `rows` rows per matrix product instead of the default (16 MiB of
    /// f32 per chunk). Results depend on the chunking only through the matrix-product library's
    /// blocking; two models with the same chunk rows compute the same bits in either residency.
    pub fn with_head_chunk_rows(mut self, rows: usize) -> Self {
        match &mut self.arch {
            Arch::Llama(m) => m.vocab_mut().set_chunk_rows(rows),
            Arch::Gemma3(m) => m.vocab_mut().set_chunk_rows(rows),
            Arch::Deepseek2(m) => m.vocab_mut().set_chunk_rows(rows),
        }
        self
    }

    /// Number of layers (`blk.{i}`).
    pub fn n_layers(&self) -> usize {
        match &self.arch {
            Arch::Llama(m) => m.n_layers(),
            Arch::Gemma3(m) => m.n_layers(),
            Arch::Deepseek2(m) => m.n_layers(),
        }
    }

    /// Rows of the output head (the width of the `logits` tap).
    pub fn vocab_size(&self) -> usize {
        match &self.arch {
            Arch::Llama(m) => m.vocab_size(),
            Arch::Gemma3(m) => m.vocab_size(),
            Arch::Deepseek2(m) => m.vocab_size(),
        }
    }

    /// The vocabulary piece of token `id` (`tokenizer.ggml.tokens`), if the file has one.
    pub fn token_piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// The id of the vocabulary entry spelled exactly `piece` (first match).
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.pieces
            .iter()
            .position(|p| p == piece)
            .and_then(|i| u32::try_from(i).ok())
    }

    /// The BOS id the file names (`tokenizer.ggml.bos_token_id`), read here from the metadata
    /// and not through any tokenizer.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Whether the file asks for BOS in front of every sequence (`tokenizer.ggml.add_bos_token`;
    /// `false` when the key is absent).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The reference's own SentencePiece tokenizer ([`tokenizer`]), built from this file's
    /// vocabulary; an error when the file has none or its model is not SentencePiece.
    pub fn tokenizer(&self) -> Result<&Tokenizer, ReferenceError> {
        self.tokenizer
            .as_ref()
            .map_err(|why| ReferenceError::Unsupported(why.clone()))
    }

    /// Logits for every position, `[n_tokens × vocab]` row-major, emitting every tap of
    /// `docs/TAPS.md` in forward order as `(name, [n_tokens, width], data)`.
    pub fn forward(
        &self,
        tokens: &[u32],
        taps: &mut TapObserver<'_>,
    ) -> Result<Vec<f32>, ReferenceError> {
        let x = self.hidden(tokens, taps)?;
        let logits = self.head(&x)?;
        ops::tap(taps, "logits", &logits)?;
        to_host(&logits)
    }

    /// [`Self::forward`] without the output head: every tap up to `output_norm`, and the
    /// `output_norm` values `[n_tokens × n_embd]` returned, for [`Self::logits_of`] to turn into
    /// logits a few rows at a time (a long sequence's logits need not be held all at once:
    /// 640 tokens of a 262144-word vocabulary are 671 MB of f32).
    pub fn forward_hidden(
        &self,
        tokens: &[u32],
        taps: &mut TapObserver<'_>,
    ) -> Result<Vec<f32>, ReferenceError> {
        to_host(&self.hidden(tokens, taps)?)
    }

    /// [`Self::forward_hidden`] with the experts of some `(layer, token)`s chosen by `forced`
    /// instead of by the router: the reference following another implementation's choice where
    /// the two picked different experts on a near-tie (their weights stay the router's
    /// probabilities of those experts). An error for a model without MoE layers, unless
    /// `forced` is empty.
    pub fn forward_hidden_routed(
        &self,
        tokens: &[u32],
        forced: &ForcedRoutes,
        taps: &mut TapObserver<'_>,
    ) -> Result<Vec<f32>, ReferenceError> {
        match &self.arch {
            Arch::Deepseek2(m) => {
                self.check_tokens(tokens)?;
                to_host(&m.hidden_routed(tokens, taps, forced)?)
            }
            _ if forced.is_empty() => self.forward_hidden(tokens, taps),
            _ => Err(ReferenceError::Unsupported(format!(
                "forced expert routes for {}, which has no MoE layers",
                self.architecture
            ))),
        }
    }

    /// [`Self::forward_hidden_routed`] with, besides forced expert routes, the lightning
    /// indexer's selection of some `(layer, query)`s taken from `selections` instead of from its
    /// scores: the reference following the engine where the two picked different cells on a
    /// near-tie (`glm-dsa`). The `indexer_top_k` tap shows the forced selection. An error for a
    /// model without an indexer, unless `selections` is empty.
    pub fn forward_hidden_selected(
        &self,
        tokens: &[u32],
        routes: &ForcedRoutes,
        selections: &ForcedSelections,
        taps: &mut TapObserver<'_>,
    ) -> Result<Vec<f32>, ReferenceError> {
        match &self.arch {
            Arch::Deepseek2(m) => {
                self.check_tokens(tokens)?;
                to_host(&m.hidden_forced(tokens, taps, routes, selections)?)
            }
            _ if selections.is_empty() => self.forward_hidden_routed(tokens, routes, taps),
            _ => Err(ReferenceError::Unsupported(format!(
                "forced indexer selections for {}, which has no lightning indexer",
                self.architecture
            ))),
        }
    }

    /// [`Self::forward_hidden_selected`], and the lightning indexer's scores of every full
    /// layer of that forward (`glm-dsa`; empty for a model without an indexer): what each
    /// selection ranked, for judging whether a different selection on the other side is a
    /// near-tie. Scores are `[query][key position ≤ query]` in f64.
    pub fn forward_hidden_scored(
        &self,
        tokens: &[u32],
        routes: &ForcedRoutes,
        selections: &ForcedSelections,
        taps: &mut TapObserver<'_>,
    ) -> Result<(Vec<f32>, IndexerScores), ReferenceError> {
        match &self.arch {
            Arch::Deepseek2(m) => {
                self.check_tokens(tokens)?;
                let (hidden, scores) = m.hidden_forced_scored(tokens, taps, routes, selections)?;
                Ok((to_host(&hidden)?, scores))
            }
            _ => Ok((
                self.forward_hidden_selected(tokens, routes, selections, taps)?,
                IndexerScores::new(),
            )),
        }
    }

    /// The lightning indexer's scores of full layer `layer` (`glm-dsa`) on `tokens`,
    /// `[query][key position]` in f64 for the causally visible positions (`0..=query`): what
    /// its top-k selection ranks. For explaining a selection flip between the engine and the
    /// reference with both sides' scores. An error for a model without an indexer, or for a
    /// shared layer.
    pub fn indexer_scores(
        &self,
        tokens: &[u32],
        layer: usize,
    ) -> Result<Vec<Vec<f64>>, ReferenceError> {
        match &self.arch {
            Arch::Deepseek2(m) => {
                self.check_tokens(tokens)?;
                m.indexer_scores(tokens, layer)
            }
            _ => Err(ReferenceError::Unsupported(format!(
                "indexer scores of {}, which has no lightning indexer",
                self.architecture
            ))),
        }
    }

    /// How MoE layer `layer` chooses its experts; `None` for a dense layer (and for every layer
    /// of a dense architecture).
    pub fn routing(&self, layer: usize) -> Result<Option<Routing>, ReferenceError> {
        match &self.arch {
            Arch::Deepseek2(m) => m.routing(layer),
            _ => Ok(None),
        }
    }

    /// The logits of rows of `output_norm` values (`[rows × n_embd]`, as [`Self::forward_hidden`]
    /// returns them): `[rows × vocab]`. The head's products are per row, so these are the rows
    /// [`Self::forward`] computes for the same tokens (in [`Precision::F64`], up to the rounding
    /// of the hidden states to f32).
    pub fn logits_of(&self, normed: &[f32]) -> Result<Vec<f32>, ReferenceError> {
        let n_embd = self.n_embd();
        if n_embd == 0 || !normed.len().is_multiple_of(n_embd) {
            return Err(ReferenceError::Unsupported(format!(
                "logits_of: expected whole rows of {n_embd} values, found {}",
                normed.len()
            )));
        }
        let x = candle_core::Tensor::from_slice(
            normed,
            (normed.len() / n_embd, n_embd),
            &candle_core::Device::Cpu,
        )?
        .to_dtype(self.precision.dtype())?;
        to_host(&self.head(&x)?)
    }

    /// Width of the residual stream (`output_norm`'s width).
    pub fn n_embd(&self) -> usize {
        match &self.arch {
            Arch::Llama(m) => m.vocab().n_embd(),
            Arch::Gemma3(m) => m.vocab().n_embd(),
            Arch::Deepseek2(m) => m.vocab().n_embd(),
        }
    }

    /// The layers and output norm (every tap up to `output_norm`), after checking the tokens.
    fn hidden(
        &self,
        tokens: &[u32],
        taps: &mut TapObserver<'_>,
    ) -> Result<candle_core::Tensor, ReferenceError> {
        self.check_tokens(tokens)?;
        Ok(match &self.arch {
            Arch::Llama(m) => m.hidden(tokens, taps)?,
            Arch::Gemma3(m) => m.hidden(tokens, taps)?,
            Arch::Deepseek2(m) => m.hidden(tokens, taps)?,
        })
    }

    /// A non-empty sequence of ids inside the vocabulary.
    fn check_tokens(&self, tokens: &[u32]) -> Result<(), ReferenceError> {
        if tokens.is_empty() {
            return Err(ReferenceError::EmptyInput);
        }
        let vocab_size = self.vocab_size();
        if let Some((position, &token)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab_size)
        {
            return Err(ReferenceError::TokenOutOfRange {
                token,
                position,
                vocab_size,
            });
        }
        Ok(())
    }

    fn head(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor, ReferenceError> {
        Ok(match &self.arch {
            Arch::Llama(m) => m.head(x)?,
            Arch::Gemma3(m) => m.head(x)?,
            Arch::Deepseek2(m) => m.head(x)?,
        })
    }
}

/// A tensor's values as f32, row-major.
fn to_host(t: &candle_core::Tensor) -> Result<Vec<f32>, ReferenceError> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}
