//! Op parameters: what a backend needs to know to run an op, and the math every backend shares
//! to interpret them (RoPE/YaRN, expert gating). The model layer reads these from GGUF
//! metadata ([`crate::model::ModelConfig`] holds them); backends never see the model itself.

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)` (ggml's `LLAMA_ROPE_TYPE_NORM`).
    Normal,
    /// Half-split pairs `(i, i + n_rot/2)` (ggml's `LLAMA_ROPE_TYPE_NEOX`).
    Neox,
}

/// YaRN context extension (`rope.scaling.type = yarn`), ggml's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.original_context_length`.
    pub n_ctx_orig: usize,
    /// Extrapolation mix; 1 for YaRN (llama.cpp's default when the scaling type is yarn).
    pub ext_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// Multiplies the rotation on top of YaRN's own `1 + 0.1·ln(1/freq_scale)` (llama.cpp's
    /// `attn_factor`; DeepSeek-V2 passes the inverse so that the rotation keeps magnitude 1).
    pub attn_factor: f32,
}

/// The RoPE of one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeConfig {
    pub style: RopeStyle,
    /// Rotated dimensions per head (the first `n_rot` of a head, or all of MLA's rope part).
    pub n_rot: usize,
    pub freq_base: f32,
    /// `1 / rope.scaling.factor` for linear and YaRN scaling, 1 otherwise.
    pub freq_scale: f32,
    pub yarn: Option<Yarn>,
}

/// Gated FFN activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU, tanh approximation (ggml's `ggml_gelu`).
    GeluTanh,
}

/// Router gating function (`expert_gating_func`: 1 softmax, 2 sigmoid).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// Mixture-of-experts parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_expert_shared: usize,
    pub n_ff_exp: usize,
    /// The first `n_dense_lead` layers have a dense FFN.
    pub n_dense_lead: usize,
    pub weights_scale: f32,
    pub weights_norm: bool,
    pub gating: Gating,
}

/// ggml's `ggml_rope_yarn_corr_dims`.
pub fn yarn_corr_dims(
    n_dims: usize,
    n_ctx_orig: usize,
    base: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> [f32; 2] {
    let corr = |n_rot: f32| {
        n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let start = corr(beta_fast).floor();
    let end = corr(beta_slow).ceil();
    [start.max(0.0), end.min(n_dims as f32 - 1.0)]
}
