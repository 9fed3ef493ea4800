//! `cargo xtask verify --faults`: run verify once per injected engine fault, each in its own
//! process (a fault is chosen once per process, through `PLUMBLINE_FAULT`), and require that the
//! run fails **and** names the expected first divergent tap or gate.
//!
//! The expected findings are stated here, from where each fault is planted, not read back from the
//! engine: a fault reported at the wrong place is a harness bug too.

use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::Args;

/// A planted fault, the case that must catch it, and the finding it must produce.
struct Expectation {
    fault: &'static str,
    /// Case-name glob (run on this machine's best CPU backend).
    case: &'static str,
    /// The first divergent tap, or `gate:NAME` for a gate finding.
    expect: &'static str,
}

const FAULTS: &[Expectation] = &[
    // Queries rotated for position p+1: the first rotated tap is the first divergence.
    Expectation {
        fault: "rope-position-off-by-one",
        case: "llama/q8_0/*/tp1-shm/off",
        expect: "blk.0.q",
    },
    // The attention residual of layer 0 is dropped: the FFN's norm is the first tap computed from
    // the residual stream after the attention add.
    Expectation {
        fault: "skip-residual-add",
        case: "llama/q8_0/*/tp1-shm/off",
        expect: "blk.0.ffn_norm",
    },
    // The two halves of the query heads swapped, as a TP loader with shards in the wrong order.
    Expectation {
        fault: "swapped-qk-shards",
        case: "llama/q8_0/*/tp1-shm/off",
        expect: "blk.0.q",
    },
    // The gemma3 fixture's window is 8 and verify feeds 32 tokens: layer 0 is local, so its
    // attention output is the first tap to see one key too many.
    Expectation {
        fault: "sliding-window-off-by-one",
        case: "gemma3/q4_k_m/*/tp1-shm/off",
        expect: "blk.0.attn",
    },
    // deepseek2 fixture: layer 0 dense, layer 1 is the first MoE layer; its router is computed
    // correctly, the expert mix is not.
    Expectation {
        fault: "nan-in-expert",
        case: "deepseek2/q4_k/*/tp1-shm/off",
        expect: "blk.1.ffn_out",
    },
    Expectation {
        fault: "wrong-router-top-k",
        case: "deepseek2/q4_k/*/tp1-shm/off",
        expect: "blk.1.ffn_out",
    },
    // Every expert computes with its neighbour's weights; the router is right, so the first MoE
    // layer's mix (layer 0 is dense) is the first tap to differ.
    Expectation {
        fault: "permuted-experts",
        case: "deepseek2/q4_k/*/tp1-shm/off",
        expect: "blk.1.ffn_out",
    },
    // Q4_K super-block scales read 1.0625x too large. In llama-q4_k_m, token_embd is Q4_K too, but
    // embedding rows are dequantized by a lookup, not a matmul; attn_q is the first Q4_K matmul of
    // layer 0 (the norm before it has no weights of that type), so `blk.0.q` is the first tap.
    Expectation {
        fault: "wrong-dequant-scale",
        case: "llama/q4_k_m/*/tp1-shm/off",
        expect: "blk.0.q",
    },
    // Both sides get the engine's tokens, so the taps agree; only the `bos` gate, which checks the
    // fed sequences against the BOS id the reference read from the file, can see it.
    Expectation {
        fault: "tokenizer-drops-bos",
        case: "llama/q8_0/*/tp1-shm/off",
        expect: "gate:bos",
    },
    // Tree speculation (xtask/src/verify/spec_case.rs), on the extended fixture's tree case. A
    // node that also sees its previous sibling gets another context: the first gate, which
    // compares each node's logits with its path run plainly, sees it.
    Expectation {
        fault: "tree-mask-sees-sibling",
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.tree-mask",
    },
    // The tree-mask gate runs before any compaction; the compaction gate decodes after keeping
    // the deepest path and sees the wrong row.
    Expectation {
        fault: "compact-keeps-wrong-row",
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.compact",
    },
    // Both acceptance faults break the re-walk of the greedy rounds (gate 3) before the greedy
    // output comparison (gate 4).
    Expectation {
        fault: "accept-past-rejection",
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.accept-walk",
    },
    Expectation {
        fault: "accept-by-draft-probability",
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.accept-walk",
    },
    // Only when sampling (the `coin == 0` bug): the greedy gates pass, the support gate of the
    // sampled run sees a token of target probability 0.
    Expectation {
        fault: "accept-zero-probability",
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.support",
    },
];

struct Outcome {
    fault: &'static str,
    case: String,
    detected: bool,
    finding: String,
    expect: &'static str,
}

impl Outcome {
    fn localized(&self) -> bool {
        self.detected && self.finding == self.expect
    }
}

pub fn run(args: &Args) -> Result<()> {
    let exe = std::env::current_exe().context("locating the xtask binary")?;
    let mut outcomes = Vec::new();
    for e in FAULTS {
        eprintln!("fault {}: verify --filter '{}'", e.fault, e.case);
        let out_dir = args.out.join("faults").join(e.fault);
        let mut cmd = Command::new(&exe);
        cmd.args([
            "verify",
            "--json",
            "--no-bench",
            "--filter",
            e.case,
            "--exclude",
            "*/cpu-scalar/*",
        ])
        .arg("--out")
        .arg(&out_dir)
        .env(engine::faults::ENV_VAR, e.fault);
        if let Some(t) = args.threads {
            cmd.args(["--threads", &t.to_string()]);
        }
        let output = cmd
            .output()
            .with_context(|| format!("running verify with fault {}", e.fault))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let report: Value = serde_json::from_str(&stdout).with_context(|| {
            format!(
                "fault {}: verify printed no JSON report (exit {}); stderr:\n{}",
                e.fault,
                output.status,
                String::from_utf8_lossy(&output.stderr)
            )
        })?;
        outcomes.push(judge(e, &report));
    }

    let w = outcomes
        .iter()
        .map(|o| o.fault.len())
        .max()
        .unwrap_or(5)
        .max(5);
    println!(
        "{:<w$}  {:<8}  {:<9}  {:<24}  {:<24}  case",
        "fault", "detected", "localized", "finding", "expected"
    );
    for o in &outcomes {
        println!(
            "{:<w$}  {:<8}  {:<9}  {:<24}  {:<24}  {}",
            o.fault,
            if o.detected { "yes" } else { "NO" },
            if o.localized() { "yes" } else { "NO" },
            o.finding,
            o.expect,
            o.case
        );
    }
    let escaped: Vec<_> = outcomes
        .iter()
        .filter(|o| !o.localized())
        .map(|o| o.fault)
        .collect();
    let caught = outcomes.len() - escaped.len();
    println!("{caught} passed, {} failed", escaped.len());
    if !escaped.is_empty() {
        bail!(
            "faults not detected at the expected place: {}",
            escaped.join(", ")
        );
    }
    Ok(())
}

/// Read the fault run's report: the case must have failed, and its finding is the first divergent
/// tap or else the first failed gate.
fn judge(e: &'static Expectation, report: &Value) -> Outcome {
    let case = report["cases"].as_array().and_then(|cases| {
        cases
            .iter()
            .find(|c| c["verdict"]["status"] != "skipped" && !c["verdict"].is_null())
    });
    let Some(case) = case else {
        return Outcome {
            fault: e.fault,
            case: "(no runnable case)".into(),
            detected: false,
            finding: "-".into(),
            expect: e.expect,
        };
    };
    let name = case["case"].as_str().unwrap_or("?").to_owned();
    let status = case["verdict"]["status"].as_str().unwrap_or("");
    let detected = status == "failed";
    let finding = if let Some(tap) = case["first_divergence"]["finding"]["tap"].as_str() {
        tap.to_owned()
    } else if let Some(g) = case["gates"]
        .as_array()
        .and_then(|g| g.iter().find(|g| g["passed"] == false))
    {
        format!("gate:{}", g["gate"].as_str().unwrap_or("?"))
    } else if status == "error" {
        format!(
            "error: {}",
            case["verdict"]["message"].as_str().unwrap_or("?")
        )
    } else {
        "-".into()
    };
    Outcome {
        fault: e.fault,
        case: name,
        detected,
        finding,
        expect: e.expect,
    }
}
