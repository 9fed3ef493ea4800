//! The one tolerance policy: how far an engine tap may be from the reference tap, keyed by tap
//! kind (and layer), weight type and backend.
//!
//! # Derivation
//!
//! The reference computes in f32 (or f64) on dequantized weights. The engine reads the same
//! weights, so weight quantization itself is *not* a source of disagreement; what differs is how
//! the engine treats activations and accumulates:
//!
//! * **Element-wise work** (norms, RoPE, activations, embedding lookup, softmax) differs only by
//!   f32 rounding and approximated transcendentals: ggml's `test-backend-ops` accepts NMSE 1e-7
//!   for element-wise ops ([`ELEMENTWISE_NMSE`]).
//! * **f32 weights**: f32 dot products in another summation order. With unit roundoff u = 2⁻²⁴
//!   and length K the relative error is about u·√K (≈ 2e-6 at K = 2048), NMSE ≈ 4e-12: far
//!   below the element-wise floor, so the floor applies.
//! * **f16 / bf16 weights**: ggml-style kernels round the activations to the weight's float type
//!   before the dot product. Rounding to nearest with unit roundoff u leaves a relative RMS error
//!   of u/√3 per element; a dot product's NMSE is that squared: f16 (u = 2⁻¹¹) 7.9e-8, bf16
//!   (u = 2⁻⁸) 5.1e-6.
//! * **Quantized weights** (Q4_0 … Q8_K, IQ*, MXFP4, mixes like q4_k_m): the engine quantizes
//!   activations to Q8_0 / Q8_K before integer dot products, as ggml does. With d = amax/127 the
//!   rounding error is uniform in ±d/2, RMS d/√12, i.e. amax/(127·√12) per element. Relative to
//!   the activations' RMS that is κ/(127·√12) where κ = amax/RMS is the block's crest factor;
//!   NMSE = (κ/(127·√12))². κ = 1 gives 5.2e-6; a Gaussian block of 32–256 values has κ ≈ 2.5–3.3;
//!   we take κ = 4 ([`Q8_CREST_FACTOR`]) to cover moderately heavy-tailed activations: 8.3e-5.
//!   (ggml's `test-backend-ops` bound for a single mat-mul, 5e-4, corresponds to κ ≈ 10.)
//!
//! Errors accumulate along the forward pass. We count **stages**: each layer has six places
//! where that per-stage error enters (QKV projection; the attention scores, where q's and k's
//! errors both enter the softmax, which turns an absolute score error into a relative weight
//! error; the attention-weighted sum of v — f16 KV caches and flash-attention kernels make
//! these stages of their own; output projection, gate/up projection, down projection). Two
//! attention stages, not one, is measured: on Gemma 3 270M, `blk.0.attn` reached NMSE 8.1e-4
//! after q/k/v at 1.2e-4–2.8e-4 (6-token prompt), past a two-stage bound of 6.6e-4. A tap after `s` stages is allowed `s` times the per-stage NMSE
//! (independent errors add in NMSE), times a growth allowance `1.05^layer` for amplification of
//! earlier errors by later layers, times a headroom of 4× (the bounds above are estimates, not
//! measurements), capped at 2e-2 (an error RMS of 14% of the signal: past that, top-1 tokens
//! change and a real bug must not hide under a deep layer's allowance).
//!
//! CUDA backends get a factor 2 on the per-stage error: float mat-muls may run on tensor cores
//! with f16/TF32 inputs and kernels use fast intrinsics (`__expf`, ~2 ulp); SIMD CPU backends
//! only reorder sums and share the scalar bound.
//!
//! # Exact numerics (layer-isolated)
//!
//! In [`Numerics::ExactIsolated`] the reference rounds every matrix product's activations as
//! ggml does (`reference::Precision::Exact`), and each engine layer runs on the reference's input
//! to that layer. Both sides then compute the same numbers up to f32 rounding, and the bound
//! is derived from the three ways they can still differ, with no growth with depth (each layer
//! starts from the same input) and no MoE allowance (the router sees the same input):
//!
//! 1. **f32 rounding in another order** — a norm's sum, an rsqrt, a transcendental's last ulp,
//!    a dot product summed in another order: about 8u of relative error per element, u = 2⁻²⁴,
//!    NMSE (8u)² = 2.3e-13, taken as `exact_rounding_nmse` = 1e-12. (Measured on Gemma 3 270M:
//!    attn_norm 4e-15–8e-15, q/k/v at layers 1–17 1e-13.)
//! 2. **Rounding flips** — where an activation sits (almost) exactly between two levels, the
//!    last ulp decides, and the two sides may round it one quantum apart. A fraction f of the
//!    activations flipping costs NMSE f·(quantum/RMS)²: f = [`EXACT_FLIP_FRACTION`] = 1e-3 and
//!    quantum κ/127 (Q8_0/Q8_K, κ = [`Q8_CREST_FACTOR`]) give 9.9e-7 per rounding stage; f16 and
//!    bf16 activations have a relative quantum of 2⁻¹⁰ and 2⁻⁷; f32 weights round nothing.
//! 3. **Propagation** — a stage's input error carried on with gain [`EXACT_STAGE_GAIN`] = 3.
//!
//! Along one layer (stage = `e → 3e + flip + 1e-12`): q/k/v one stage after the norm; attn
//! twice q/k's error; attn_out one stage after attn; ffn_norm as attn_out; router and gate/up one
//! more stage; ffn_out and out one more (down). Times `exact_headroom` = 4. On the quantized
//! real model that is q/k/v 4.0e-6, attn 7.9e-6, attn_out 2.8e-5, router 8.7e-5, ffn_out 2.7e-4
//! at every layer — against the growing full-precision bound's 3.3e-4 … 2e-2 (capped from layer
//! 7 of 18) and its MoE blanket of 0.1.
//!
//! Cosine similarity has a floor of `1 − nmse_max` (never below 0.9): for an uncorrelated error of
//! NMSE ε at matched scale the cosine is 1/√(1+ε) ≥ 1 − ε/2, so the floor has 2× margin over what
//! the NMSE bound already admits; it is a scale-free second view, not a second tolerance.

use serde::{Deserialize, Serialize};

use crate::cases::Backend;
use crate::error::{HarnessError, Result};
use crate::tap::TapKind;

/// ggml `test-backend-ops`: default `max_nmse_err()` of 1e-7 for element-wise ops.
pub const ELEMENTWISE_NMSE: f64 = 1e-7;
/// ggml `test-backend-ops`: `max_nmse_err()` of 5e-4 for matrix products (kept for reference and
/// tests: our single-stage quantized bound must stay at or below it).
pub const GGML_MUL_MAT_NMSE: f64 = 5e-4;
/// Assumed crest factor amax/RMS of a Q8 activation block (Gaussian: 2.5–3.3; see module docs).
pub const Q8_CREST_FACTOR: f64 = 4.0;
/// Exact numerics: the fraction of one stage's activations allowed to round to the neighbouring
/// level. Ties at exactly half a quantum are what makes them frequent: Gemma 3's layer 0 reads a
/// Q8_0 embedding, so its normed activations are few distinct multiples and many land on a tie
/// that one ulp decides (measured: q/k/v NMSE 0.9e-7–2.1e-7 at layer 0, ~1e-13 at layers 1–17).
/// 1e-3 (one activation in a thousand) gives a per-stage flip NMSE of 1e-3·(κ/127)² = 9.9e-7,
/// about 5× the worst layer-0 measurement before headroom.
pub const EXACT_FLIP_FRACTION: f64 = 1e-3;
/// Exact numerics: how much a stage's input error can grow through the product and the
/// element-wise work after it (a norm, GELU·up). Measured on Gemma 3 layer 0: attn → attn_out
/// 2.4×, ffn_norm → ffn_out 2.5×; 3 leaves room above both.
pub const EXACT_STAGE_GAIN: f64 = 3.0;
/// The largest mean signed error, in f16 units, of the rows an f16 KV cache hands back (the
/// `kv_cache` and `indexer_k_cache` taps, exact numerics only; [`crate::compare::TapMetrics`]'s
/// `rounding_bias`: the mean of sign(r)·(e − r)/unit(r), each term clamped to ±1, `r` the
/// reference's value rounded to nearest, `unit` one f16 unit at its magnitude).
///
/// Why a bias and not only the NMSE: a conversion that rounds toward zero (truncation) instead
/// of to nearest moves about half the values by one unit toward zero, a bias of −½ unit, while
/// its NMSE — about ½·(2⁻¹⁰)²/E[m²] ≈ 2.6e-7 of the signal (m the mantissa in [1, 2)) — sits
/// under the q/k/v bound of quantized weights (4e-6), which must admit the honest
/// activation-rounding flips of the projections before the cache, and so does every tap after
/// the cache (the attention output moves by ~4.5e-7 against 7.9e-6). Rounding both sides to
/// nearest leaves no bias of its own: the honest difference before rounding is symmetric in
/// sign, so its terms (at most one unit each after the clamp, which keeps values near zero,
/// whose unit is tiny, from outweighing the rest) average out to within about 1/√values —
/// 0.022 for the smallest judged block (64 rows of a 32-value indexer key). ⅛ is a quarter of a
/// directed rounding's ½ (truncation or rounding away from zero both fail it) and more than 5
/// such standard errors. Not tuned to a measurement: honest engines measured |bias| ≤ 0.0078
/// in any judged block of the f16 cases (≤ 0.0016 over all rows, fixtures and the real
/// model), truncation −0.50. Without the clamp, glm-dsa's layer-0 indexer keys (LayerNorm
/// outputs, some near zero) measured +0.047 over all rows and +0.138 in one block: the clamp
/// belongs to the statistic (a rounding moves a value by at most a unit), not to the bound.
pub const CACHE_ROUNDING_BIAS_MAX: f64 = 0.125;
/// The relative spacing of f16 values (one unit at 1), the quantum of an f16 cache's rounding.
pub const F16_QUANTUM: f64 = 1.0 / 1024.0;
/// Where the per-stage error enters in each layer: QKV, attention scores, attention sum, output
/// proj, gate/up, down.
pub const STAGES_PER_LAYER: usize = 6;

/// How a case's weights make the engine treat activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightClass {
    F32,
    F16,
    Bf16,
    /// Any block-quantized type or mix: activations go through Q8_0 / Q8_K.
    Quantized,
}

impl WeightClass {
    /// Classify a weight-type name as used in case names (`f32`, `q8_0`, `q4_k_m`, `iq4_xs`,
    /// `mxfp4`, …). Case-insensitive.
    pub fn parse(weights: &str) -> Result<WeightClass> {
        let w = weights.to_ascii_lowercase();
        let starts_quant = |prefix: &str| {
            w.strip_prefix(prefix)
                .and_then(|r| r.bytes().next())
                .is_some_and(|b| b.is_ascii_digit())
        };
        match w.as_str() {
            "f32" => Ok(WeightClass::F32),
            "f16" => Ok(WeightClass::F16),
            "bf16" => Ok(WeightClass::Bf16),
            "mxfp4" => Ok(WeightClass::Quantized),
            // A fixture mixing every block type (`mix-all`): activations are quantized.
            _ if w.starts_with("mix") => Ok(WeightClass::Quantized),
            _ if starts_quant("q") || starts_quant("iq") || starts_quant("tq") => {
                Ok(WeightClass::Quantized)
            }
            _ => Err(HarnessError::UnknownWeightType(weights.to_owned())),
        }
    }
}

/// Which reference, and which engine run, a tap comparison is between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Numerics {
    /// Reference in f32 without activation quantization, engine end to end: the difference is
    /// what quantizing activations costs, bounded by the growing per-stage policy.
    #[default]
    FullPrecision,
    /// Exact-numerics reference, each engine layer run on the reference's input to that layer:
    /// every layer's error is its own; flat bounds ([`TolerancePolicy::exact_tolerance`]).
    ExactIsolated,
}

/// What the comparison needs to know about the case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaseContext {
    /// Weight type as in the case name, e.g. `q4_k_m`.
    pub weights: String,
    pub weight_class: WeightClass,
    pub backend: Backend,
    #[serde(default)]
    pub numerics: Numerics,
}

impl CaseContext {
    pub fn new(weights: &str, backend: &str) -> Result<CaseContext> {
        Ok(CaseContext {
            weights: weights.to_owned(),
            weight_class: WeightClass::parse(weights)?,
            backend: backend.parse()?,
            numerics: Numerics::FullPrecision,
        })
    }

    /// The same case compared in another [`Numerics`] mode.
    pub fn with_numerics(&self, numerics: Numerics) -> CaseContext {
        CaseContext {
            numerics,
            ..self.clone()
        }
    }
}

/// The bound one tap must meet.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    /// Largest admitted NMSE Σ(a−b)²/Σb².
    pub nmse_max: f64,
    /// Smallest admitted cosine similarity.
    pub cosine_min: f64,
    /// Largest admitted |mean signed error| in f16 units (the rows of an f16 KV cache, exact
    /// numerics; [`CACHE_ROUNDING_BIAS_MAX`]); `None`: not judged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounding_bias_max: Option<f64>,
}

/// The policy's parameters. [`Default`] holds the derived values of the module docs; every field is
/// public so a case (or an experiment) can tighten or loosen one knob and say so.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TolerancePolicy {
    pub elementwise_nmse: f64,
    /// Per-stage NMSE of a mat-mul, by weight class (before the element-wise floor).
    pub matmul_nmse_f32: f64,
    pub matmul_nmse_f16: f64,
    pub matmul_nmse_bf16: f64,
    pub matmul_nmse_quantized: f64,
    /// Factor on the per-stage error for CUDA backends.
    pub cuda_factor: f64,
    /// Multiplicative allowance per layer of depth.
    pub layer_growth: f64,
    pub headroom: f64,
    pub nmse_cap: f64,
    pub cosine_floor: f64,
    /// NMSE admitted from a mixture-of-experts layer's output onward (see [`Self::after_moe`]).
    pub moe_route_flip_nmse: f64,
    /// Exact numerics: NMSE of f32 work done in another order (see "Exact numerics" in the
    /// module docs).
    pub exact_rounding_nmse: f64,
    /// Exact numerics: headroom over the derived chain (the flip model is an expectation).
    pub exact_headroom: f64,
}

/// NMSE of a dot product whose activations are rounded to a float type with unit roundoff `u`.
fn float_rounding_nmse(u: f64) -> f64 {
    (u / 3f64.sqrt()).powi(2)
}

/// NMSE of a dot product whose activations are Q8-quantized, for block crest factor `crest`.
pub fn q8_matmul_nmse(crest: f64) -> f64 {
    (crest / (127.0 * 12f64.sqrt())).powi(2)
}

impl Default for TolerancePolicy {
    fn default() -> Self {
        TolerancePolicy {
            elementwise_nmse: ELEMENTWISE_NMSE,
            // u²·K/2 at K = 16384 is 3e-11; 1e-10 sits above it and far below the floor.
            matmul_nmse_f32: 1e-10,
            matmul_nmse_f16: float_rounding_nmse(2f64.powi(-11)),
            matmul_nmse_bf16: float_rounding_nmse(2f64.powi(-8)),
            matmul_nmse_quantized: q8_matmul_nmse(Q8_CREST_FACTOR),
            // Tensor-core f16/TF32 inputs and fast intrinsics: an estimate, see module docs.
            cuda_factor: 2.0,
            // 18 layers (gemma3-270m) → 2.4× at the last layer.
            layer_growth: 1.05,
            // The per-stage bounds are derived, not measured: 4× room.
            headroom: 4.0,
            // Error RMS 14% of signal RMS; see module docs.
            nmse_cap: 2e-2,
            // A cosine below 0.9 is a different vector whatever the NMSE allowance says.
            cosine_floor: 0.9,
            // Top-k routing is a discrete choice: where a token's k-th and (k+1)-th router scores
            // are closer than the Q8 activation noise, engine and reference pick different
            // experts, and that token's MoE output differs by a whole expert. On the deepseek2
            // fixtures this was measured at NMSE up to 0.045 (random routers have many near
            // ties); 0.1 leaves 2x headroom. Wrong routing for every token (a real bug) costs
            // NMSE of order 1, and a NaN fails on parity whatever the bound.
            moe_route_flip_nmse: 0.1,
            // (8u)² with u = 2⁻²⁴, rounded up: eight roundings' worth of relative error per
            // element (a norm's sum, its rsqrt, a transcendental's last ulps, another summation
            // order) — NMSE 2.3e-13, taken as 1e-12.
            exact_rounding_nmse: 1e-12,
            // The chain below is the expected flip error, not a bound on every draw: 4×, as for
            // the full-precision per-stage estimates.
            exact_headroom: 4.0,
        }
    }
}

/// Number of error stages between the token ids and a tap (see module docs).
pub fn stages(kind: TapKind, layer: Option<usize>, n_layers: usize) -> usize {
    let base = STAGES_PER_LAYER * layer.unwrap_or(0);
    match kind {
        TapKind::Embed => 0,
        TapKind::AttnNorm => base,
        // What the cache hands back: the projections' rows (the rounding to f16 is no stage of
        // its own in the full-precision count; its quantum is far below a Q8 stage's).
        TapKind::Q | TapKind::K | TapKind::V | TapKind::KvCache | TapKind::IndexerKCache => {
            base + 1
        }
        // The indexer's scores see its q's and k's errors, as attention's scores do.
        TapKind::IndexerTopK => base + 2,
        TapKind::Attn => base + 3,
        TapKind::AttnOut | TapKind::FfnNorm => base + 4,
        TapKind::Router => base + 5,
        TapKind::FfnOut | TapKind::Out => base + 6,
        TapKind::OutputNorm => STAGES_PER_LAYER * n_layers,
        TapKind::Logits => STAGES_PER_LAYER * n_layers + 1,
    }
}

impl TolerancePolicy {
    /// The per-stage NMSE of a case: the mat-mul bound of its weight class, at least the
    /// element-wise floor, times the CUDA factor on CUDA.
    pub fn stage_nmse(&self, ctx: &CaseContext) -> f64 {
        let matmul = match ctx.weight_class {
            WeightClass::F32 => self.matmul_nmse_f32,
            WeightClass::F16 => self.matmul_nmse_f16,
            WeightClass::Bf16 => self.matmul_nmse_bf16,
            WeightClass::Quantized => self.matmul_nmse_quantized,
        };
        let backend = if ctx.backend.is_cuda() {
            self.cuda_factor
        } else {
            1.0
        };
        matmul.max(self.elementwise_nmse) * backend
    }

    /// NMSE of one rounding stage's flips in exact numerics: a fraction [`EXACT_FLIP_FRACTION`]
    /// of the activations rounded to the neighbouring level, each off by one quantum (module
    /// docs, "Exact numerics"), for the case's weight class.
    pub fn exact_flip_nmse(&self, ctx: &CaseContext) -> f64 {
        let quantum = match ctx.weight_class {
            // no rounding of activations at all
            WeightClass::F32 => 0.0,
            // one ulp of the rounded type, relative to the value: f16 2⁻¹⁰, bf16 2⁻⁷
            WeightClass::F16 => 2f64.powi(-10),
            WeightClass::Bf16 => 2f64.powi(-7),
            // d = amax/127 = κ·RMS/127 at κ = Q8_CREST_FACTOR
            WeightClass::Quantized => Q8_CREST_FACTOR / 127.0,
        };
        EXACT_FLIP_FRACTION * quantum * quantum
    }

    /// The flat bound of a tap in exact-numerics, layer-isolated comparison: the same at every
    /// layer, no MoE allowance (module docs, "Exact numerics").
    pub fn exact_tolerance(&self, kind: TapKind, ctx: &CaseContext) -> Tolerance {
        let floor = self.exact_rounding_nmse;
        let flip = self.exact_flip_nmse(ctx);
        // A rounding stage: the input's error carried through with gain EXACT_STAGE_GAIN, plus
        // its own flips and f32 rounding.
        let q = |e: f64| EXACT_STAGE_GAIN * e + flip + floor;
        let norm = floor;
        let qkv = q(norm);
        // The scores see q's and k's errors: two stages, as in the full-precision policy.
        let attn = 2.0 * qkv + floor;
        let attn_out = q(attn);
        let ffn_norm = attn_out + floor;
        let gate_up = q(ffn_norm);
        let ffn_out = q(gate_up);
        let raw = match kind {
            TapKind::Embed | TapKind::AttnNorm | TapKind::OutputNorm => norm,
            TapKind::Q | TapKind::K | TapKind::V => qkv,
            // The projections' rows rounded to f16 on both sides: a pre-rounding difference δ
            // becomes 0 or one f16 unit, with probability |δ|/unit, so the cache is one more
            // rounding stage of gain 1 whose flips are those of f16 activations (a fraction
            // EXACT_FLIP_FRACTION one unit apart), plus f32 rounding.
            TapKind::KvCache | TapKind::IndexerKCache => {
                qkv + EXACT_FLIP_FRACTION * F16_QUANTUM * F16_QUANTUM + floor
            }
            // A selection: equal (NMSE 0) unless a near-tie flipped; the scores' bound, as
            // attention's, since they see q's and k's errors.
            TapKind::IndexerTopK => attn,
            TapKind::Attn => attn,
            TapKind::AttnOut => attn_out,
            TapKind::FfnNorm => ffn_norm,
            TapKind::Router => gate_up,
            TapKind::FfnOut | TapKind::Out => ffn_out,
            // The head rounds output_norm once.
            TapKind::Logits => q(norm),
        };
        let backend = if ctx.backend.is_cuda() {
            self.cuda_factor
        } else {
            1.0
        };
        let nmse_max = raw * backend * self.exact_headroom;
        Tolerance {
            nmse_max,
            cosine_min: (1.0 - nmse_max).max(self.cosine_floor),
            rounding_bias_max: kind.is_cache().then_some(CACHE_ROUNDING_BIAS_MAX),
        }
    }

    /// The tolerance of one tap. `layer` is the tap's layer (`None` for embed, output_norm and
    /// logits); `n_layers` is the model's layer count (depth of output_norm and logits).
    pub fn tolerance(
        &self,
        kind: TapKind,
        layer: Option<usize>,
        n_layers: usize,
        ctx: &CaseContext,
    ) -> Tolerance {
        if ctx.numerics == Numerics::ExactIsolated {
            return self.exact_tolerance(kind, ctx);
        }
        let s = stages(kind, layer, n_layers);
        let depth = match kind {
            TapKind::OutputNorm | TapKind::Logits => n_layers,
            _ => layer.unwrap_or(0),
        };
        let raw = if s == 0 {
            let backend = if ctx.backend.is_cuda() {
                self.cuda_factor
            } else {
                1.0
            };
            self.elementwise_nmse * backend
        } else {
            self.stage_nmse(ctx)
                * s as f64
                * self.layer_growth.powi(depth.min(i32::MAX as usize) as i32)
        };
        let nmse_max = (raw * self.headroom).min(self.nmse_cap);
        Tolerance {
            nmse_max,
            cosine_min: (1.0 - nmse_max).max(self.cosine_floor),
            rounding_bias_max: None,
        }
    }

    /// Loosen `tol` for a tap computed after a top-k expert choice: the MoE layer's own
    /// `ffn_out` and `out`, every later layer, and the model's outputs.
    pub fn after_moe(&self, tol: Tolerance) -> Tolerance {
        let nmse_max = tol.nmse_max.max(self.moe_route_flip_nmse);
        Tolerance {
            nmse_max,
            cosine_min: tol.cosine_min.min((1.0 - nmse_max).max(self.cosine_floor)),
            ..tol
        }
    }

    /// The policy written out for a report: every tap kind at its first and last layer.
    pub fn table(&self, n_layers: usize, ctx: &CaseContext) -> Vec<ThresholdRow> {
        let last = n_layers.saturating_sub(1);
        TapKind::ALL
            .into_iter()
            .map(|kind| {
                let (first_layer, last_layer) = if kind.is_per_layer() {
                    (Some(0), Some(last))
                } else {
                    (None, None)
                };
                ThresholdRow {
                    kind,
                    first: self.tolerance(kind, first_layer, n_layers, ctx),
                    last: self.tolerance(kind, last_layer, n_layers, ctx),
                }
            })
            .collect()
    }
}

/// One row of [`TolerancePolicy::table`]: a tap kind's bound at layer 0 and at the last layer
/// (equal for kinds without a layer).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ThresholdRow {
    pub kind: TapKind,
    pub first: Tolerance,
    pub last: Tolerance,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(weights: &str, backend: &str) -> CaseContext {
        match CaseContext::new(weights, backend) {
            Ok(c) => c,
            Err(e) => panic!("test context {weights}/{backend}: {e}"),
        }
    }

    fn nmse(kind: TapKind, layer: Option<usize>, weights: &str, backend: &str) -> f64 {
        TolerancePolicy::default()
            .tolerance(kind, layer, 18, &ctx(weights, backend))
            .nmse_max
    }

    #[test]
    fn weight_types_classify() {
        for (w, class) in [
            ("f32", Some(WeightClass::F32)),
            ("F16", Some(WeightClass::F16)),
            ("bf16", Some(WeightClass::Bf16)),
            ("q8_0", Some(WeightClass::Quantized)),
            ("q4_k_m", Some(WeightClass::Quantized)),
            ("iq4_nl", Some(WeightClass::Quantized)),
            ("tq2_0", Some(WeightClass::Quantized)),
            ("mxfp4", Some(WeightClass::Quantized)),
            ("q", None),
            ("int8", None),
            ("", None),
        ] {
            assert_eq!(WeightClass::parse(w).ok(), class, "{w}");
        }
    }

    #[test]
    fn q8_bound_matches_the_hand_computation() {
        // 1/(127·√12) = 2.273e-3 (the brief's per-operand figure); squared 5.17e-6.
        let unit = q8_matmul_nmse(1.0);
        assert!((unit - 5.167e-6).abs() < 1e-8, "{unit}");
        // κ = 4: (4 · 2.273e-3)² = 8.27e-5.
        assert!((q8_matmul_nmse(4.0) - 8.267e-5).abs() < 1e-7);
        // f16 rounding: (2⁻¹¹/√3)² = 7.95e-8; bf16: (2⁻⁸/√3)² = 5.09e-6.
        let p = TolerancePolicy::default();
        assert!((p.matmul_nmse_f16 - 7.947e-8).abs() < 1e-10);
        assert!((p.matmul_nmse_bf16 - 5.086e-6).abs() < 1e-8);
    }

    #[test]
    fn first_quantized_projection_stays_within_ggmls_mul_mat_bound() {
        // blk.0.q: one stage at κ = 4 with 4× headroom = 3.3e-4 ≤ ggml's 5e-4.
        let q = nmse(TapKind::Q, Some(0), "q4_k_m", "cpu-avx2");
        assert!((q - 4.0 * 8.267e-5).abs() < 1e-6, "{q}");
        assert!(q <= GGML_MUL_MAT_NMSE);
    }

    #[test]
    fn embed_is_elementwise_whatever_the_weights() {
        for w in ["f32", "q4_0", "bf16"] {
            assert_eq!(
                nmse(TapKind::Embed, None, w, "cpu-scalar"),
                4.0 * ELEMENTWISE_NMSE
            );
        }
    }

    #[test]
    fn bounds_grow_in_forward_order_and_stop_at_the_cap() {
        let c = ctx("q4_k_m", "cpu-avx512");
        let p = TolerancePolicy::default();
        let mut prev = 0.0;
        let mut order = vec![(TapKind::Embed, None)];
        for l in 0..18 {
            for k in [
                TapKind::AttnNorm,
                TapKind::Q,
                TapKind::Attn,
                TapKind::AttnOut,
                TapKind::Router,
                TapKind::Out,
            ] {
                order.push((k, Some(l)));
            }
        }
        order.push((TapKind::OutputNorm, None));
        order.push((TapKind::Logits, None));
        for (k, l) in order {
            let t = p.tolerance(k, l, 18, &c);
            assert!(t.nmse_max >= prev, "{k} {l:?}: {} < {prev}", t.nmse_max);
            assert!(t.nmse_max <= p.nmse_cap);
            assert!(t.cosine_min >= p.cosine_floor && t.cosine_min < 1.0);
            prev = t.nmse_max;
        }
        assert_eq!(prev, p.nmse_cap);
    }

    #[test]
    fn float_weights_are_tighter_than_quantized_and_cuda_looser_than_cpu() {
        let at = |w: &str, b: &str| nmse(TapKind::Out, Some(3), w, b);
        assert!(at("f32", "cpu-scalar") < at("bf16", "cpu-scalar"));
        assert!(at("bf16", "cpu-scalar") < at("q8_0", "cpu-scalar"));
        assert_eq!(at("f32", "cpu-scalar"), at("f32", "cpu-avx512"));
        assert_eq!(at("q8_0", "cuda-sm90"), 2.0 * at("q8_0", "cpu-avx2"));
    }

    #[test]
    fn table_lists_every_kind() {
        let rows = TolerancePolicy::default().table(18, &ctx("f16", "cpu-avx2"));
        assert_eq!(rows.len(), TapKind::ALL.len());
        let logits = rows.iter().find(|r| r.kind == TapKind::Logits);
        assert!(logits.is_some_and(|r| r.first == r.last));
        let q = rows.iter().find(|r| r.kind == TapKind::Q);
        assert!(q.is_some_and(|r| r.first.nmse_max < r.last.nmse_max));
    }

    #[test]
    fn exact_isolated_bounds_are_flat_tight_and_as_documented() {
        let p = TolerancePolicy::default();
        let c = ctx("q4_k_m", "cpu-avx512").with_numerics(Numerics::ExactIsolated);
        let full = ctx("q4_k_m", "cpu-avx512");
        for (kind, documented) in [
            (TapKind::Q, 3.97e-6),
            (TapKind::Attn, 7.94e-6),
            (TapKind::AttnOut, 2.78e-5),
            (TapKind::Router, 8.73e-5),
            (TapKind::FfnOut, 2.66e-4),
        ] {
            let at0 = p.tolerance(kind, Some(0), 18, &c).nmse_max;
            let at17 = p.tolerance(kind, Some(17), 18, &c).nmse_max;
            assert_eq!(at0, at17, "{kind}: flat");
            assert!((at0 / documented - 1.0).abs() < 0.01, "{kind}: {at0}");
            // Tighter than the full-precision bound at layer 0, far tighter at the last layer.
            assert!(
                at0 < p.tolerance(kind, Some(0), 18, &full).nmse_max,
                "{kind}"
            );
            assert!(
                at17 * 50.0 < p.tolerance(kind, Some(17), 18, &full).nmse_max,
                "{kind}"
            );
        }
        // f32 weights round nothing: only f32 rounding is left.
        let f32c = ctx("f32", "cpu-avx2").with_numerics(Numerics::ExactIsolated);
        assert!(p.tolerance(TapKind::FfnOut, Some(3), 18, &f32c).nmse_max < 2e-9);
    }

    #[test]
    fn cache_taps_are_judged_by_bias_in_exact_numerics_only() {
        let p = TolerancePolicy::default();
        let exact = ctx("q4_k_m", "cpu-avx2").with_numerics(Numerics::ExactIsolated);
        let full = ctx("q4_k_m", "cpu-avx2");
        let kv = p.tolerance(TapKind::KvCache, Some(0), 18, &exact);
        let k = p.tolerance(TapKind::K, Some(0), 18, &exact);
        assert_eq!(kv.rounding_bias_max, Some(CACHE_ROUNDING_BIAS_MAX));
        assert_eq!(k.rounding_bias_max, None);
        // One more rounding stage than k, by f16's flips: a little looser, never tighter.
        assert!(kv.nmse_max > k.nmse_max && kv.nmse_max < 1.01 * k.nmse_max);
        assert_eq!(p.tolerance(TapKind::IndexerKCache, Some(2), 18, &exact), kv);
        assert_eq!(
            p.tolerance(TapKind::KvCache, Some(0), 18, &full)
                .rounding_bias_max,
            None
        );
        // f32 weights: the cache's own f16 flips dominate, about 1e-9 before headroom.
        let f32c = ctx("f32", "cpu-avx2").with_numerics(Numerics::ExactIsolated);
        let b = p.tolerance(TapKind::KvCache, Some(0), 18, &f32c).nmse_max;
        assert!(b > 3e-9 && b < 6e-9, "{b}");
    }

    #[test]
    fn unknown_case_axes_are_errors() {
        assert!(CaseContext::new("q4_k_m", "tpu").is_err());
        assert!(CaseContext::new("fp8", "cpu-avx2").is_err());
    }
}
