//! [`ModelConfig`]: the hyperparameters of a model, read from GGUF metadata with llama.cpp's keys.

use crate::gguf::Gguf;

use super::ModelError;
pub use crate::runtime::params::{Activation, Gating, MoeConfig, RopeConfig, RopeStyle, Yarn};

/// The architecture families the engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Dense GQA transformer: `llama`, `mistral` (normal RoPE), `qwen2` (NeoX RoPE, QKV biases).
    Llama,
    /// Gemma 3: QK-norm, post-norms, sliding-window layers, GELU, scaled embeddings.
    Gemma3,
    /// DeepSeek-V2 style: MLA attention, MoE with shared experts, leading dense layers.
    Deepseek2,
    /// GLM-5 (`glm-dsa`): `deepseek2`'s MLA and MoE plus DeepSeek Sparse Attention (the
    /// lightning indexer, [`DsaConfig`]) and multi-token-prediction (NextN) layers kept in the
    /// file.
    GlmDsa,
}

/// DeepSeek Sparse Attention: the lightning indexer of every layer (`glm-dsa`).
///
/// Sources, per choice (llama.cpp `src/models/glm-dsa.cpp` and `llama-arch.cpp` at ggml-org
/// master; the DeepSeek-V3.2 report and its `inference/model.py`; the GLM-5/5.2 `config.json`):
/// - keys `{arch}.attention.indexer.{head_count, key_length, top_k}` and the per-layer
///   `{arch}.attention.indexer.types` (1 full, 0 shared), llama.cpp's names;
/// - without `indexer.types`, every layer is full when `context_length` < 1048576 (GLM-5 and
///   5.1), and GLM-5.2's pattern otherwise (layers 0 and 1 full, then every fourth from 2),
///   as llama.cpp's `GLM_5_2_DEFAULT_INDEXER_TYPES`;
/// - a shared layer reuses the selection of the last full layer before it (llama.cpp
///   `prev_top_k`; GLM-5.2 config `indexer_types`), so layer 0 must be full;
/// - the indexer RoPE covers the first `rope.dimension_count` values of each indexer head
///   (`[pe | nope]`, pe first: DeepSeek-V3.2 `Indexer.forward`, llama.cpp's views), in the
///   interleaved-pair layout for `glm-dsa` (llama.cpp `LLAMA_ROPE_TYPE_NORM`; HF
///   `modeling_glm_moe_dsa` applies interleaved RoPE to the indexer) — DeepSeek-V3.2 itself uses
///   the half-split (NeoX) layout there;
/// - the indexer key's LayerNorm has a weight and a bias, eps 1e-6 (DeepSeek-V3.2
///   `LayerNorm(head_dim)` with its default eps; llama.cpp's `LLM_NORM` reads `f_norm_eps`,
///   which `glm-dsa` never sets: the config follows the model's own definition, and
///   `{arch}.attention.layer_norm_epsilon` overrides it when a file carries it);
/// - head weights `proj(x) · (n_head · head_dim)^-½` (DeepSeek-V3.2: `n_heads^-½ ·
///   softmax_scale`, `softmax_scale = head_dim^-½`; llama.cpp pre-scales the same product).
#[derive(Clone, Debug, PartialEq)]
pub struct DsaConfig {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// Layout of the indexer's RoPE (its `n_rot` is the model's `rope.dimension_count`).
    pub rope_style: RopeStyle,
    /// Per layer: whether it computes a fresh selection (full) or reuses the last full one's.
    pub full: Vec<bool>,
    /// LayerNorm epsilon of the indexer key.
    pub k_norm_eps: f32,
}

impl DsaConfig {
    /// The multiplier of the indexer's head weights: `(n_head · head_dim)^-½`.
    pub fn weights_scale(&self) -> f32 {
        1.0 / ((self.n_head * self.head_dim) as f32).sqrt()
    }
}

/// MLA dimensions (DeepSeek-V2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaConfig {
    /// 0: queries come from `attn_q` directly.
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head_dim: usize,
}

/// Everything the forward pass needs to know about a model besides its weights.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    /// `general.architecture` as written in the file.
    pub arch_name: String,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_ctx_train: usize,
    pub n_head: usize,
    /// KV heads as cached (MLA in its expanded form: `n_head`).
    pub n_head_kv: usize,
    /// Query/key head width (MLA: `qk_nope + qk_rope`).
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    /// Dense FFN width.
    pub n_ff: usize,
    pub rms_eps: f32,
    /// RoPE of global (full-attention) layers.
    pub rope: RopeConfig,
    /// RoPE of sliding-window layers.
    pub rope_swa: RopeConfig,
    /// Sliding window in tokens: a query at `p` sees keys at `p - window + 1 ..= p`.
    pub sliding_window: Option<usize>,
    /// Layer `i` is a sliding-window layer iff `i % swa_pattern < swa_pattern - 1` (0: none).
    pub swa_pattern: usize,
    /// Scale of `q·k` (llama.cpp's `kq_scale` or Gemma's `f_attention_scale`).
    pub attn_scale: f32,
    /// Multiplier of the token embeddings (Gemma: √n_embd).
    pub embed_scale: Option<f32>,
    /// `final_logit_softcapping`: logits become `c · tanh(logits / c)`.
    pub final_logit_softcap: Option<f32>,
    pub activation: Activation,
    pub mla: Option<MlaConfig>,
    pub moe: Option<MoeConfig>,
    /// The lightning indexer (`glm-dsa`).
    pub dsa: Option<DsaConfig>,
    /// Multi-token-prediction (NextN) blocks stored after the `n_layer` layers of the trunk
    /// (`{arch}.nextn_predict_layers`); loaded and kept, not run by the forward pass.
    pub n_nextn: usize,
}

struct Keys<'a> {
    gguf: &'a Gguf,
    arch: &'a str,
}

impl Keys<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn usize(&self, k: &str) -> Result<usize, ModelError> {
        let key = self.key(k);
        let v = self.gguf.get_u64(&key)?;
        usize::try_from(v).map_err(|_| ModelError::invalid(key, "a size that fits in usize", v))
    }
    fn usize_opt(&self, k: &str) -> Result<Option<usize>, ModelError> {
        let key = self.key(k);
        match self.gguf.get_u64_opt(&key)? {
            None => Ok(None),
            Some(v) => usize::try_from(v)
                .map(Some)
                .map_err(|_| ModelError::invalid(key, "a size that fits in usize", v)),
        }
    }
    fn f32_opt(&self, k: &str) -> Result<Option<f32>, ModelError> {
        Ok(self.gguf.get_f32_opt(&self.key(k))?)
    }
    /// `{arch}.{k}` as one flag per layer: an array of bools or integers (non-zero is true).
    fn flags_opt(&self, k: &str, n: usize) -> Result<Option<Vec<bool>>, ModelError> {
        use crate::gguf::MetadataValue as V;
        let key = self.key(k);
        let Some(v) = self.gguf.get(&key) else {
            return Ok(None);
        };
        let V::Array(items) = v else {
            return Err(ModelError::invalid(
                key,
                "an array of one flag per layer",
                format!("{v:?}"),
            ));
        };
        if items.len() < n {
            return Err(ModelError::invalid(
                key,
                format!("at least {n} entries (one per layer)"),
                items.len(),
            ));
        }
        items[..n]
            .iter()
            .map(|it| match it {
                V::Bool(b) => Ok(*b),
                V::U8(x) => Ok(*x != 0),
                V::I8(x) => Ok(*x != 0),
                V::U16(x) => Ok(*x != 0),
                V::I16(x) => Ok(*x != 0),
                V::U32(x) => Ok(*x != 0),
                V::I32(x) => Ok(*x != 0),
                V::U64(x) => Ok(*x != 0),
                V::I64(x) => Ok(*x != 0),
                other => Err(ModelError::invalid(
                    key.clone(),
                    "booleans or integers (1 full, 0 shared)",
                    format!("{other:?}"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
    fn positive(&self, k: &str) -> Result<usize, ModelError> {
        let v = self.usize(k)?;
        if v == 0 {
            return Err(ModelError::invalid(self.key(k), "a value > 0", v));
        }
        Ok(v)
    }
}

/// Upper bound on any single dimension read from metadata: keeps untrusted counts from sizing
/// allocations (the largest real models are far below it).
const MAX_DIM: usize = 1 << 24;

impl ModelConfig {
    /// The KV cache's shape for the first `n_layers` layers: `n_head_kv × head_dim` per row each,
    /// or for MLA the latent row `(kv_lora_rank + qk_rope, 0)`.
    pub fn kv_layout(&self, n_layers: usize) -> crate::runtime::KvLayout {
        let (k_width, v_width) = match self.mla {
            Some(m) => (m.kv_lora_rank + m.qk_rope, 0),
            None => (
                self.n_head_kv * self.head_dim_k,
                self.n_head_kv * self.head_dim_v,
            ),
        };
        crate::runtime::KvLayout {
            n_layers,
            k_width,
            v_width,
            index_width: self.dsa.as_ref().map_or(0, |d| d.head_dim),
        }
    }

    /// Read the configuration of the model in `gguf`. Checks every size for consistency; tensor
    /// shapes are checked against it when the weights are loaded.
    pub fn from_gguf(gguf: &Gguf) -> Result<ModelConfig, ModelError> {
        let arch_name = gguf.architecture()?.to_owned();
        let arch = match arch_name.as_str() {
            "llama" | "mistral" | "qwen2" => Architecture::Llama,
            "gemma3" => Architecture::Gemma3,
            "deepseek2" => Architecture::Deepseek2,
            "glm-dsa" => Architecture::GlmDsa,
            other => {
                return Err(ModelError::UnsupportedArchitecture {
                    found: other.to_owned(),
                })
            }
        };
        let k = Keys {
            gguf,
            arch: &arch_name,
        };

        let n_embd = k.positive("embedding_length")?;
        let block_count = k.positive("block_count")?;
        // llama.cpp: `block_count` counts the NextN blocks too (`n_layer_all`); the trunk is the
        // first `block_count - nextn_predict_layers` (`n_layer()`), the NextN blocks follow it.
        let n_nextn = if arch == Architecture::GlmDsa {
            k.usize_opt("nextn_predict_layers")?.unwrap_or(0)
        } else {
            0
        };
        if n_nextn >= block_count {
            return Err(ModelError::invalid(
                k.key("nextn_predict_layers"),
                format!("fewer than block_count ({block_count})"),
                n_nextn,
            ));
        }
        let n_layer = block_count - n_nextn;
        let n_head = k.positive("attention.head_count")?;
        let n_ctx_train = k.usize_opt("context_length")?.unwrap_or(4096);
        let n_ff = k.usize_opt("feed_forward_length")?.unwrap_or(0);
        let rms_eps = k
            .f32_opt("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| {
                ModelError::invalid(
                    k.key("attention.layer_norm_rms_epsilon"),
                    "a value",
                    "nothing",
                )
            })?;
        if !(rms_eps.is_finite() && rms_eps >= 0.0) {
            return Err(ModelError::invalid(
                k.key("attention.layer_norm_rms_epsilon"),
                "a finite value >= 0",
                rms_eps,
            ));
        }
        let n_vocab = match k.usize_opt("vocab_size")? {
            Some(v) => v,
            None => match gguf.tensor("token_embd.weight") {
                Some(t) if t.dims.len() == 2 => usize::try_from(t.dims[1]).map_err(|_| {
                    ModelError::invalid("token_embd.weight", "a vocab size", t.dims[1])
                })?,
                _ => {
                    return Err(ModelError::MissingTensor {
                        name: "token_embd.weight".into(),
                    })
                }
            },
        };

        let default_head = n_embd / n_head;
        let mut head_dim_k = k.usize_opt("attention.key_length")?.unwrap_or(default_head);
        let mut head_dim_v = k
            .usize_opt("attention.value_length")?
            .unwrap_or(default_head);
        let mut n_head_kv = k.usize_opt("attention.head_count_kv")?.unwrap_or(n_head);

        let freq_base = k.f32_opt("rope.freq_base")?.unwrap_or(10_000.0);
        let (freq_scale, mut yarn) = rope_scaling(&k, n_ctx_train)?;

        let mut mla = None;
        let mut moe = None;
        let mut dsa = None;
        let n_rot;
        let style;
        let activation;
        let mut embed_scale = None;
        let mut sliding_window = None;
        let mut swa_pattern = 0;
        let mut freq_base_swa = freq_base;
        let mut freq_scale_swa = freq_scale;
        let attn_scale;
        match arch {
            Architecture::Llama => {
                n_rot = k.usize_opt("rope.dimension_count")?.unwrap_or(head_dim_k);
                style = if arch_name == "qwen2" {
                    RopeStyle::Neox
                } else {
                    RopeStyle::Normal
                };
                activation = Activation::Silu;
                attn_scale = 1.0 / (head_dim_k as f32).sqrt();
            }
            Architecture::Gemma3 => {
                n_rot = k.usize_opt("rope.dimension_count")?.unwrap_or(head_dim_k);
                style = RopeStyle::Neox;
                activation = Activation::GeluTanh;
                embed_scale = Some((n_embd as f32).sqrt());
                let window = k.positive("attention.sliding_window")?;
                sliding_window = Some(window);
                swa_pattern = 6;
                freq_base_swa = k.f32_opt("rope.freq_base_swa")?.unwrap_or(10_000.0);
                freq_scale_swa = 1.0;
                // llama.cpp (after gemma_pytorch's config): 1/sqrt(n_embd/n_head) for the 27B
                // (62 layers), 1/sqrt(key_length) for every other size.
                attn_scale = if n_layer == 62 {
                    1.0 / ((n_embd / n_head) as f32).sqrt()
                } else {
                    1.0 / (head_dim_k as f32).sqrt()
                };
            }
            Architecture::Deepseek2 | Architecture::GlmDsa => {
                let glm = arch == Architecture::GlmDsa;
                style = RopeStyle::Normal;
                activation = Activation::Silu;
                n_rot = k.positive("rope.dimension_count")?;
                // Files converted for absorbed MLA carry the per-head sizes under `_mla` keys.
                if let Some(kl) = k.usize_opt("attention.key_length_mla")? {
                    head_dim_k = kl;
                }
                if let Some(vl) = k.usize_opt("attention.value_length_mla")? {
                    head_dim_v = vl;
                }
                if head_dim_k <= n_rot {
                    return Err(ModelError::invalid(
                        k.key("attention.key_length"),
                        format!("more than rope.dimension_count ({n_rot})"),
                        head_dim_k,
                    ));
                }
                let q_lora_rank = if glm {
                    // The indexer's queries come from the q latent: glm-dsa always has one.
                    k.positive("attention.q_lora_rank")?
                } else {
                    k.usize_opt("attention.q_lora_rank")?.unwrap_or(0)
                };
                let cfg = MlaConfig {
                    q_lora_rank,
                    kv_lora_rank: k.positive("attention.kv_lora_rank")?,
                    qk_nope: head_dim_k - n_rot,
                    qk_rope: n_rot,
                    v_head_dim: head_dim_v,
                };
                mla = Some(cfg);
                n_head_kv = n_head;
                let gating = match k.usize_opt("expert_gating_func")?.unwrap_or(0) {
                    // 0 ("none", or absent): llama.cpp reads sigmoid for glm-dsa (GLM-4.5 on)
                    // and softmax for older DeepSeek-V2 files.
                    0 if glm => Gating::Sigmoid,
                    0 | 1 => Gating::Softmax,
                    2 => Gating::Sigmoid,
                    other => {
                        return Err(ModelError::invalid(
                            k.key("expert_gating_func"),
                            "1 (softmax) or 2 (sigmoid)",
                            other,
                        ))
                    }
                };
                let n_expert = k.positive("expert_count")?;
                let n_expert_used = k.positive("expert_used_count")?;
                if n_expert_used > n_expert {
                    return Err(ModelError::invalid(
                        k.key("expert_used_count"),
                        format!("at most expert_count ({n_expert})"),
                        n_expert_used,
                    ));
                }
                let weights_scale = match k.f32_opt("expert_weights_scale")? {
                    Some(s) => s,
                    // llama.cpp reads it as optional for glm-dsa and skips the scaling when it
                    // is 0 (absent): a scale of 1.
                    None if glm => 1.0,
                    None => {
                        return Err(ModelError::invalid(
                            k.key("expert_weights_scale"),
                            "a value",
                            "nothing",
                        ))
                    }
                };
                moe = Some(MoeConfig {
                    n_expert,
                    n_expert_used,
                    n_expert_shared: k.usize("expert_shared_count")?,
                    n_ff_exp: k.positive("expert_feed_forward_length")?,
                    n_dense_lead: if glm {
                        k.usize_opt("leading_dense_block_count")?.unwrap_or(0)
                    } else {
                        k.usize("leading_dense_block_count")?
                    },
                    weights_scale,
                    weights_norm: gguf
                        .get_bool_opt(&k.key("expert_weights_norm"))?
                        .unwrap_or(false),
                    gating,
                });
                // llama.cpp's kq_scale: mscale² / sqrt(key_length), mscale = 1 + 0.1·log_mul·ln(factor)
                // under YaRN (the rotation itself keeps magnitude 1), 1 otherwise.
                let log_mul = k
                    .f32_opt("rope.scaling.yarn_log_multiplier")?
                    .unwrap_or(0.0);
                let mscale = if yarn.is_some() {
                    1.0 + log_mul * (1.0 / freq_scale).ln()
                } else {
                    1.0
                };
                attn_scale = mscale * mscale / (head_dim_k as f32).sqrt();
                if let Some(y) = yarn.as_mut() {
                    y.attn_factor = 1.0 / (1.0 + 0.1 * (1.0 / freq_scale).ln());
                }
                if glm {
                    dsa = Some(dsa_config(&k, n_layer, n_ctx_train, n_rot)?);
                }
            }
        }

        for (key, v) in [
            ("embedding_length", n_embd),
            ("block_count", n_layer),
            ("attention.head_count", n_head),
            ("attention.head_count_kv", n_head_kv),
            ("attention.key_length", head_dim_k),
            ("attention.value_length", head_dim_v),
            ("feed_forward_length", n_ff),
            ("vocab_size", n_vocab),
        ] {
            if v > MAX_DIM {
                return Err(ModelError::invalid(
                    k.key(key),
                    format!("at most {MAX_DIM}"),
                    v,
                ));
            }
        }
        if n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(ModelError::invalid(
                k.key("attention.head_count_kv"),
                format!("a divisor of attention.head_count ({n_head})"),
                n_head_kv,
            ));
        }
        let rope_dims = mla.map_or(head_dim_k, |m| m.qk_rope);
        if n_rot == 0 || n_rot > rope_dims || !n_rot.is_multiple_of(2) {
            return Err(ModelError::invalid(
                k.key("rope.dimension_count"),
                format!("an even value in 2..={rope_dims}"),
                n_rot,
            ));
        }
        let final_logit_softcap = k.f32_opt("final_logit_softcapping")?.filter(|c| *c != 0.0);

        let rope = RopeConfig {
            style,
            n_rot,
            freq_base,
            freq_scale,
            yarn,
        };
        let rope_swa = RopeConfig {
            freq_base: freq_base_swa,
            freq_scale: freq_scale_swa,
            yarn: if swa_pattern > 0 { None } else { yarn },
            ..rope
        };
        Ok(ModelConfig {
            arch,
            arch_name,
            n_vocab,
            n_embd,
            n_layer,
            n_ctx_train,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_ff,
            rms_eps,
            rope,
            rope_swa,
            sliding_window,
            swa_pattern,
            attn_scale,
            embed_scale,
            final_logit_softcap,
            activation,
            mla,
            moe,
            dsa,
            n_nextn,
        })
    }

    /// Whether layer `il` attends through the sliding window.
    pub fn is_swa_layer(&self, il: usize) -> bool {
        self.sliding_window.is_some()
            && self.swa_pattern > 0
            && il % self.swa_pattern < self.swa_pattern - 1
    }

    /// The RoPE of layer `il`.
    pub fn rope_for_layer(&self, il: usize) -> &RopeConfig {
        if self.is_swa_layer(il) {
            &self.rope_swa
        } else {
            &self.rope
        }
    }

    /// Whether layer `il` computes a fresh indexer selection (`glm-dsa` full layers).
    pub fn is_indexer_full(&self, il: usize) -> bool {
        self.dsa
            .as_ref()
            .is_some_and(|d| d.full.get(il).copied().unwrap_or(false))
    }

    /// Whether layer `il` has a MoE FFN.
    pub fn is_moe_layer(&self, il: usize) -> bool {
        self.moe.is_some_and(|m| il >= m.n_dense_lead)
    }
}

/// The indexer's configuration (see [`DsaConfig`] for where each choice comes from).
fn dsa_config(
    k: &Keys<'_>,
    n_layer: usize,
    n_ctx_train: usize,
    n_rot: usize,
) -> Result<DsaConfig, ModelError> {
    let n_head = k.positive("attention.indexer.head_count")?;
    let head_dim = k.positive("attention.indexer.key_length")?;
    let top_k = k.positive("attention.indexer.top_k")?;
    for (key, v) in [
        ("attention.indexer.head_count", n_head),
        ("attention.indexer.key_length", head_dim),
        ("attention.indexer.top_k", top_k),
    ] {
        if v > MAX_DIM {
            return Err(ModelError::invalid(
                k.key(key),
                format!("at most {MAX_DIM}"),
                v,
            ));
        }
    }
    if head_dim <= n_rot {
        return Err(ModelError::invalid(
            k.key("attention.indexer.key_length"),
            format!("more than rope.dimension_count ({n_rot}), the indexer's roped part"),
            head_dim,
        ));
    }
    let full = match k.flags_opt("attention.indexer.types", n_layer)? {
        Some(f) => f,
        // GLM-5 / 5.1 (trained context below 1M): a full indexer on every layer.
        None if n_ctx_train < 1_048_576 => vec![true; n_layer],
        // GLM-5.2's default pattern (llama.cpp `GLM_5_2_DEFAULT_INDEXER_TYPES`, 78 entries;
        // layers past them zero, i.e. shared).
        None => (0..n_layer)
            .map(|i| i < 78 && (i < 2 || (i - 2) % 4 == 0))
            .collect(),
    };
    if full.first() == Some(&false) {
        return Err(ModelError::invalid(
            k.key("attention.indexer.types"),
            "layer 0 full (a shared layer reuses the last full layer's selection)",
            "shared",
        ));
    }
    let k_norm_eps = k.f32_opt("attention.layer_norm_epsilon")?.unwrap_or(1e-6);
    if !(k_norm_eps.is_finite() && k_norm_eps >= 0.0) {
        return Err(ModelError::invalid(
            k.key("attention.layer_norm_epsilon"),
            "a finite value >= 0",
            k_norm_eps,
        ));
    }
    Ok(DsaConfig {
        n_head,
        head_dim,
        top_k,
        rope_style: RopeStyle::Normal,
        full,
        k_norm_eps,
    })
}

/// `rope.scaling.*`: (freq_scale, YaRN parameters).
fn rope_scaling(k: &Keys<'_>, n_ctx_train: usize) -> Result<(f32, Option<Yarn>), ModelError> {
    let ty = k.gguf.get_str_opt(&k.key("rope.scaling.type"))?;
    let factor = k.f32_opt("rope.scaling.factor")?;
    let factor = match (ty, factor) {
        (Some("none"), _) | (_, None) => {
            // Older files: `rope.scale_linear`.
            let lin = k.f32_opt("rope.scale_linear")?.unwrap_or(1.0);
            return Ok((check_factor(k, "rope.scale_linear", lin)?, None));
        }
        (_, Some(f)) => f,
    };
    let freq_scale = check_factor(k, "rope.scaling.factor", factor)?;
    match ty {
        None | Some("linear") => Ok((freq_scale, None)),
        Some("yarn") => {
            let n_ctx_orig = k
                .usize_opt("rope.scaling.original_context_length")?
                .unwrap_or(n_ctx_train);
            Ok((
                freq_scale,
                Some(Yarn {
                    n_ctx_orig,
                    ext_factor: 1.0,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    attn_factor: 1.0,
                }),
            ))
        }
        Some(other) => Err(ModelError::invalid(
            k.key("rope.scaling.type"),
            "none, linear or yarn",
            other,
        )),
    }
}

fn check_factor(k: &Keys<'_>, key: &str, factor: f32) -> Result<f32, ModelError> {
    if factor == 0.0 || factor == 1.0 {
        return Ok(1.0);
    }
    if !(factor.is_finite() && factor > 0.0) {
        return Err(ModelError::invalid(
            k.key(key),
            "a finite factor > 0",
            factor,
        ));
    }
    Ok(1.0 / factor)
}
