//! Snapshot and structure tests of the writers on a synthetic report.

use super::*;
use crate::compare::compare_taps;
use crate::gate::GateResult;
use crate::tap::Tap;
use crate::tolerance::{CaseContext, TolerancePolicy};

/// Taps of a 3-layer pass: embed, then per layer q, attn, attn_out, ffn_out, out, then logits.
/// Every reference value is 1.0 on a [2, 4] tap (Σb² = 8); `delta(name)` is added to element 0 of
/// the engine's tap, so its NMSE is delta²/8.
fn passes(delta: impl Fn(&str) -> f32) -> (Vec<Tap>, Vec<Tap>) {
    let mut names = vec!["embed".to_owned()];
    for l in 0..3 {
        for k in ["q", "attn", "attn_out", "ffn_out", "out"] {
            names.push(format!("blk.{l}.{k}"));
        }
    }
    names.push("logits".into());
    let reference: Vec<Tap> = names
        .iter()
        .map(|n| Tap::new(n.clone(), vec![2, 4], vec![1.0; 8]))
        .collect();
    let engine = reference
        .iter()
        .map(|t| {
            let mut e = t.clone();
            e.data[0] += delta(&t.name);
            e
        })
        .collect();
    (engine, reference)
}

fn ctx(weights: &str, backend: &str) -> CaseContext {
    match CaseContext::new(weights, backend) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    }
}

pub(crate) fn synthetic_report() -> Report {
    let policy = TolerancePolicy::default();
    let mut r = Report::default();

    // 1. Passes: small errors growing with depth, all within the q4_k_m tolerance.
    let c1 = ctx("q4_k_m", "cpu-avx2");
    let (e, re) = passes(|n| match n {
        n if n.starts_with("blk.0.") => 1e-3,
        n if n.starts_with("blk.1.") => 4e-3,
        n if n.starts_with("blk.2.") || n == "logits" => 1e-2,
        _ => 0.0,
    });
    let cmp = compare_taps(&e, &re, &policy, &c1);
    r.push(
        CaseResult::judged(
            "gemma3-270m/q4_k_m/cpu-avx2/tp1-shm/off",
            Some(&cmp),
            vec![
                GateResult::at_least("greedy_prefix", 32.0, 32.0, "first 32 tokens match".into()),
                GateResult::at_most("kld_mean", 1.2e-3, 5e-3, "over 511 positions".into()),
            ],
            vec![
                Figure::new("decode", 41.25, "tok/s"),
                Figure::new("kld_mean", 1.2e-3, ""),
                Figure::new("roofline", 0.62, ""),
            ],
        )
        .with_tolerances(policy.table(cmp.n_layers, &c1))
        .with_duration(12.5),
    );

    // 2. Fails at blk.1.attn_out (and everything after it), f32 tolerance.
    let c2 = ctx("f32", "cpu-scalar");
    let (e, re) = passes(|n| {
        let after = ["blk.1.attn_out", "blk.1.ffn_out", "blk.1.out", "logits"].contains(&n)
            || n.starts_with("blk.2.");
        if after {
            0.5
        } else {
            0.0
        }
    });
    let cmp = compare_taps(&e, &re, &policy, &c2);
    r.push(
        CaseResult::judged(
            "llama/f32/cpu-scalar/tp1-shm/off",
            Some(&cmp),
            vec![],
            vec![],
        )
        .with_duration(1.0),
    );

    // 3. Taps fine but a gate fails.
    r.push(CaseResult::judged(
        "llama/q8_0/cpu-avx2/tp1-shm/off",
        None,
        vec![
            GateResult::at_most(
                "kld_mean",
                0.0213,
                5e-3,
                "over 511 positions; max 1.7 at position 88".into(),
            ),
            GateResult::at_least(
                "same_top1",
                0.91,
                0.95,
                "first differing top-1 at position 3".into(),
            ),
        ],
        vec![Figure::new("kld_mean", 0.0213, "")],
    ));

    // 4. Skipped; 5. error with characters that need escaping.
    r.push(CaseResult::skipped(
        "gemma3-270m/q4_k_m/cuda-sm90/tp1-shm/off",
        "no CUDA device",
    ));
    r.push(CaseResult::error(
        "deepseek2/q4_k/cpu-avx2/tp1-shm/off",
        "reading fixture <deepseek2-q4_k.gguf>: tensor \"blk.0.ffn_gate_exps\" | offset 12 & beyond end",
    ));
    r
}

#[test]
fn verdicts_and_summary() {
    let r = synthetic_report();
    let labels: Vec<&str> = r.cases.iter().map(|c| c.verdict.label()).collect();
    assert_eq!(labels, ["PASS", "FAIL", "FAIL", "SKIP", "ERROR"]);
    assert_eq!(r.summary().to_string(), "1 passed, 3 failed, 1 skipped");
    assert!(r.has_failures());
    let d = r.cases[1]
        .first_divergence
        .as_ref()
        .map(|d| d.finding.tap().to_owned());
    assert_eq!(d.as_deref(), Some("blk.1.attn_out"));
    // NMSE of blk.1.attn_out is 0.5²/8.
    assert!(r.cases[1]
        .layer_series
        .iter()
        .any(|s| s.kind == crate::tap::TapKind::AttnOut
            && s.points
                .iter()
                .any(|p| p.layer == 1 && (p.nmse - 0.03125).abs() < 1e-12)));
}

#[test]
fn a_gate_not_judged_is_shown_and_counted_not_passed_silently() {
    let mut r = Report::default();
    r.push(CaseResult::judged(
        "m/q8_0/cpu-avx2/tp1-shm/off",
        None,
        vec![
            GateResult::at_most("kld_mean", 0.0, 1.0, String::new()),
            GateResult::not_judged("decode_ratio", 0.5, "no baseline".into()),
        ],
        Vec::new(),
    ));
    assert_eq!(r.cases[0].verdict.label(), "PASS");
    assert_eq!(
        r.cases[0].headline(),
        "not judged: decode_ratio (no baseline)"
    );
    assert_eq!(
        r.summary().to_string(),
        "1 passed, 0 failed, 0 skipped (1 with gates not judged)"
    );
    assert!(markdown(&r).contains("| decode_ratio | NOT JUDGED |"));
}

#[test]
fn console_table_snapshot() {
    let text = console_table(&synthetic_report());
    assert!(text.lines().any(|l| l == "1 passed, 3 failed, 1 skipped"));
    insta::assert_snapshot!("console", text);
}

#[test]
fn junit_snapshot() {
    let xml = junit_xml(&synthetic_report());
    assert!(xml.contains(r#"<skipped message="no CUDA device"/>"#));
    assert!(xml.contains("&lt;deepseek2-q4_k.gguf&gt;"));
    insta::assert_snapshot!("junit", xml);
}

#[test]
fn markdown_snapshot() {
    let md = markdown(&synthetic_report());
    assert!(md.lines().any(|l| l == "1 passed, 3 failed, 1 skipped"));
    assert!(md.contains("](plots/gemma3-270m/q4_k_m/cpu-avx2/tp1-shm/off.svg)"));
    insta::assert_snapshot!("markdown", md);
}

#[test]
fn svg_snapshot() {
    let r = synthetic_report();
    let svg = layer_plot_svg(&r.cases[1].case, &r.cases[1].layer_series);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // q, attn, attn_out, ffn_out, out and the tolerance line.
    assert_eq!(svg.matches("<polyline").count(), 6);
    insta::assert_snapshot!("svg", svg);
}

#[test]
fn svg_handles_zero_infinite_and_single_layer() {
    use crate::compare::{LayerPoint, LayerSeries};
    let series = vec![LayerSeries {
        kind: crate::tap::TapKind::Out,
        points: vec![LayerPoint {
            layer: 0,
            nmse: 0.0,
            nmse_max: f64::INFINITY,
        }],
    }];
    let svg = layer_plot_svg("t", &series);
    assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
    let empty = layer_plot_svg("t", &[]);
    assert!(empty.contains("</svg>") && !empty.contains("<polyline"));
}

#[test]
fn json_has_summary_tagged_verdicts_and_encodes_infinity() {
    let mut r = synthetic_report();
    r.cases[0]
        .figures
        .push(Figure::new("nmse_zero_ref", f64::INFINITY, ""));
    let json = match r.to_json() {
        Ok(j) => j,
        Err(e) => panic!("{e}"),
    };
    let v: serde_json::Value = match serde_json::from_str(&json) {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(
        v["summary"],
        serde_json::json!({"passed": 1, "failed": 3, "skipped": 1, "not_judged": 0})
    );
    assert_eq!(
        v["cases"][3]["verdict"],
        serde_json::json!({"status": "skipped", "reason": "no CUDA device"})
    );
    assert_eq!(
        v["cases"][1]["first_divergence"]["finding"]["kind"],
        "past_tolerance"
    );
    assert_eq!(
        v["cases"][1]["first_divergence"]["finding"]["tap"],
        "blk.1.attn_out"
    );
    assert_eq!(v["cases"][0]["figures"][3]["value"], "inf");
    assert_eq!(v["cases"][0]["gates"][0]["gate"], "greedy_prefix");
    assert_eq!(
        v["cases"][0]["tolerances"].as_array().map(Vec::len),
        Some(harness_tap_kinds())
    );
}

#[test]
fn write_all_writes_every_file() {
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("{e}"),
    };
    let w = match synthetic_report().write_all(dir.path()) {
        Ok(w) => w,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(w.plots.len(), 2);
    assert!(w.plots[0].ends_with("plots/gemma3-270m/q4_k_m/cpu-avx2/tp1-shm/off.svg"));
    for p in [&w.json, &w.junit, &w.markdown].into_iter().chain(&w.plots) {
        assert!(
            std::fs::metadata(p).is_ok_and(|m| m.len() > 0),
            "{}",
            p.display()
        );
    }
}

#[test]
fn plot_paths_stay_inside_plots() {
    for (case, path) in [
        (
            "llama/q4_0/cpu-scalar/tp1-shm/off",
            "plots/llama/q4_0/cpu-scalar/tp1-shm/off.svg",
        ),
        ("../../etc/passwd", "plots/__/__/etc/passwd.svg"),
        ("a b/c:d", "plots/a_b/c_d.svg"),
        ("x//y", "plots/x/_/y.svg"),
    ] {
        assert_eq!(plot_path(case), path);
    }
}

/// One tolerance row per tap kind.
fn harness_tap_kinds() -> usize {
    crate::tap::TapKind::ALL.len()
}
