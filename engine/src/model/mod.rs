//! Models: configuration from GGUF metadata, weight handles, and the forward pass of every
//! supported architecture (`llama` family, `gemma3`, `deepseek2`, `glm-dsa`).
//!
//! A [`Model`] owns the opened [`Gguf`]; its weights are checked slices of the file's maps (no
//! dequantization at load except small norm vectors). The forward pass ([`forward`]) is one
//! function for all architectures, with the differences read from [`ModelConfig`] and from
//! which tensors a layer has. It runs on any [`crate::runtime::Backend`].
//!
//! Files: `config.rs` (metadata → [`ModelConfig`]), `weights.rs` (checked tensor handles),
//! `forward.rs` (the forward pass), `error.rs`.

mod config;
mod error;
pub(crate) mod forward;
mod weights;

use std::path::Path;

use kernels::quant::dequantize;

use crate::gguf::{Gguf, WeightPages};
use crate::runtime::WeightData;

pub use config::{
    Activation, Architecture, DsaConfig, Gating, MlaConfig, ModelConfig, MoeConfig, RopeConfig,
    RopeStyle, Yarn,
};
pub use error::ModelError;
pub use forward::Weights;
pub use weights::{shard_block, ShardError, ShardView, Weight};

use weights::Loader;

/// Standard (GQA) attention weights.
#[derive(Debug)]
pub struct StdAttention {
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// Per-head RMSNorm weights (Gemma 3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

/// Multi-head latent attention weights (DeepSeek-V2), used in the expanded form.
#[derive(Debug)]
pub struct MlaAttention {
    /// `attn_q_a`, `attn_q_a_norm`, `attn_q_b` when `q_lora_rank > 0`.
    pub wq_a: Option<(Weight, Vec<f32>, Weight)>,
    /// `attn_q` when `q_lora_rank == 0`.
    pub wq: Option<Weight>,
    pub wkv_a_mqa: Weight,
    pub kv_a_norm: Vec<f32>,
    pub wkv_b: Weight,
}

/// One per layer, built once at load (as [`Ffn`]).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Attention {
    Std(StdAttention),
    Mla(MlaAttention),
}

/// A gated FFN: `down(act(gate(x)) * up(x))`.
#[derive(Debug)]
pub struct DenseFfn {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

/// A mixture of experts with optional shared experts.
#[derive(Debug)]
pub struct MoeFfn {
    /// Router `[n_embd, n_expert]`.
    pub gate_inp: Weight,
    /// Selection bias (`exp_probs_b`), used for choosing experts only.
    pub exp_probs_b: Option<Vec<f32>>,
    pub gate_exps: Weight,
    pub up_exps: Weight,
    pub down_exps: Weight,
    pub shared: Option<DenseFfn>,
}

/// One per layer, built once at load and never moved on a hot path, so the size difference
/// between the variants does not matter.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Ffn {
    Dense(DenseFfn),
    Moe(MoeFfn),
}

/// The lightning indexer of one layer (DeepSeek Sparse Attention, `glm-dsa`): llama.cpp's
/// `blk.N.indexer.{attn_q_b, attn_k, k_norm, proj}`. Its matrices stay in the file's weight
/// types like every other matrix (never dequantized at load); only the LayerNorm vectors are.
#[derive(Debug, Clone)]
pub struct Indexer {
    /// `indexer.attn_q_b`: `[q_lora_rank, n_head·head_dim]`, queries from the MLA q latent.
    pub q_b: Weight,
    /// `indexer.attn_k`: `[n_embd, head_dim]`, the one key head from the normed hidden state.
    pub k: Weight,
    /// `indexer.k_norm.weight` and `.bias`: the key's LayerNorm.
    pub k_norm: Vec<f32>,
    pub k_norm_b: Vec<f32>,
    /// `indexer.proj`: `[n_embd, n_head]`, the per-head weights of the scores.
    pub proj: Weight,
}

/// A multi-token-prediction (NextN) block of a `glm-dsa` file (llama.cpp
/// `LLM_TENSOR_NEXTN_*`): a whole layer plus the projection of `[enorm(embed) | hnorm(h)]`.
/// Loaded with checked shapes and kept (for inspection and a future MTP drafter); the forward
/// pass does not run it.
#[derive(Debug)]
pub struct MtpLayer {
    /// The block's index in the file (`block_count - nextn_predict_layers + i`).
    pub index: usize,
    pub layer: Layer,
    pub indexer: Option<Indexer>,
    /// `nextn.eh_proj`: `[2·n_embd, n_embd]`.
    pub eh_proj: Weight,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// Optional: `nextn.embed_tokens`, `nextn.shared_head_head`, `nextn.shared_head_norm`.
    pub embed_tokens: Option<Weight>,
    pub shared_head_head: Option<Weight>,
    pub shared_head_norm: Option<Vec<f32>>,
}

/// One transformer block.
#[derive(Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    pub wo: Weight,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// A loaded model: the file, its configuration and checked weight handles.
pub struct Model {
    gguf: Gguf,
    config: ModelConfig,
    pub(crate) token_embd: Weight,
    pub(crate) layers: Vec<Layer>,
    /// Per trunk layer, its lightning indexer (`glm-dsa`; `None` elsewhere, and on shared
    /// layers of files that store no indexer there). Kept beside `layers` so that tensor
    /// parallelism's per-rank layers stay as they are: the indexer is replicated on every rank.
    pub(crate) indexers: Vec<Option<Indexer>>,
    /// The NextN blocks after the trunk (`glm-dsa`).
    pub(crate) mtp: Vec<MtpLayer>,
    pub(crate) output_norm: Vec<f32>,
    /// The output head (`output`, or `token_embd` when tied).
    pub(crate) output: Weight,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .field("n_layers", &self.layers.len())
            .finish()
    }
}

impl Model {
    /// Open a GGUF file (or split set) and load the model in it, its weights resident in huge
    /// pages when they fit ([`WeightPages::Auto`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Model, ModelError> {
        Model::load_with(path, WeightPages::Auto)
    }

    /// [`Model::load`] with the weights' pages chosen.
    pub fn load_with(path: impl AsRef<Path>, pages: WeightPages) -> Result<Model, ModelError> {
        Model::from_gguf(Gguf::open(path)?)?.with_weight_pages(pages)
    }

    /// Load a split set from its shard files listed in any order ([`Gguf::open_listed`]).
    pub fn load_listed<P: AsRef<Path>>(paths: &[P]) -> Result<Model, ModelError> {
        Model::from_gguf(Gguf::open_listed(paths)?)?.with_weight_pages(WeightPages::Auto)
    }

    /// The model with its tensor bytes where `pages` says ([`Gguf::set_weight_pages`]).
    pub fn with_weight_pages(mut self, pages: WeightPages) -> Result<Model, ModelError> {
        self.gguf.set_weight_pages(pages)?;
        Ok(self)
    }

    /// Load the model of an opened file: read the configuration, then find and check every
    /// tensor (name, dims, type, byte length).
    pub fn from_gguf(gguf: Gguf) -> Result<Model, ModelError> {
        let config = ModelConfig::from_gguf(&gguf)?;
        let l = Loader { gguf: &gguf };
        let c = &config;
        let d = c.n_embd;
        let token_embd = l.matrix("token_embd.weight", d, c.n_vocab)?;
        let output_norm = l.vector("output_norm.weight", d)?;
        let output = l
            .matrix_opt("output.weight", d, c.n_vocab)?
            .unwrap_or_else(|| token_embd.clone());
        let mut layers = Vec::with_capacity(c.n_layer);
        let mut indexers = Vec::with_capacity(c.n_layer);
        for il in 0..c.n_layer {
            layers.push(load_layer(&l, c, il)?);
            indexers.push(load_indexer(&l, c, il, c.is_indexer_full(il))?);
        }
        let mtp = (c.n_layer..c.n_layer + c.n_nextn)
            .map(|il| load_mtp(&l, c, il))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Model {
            token_embd,
            layers,
            indexers,
            mtp,
            output_norm,
            output,
            config,
            gguf,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The file, for the tokenizer and for inspection.
    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// The bytes of a weight's whole tensor (all of its matrices).
    pub fn data(&self, w: &Weight) -> &[u8] {
        self.gguf.tensor_data(&w.info)
    }

    /// A weight as a backend's [`prepare`](crate::runtime::Backend::prepare) takes it: its
    /// view's bytes cut out of the tensor (borrowed from the map where they are contiguous).
    pub fn weight_data<'a>(&'a self, w: &Weight) -> WeightData<'a> {
        WeightData {
            name: w.name().to_owned(),
            ty: w.ty,
            k_dim: w.k_dim,
            n_rows: w.n_rows,
            n_mats: w.n_mats,
            data: w.bytes(self.data(w)),
        }
    }

    /// The token embedding table for the gather path ([`crate::runtime::Backend::embed`]):
    /// [`Model::weight_data`] without the loader faults, which model matrix-product loaders.
    pub(crate) fn embedding_data(&self) -> WeightData<'_> {
        let w = &self.token_embd;
        WeightData {
            data: w.view_bytes(self.data(w)),
            ..self.weight_data(w)
        }
    }

    /// The lightning indexer of layer `il`, if it has one.
    pub fn indexer(&self, il: usize) -> Option<&Indexer> {
        self.indexers.get(il).and_then(Option::as_ref)
    }

    /// The multi-token-prediction blocks kept after the trunk.
    pub fn mtp_layers(&self) -> &[MtpLayer] {
        &self.mtp
    }

    /// Every weight matrix of the model, in forward order (token embedding first, output head
    /// last): for inspection, shard planning and tests. The indexer's matrices follow their
    /// layer's attention; the NextN blocks, which the forward pass does not run, are not listed
    /// (see [`Model::mtp_layers`]).
    pub fn weights(&self) -> Vec<&Weight> {
        let mut out = vec![&self.token_embd];
        for (il, l) in self.layers.iter().enumerate() {
            match &l.attn {
                Attention::Std(a) => out.extend([&a.wq, &a.wk, &a.wv]),
                Attention::Mla(a) => {
                    if let Some((qa, _, qb)) = &a.wq_a {
                        out.extend([qa, qb]);
                    }
                    out.extend(a.wq.as_ref());
                    out.extend([&a.wkv_a_mqa, &a.wkv_b]);
                }
            }
            if let Some(ix) = self.indexer(il) {
                out.extend([&ix.q_b, &ix.k, &ix.proj]);
            }
            out.push(&l.wo);
            match &l.ffn {
                Ffn::Dense(f) => out.extend([&f.gate, &f.up, &f.down]),
                Ffn::Moe(f) => {
                    out.extend([&f.gate_inp, &f.gate_exps, &f.up_exps, &f.down_exps]);
                    if let Some(s) = &f.shared {
                        out.extend([&s.gate, &s.up, &s.down]);
                    }
                }
            }
        }
        out.push(&self.output);
        out
    }

    /// Dequantize the embedding row of `token` into `out` (`n_embd` values), unscaled.
    pub fn embedding_row(&self, token: u32, out: &mut [f32]) -> Result<(), ModelError> {
        let w = &self.token_embd;
        let t = token as usize;
        if t >= w.n_rows {
            return Err(ModelError::invalid(
                "token id",
                format!("< n_vocab ({})", w.n_rows),
                token,
            ));
        }
        let bytes = &self.data(w)[t * w.row_bytes..(t + 1) * w.row_bytes];
        dequantize(w.ty, bytes, out).map_err(|source| ModelError::Dequantize {
            name: w.info.name.clone(),
            source,
        })
    }
}

fn load_layer(l: &Loader<'_>, c: &ModelConfig, il: usize) -> Result<Layer, ModelError> {
    let n = |s: &str| format!("blk.{il}.{s}.weight");
    let b = |s: &str| format!("blk.{il}.{s}.bias");
    let d = c.n_embd;
    let gemma = c.arch == Architecture::Gemma3;
    let attn = match c.mla {
        None => {
            let nq = c.n_head * c.head_dim_k;
            let nk = c.n_head_kv * c.head_dim_k;
            let nv = c.n_head_kv * c.head_dim_v;
            Attention::Std(StdAttention {
                wq: l.matrix(&n("attn_q"), d, nq)?,
                wk: l.matrix(&n("attn_k"), d, nk)?,
                wv: l.matrix(&n("attn_v"), d, nv)?,
                bq: l.vector_opt(&b("attn_q"), nq)?,
                bk: l.vector_opt(&b("attn_k"), nk)?,
                bv: l.vector_opt(&b("attn_v"), nv)?,
                q_norm: norm_opt(l, gemma, &n("attn_q_norm"), c.head_dim_k)?,
                k_norm: norm_opt(l, gemma, &n("attn_k_norm"), c.head_dim_k)?,
            })
        }
        Some(m) => {
            let nq = c.n_head * (m.qk_nope + m.qk_rope);
            let (wq_a, wq) = if m.q_lora_rank > 0 {
                (
                    Some((
                        l.matrix(&n("attn_q_a"), d, m.q_lora_rank)?,
                        l.vector(&n("attn_q_a_norm"), m.q_lora_rank)?,
                        l.matrix(&n("attn_q_b"), m.q_lora_rank, nq)?,
                    )),
                    None,
                )
            } else {
                (None, Some(l.matrix(&n("attn_q"), d, nq)?))
            };
            Attention::Mla(MlaAttention {
                wq_a,
                wq,
                wkv_a_mqa: l.matrix(&n("attn_kv_a_mqa"), d, m.kv_lora_rank + m.qk_rope)?,
                kv_a_norm: l.vector(&n("attn_kv_a_norm"), m.kv_lora_rank)?,
                wkv_b: l.matrix(
                    &n("attn_kv_b"),
                    m.kv_lora_rank,
                    c.n_head * (m.qk_nope + m.v_head_dim),
                )?,
            })
        }
    };
    let wo = l.matrix(&n("attn_output"), c.n_head * c.head_dim_v, d)?;
    let dense = |prefix: &str, n_ff: usize| -> Result<DenseFfn, ModelError> {
        Ok(DenseFfn {
            gate: l.matrix(&n(&format!("ffn_gate{prefix}")), d, n_ff)?,
            up: l.matrix(&n(&format!("ffn_up{prefix}")), d, n_ff)?,
            down: l.matrix(&n(&format!("ffn_down{prefix}")), n_ff, d)?,
        })
    };
    let ffn = match c.moe {
        Some(m) if il >= m.n_dense_lead => Ffn::Moe(MoeFfn {
            gate_inp: l.matrix(&n("ffn_gate_inp"), d, m.n_expert)?,
            exp_probs_b: l.vector_opt(&format!("blk.{il}.exp_probs_b.bias"), m.n_expert)?,
            gate_exps: l.experts(&n("ffn_gate_exps"), d, m.n_ff_exp, m.n_expert)?,
            up_exps: l.experts(&n("ffn_up_exps"), d, m.n_ff_exp, m.n_expert)?,
            down_exps: l.experts(&n("ffn_down_exps"), m.n_ff_exp, d, m.n_expert)?,
            shared: if m.n_expert_shared > 0 {
                Some(dense("_shexp", m.n_ff_exp * m.n_expert_shared)?)
            } else {
                None
            },
        }),
        _ => {
            if c.n_ff == 0 {
                return Err(ModelError::invalid(
                    format!("{}.feed_forward_length", c.arch_name),
                    "a value > 0",
                    0,
                ));
            }
            Ffn::Dense(dense("", c.n_ff)?)
        }
    };
    Ok(Layer {
        attn_norm: l.vector(&n("attn_norm"), d)?,
        attn,
        wo,
        post_attn_norm: if gemma {
            Some(l.vector(&n("post_attention_norm"), d)?)
        } else {
            None
        },
        ffn_norm: l.vector(&n("ffn_norm"), d)?,
        ffn,
        post_ffn_norm: if gemma {
            Some(l.vector(&n("post_ffw_norm"), d)?)
        } else {
            None
        },
    })
}

/// The indexer of layer `il` (`glm-dsa`): required on a full layer; on a shared layer loaded
/// and checked when the file has it (GLM-5.2 files store it on full layers only), else `None`.
fn load_indexer(
    l: &Loader<'_>,
    c: &ModelConfig,
    il: usize,
    full: bool,
) -> Result<Option<Indexer>, ModelError> {
    let (Some(d), Some(m)) = (&c.dsa, c.mla) else {
        return Ok(None);
    };
    let n = |s: &str| format!("blk.{il}.indexer.{s}.weight");
    if !full && l.gguf.tensor(&n("attn_k")).is_none() {
        return Ok(None);
    }
    Ok(Some(Indexer {
        q_b: l.matrix(&n("attn_q_b"), m.q_lora_rank, d.n_head * d.head_dim)?,
        k: l.matrix(&n("attn_k"), c.n_embd, d.head_dim)?,
        k_norm: l.vector(&n("k_norm"), d.head_dim)?,
        k_norm_b: l.vector(&format!("blk.{il}.indexer.k_norm.bias"), d.head_dim)?,
        proj: l.matrix(&n("proj"), c.n_embd, d.n_head)?,
    }))
}

/// NextN block `il` (past the trunk): a whole layer, its indexer, and the `nextn.*` tensors.
fn load_mtp(l: &Loader<'_>, c: &ModelConfig, il: usize) -> Result<MtpLayer, ModelError> {
    let n = |s: &str| format!("blk.{il}.nextn.{s}.weight");
    let d = c.n_embd;
    Ok(MtpLayer {
        index: il,
        layer: load_layer(l, c, il)?,
        indexer: load_indexer(l, c, il, true)?,
        eh_proj: l.matrix(&n("eh_proj"), 2 * d, d)?,
        enorm: l.vector(&n("enorm"), d)?,
        hnorm: l.vector(&n("hnorm"), d)?,
        embed_tokens: l.matrix_opt(&n("embed_tokens"), d, c.n_vocab)?,
        shared_head_head: l.matrix_opt(&n("shared_head_head"), d, c.n_vocab)?,
        shared_head_norm: l.vector_opt(&n("shared_head_norm"), d)?,
    })
}

/// A norm vector that `required` architectures must have and others may.
fn norm_opt(
    l: &Loader<'_>,
    required: bool,
    name: &str,
    n: usize,
) -> Result<Option<Vec<f32>>, ModelError> {
    if required {
        l.vector(name, n).map(Some)
    } else {
        l.vector_opt(name, n)
    }
}
