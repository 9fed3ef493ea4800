//! The GPU efficiency gates that need no GPU: on a CUDA case (real or emulated device, TP 1,
//! the teacher-forced case of each model and weight mix) the engine prefills a short prompt,
//! then decodes a few tokens, and the backend's device counters
//! ([`engine::runtime::DeviceCounters`]) of each decode step are judged:
//!
//! | gate | bound | why that bound |
//! |---|---|---|
//! | `decode_allocs` | 0 per steady-state step | every temporary of a decode step has the size it had in the step before, so the backend's buffer pool serves it; one device allocation per step means an op allocates outside the pool |
//! | `decode_kv_moved` | 0 B per steady-state step | the KV cache reserves geometrically (twice what it needs when it grows), so a step within that capacity copies nothing; growing by the new cell alone copies the whole cache, `ctx × layers × row bytes`, every step |
//! | `decode_htod` | ≤ [`HTOD_MAX`] B per token | what a step must send: the token id, its position twice (RoPE, query), its sequence, its cell (20 B), and the cell table's change (the new cell's position, sequence and batch index, and the previous cell's batch index turning committed: 16 B); 36 B, plus one cell's 12 B of slack. Uploading the cell table (12 B × context) or any metadata per layer instead of once per forward exceeds it |
//! | `decode_weights_read` | within 5% of the model's bytes | a decode step reads every matrix once, the head included, one embedding row and the routed experts (issue 29); reading a matrix twice (e.g. once per token of a small batch, or a whole embedding table) moves it out |
//! | `decode_launches` | ≤ [`LAUNCHES_PER_LAYER`] per layer (MLA or routed experts: [`LAUNCHES_PER_LAYER_MLA_MOE`]) + [`LAUNCHES_FIXED`] | one launch per op of the forward (28 in a Gemma 3 layer: norms, the activation quantization before each product, products, RoPE, cache writes, attention, activation, adds; 45–50 in the MLA + MoE fixtures' layers: the latent projections and their expansion over the cache, router, routed and shared expert products, combine); a kernel per head, per cell or per expert would exceed it |
//!
//! "Steady state" is every decode step after the first: the first decode step after a prefill
//! fills the pool with the one-token sizes (the prefill's temporaries have the prompt's
//! sizes). The allocation and upload gates are judged on dense-attention models without routed
//! experts (`llama`, `gemma3`): an MLA layer expands its whole latent cache each step (buffers
//! that grow with the context: 6 allocations per step in the deepseek2 fixtures), and an MoE
//! layer uploads its routing ids, so there the figures are reported and the gates say why they
//! are not judged. The KV, weight and launch gates are judged on every model.

use anyhow::Result;
use engine::exec::{self, AnyEngine, Topology};
use engine::model::Model;
use engine::runtime::DeviceCounters;
use harness::cases::{Backend, Case, PathMode, Spec};
use harness::gate::GateResult;
use harness::report::{CaseResult, Figure, Verdict};

use super::common::{device_of, load_model, CaseEnv, TEXT};
use crate::device_counters::{decode_weight_bytes, measure, Measured};

/// Host→device bytes a decoded token may cost (see the module's table).
pub const HTOD_MAX: f64 = 48.0;
/// The weight bytes a decoded token reads may differ from the model's by this fraction.
pub const WEIGHTS_TOL: f64 = 0.05;
/// Launches per layer of a decoded token.
pub const LAUNCHES_PER_LAYER: u64 = 32;
/// Launches per layer of a decoded token where a layer has MLA or routed experts.
pub const LAUNCHES_PER_LAYER_MLA_MOE: u64 = 64;
/// Launches of a decoded token outside the layers: embedding, scale, final norm, head (with
/// its activation quantization), soft-capping.
pub const LAUNCHES_FIXED: u64 = 16;

/// Whether `case` carries the counter gates: a CUDA device, TP 1, the teacher-forced case.
pub fn applies(case: &Case) -> bool {
    matches!(case.backend, Backend::CudaEmu | Backend::Cuda { .. })
        && case.tp == 1
        && case.spec == Spec::Off
        && case.path == PathMode::Prefill
}

/// Prompt tokens and decode steps: the real model's steps cost the emulator seconds each, and
/// a prompt under the GEMM threshold keeps its prefill on the matrix-vector path.
fn shape(real: bool) -> (usize, usize) {
    if real {
        (8, 3)
    } else {
        (32, 4)
    }
}

/// Measure the counters of a short prefill and decode of `case` and add their gates and
/// figures to `result` (a failed gate fails a case that had passed).
pub fn attach(case: &Case, env: &CaseEnv<'_>, result: CaseResult) -> Result<CaseResult> {
    let (model, tokenizer) = load_model(env.path)?;
    let device = device_of(case.backend, env.threads)?;
    let engine = exec::open(&model, &device, &Topology::single())?;
    let (ctx, steps) = shape(env.real);
    let mut tokens = tokenizer.encode(TEXT, true, false)?;
    anyhow::ensure!(
        tokens.len() >= ctx + steps,
        "the fixed text has {} tokens, the counters need {}",
        tokens.len(),
        ctx + steps
    );
    tokens.truncate(ctx + steps);
    let Some(m) = measure(&engine, &tokens, ctx)? else {
        anyhow::bail!("{}: the CUDA engine counts nothing", case.name());
    };
    let (gates, figures) = judge(&m, &Shape::of(&model, &engine));
    Ok(with_gates(result, gates, figures))
}

/// What the bounds depend on.
pub struct Shape {
    pub n_layers: usize,
    pub weight_bytes: u64,
    /// Dense attention and no routed experts: the allocation and upload gates are judged.
    pub dense: bool,
}

impl Shape {
    fn of(model: &Model, engine: &AnyEngine<'_>) -> Shape {
        use engine::exec::BatchEngine;
        let c = model.config();
        Shape {
            n_layers: engine.n_layers(),
            weight_bytes: decode_weight_bytes(model),
            dense: c.mla.is_none() && c.moe.is_none(),
        }
    }
}

/// The gates and figures of a measurement.
pub fn judge(m: &Measured, s: &Shape) -> (Vec<GateResult>, Vec<Figure>) {
    let steady: &[DeviceCounters] = m.decode.get(1..).unwrap_or(&[]);
    let max = |f: fn(&DeviceCounters) -> u64| steady.iter().map(f).max().unwrap_or(0);
    let worst_step = |f: fn(&DeviceCounters) -> u64| {
        steady
            .iter()
            .enumerate()
            .max_by_key(|(_, c)| f(c))
            .map_or(0, |(i, _)| i + 2)
    };
    let mut gates = Vec::new();
    if steady.is_empty() {
        gates.push(GateResult::not_judged(
            "decode_counters",
            0.0,
            "fewer than two decode steps measured".into(),
        ));
        return (gates, Vec::new());
    }
    // The KV gate first: a cache that grows by copying also allocates, and the copy is the
    // finding.
    gates.push(GateResult::at_most(
        "decode_kv_moved",
        max(|c| c.kv_bytes_moved) as f64,
        0.0,
        format!(
            "KV-cache bytes copied in a steady-state decode step (worst: step {})",
            worst_step(|c| c.kv_bytes_moved)
        ),
    ));
    let not_dense = "not judged on MLA or routed-expert models (their steps allocate and \
                     upload by design for now)";
    let allocs = max(|c| c.allocs) as f64;
    let detail = format!(
        "device allocations in a steady-state decode step (worst: step {}, {} B) at context {}",
        worst_step(|c| c.allocs),
        max(|c| c.alloc_bytes),
        m.ctx
    );
    gates.push(if s.dense {
        GateResult::at_most("decode_allocs", allocs, 0.0, detail)
    } else {
        GateResult::not_judged("decode_allocs", allocs, not_dense.into())
    });
    let htod = max(|c| c.htod_bytes) as f64;
    let detail = "host→device bytes per decoded token (id, position, sequence, cell, the cell \
                  table's change)"
        .to_string();
    gates.push(if s.dense {
        GateResult::at_most("decode_htod", htod, HTOD_MAX, detail)
    } else {
        GateResult::not_judged("decode_htod", htod, not_dense.into())
    });
    let read = max(|c| c.weight_bytes_read) as f64;
    let ratio = read / s.weight_bytes.max(1) as f64;
    let detail = format!(
        "weight bytes read per decoded token ({read:.0}) ÷ the model's ({}); within {:.0}%",
        s.weight_bytes,
        100.0 * WEIGHTS_TOL
    );
    gates.push(GateResult::at_most(
        "decode_weights_read",
        (ratio - 1.0).abs(),
        WEIGHTS_TOL,
        detail,
    ));
    let launches = max(|c| c.launches);
    let per_layer = if s.dense {
        LAUNCHES_PER_LAYER
    } else {
        LAUNCHES_PER_LAYER_MLA_MOE
    };
    let bound = per_layer * s.n_layers as u64 + LAUNCHES_FIXED;
    gates.push(GateResult::at_most(
        "decode_launches",
        launches as f64,
        bound as f64,
        format!(
            "kernel launches per decoded token ({:.1} per layer of {})",
            launches as f64 / s.n_layers.max(1) as f64,
            s.n_layers
        ),
    ));
    let pre = |v: u64| v as f64 / m.ctx.max(1) as f64;
    let figures = vec![
        Figure::new("decode_launches", launches as f64, "/tok"),
        Figure::new("decode_htod", htod, "B/tok"),
        Figure::new("decode_dtoh", max(|c| c.dtoh_bytes) as f64, "B/tok"),
        Figure::new("decode_weights_ratio", ratio, "×"),
        Figure::new("prefill_launches", pre(m.prefill.launches), "/tok"),
        Figure::new("prefill_allocs", pre(m.prefill.allocs), "/tok"),
        Figure::new("prefill_htod", pre(m.prefill.htod_bytes), "B/tok"),
    ];
    (gates, figures)
}

/// `result` with the counter gates and figures added; a failed gate fails a passed case (the
/// first failed gate is the finding).
pub fn with_gates(
    mut result: CaseResult,
    gates: Vec<GateResult>,
    figures: Vec<Figure>,
) -> CaseResult {
    if result.verdict == Verdict::Passed {
        if let Some(g) = gates.iter().find(|g| !g.passed) {
            result.verdict = Verdict::Failed {
                finding: g.to_string(),
            };
        }
    }
    result.gates.extend(gates);
    result.figures.extend(figures);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decode step of a two-layer dense model as the fixed backend counts it.
    fn clean_step() -> DeviceCounters {
        DeviceCounters {
            launches: 50,
            allocs: 0,
            alloc_bytes: 0,
            htod_bytes: 36,
            dtoh_bytes: 1024,
            kv_bytes_moved: 0,
            weight_bytes_read: 10_000,
        }
    }

    fn shape() -> Shape {
        Shape {
            n_layers: 2,
            weight_bytes: 10_000,
            dense: true,
        }
    }

    /// The first decode step may allocate (it fills the pool); the later ones are judged.
    fn measured(first: DeviceCounters, later: DeviceCounters) -> Measured {
        Measured {
            ctx: 32,
            prefill: DeviceCounters::default(),
            decode: vec![first, later, later, later],
        }
    }

    fn failed(m: &Measured) -> Vec<&'static str> {
        let (gates, _) = judge(m, &shape());
        gates.iter().filter(|g| !g.passed).map(|g| g.gate).collect()
    }

    #[test]
    fn a_clean_decode_passes_every_gate() {
        let warm = DeviceCounters {
            allocs: 20,
            alloc_bytes: 4096,
            ..clean_step()
        };
        assert_eq!(failed(&measured(warm, clean_step())), Vec::<&str>::new());
    }

    /// The bug issue 29 names first: the cache grown by the new cell alone, reallocated and
    /// copied on every step (32 cells × 2 layers × K and V × 64 f16 values here).
    #[test]
    fn a_cache_copied_every_step_fails() {
        let copying = DeviceCounters {
            allocs: 4,
            alloc_bytes: 4 * 33 * 128,
            kv_bytes_moved: 32 * 2 * 2 * 128,
            ..clean_step()
        };
        assert_eq!(
            failed(&measured(clean_step(), copying)),
            ["decode_kv_moved", "decode_allocs"]
        );
    }

    /// Metadata uploaded per op instead of once per forward: the cell table (12 B per cell)
    /// for each layer's attention.
    #[test]
    fn metadata_uploaded_per_layer_fails() {
        let per_layer = DeviceCounters {
            htod_bytes: 4 + 2 * (12 * 33 + 4 + 8 + 4),
            ..clean_step()
        };
        assert_eq!(failed(&measured(clean_step(), per_layer)), ["decode_htod"]);
    }

    /// Reading a matrix per token of a batch, or the whole embedding table, moves the weight
    /// bytes off the model's; so does skipping one.
    #[test]
    fn weight_bytes_off_the_model_fail() {
        for read in [10_600, 9_400, 20_000] {
            let m = measured(
                clean_step(),
                DeviceCounters {
                    weight_bytes_read: read,
                    ..clean_step()
                },
            );
            assert_eq!(failed(&m), ["decode_weights_read"], "{read}");
        }
    }

    #[test]
    fn launches_past_the_bound_fail() {
        let m = measured(
            clean_step(),
            DeviceCounters {
                launches: 2 * LAUNCHES_PER_LAYER + LAUNCHES_FIXED + 1,
                ..clean_step()
            },
        );
        assert_eq!(failed(&m), ["decode_launches"]);
    }

    #[test]
    fn a_failed_gate_fails_a_passed_case_and_names_itself() {
        let copying = DeviceCounters {
            kv_bytes_moved: 100,
            ..clean_step()
        };
        let (gates, figures) = judge(&measured(clean_step(), copying), &shape());
        let r = with_gates(
            CaseResult::judged("llama/q8_0/cuda-emu/tp1-shm/off", None, vec![], vec![]),
            gates,
            figures,
        );
        match &r.verdict {
            Verdict::Failed { finding } => {
                assert!(finding.contains("decode_kv_moved"), "{finding}")
            }
            v => panic!("expected a failure, found {v:?}"),
        }
    }

    /// Non-dense models report the allocation and upload figures without judging them.
    #[test]
    fn mla_and_moe_figures_are_reported_not_judged() {
        let busy = DeviceCounters {
            allocs: 3,
            htod_bytes: 1000,
            weight_bytes_read: 50_000,
            ..clean_step()
        };
        let s = Shape {
            dense: false,
            ..shape()
        };
        let (gates, _) = judge(&measured(clean_step(), busy), &s);
        let open: Vec<_> = gates.iter().filter(|g| !g.judged).map(|g| g.gate).collect();
        assert_eq!(open, ["decode_allocs", "decode_htod"]);
        // The weight bytes (routed experts counted by their share) are judged on every model.
        let failed: Vec<_> = gates.iter().filter(|g| !g.passed).map(|g| g.gate).collect();
        assert_eq!(failed, ["decode_weights_read"]);
    }
}
