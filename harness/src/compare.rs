//! Tap-by-tap comparison of the engine against the reference.
//!
//! [`tap_metrics`] computes the numbers for one pair of equal-length tensors; [`compare_taps`]
//! pairs two forward passes' taps by name, applies the [`TolerancePolicy`], and names the first tap
//! past tolerance in forward (reference) order — the finding a person should look at first.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::float::{fmt_cosine, fmt_sig};
use crate::tap::{Tap, TapId, TapKind};
use crate::tolerance::{CaseContext, Tolerance, TolerancePolicy};

/// Where the largest absolute difference is, and the two values there.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MaxAbsError {
    #[serde(with = "crate::float")]
    pub abs_error: f64,
    pub flat_index: usize,
    /// `[token, column]` of `flat_index` for a `[n_tokens, width]` tap.
    pub token: usize,
    pub column: usize,
    pub engine: f32,
    pub reference: f32,
}

/// NaN/Inf bookkeeping. Parity holds when every non-finite value appears at the same index with the
/// same value class on both sides (NaN with NaN, +∞ with +∞, −∞ with −∞).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NonFinite {
    pub engine_nan: usize,
    pub engine_inf: usize,
    pub reference_nan: usize,
    pub reference_inf: usize,
    /// Indices where only one side is non-finite, or both are but of different classes.
    pub mismatches: usize,
    pub first_mismatch: Option<usize>,
}

impl NonFinite {
    pub fn parity(&self) -> bool {
        self.mismatches == 0
    }
}

/// The metrics of one tap.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TapMetrics {
    /// Σ(a−b)²/Σb² over the indices where both sides are finite. 0/0 (both all zero) is 0;
    /// x/0 with x > 0 (reference all zero, engine not) is +∞.
    #[serde(with = "crate::float")]
    pub nmse: f64,
    /// `None` when no index has finite values on both sides.
    pub max_abs: Option<MaxAbsError>,
    /// a·b/(|a||b|) over finite pairs; 1 when both are all zero, 0 when exactly one is.
    #[serde(with = "crate::float")]
    pub cosine: f64,
    pub non_finite: NonFinite,
    /// Number of compared elements.
    pub len: usize,
    /// The mean signed error in f16 units, positive away from zero:
    /// Σ clamp(sign(b)·(a − b)/spacing(b), ±1) / count over finite pairs, `spacing(b)` one f16
    /// unit at b's magnitude (a term past one unit is no rounding's: it counts as one). Measured on the taps of an f16 KV cache only
    /// ([`crate::tolerance::CACHE_ROUNDING_BIAS_MAX`]); `None` elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounding_bias: Option<f64>,
}

/// Metrics of `engine` against `reference`, both `[n_tokens, width]` row-major with the given
/// `width` (used only to turn the max-error index into `[token, column]`). Accumulates in f64.
/// The slices must have equal length; extra elements of the longer one are ignored (callers check
/// shapes first and report a mismatch as a finding).
pub fn tap_metrics(engine: &[f32], reference: &[f32], width: usize) -> TapMetrics {
    let mut acc = MetricsAccumulator::default();
    acc.push(engine, reference, width);
    acc.finish()
}

/// [`tap_metrics`] for a tap of `kind`: with the rounding bias for the cache kinds.
pub fn tap_metrics_of(
    kind: TapKind,
    engine: &[f32],
    reference: &[f32],
    width: usize,
) -> TapMetrics {
    let mut acc = MetricsAccumulator::for_kind(kind);
    acc.push(engine, reference, width);
    acc.finish()
}

/// One f16 unit at the magnitude of `x` (at least the subnormal spacing 2⁻²⁴), in f64.
fn f16_unit(x: f32) -> f64 {
    let a = x.abs();
    let e = if a.is_normal() {
        ((a.to_bits() >> 23) & 0xff) as i32 - 127
    } else {
        -149
    };
    2f64.powi(e.clamp(-14, 15) - 10)
}

/// [`tap_metrics`] over a tap that arrives in consecutive chunks of rows (a long sequence
/// compared a few rows at a time, a decode run one row at a time): the sums behind NMSE and
/// cosine, the largest error and the non-finite counts, with indices counted from the first
/// chunk. After any sequence of [`Self::push`], [`Self::finish`] equals `tap_metrics` over the
/// concatenated rows.
#[derive(Debug, Clone, Default)]
pub struct MetricsAccumulator {
    err2: f64,
    ref2: f64,
    eng2: f64,
    dot: f64,
    max_abs: Option<MaxAbsError>,
    nf: NonFinite,
    len: usize,
    /// Σ sign(b)·(a − b)/unit(b) and its count, when measured ([`Self::for_kind`]).
    bias: Option<(f64, usize)>,
}

impl MetricsAccumulator {
    /// An accumulator for a tap of `kind` (the cache kinds also measure the rounding bias).
    pub fn for_kind(kind: TapKind) -> MetricsAccumulator {
        MetricsAccumulator {
            bias: kind.is_cache().then_some((0.0, 0)),
            ..MetricsAccumulator::default()
        }
    }

    /// The next rows of the tap (`width` values each; see [`tap_metrics`] for unequal lengths).
    pub fn push(&mut self, engine: &[f32], reference: &[f32], width: usize) {
        let base = self.len;
        let nf = &mut self.nf;
        for (j, (&a, &b)) in engine.iter().zip(reference).enumerate() {
            let i = base + j;
            nf.engine_nan += a.is_nan() as usize;
            nf.engine_inf += a.is_infinite() as usize;
            nf.reference_nan += b.is_nan() as usize;
            nf.reference_inf += b.is_infinite() as usize;
            if !a.is_finite() || !b.is_finite() {
                let same_class = (a.is_nan() && b.is_nan()) || (a.is_infinite() && a == b);
                if !same_class {
                    nf.mismatches += 1;
                    nf.first_mismatch.get_or_insert(i);
                }
                continue;
            }
            let (a64, b64) = (a as f64, b as f64);
            let d = a64 - b64;
            self.err2 += d * d;
            self.ref2 += b64 * b64;
            self.eng2 += a64 * a64;
            self.dot += a64 * b64;
            if let Some((sum, count)) = self.bias.as_mut() {
                // A rounding moves a value by at most one unit: a larger difference (a value
                // near zero, whose unit is tiny, or a difference before the rounding) counts as
                // one unit, so that a few values cannot outweigh the rounding of all the others.
                if b != 0.0 {
                    *sum += (b64.signum() * d / f16_unit(b)).clamp(-1.0, 1.0);
                }
                *count += 1;
            }
            if self.max_abs.is_none_or(|m| d.abs() > m.abs_error) {
                let w = width.max(1);
                self.max_abs = Some(MaxAbsError {
                    abs_error: d.abs(),
                    flat_index: i,
                    token: i / w,
                    column: i % w,
                    engine: a,
                    reference: b,
                });
            }
        }
        self.len += engine.len().min(reference.len());
    }

    /// The metrics of every row pushed so far.
    pub fn finish(&self) -> TapMetrics {
        let (err2, ref2, eng2, dot) = (self.err2, self.ref2, self.eng2, self.dot);
        let nmse = if ref2 > 0.0 {
            err2 / ref2
        } else if err2 == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        let cosine = match (eng2 > 0.0, ref2 > 0.0) {
            (true, true) => (dot / (eng2.sqrt() * ref2.sqrt())).clamp(-1.0, 1.0),
            (false, false) => 1.0,
            _ => 0.0,
        };
        TapMetrics {
            nmse,
            max_abs: self.max_abs,
            cosine,
            non_finite: self.nf,
            len: self.len,
            rounding_bias: self
                .bias
                .map(|(sum, count)| if count > 0 { sum / count as f64 } else { 0.0 }),
        }
    }
}

/// Why a compared tap failed its tolerance.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "check", rename_all = "snake_case")]
pub enum Violation {
    NonFiniteParity {
        mismatches: usize,
        first_index: Option<usize>,
    },
    Nmse {
        #[serde(with = "crate::float")]
        value: f64,
        #[serde(with = "crate::float")]
        max: f64,
    },
    Cosine {
        #[serde(with = "crate::float")]
        value: f64,
        #[serde(with = "crate::float")]
        min: f64,
    },
    /// The mean signed error of an f16 cache's rows, in f16 units, past its bound (a rounding
    /// that is not to nearest).
    RoundingBias {
        #[serde(with = "crate::float")]
        value: f64,
        #[serde(with = "crate::float")]
        max: f64,
    },
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::NonFiniteParity {
                mismatches,
                first_index,
            } => {
                write!(f, "NaN/Inf on one side only at {mismatches} indices")?;
                if let Some(i) = first_index {
                    write!(f, " (first {i})")?;
                }
                Ok(())
            }
            Violation::Nmse { value, max } => {
                write!(f, "NMSE {} > {}", fmt_sig(*value), fmt_sig(*max))
            }
            Violation::Cosine { value, min } => {
                write!(f, "cosine {} < {}", fmt_cosine(*value), fmt_cosine(*min))
            }
            Violation::RoundingBias { value, max } => write!(
                f,
                "f16 rounding bias {:.3} units {} past ±{}",
                value.abs(),
                if *value < 0.0 {
                    "toward zero"
                } else {
                    "away from zero"
                },
                fmt_sig(*max)
            ),
        }
    }
}

/// The checks of one tap against its tolerance; empty when it passes.
pub fn check_tolerance(m: &TapMetrics, tol: &Tolerance) -> Vec<Violation> {
    let mut v = Vec::new();
    if !m.non_finite.parity() {
        v.push(Violation::NonFiniteParity {
            mismatches: m.non_finite.mismatches,
            first_index: m.non_finite.first_mismatch,
        });
    }
    // Written so that a NaN metric fails: NaN <= x and NaN >= x are both false.
    let nmse_ok = m.nmse <= tol.nmse_max;
    let cosine_ok = m.cosine >= tol.cosine_min;
    if !nmse_ok {
        v.push(Violation::Nmse {
            value: m.nmse,
            max: tol.nmse_max,
        });
    }
    if !cosine_ok {
        v.push(Violation::Cosine {
            value: m.cosine,
            min: tol.cosine_min,
        });
    }
    if let (Some(max), Some(value)) = (tol.rounding_bias_max, m.rounding_bias) {
        // Written so that a NaN bias fails.
        let ok = value.abs() <= max;
        if !ok {
            v.push(Violation::RoundingBias { value, max });
        }
    }
    v
}

/// Something wrong with one tap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Finding {
    /// The reference emitted it, the engine did not.
    MissingTap { tap: String },
    /// The engine emitted it, the reference did not.
    ExtraTap { tap: String },
    /// The name is not one of `docs/TAPS.md`.
    UnknownTapName { tap: String },
    /// The same name twice on one side.
    DuplicateTap { tap: String, side: Side },
    ShapeMismatch {
        tap: String,
        engine: Vec<usize>,
        reference: Vec<usize>,
    },
    /// `data.len()` is not the product of `shape`.
    DataLength {
        tap: String,
        side: Side,
        expected: usize,
        found: usize,
    },
    PastTolerance {
        tap: String,
        violations: Vec<Violation>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    Engine,
    Reference,
}

impl Finding {
    pub fn tap(&self) -> &str {
        match self {
            Finding::MissingTap { tap }
            | Finding::ExtraTap { tap }
            | Finding::UnknownTapName { tap }
            | Finding::DuplicateTap { tap, .. }
            | Finding::ShapeMismatch { tap, .. }
            | Finding::DataLength { tap, .. }
            | Finding::PastTolerance { tap, .. } => tap,
        }
    }
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let side = |s: &Side| match s {
            Side::Engine => "engine",
            Side::Reference => "reference",
        };
        match self {
            Finding::MissingTap { tap } => write!(f, "{tap}: missing from the engine"),
            Finding::ExtraTap { tap } => write!(f, "{tap}: emitted by the engine only"),
            Finding::UnknownTapName { tap } => write!(f, "{tap}: not a tap name of docs/TAPS.md"),
            Finding::DuplicateTap { tap, side: s } => {
                write!(f, "{tap}: emitted twice by the {}", side(s))
            }
            Finding::ShapeMismatch {
                tap,
                engine,
                reference,
            } => write!(
                f,
                "{tap}: shape {engine:?} in the engine, {reference:?} in the reference"
            ),
            Finding::DataLength {
                tap,
                side: s,
                expected,
                found,
            } => write!(
                f,
                "{tap}: {} data has {found} values, shape says {expected}",
                side(s)
            ),
            Finding::PastTolerance { tap, violations } => {
                write!(f, "{tap}: ")?;
                for (i, v) in violations.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                Ok(())
            }
        }
    }
}

/// One tap pair that could be compared.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TapComparison {
    pub tap: String,
    pub kind: TapKind,
    pub layer: Option<usize>,
    pub shape: Vec<usize>,
    pub metrics: TapMetrics,
    pub tolerance: Tolerance,
    pub violations: Vec<Violation>,
}

impl TapComparison {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// The first problem in forward order, with where it sits in that order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Divergence {
    /// Position of the tap in the reference's forward order (engine-only taps come after it).
    pub position: usize,
    pub finding: Finding,
}

/// NMSE by layer for one tap kind, with the tolerance at each layer (for plots).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSeries {
    pub kind: TapKind,
    pub points: Vec<LayerPoint>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerPoint {
    pub layer: usize,
    #[serde(with = "crate::float")]
    pub nmse: f64,
    #[serde(with = "crate::float")]
    pub nmse_max: f64,
}

/// Everything [`compare_taps`] found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Compared taps in reference order.
    pub taps: Vec<TapComparison>,
    /// Every finding, in forward order (reference order, then engine-only taps).
    pub findings: Vec<Finding>,
    pub first_divergence: Option<Divergence>,
    /// Layer count used for the depth of `output_norm` and `logits` (highest reference layer + 1).
    pub n_layers: usize,
}

impl Comparison {
    pub fn passed(&self) -> bool {
        self.findings.is_empty()
    }

    /// NMSE by layer for each per-layer tap kind present, kinds in forward order.
    pub fn layer_series(&self) -> Vec<LayerSeries> {
        let mut by_kind: BTreeMap<TapKind, Vec<LayerPoint>> = BTreeMap::new();
        for t in &self.taps {
            if let Some(layer) = t.layer {
                by_kind.entry(t.kind).or_default().push(LayerPoint {
                    layer,
                    nmse: t.metrics.nmse,
                    nmse_max: t.tolerance.nmse_max,
                });
            }
        }
        by_kind
            .into_iter()
            .map(|(kind, mut points)| {
                points.sort_by_key(|p| p.layer);
                LayerSeries { kind, points }
            })
            .collect()
    }

    pub fn tap(&self, name: &str) -> Option<&TapComparison> {
        self.taps.iter().find(|t| t.tap == name)
    }
}

fn expected_len(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Index taps by name; the first occurrence wins and every later one is a finding.
fn index<'a>(
    taps: &'a [Tap],
    side: Side,
    findings: &mut Vec<(usize, Finding)>,
    order_base: usize,
) -> HashMap<&'a str, &'a Tap> {
    let mut map = HashMap::with_capacity(taps.len());
    for (i, t) in taps.iter().enumerate() {
        match map.entry(t.name.as_str()) {
            std::collections::hash_map::Entry::Occupied(_) => findings.push((
                order_base + i,
                Finding::DuplicateTap {
                    tap: t.name.clone(),
                    side,
                },
            )),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(t);
            }
        }
    }
    map
}

/// Compare the engine's taps with the reference's: pair by name, check names, shapes and data
/// lengths, compute metrics, apply the policy. Findings are ordered by the reference's forward
/// order; engine-only taps follow in the engine's order. The first finding is the first divergence.
pub fn compare_taps(
    engine: &[Tap],
    reference: &[Tap],
    policy: &TolerancePolicy,
    ctx: &CaseContext,
) -> Comparison {
    compare_taps_of(engine, reference, policy, ctx, ModelLayers::of(reference))
}

/// What the tolerance of a tap depends on besides its own name: the model's depth (the depth of
/// `output_norm` and `logits`) and its first MoE layer (top-k expert choices start there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModelLayers {
    pub n_layers: usize,
    pub first_moe_layer: Option<usize>,
}

impl ModelLayers {
    /// As read from a forward pass's taps: one more than the largest layer, and the first layer
    /// with a `router` tap.
    pub fn of(taps: &[Tap]) -> ModelLayers {
        let ids = || taps.iter().filter_map(|t| TapId::parse(&t.name));
        ModelLayers {
            n_layers: ids().filter_map(|id| id.layer).max().map_or(0, |l| l + 1),
            first_moe_layer: ids()
                .filter(|id| id.kind == TapKind::Router)
                .filter_map(|id| id.layer)
                .min(),
        }
    }
}

/// [`compare_taps`] for taps that are only part of a forward pass (the logits of a block of
/// rows, compared apart from the layers): `layers` says what the whole pass has.
pub fn compare_taps_of(
    engine: &[Tap],
    reference: &[Tap],
    policy: &TolerancePolicy,
    ctx: &CaseContext,
    layers: ModelLayers,
) -> Comparison {
    let mut findings: Vec<(usize, Finding)> = Vec::new();
    let ref_by_name = index(reference, Side::Reference, &mut findings, 0);
    // Engine-side duplicates are ordered with the engine-only block.
    let eng_by_name = index(engine, Side::Engine, &mut findings, reference.len());
    let ModelLayers {
        n_layers,
        first_moe_layer,
    } = layers;

    let mut taps = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (pos, r) in reference.iter().enumerate() {
        if !seen.insert(r.name.as_str()) {
            continue;
        }
        let name = r.name.clone();
        let Some(id) = TapId::parse(&r.name) else {
            findings.push((pos, Finding::UnknownTapName { tap: name }));
            continue;
        };
        let Some(e) = eng_by_name.get(r.name.as_str()) else {
            findings.push((pos, Finding::MissingTap { tap: name }));
            continue;
        };
        if e.shape != r.shape {
            findings.push((
                pos,
                Finding::ShapeMismatch {
                    tap: name,
                    engine: e.shape.clone(),
                    reference: r.shape.clone(),
                },
            ));
            continue;
        }
        let bad_len = [(Side::Reference, r), (Side::Engine, *e)]
            .into_iter()
            .find_map(|(side, t)| {
                let expected = expected_len(&t.shape).unwrap_or(usize::MAX);
                (t.data.len() != expected).then_some(Finding::DataLength {
                    tap: name.clone(),
                    side,
                    expected,
                    found: t.data.len(),
                })
            });
        if let Some(f) = bad_len {
            findings.push((pos, f));
            continue;
        }
        let width = r.shape.last().copied().unwrap_or(1);
        let metrics = tap_metrics_of(id.kind, &e.data, &r.data, width);
        let mut tolerance = policy.tolerance(id.kind, id.layer, n_layers, ctx);
        // Layer-isolated exact comparisons start every layer from the reference's input, and the
        // router sees the same input on both sides: no route-flip allowance there.
        let full = ctx.numerics == crate::tolerance::Numerics::FullPrecision;
        if let (Some(m), true) = (first_moe_layer, full) {
            let after = match id.layer {
                Some(l) => l > m || (l == m && matches!(id.kind, TapKind::FfnOut | TapKind::Out)),
                None => matches!(id.kind, TapKind::OutputNorm | TapKind::Logits),
            };
            if after {
                tolerance = policy.after_moe(tolerance);
            }
        }
        let violations = check_tolerance(&metrics, &tolerance);
        if !violations.is_empty() {
            findings.push((
                pos,
                Finding::PastTolerance {
                    tap: name.clone(),
                    violations: violations.clone(),
                },
            ));
        }
        taps.push(TapComparison {
            tap: name,
            kind: id.kind,
            layer: id.layer,
            shape: r.shape.clone(),
            metrics,
            tolerance,
            violations,
        });
    }
    let mut extra_seen = std::collections::HashSet::new();
    for (i, e) in engine.iter().enumerate() {
        if !ref_by_name.contains_key(e.name.as_str()) && extra_seen.insert(e.name.as_str()) {
            findings.push((
                reference.len() + i,
                Finding::ExtraTap {
                    tap: e.name.clone(),
                },
            ));
        }
    }
    // Stable: at equal positions the order of discovery is kept.
    findings.sort_by_key(|(pos, _)| *pos);
    let first_divergence = findings.first().map(|(position, finding)| Divergence {
        position: *position,
        finding: finding.clone(),
    });
    Comparison {
        taps,
        findings: findings.into_iter().map(|(_, f)| f).collect(),
        first_divergence,
        n_layers,
    }
}

/// A comparison made a chunk of token rows at a time: a long sequence whose taps (or logits)
/// are not held whole, a chunked prefill, a decode run one row per step. Each chunk (one forward
/// call's rows) is checked at once for the structural findings (a missing, extra or misshapen
/// tap); the tolerances are judged on blocks of consecutive rows that the caller closes
/// ([`Self::close_block`]), so a defect confined to some positions is judged over its block, not
/// averaged over the whole text, while each judgement still covers enough rows for the
/// statistical bounds of the policy (they were derived and measured over 32–64 rows, not one).
/// The first block with a finding is the finding; the metrics over every row go to the report.
#[derive(Debug, Default)]
pub struct ChunkedComparison {
    /// Per tap (in the order first seen): its identity, tolerance and metrics, over every row
    /// and over the open block.
    taps: Vec<Accumulated>,
    index: HashMap<String, usize>,
    layers: Option<ModelLayers>,
    block_rows: Option<std::ops::Range<usize>>,
    /// The first chunk or block with a finding: its rows and its findings.
    first: Option<(std::ops::Range<usize>, Vec<Finding>)>,
}

#[derive(Debug)]
struct Accumulated {
    tap: String,
    kind: TapKind,
    layer: Option<usize>,
    width: usize,
    tolerance: Tolerance,
    total: MetricsAccumulator,
    block: MetricsAccumulator,
    /// The judged block's rounding bias farthest from zero so far (cache taps only).
    worst_block_bias: Option<f64>,
}

impl ChunkedComparison {
    pub fn new() -> ChunkedComparison {
        ChunkedComparison::default()
    }

    /// Add the rows `rows` (token positions) of some taps: `engine` and `reference` hold those
    /// rows of the same taps (every tap of a forward call, or only the logits of a block). The
    /// model's depth and first MoE layer are read from the first push that has layer taps.
    pub fn push(
        &mut self,
        rows: std::ops::Range<usize>,
        engine: &[Tap],
        reference: &[Tap],
        policy: &TolerancePolicy,
        ctx: &CaseContext,
    ) {
        let layers = match self.layers {
            Some(l) => l,
            None => {
                let l = ModelLayers::of(reference);
                if l.n_layers > 0 {
                    self.layers = Some(l);
                }
                l
            }
        };
        let c = compare_taps_of(engine, reference, policy, ctx, layers);
        let structural: Vec<Finding> = c
            .findings
            .into_iter()
            .filter(|f| !matches!(f, Finding::PastTolerance { .. }))
            .collect();
        if self.first.is_none() && !structural.is_empty() {
            self.first = Some((rows.clone(), structural));
        }
        let find = |taps: &'_ [Tap], name: &str| taps.iter().position(|t| t.name == name);
        for t in &c.taps {
            let (Some(e), Some(r)) = (find(engine, &t.tap), find(reference, &t.tap)) else {
                continue;
            };
            let width = t.shape.last().copied().unwrap_or(1);
            let i = *self.index.entry(t.tap.clone()).or_insert_with(|| {
                self.taps.push(Accumulated {
                    tap: t.tap.clone(),
                    kind: t.kind,
                    layer: t.layer,
                    width,
                    tolerance: t.tolerance,
                    total: MetricsAccumulator::for_kind(t.kind),
                    block: MetricsAccumulator::for_kind(t.kind),
                    worst_block_bias: None,
                });
                self.taps.len() - 1
            });
            let a = &mut self.taps[i];
            a.total.push(&engine[e].data, &reference[r].data, width);
            a.block.push(&engine[e].data, &reference[r].data, width);
        }
        self.block_rows = Some(match self.block_rows.take() {
            Some(b) => b.start.min(rows.start)..b.end.max(rows.end),
            None => rows,
        });
    }

    /// Judge the rows pushed since the last close, tap by tap in forward order; the first block
    /// with a tap past its tolerance (if no earlier one had a finding) gives the finding.
    pub fn close_block(&mut self) {
        let Some(rows) = self.block_rows.take() else {
            return;
        };
        let mut findings = Vec::new();
        for a in &mut self.taps {
            let m = std::mem::replace(&mut a.block, MetricsAccumulator::for_kind(a.kind)).finish();
            if m.len == 0 {
                continue;
            }
            if let Some(b) = m.rounding_bias {
                if a.worst_block_bias.is_none_or(|w| b.abs() > w.abs()) {
                    a.worst_block_bias = Some(b);
                }
            }
            let violations = check_tolerance(&m, &a.tolerance);
            if !violations.is_empty() {
                findings.push(Finding::PastTolerance {
                    tap: a.tap.clone(),
                    violations,
                });
            }
        }
        if self.first.is_none() && !findings.is_empty() {
            self.first = Some((rows, findings));
        }
    }

    /// The rounding bias farthest from zero of any judged block of any cache tap (`None`
    /// without cache taps).
    pub fn worst_block_rounding_bias(&self) -> Option<f64> {
        self.taps.iter().filter_map(|a| a.worst_block_bias).fold(
            None,
            |w: Option<f64>, b| match w {
                Some(w) if w.abs() >= b.abs() => Some(w),
                _ => Some(b),
            },
        )
    }

    /// The rows of the first chunk or block that had a finding.
    pub fn divergent_rows(&self) -> Option<std::ops::Range<usize>> {
        self.first.as_ref().map(|(r, _)| r.clone())
    }

    /// Every tap's metrics over all the rows pushed (judged against its tolerance for the
    /// report); the findings and first divergence are those of the first block that had any.
    /// An open block is closed first.
    pub fn finish(mut self) -> Comparison {
        self.close_block();
        let findings = self.first.map(|(_, f)| f).unwrap_or_default();
        let first_divergence = findings.first().map(|f| Divergence {
            position: self.index.get(f.tap()).copied().unwrap_or(0),
            finding: f.clone(),
        });
        let taps = self
            .taps
            .into_iter()
            .map(|a| {
                let metrics = a.total.finish();
                let violations = check_tolerance(&metrics, &a.tolerance);
                TapComparison {
                    shape: vec![metrics.len / a.width.max(1), a.width],
                    tap: a.tap,
                    kind: a.kind,
                    layer: a.layer,
                    metrics,
                    tolerance: a.tolerance,
                    violations,
                }
            })
            .collect();
        Comparison {
            taps,
            findings,
            first_divergence,
            n_layers: self.layers.map_or(0, |l| l.n_layers),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> CaseContext {
        match CaseContext::new("f32", "cpu-scalar") {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    fn check_metrics(a: &[f32], b: &[f32], nmse: f64, cosine: f64) {
        let m = tap_metrics(a, b, a.len());
        let close = |x: f64, y: f64| (x == y) || (x - y).abs() <= 1e-12 * y.abs().max(1.0);
        assert!(
            close(m.nmse, nmse),
            "nmse {} != {nmse} for {a:?} vs {b:?}",
            m.nmse
        );
        assert!(
            close(m.cosine, cosine),
            "cosine {} != {cosine} for {a:?} vs {b:?}",
            m.cosine
        );
    }

    #[test]
    fn nmse_and_cosine_by_hand() {
        check_metrics(&[1.0, 2.0], &[1.0, 2.0], 0.0, 1.0);
        // err² = 1, ref² = 1+4 = 5.
        check_metrics(
            &[1.0, 3.0],
            &[1.0, 2.0],
            0.2,
            7.0 / (10f64.sqrt() * 5f64.sqrt()),
        );
        // Orthogonal, same norm: NMSE 2, cosine 0.
        check_metrics(&[0.0, 1.0], &[1.0, 0.0], 2.0, 0.0);
        // Scaled: NMSE (2−1)² = 1, cosine 1 (NMSE sees scale, cosine does not).
        check_metrics(&[2.0, 4.0], &[1.0, 2.0], 1.0, 1.0);
        check_metrics(&[-1.0, -2.0], &[1.0, 2.0], 4.0, -1.0);
    }

    #[test]
    fn rounding_bias_sees_truncation_and_not_nearest_rounding() {
        // Values just past halfway between two f16 values (1 + 0.6 unit, scaled): nearest
        // rounds them away from zero, truncation toward it, one unit apart.
        let unit = 2f32.powi(-10);
        let exact: Vec<f32> = (0..64)
            .map(|i| {
                let s = if i % 2 == 0 { 1.0 } else { -1.0 };
                s * (1.0 + (i as f32 + 0.6) * unit) * 2f32.powi(i % 5 - 2)
            })
            .collect();
        let nearest: Vec<f32> = exact
            .iter()
            .map(|&x| x.signum() * ((x.abs() / f16u(x)).round() * f16u(x)))
            .collect();
        let truncated: Vec<f32> = exact
            .iter()
            .map(|&x| x.signum() * ((x.abs() / f16u(x)).floor() * f16u(x)))
            .collect();
        let bias = |e: &[f32]| {
            tap_metrics_of(TapKind::KvCache, e, &nearest, 8)
                .rounding_bias
                .unwrap_or(f64::NAN)
        };
        assert_eq!(bias(&nearest), 0.0);
        assert!(
            (bias(&truncated) + 1.0).abs() < 1e-9,
            "{}",
            bias(&truncated)
        );
        // Not measured on other kinds.
        assert_eq!(tap_metrics(&truncated, &nearest, 8).rounding_bias, None);
        let tol = Tolerance {
            nmse_max: 1.0,
            cosine_min: 0.0,
            rounding_bias_max: Some(0.125),
        };
        let m = tap_metrics_of(TapKind::KvCache, &truncated, &nearest, 8);
        assert!(matches!(
            check_tolerance(&m, &tol).as_slice(),
            [Violation::RoundingBias { .. }]
        ));
        let m = tap_metrics_of(TapKind::KvCache, &nearest, &nearest, 8);
        assert!(check_tolerance(&m, &tol).is_empty());
    }

    #[test]
    fn chunked_comparison_judges_the_bias_per_block() {
        use crate::tolerance::Numerics;
        let exact = ctx().with_numerics(Numerics::ExactIsolated);
        let policy = TolerancePolicy::default();
        let unit = 2f32.powi(-10);
        let row = |down: bool| {
            let r: Vec<f32> = (0..8).map(|i| 1.0 + (2 * i) as f32 * unit).collect();
            let e: Vec<f32> = r.iter().map(|&x| if down { x - unit } else { x }).collect();
            (
                vec![Tap::new("blk.0.kv_cache", vec![1, 8], e)],
                vec![Tap::new("blk.0.kv_cache", vec![1, 8], r)],
            )
        };
        let mut c = ChunkedComparison::new();
        let (e, r) = row(false);
        c.push(0..1, &e, &r, &policy, &exact);
        c.close_block();
        assert_eq!(c.worst_block_rounding_bias(), Some(0.0));
        // A block one unit low everywhere: bias −1, past ±⅛ (f32 weights: the NMSE bound, ~4e-9,
        // fails too), and the first block with a finding.
        let (e, r) = row(true);
        c.push(1..2, &e, &r, &policy, &exact);
        c.close_block();
        assert_eq!(c.worst_block_rounding_bias(), Some(-1.0));
        assert_eq!(c.divergent_rows(), Some(1..2));
        let done = c.finish();
        assert!(done.findings.iter().any(|f| matches!(
            f,
            Finding::PastTolerance { violations, .. }
                if violations.iter().any(|v| matches!(v, Violation::RoundingBias { .. }))
        )));
    }

    fn f16u(x: f32) -> f32 {
        f16_unit(x) as f32
    }

    #[test]
    fn zero_reference_cases() {
        check_metrics(&[0.0, 0.0], &[0.0, 0.0], 0.0, 1.0);
        check_metrics(&[0.0, 1e-3], &[0.0, 0.0], f64::INFINITY, 0.0);
        check_metrics(&[], &[], 0.0, 1.0);
    }

    #[test]
    fn max_abs_error_reports_position_and_values() {
        let m = tap_metrics(
            &[1.0, 2.0, 3.0, 4.0, 5.5, 6.0],
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.1],
            3,
        );
        let Some(mx) = m.max_abs else {
            panic!("no max abs")
        };
        assert_eq!((mx.flat_index, mx.token, mx.column), (4, 1, 1));
        assert_eq!((mx.engine, mx.reference), (5.5, 5.0));
        assert!((mx.abs_error - 0.5).abs() < 1e-12);
    }

    #[test]
    fn nan_on_one_side_breaks_parity_whatever_the_numbers() {
        let m = tap_metrics(&[1.0, f32::NAN, 3.0], &[1.0, 2.0, 3.0], 3);
        assert_eq!(m.non_finite.mismatches, 1);
        assert_eq!(m.non_finite.first_mismatch, Some(1));
        // The NaN index is excluded from the sums: the rest agrees exactly.
        assert_eq!(m.nmse, 0.0);
        let tol = Tolerance {
            nmse_max: 1.0,
            cosine_min: 0.0,
            rounding_bias_max: None,
        };
        assert!(matches!(
            check_tolerance(&m, &tol).as_slice(),
            [Violation::NonFiniteParity {
                mismatches: 1,
                first_index: Some(1)
            }]
        ));
    }

    #[test]
    fn matching_non_finite_values_keep_parity() {
        let inf = f32::INFINITY;
        let m = tap_metrics(&[f32::NAN, inf, -inf, 1.0], &[f32::NAN, inf, -inf, 1.0], 4);
        assert!(m.non_finite.parity());
        assert_eq!(
            (m.non_finite.engine_nan, m.non_finite.reference_inf),
            (1, 2)
        );
        let m = tap_metrics(&[inf, 1.0], &[-inf, 1.0], 2);
        assert_eq!(m.non_finite.mismatches, 1);
        let m = tap_metrics(&[f32::NAN, 1.0], &[inf, 1.0], 2);
        assert_eq!(m.non_finite.mismatches, 1);
    }

    #[test]
    fn a_nan_metric_fails_the_tolerance() {
        let m = TapMetrics {
            nmse: f64::NAN,
            max_abs: None,
            cosine: f64::NAN,
            non_finite: NonFinite::default(),
            len: 0,
            rounding_bias: None,
        };
        let tol = Tolerance {
            nmse_max: 1.0,
            cosine_min: 0.0,
            rounding_bias_max: None,
        };
        assert_eq!(check_tolerance(&m, &tol).len(), 2);
    }

    // A tiny forward pass: embed, two layers of (q, out), logits; two tokens, width 4.
    fn pass(perturb: impl Fn(&str, usize) -> f32) -> Vec<Tap> {
        let mut names = vec!["embed".to_owned()];
        for l in 0..2 {
            names.push(format!("blk.{l}.q"));
            names.push(format!("blk.{l}.out"));
        }
        names.push("logits".into());
        names
            .into_iter()
            .map(|n| {
                let data = (0..8).map(|i| 1.0 + i as f32 + perturb(&n, i)).collect();
                Tap::new(n, vec![2, 4], data)
            })
            .collect()
    }

    fn first(c: &Comparison) -> Option<String> {
        c.first_divergence.as_ref().map(|d| d.finding.to_string())
    }

    #[test]
    fn identical_passes_have_no_findings() {
        let p = pass(|_, _| 0.0);
        let c = compare_taps(&p, &p, &TolerancePolicy::default(), &ctx());
        assert!(c.passed(), "{:?}", c.findings);
        assert_eq!(c.taps.len(), 6);
        assert_eq!(c.n_layers, 2);
    }

    #[test]
    fn names_the_first_tap_past_tolerance_in_forward_order() {
        let reference = pass(|_, _| 0.0);
        // blk.1.q is off by a lot, and so is everything after it (as a real bug would cascade);
        // blk.0.q gets a perturbation well within f32 tolerance.
        let engine = pass(|n, i| match n {
            "blk.0.q" if i == 0 => 1e-6,
            "blk.1.q" | "blk.1.out" | "logits" => 0.5,
            _ => 0.0,
        });
        let c = compare_taps(&engine, &reference, &TolerancePolicy::default(), &ctx());
        let d = c
            .first_divergence
            .as_ref()
            .map(|d| (d.position, d.finding.tap().to_owned()));
        assert_eq!(d, Some((3, "blk.1.q".to_owned())));
        assert_eq!(c.findings.len(), 3);
        assert!(c
            .tap("blk.0.q")
            .is_some_and(|t| t.passed() && t.metrics.nmse > 0.0));
    }

    #[test]
    fn missing_extra_and_shape_findings() {
        let reference = pass(|_, _| 0.0);
        let mut engine = reference.clone();
        engine.retain(|t| t.name != "blk.0.out");
        engine.push(Tap::new("blk.0.router", vec![2, 4], vec![0.0; 8]));
        if let Some(t) = engine.iter_mut().find(|t| t.name == "blk.1.q") {
            t.shape = vec![4, 2];
        }
        let c = compare_taps(&engine, &reference, &TolerancePolicy::default(), &ctx());
        let got: Vec<String> = c.findings.iter().map(|f| f.to_string()).collect();
        assert_eq!(
            got,
            [
                "blk.0.out: missing from the engine",
                "blk.1.q: shape [4, 2] in the engine, [2, 4] in the reference",
                "blk.0.router: emitted by the engine only",
            ]
        );
        assert_eq!(
            first(&c).as_deref(),
            Some("blk.0.out: missing from the engine")
        );
    }

    #[test]
    fn bad_data_length_unknown_and_duplicate_names() {
        let mut reference = pass(|_, _| 0.0);
        reference.insert(1, Tap::new("blk.0.attn_q", vec![1, 1], vec![0.0]));
        let mut engine = pass(|_, _| 0.0);
        engine[0].data.pop();
        engine.push(engine[1].clone());
        let c = compare_taps(&engine, &reference, &TolerancePolicy::default(), &ctx());
        let got: Vec<String> = c.findings.iter().map(|f| f.to_string()).collect();
        assert_eq!(
            got,
            [
                "embed: engine data has 7 values, shape says 8",
                "blk.0.attn_q: not a tap name of docs/TAPS.md",
                "blk.0.q: emitted twice by the engine",
            ]
        );
    }

    #[test]
    fn nan_in_engine_is_the_finding_even_when_numbers_agree() {
        let reference = pass(|_, _| 0.0);
        let mut engine = reference.clone();
        engine[2].data[5] = f32::NAN;
        let c = compare_taps(&engine, &reference, &TolerancePolicy::default(), &ctx());
        assert_eq!(
            first(&c).as_deref(),
            Some("blk.0.out: NaN/Inf on one side only at 1 indices (first 5)")
        );
    }

    #[test]
    fn layer_series_by_kind() {
        let reference = pass(|_, _| 0.0);
        let engine = pass(|n, i| if n == "blk.1.out" && i == 0 { 1.0 } else { 0.0 });
        let c = compare_taps(&engine, &reference, &TolerancePolicy::default(), &ctx());
        let s = c.layer_series();
        let kinds: Vec<TapKind> = s.iter().map(|s| s.kind).collect();
        assert_eq!(kinds, [TapKind::Q, TapKind::Out]);
        let out: Vec<(usize, f64)> = s[1].points.iter().map(|p| (p.layer, p.nmse)).collect();
        // blk.1.out: data 1..=8, Σb² = 204, one element off by 1.
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], (0, 0.0));
        assert!((out[1].1 - 1.0 / 204.0).abs() < 1e-12);
        assert!(s[1].points[0].nmse_max < s[1].points[1].nmse_max);
    }

    #[test]
    fn accumulated_chunks_equal_the_whole_tap() {
        let e: Vec<f32> = vec![1.0, 2.5, f32::NAN, 4.0, 5.0, -6.0, 7.0, 8.5, 0.0];
        let r: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.5, -6.0, 7.0, 8.0, f32::INFINITY];
        let whole = tap_metrics(&e, &r, 3);
        for cuts in [vec![3], vec![3, 6], vec![6], vec![0, 9]] {
            let mut acc = MetricsAccumulator::default();
            let mut at = 0;
            for &c in cuts.iter().chain(std::iter::once(&9)) {
                acc.push(&e[at..c], &r[at..c], 3);
                at = c;
            }
            let m = acc.finish();
            // The same sums in the same order: equal, not merely close.
            assert_eq!(m, whole, "cuts {cuts:?}");
        }
        let Some(mx) = whole.max_abs else {
            panic!("no max abs")
        };
        // Row 2 of width 3: the index counts from the first chunk.
        assert_eq!((mx.flat_index, mx.token, mx.column), (1, 0, 1));
        assert_eq!(whole.non_finite.first_mismatch, Some(2));
    }

    // Rows `rows` of a tap over 4 positions, width 2: value 1 + position + column, plus `bad`
    // at the positions it names.
    fn rows_of(name: &str, rows: std::ops::Range<usize>, bad: &dyn Fn(usize) -> f32) -> Tap {
        let data = rows
            .clone()
            .flat_map(|p| (0..2).map(move |c| (p, c)))
            .map(|(p, c)| 1.0 + p as f32 + c as f32 + bad(p))
            .collect();
        Tap::new(name, vec![rows.len(), 2], data)
    }

    fn chunked(bad: &dyn Fn(usize) -> f32, missing_at: Option<usize>) -> ChunkedComparison {
        let policy = TolerancePolicy::default();
        let mut c = ChunkedComparison::new();
        let names = ["embed", "blk.0.q", "blk.0.out", "blk.1.q", "blk.1.out"];
        // Two blocks of two single-row calls each (a decode run), then the logits per block.
        for block in [0..2, 2..4] {
            for p in block.clone() {
                let r: Vec<Tap> = names
                    .iter()
                    .map(|n| rows_of(n, p..p + 1, &|_| 0.0))
                    .collect();
                let mut e: Vec<Tap> = names
                    .iter()
                    .map(|n| match *n {
                        "blk.1.q" => rows_of(n, p..p + 1, bad),
                        _ => rows_of(n, p..p + 1, &|_| 0.0),
                    })
                    .collect();
                if missing_at == Some(p) {
                    e.retain(|t| t.name != "blk.0.out");
                }
                c.push(p..p + 1, &e, &r, &policy, &ctx());
            }
            let logits = |bad: &dyn Fn(usize) -> f32| rows_of("logits", block.clone(), bad);
            c.push(
                block.clone(),
                &[logits(&|_| 0.0)],
                &[logits(&|_| 0.0)],
                &policy,
                &ctx(),
            );
            c.close_block();
        }
        c
    }

    #[test]
    fn chunked_comparison_names_the_first_bad_block() {
        let clean = chunked(&|_| 0.0, None);
        assert_eq!(clean.divergent_rows(), None);
        let clean = clean.finish();
        assert!(clean.passed());
        assert_eq!((clean.taps.len(), clean.n_layers), (6, 2));
        // Totals cover all four rows; the logits, pushed apart, got the bound of depth 2.
        let logits = clean.tap("logits").map(|t| (t.shape.clone(), t.tolerance));
        let policy = TolerancePolicy::default();
        let want = policy.tolerance(TapKind::Logits, None, 2, &ctx());
        assert_eq!(logits, Some((vec![4, 2], want)));

        // Only position 3 is wrong: the second block is the finding, at blk.1.q.
        let late = chunked(&|p| if p == 3 { 0.5 } else { 0.0 }, None);
        assert_eq!(late.divergent_rows(), Some(2..4));
        let late = late.finish();
        assert_eq!(
            late.first_divergence.map(|d| d.finding.tap().to_owned()),
            Some("blk.1.q".to_owned())
        );

        // A tap missing from one call is a finding of that call, before any tolerance.
        let missing = chunked(&|p| if p == 3 { 0.5 } else { 0.0 }, Some(1));
        assert_eq!(missing.divergent_rows(), Some(1..2));
        let f = missing.finish().first_divergence.map(|d| d.finding);
        assert!(
            matches!(&f, Some(Finding::MissingTap { tap }) if tap == "blk.0.out"),
            "{f:?}"
        );
    }
}

#[cfg(test)]
mod props {
    use super::tap_metrics;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn metrics_are_bounded_and_scale_free(
            pairs in proptest::collection::vec((-1e3f32..1e3, -1e3f32..1e3), 1..64),
            // Powers of two scale exactly in binary floating point.
            exp in -8i32..8,
        ) {
            let (a, b): (Vec<f32>, Vec<f32>) = pairs.into_iter().unzip();
            let m = tap_metrics(&a, &b, 4);
            prop_assert!(m.nmse >= 0.0);
            prop_assert!((-1.0..=1.0).contains(&m.cosine));
            prop_assert!(m.non_finite.parity());
            prop_assert_eq!(tap_metrics(&b, &b, 4).nmse, 0.0);
            let k = 2f32.powi(exp);
            let scaled = tap_metrics(
                &a.iter().map(|x| x * k).collect::<Vec<_>>(),
                &b.iter().map(|x| x * k).collect::<Vec<_>>(),
                4,
            );
            // Exact power-of-two scaling leaves every ratio unchanged, up to f64 summation rounding.
            if m.nmse.is_finite() {
                prop_assert!((scaled.nmse - m.nmse).abs() <= 1e-12 * m.nmse.max(1e-300));
            }
            prop_assert!((scaled.cosine - m.cosine).abs() <= 1e-12);
        }
    }
}
