//! `cargo xtask verify --faults`: run verify once per injected engine fault, each in its own
//! process (a fault is chosen once per process, through `PLUMBLINE_FAULT`), and require that the
//! run fails **and** names the expected first divergent tap or gate.
//!
//! Hygiene:
//! - The fault hooks exist only in a separate build (xtask feature `fault-injection`: the binary
//!   `xtask-faults` beside the plain one, or the alias `cargo xtask-faults` in `target/faults`);
//!   the build that tests and benchmarks use has none. From the plain build, `--faults` builds
//!   that one first ([`fault_build`]) and runs it.
//! - A clean control run (no fault, the same cases, the same fault build) goes first; the suite
//!   fails if the control fails, since a fault "caught" by a case that fails anyway proves nothing.
//! - `--fault NAME` picks faults; an unknown name is an error that lists the known ones.
//! - CUDA faults planted in the kernel sources (`Fault::cuda_define`) reach the device code
//!   through the fault build only: the engine defines the fault's symbol in the programs NVRTC
//!   compiles (another source hash, so another cubin cache entry than the clean kernels') and
//!   `cargo xtask cuda-emu` builds an emulator with it in `target/faults/cuda-emu/<fault>`; the
//!   clean `target/cuda-emu` and the clean cubins are never built with a fault.
//! - The table is keyed by [`Fault`]; every fault of [`Fault::ALL`] must have exactly one
//!   expectation (checked before anything runs, and by a unit test).
//!
//! The expected findings are stated here, from where each fault is planted, not read back from the
//! engine: a fault reported at the wrong place is a harness bug too.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use engine::faults::Fault;
use serde_json::Value;

use super::Args;

/// A planted fault, the case that must catch it, and the finding it must produce.
struct Expectation {
    fault: Fault,
    /// Case-name glob (run on this machine's best CPU backend).
    case: &'static str,
    /// The first divergent tap, or `gate:NAME` for a gate finding.
    expect: &'static str,
}

const FAULTS: &[Expectation] = &[
    // Queries rotated for position p+1: the first rotated tap is the first divergence.
    Expectation {
        fault: Fault::RopePositionOffByOne,
        case: "llama/q8_0/*/tp1-shm/off",
        expect: "blk.0.q",
    },
    // The attention residual of layer 0 is dropped: the FFN's norm is the first tap computed from
    // the residual stream after the attention add.
    Expectation {
        fault: Fault::SkipResidualAdd,
        case: "llama/q8_0/*/tp1-shm/off",
        expect: "blk.0.ffn_norm",
    },
    // The two halves of the query heads swapped, as a TP loader with shards in the wrong order.
    Expectation {
        fault: Fault::SwappedQkShards,
        case: "llama/q8_0/*/tp1-shm/off",
        expect: "blk.0.q",
    },
    // The gemma3 fixture's window is 8 and verify feeds 32 tokens: layer 0 is local, so its
    // attention output is the first tap to see one key too many.
    Expectation {
        fault: Fault::SlidingWindowOffByOne,
        case: "gemma3/q4_k_m/*/tp1-shm/off",
        expect: "blk.0.attn",
    },
    // deepseek2 fixture: layer 0 dense, layer 1 is the first MoE layer; its router is computed
    // correctly, the expert mix is not.
    Expectation {
        fault: Fault::NanInExpert,
        case: "deepseek2/q4_k/*/tp1-shm/off",
        expect: "blk.1.ffn_out",
    },
    Expectation {
        fault: Fault::WrongRouterTopK,
        case: "deepseek2/q4_k/*/tp1-shm/off",
        expect: "blk.1.ffn_out",
    },
    // Every expert computes with its neighbour's weights; the router is right, so the first MoE
    // layer's mix (layer 0 is dense) is the first tap to differ.
    Expectation {
        fault: Fault::PermutedExperts,
        case: "deepseek2/q4_k/*/tp1-shm/off",
        expect: "blk.1.ffn_out",
    },
    // Q4_K super-block scales read 1.0625x too large. In llama-q4_k_m, token_embd is Q4_K too, but
    // embedding rows are dequantized by a lookup, not a matmul; attn_q is the first Q4_K matmul of
    // layer 0 (the norm before it has no weights of that type), so `blk.0.q` is the first tap.
    Expectation {
        fault: Fault::WrongDequantScale,
        case: "llama/q4_k_m/*/tp1-shm/off",
        expect: "blk.0.q",
    },
    // The split set is written one layer per shard (shard 0: metadata and globals), so shards 1
    // and 2 have the same layout; listed 0, 2, 1, a loader that trusts the listing reads layer 1's
    // bytes for layer 0, whose first weighted tap is its attention norm.
    Expectation {
        fault: Fault::SplitListingOrder,
        case: "llama@split-021/q8_0/*/tp1-shm/off",
        expect: "blk.0.attn_norm",
    },
    // Rank 0 holds rank 1's query rows: the gathered queries have their two halves swapped, while
    // the attention norm before them is replicated and right.
    Expectation {
        fault: Fault::TpQkvShardOrder,
        case: "llama/f16/*/tp2-shm/off",
        expect: "blk.0.q",
    },
    // Each rank keeps its partial sum of the row-parallel output projection; the gathered
    // attention before it is right.
    Expectation {
        fault: Fault::TpMissingAttnAllReduce,
        case: "llama/f16/*/tp2-shm/off",
        expect: "blk.0.attn_out",
    },
    // Every tap up to the head is right; the gathered logits have their vocabulary halves swapped.
    Expectation {
        fault: Fault::TpVocabGatherOrder,
        case: "llama/f16/*/tp2-shm/off",
        expect: "logits",
    },
    // deepseek2 (Q4_K experts of 256 cannot split over 2 ranks: expert parallel): each rank routes
    // to its own experts but holds the other rank's weights; the router is replicated and right,
    // so the first MoE layer's mix (layer 0 is dense) is the first tap to differ.
    Expectation {
        fault: Fault::TpExpertWrongRank,
        case: "deepseek2/q4_k/*/tp2-shm/off",
        expect: "blk.1.ffn_out",
    },
    // Bits, not values: every tap is within its tolerance of the reference; ranks 1-3 of 4 sum
    // each all-reduce in another order, and only the bit-for-bit rank agreement sees it.
    Expectation {
        fault: Fault::TpReduceOwnOrder,
        case: "llama/f16/*/tp4-shm/off",
        expect: "gate:tp.rank-agreement",
    },
    // Each side tokenizes with its own tokenizer: the engine's ids lack the BOS the reference's
    // have, and the `tokens` gate (judged before any tap) is the finding.
    Expectation {
        fault: Fault::TokenizerDropsBos,
        case: "llama/q8_0/*/tp1-shm/off",
        expect: "gate:tokens",
    },
    // Tree speculation (xtask/src/verify/spec_case.rs), on the extended fixture's tree case. A
    // node that also sees its previous sibling gets another context: the first gate, which
    // compares each node's logits with its path run plainly, sees it.
    Expectation {
        fault: Fault::TreeMaskSeesSibling,
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.tree-mask",
    },
    // Only a batch with two sequences at one position shows it: the batched case's first
    // forward starts three sequences together; every single-sequence case passes.
    Expectation {
        fault: Fault::BatchSeesOtherSequence,
        case: "llama/*/*/tp1-shm/batched",
        expect: "gate:batch.taps",
    },
    // Only a verify batch past 64 tokens has ancestors in the second word: the case's own tree
    // (9 tokens) passes, the hand-built fan and chain of the tree-shapes gate do not.
    Expectation {
        fault: Fault::TreeMaskFirstWordOnly,
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.tree-shapes",
    },
    // The tree-mask gate runs before any compaction; the compaction gate decodes after keeping
    // the deepest path and sees the wrong row.
    Expectation {
        fault: Fault::CompactKeepsWrongRow,
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.compact",
    },
    // Both acceptance faults break the re-walk of the greedy rounds (gate 3) before the greedy
    // output comparison (gate 4).
    Expectation {
        fault: Fault::AcceptPastRejection,
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.accept-walk",
    },
    Expectation {
        fault: Fault::AcceptByDraftProbability,
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.accept-walk",
    },
    // Only when sampling (the `coin == 0` bug): the greedy gates pass, the support gate of the
    // sampled run sees a token of target probability 0.
    Expectation {
        fault: Fault::AcceptZeroProbability,
        case: "llama/*/*/tp1-shm/tree-b8k4",
        expect: "gate:spec.support",
    },
    // The last 8 of each 32-value Q8_0 block one quantum high (weight NMSE ~1e-4): the first
    // Q8_0 product of llama-q8_0 is attn_q (token_embd is looked up, not multiplied), and the
    // exact-numerics bound of q (4.0e-6) sees what the old full-precision one (3.3e-4) did not.
    Expectation {
        fault: Fault::Q8_0BlockTail,
        case: "llama/q8_0/*/tp1-shm/off",
        expect: "blk.0.q",
    },
    // Only a product of more than 64 tokens with a partial last tile: the off cases feed 32
    // (fixtures) and 64 (real model) tokens and miss it; the chunked case's first chunk is 67,
    // so its 3 tail rows of q are the first wrong values (attn_q is the first product).
    Expectation {
        fault: Fault::PrefillTileTail,
        case: "llama/f16/*/tp1-shm/chunked",
        expect: "blk.0.q",
    },
    // One ISA's tail: only the AVX2 backend's chunked case (a fixture chunked on every CPU
    // backend) runs its products with a partial 16-token tile; the best backend's cases pass.
    Expectation {
        fault: Fault::Avx2TileTail,
        case: "gemma3/*/cpu-avx2/tp1-shm/chunked",
        expect: "blk.0.q",
    },
    // Only decode steps past position 300: the decode case steps one token at a time to 340;
    // q/k/v are right, attention over the cells without the newest one is not.
    Expectation {
        fault: Fault::DecodeLateKvOffByOne,
        case: "llama/f16/*/tp1-shm/decode",
        expect: "blk.0.attn",
    },
    // The router logits are right (layer-isolated: same input), the mix of the first MoE layer
    // (layer 0 is dense) is not.
    Expectation {
        fault: Fault::MoeWeightsSwapped,
        case: "deepseek2/q4_k/*/tp1-shm/off",
        expect: "blk.1.ffn_out",
    },
    // deepseek2's MLA query (attn_q_b after the replicated low-rank attn_q_a) split over two
    // ranks: the gathered queries have their halves swapped.
    Expectation {
        fault: Fault::TpMlaShardOrder,
        case: "deepseek2/q4_k/*/tp2-shm/off",
        expect: "blk.0.q",
    },
    // CUDA-only faults, caught by the emulated CUDA backend (cuda-emu cases: the fault build
    // runs them with --cuda-emu; the CPU cases of the same fixtures would pass). llama-q4_k_m's
    // q and k are Q4_K, attn_v of layer 0 its first Q6_K matrix: the second half of each
    // super-block of v gets wrong high bits (a 32-token prefill: the GEMM path).
    Expectation {
        fault: Fault::CudaQ6KHighBitsHalf,
        case: "llama/q4_k_m/cuda-emu/tp1-shm/off",
        expect: "blk.0.v",
    },
    // q, k and v are right; every query also sees the next token's cell.
    Expectation {
        fault: Fault::CudaCausalMaskOffByOne,
        case: "llama/q8_0/cuda-emu/tp1-shm/off",
        expect: "blk.0.attn",
    },
    // The 32-token prefill multiplies through the GEMM (≥ 16 tokens, F16 weights); attn_q is
    // its first product.
    Expectation {
        fault: Fault::CudaGemmMissingBarrier,
        case: "llama/f16/cuda-emu/tp1-shm/off",
        expect: "blk.0.q",
    },
    // RoPE turns the right projections into wrong q (the first rotated tap).
    Expectation {
        fault: Fault::CudaRopeArgsSwapped,
        case: "llama/q8_0/cuda-emu/tp1-shm/off",
        expect: "blk.0.q",
    },
    // Every tap is right; the decode steps after the prefill copy the whole cache each
    // (verify/counters.rs).
    Expectation {
        fault: Fault::CudaKvGrowsByTheNewCells,
        case: "llama/q8_0/cuda-emu/tp1-shm/off",
        expect: "gate:decode_kv_moved",
    },
    // glm-dsa (layers 0 and 2 full indexers, top-k 8 of verify's 32 tokens; the Q8_0 fixture,
    // whose clean run passes — the Q4_K one has a near-tie selection flip at blk.0 query 23):
    // the first full layer's selection is the first tap computed from the transposed scores.
    Expectation {
        fault: Fault::IndexerTopKWrongAxis,
        case: "glm-dsa/q8_0/*/tp1-shm/off",
        expect: "blk.0.indexer_top_k",
    },
    // Layer 2 (full) reuses layer 0's selection: its tap shows layer 0's positions (found there
    // by verify's layer-isolated comparison; golden's end-to-end engine_vs_reference, with the
    // route-flip allowance after the MoE layer 1, first sees it at blk.2.attn).
    Expectation {
        fault: Fault::IndexerFullLayerReuses,
        case: "glm-dsa/q8_0/*/tp1-shm/off",
        expect: "blk.2.indexer_top_k",
    },
    // The indexer's query heads half-swapped at load: layer 0's selection is the first tap.
    Expectation {
        fault: Fault::IndexerWeightsShardOrder,
        case: "glm-dsa/q8_0/*/tp1-shm/off",
        expect: "blk.0.indexer_top_k",
    },
    // Server faults (the `plumbline-faults` binary the serve case builds from the fault xtask).
    // The stop string is cut across a token boundary, so a search of the newest token's text
    // never finds it: the answer runs to its length.
    Expectation {
        fault: Fault::ServeStopInOnePiece,
        case: "llama/f16/*/tp1-shm/serve",
        expect: "gate:stop",
    },
    // The text prefixes and the greedy prompt are admitted together, so all but the first chunk
    // of a batch take their neighbour's row: at least three of the four prefixes, whose one
    // token each the `concurrent` gate judges before the greedy answer.
    Expectation {
        fault: Fault::ServeRowOfNeighbour,
        case: "llama/f16/*/tp1-shm/serve",
        expect: "gate:concurrent",
    },
    // The f16 cache truncates instead of rounding to nearest: every value it changes moves one
    // f16 unit toward zero (half of them), NMSE ~2e-7, under the q/k/v bound (4e-6) of the cache
    // rows and of every tap after them; the cache rows' rounding bias (−½ unit against ±⅛) is
    // the first to see it. The gemma3 fixture's layer 0 is its first cached row (K and V).
    Expectation {
        fault: Fault::KvF16Truncates,
        case: "gemma3/q4_k_m/*/tp1-shm/chunked-kvf16",
        expect: "blk.0.kv_cache",
    },
];

struct Outcome {
    fault: String,
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

/// Every fault of [`Fault::ALL`] has exactly one expectation, and nothing else has one.
fn check_table() -> Result<()> {
    for f in Fault::ALL {
        let n = FAULTS.iter().filter(|e| e.fault == f).count();
        if n != 1 {
            bail!(
                "fault {f} has {n} expectations in xtask/src/verify/faults.rs, expected exactly 1 \
                 (every fault of engine::faults::Fault::ALL must be checked)"
            );
        }
    }
    Ok(())
}

/// The faults `--fault` names (all when none): an unknown name is an error.
fn selected(names: &[String]) -> Result<Vec<&'static Expectation>> {
    if names.is_empty() {
        return Ok(FAULTS.iter().collect());
    }
    names
        .iter()
        .map(|n| {
            let f = Fault::from_name(n).with_context(|| {
                format!(
                    "--fault {n:?}: no such fault; expected one of {}",
                    Fault::ALL.map(|f| f.name()).join(", ")
                )
            })?;
            FAULTS
                .iter()
                .find(|e| e.fault == f)
                .with_context(|| format!("fault {f} has no expectation"))
        })
        .collect()
}

/// The xtask binary that has the engine's fault hooks: this one when it was built with them,
/// otherwise `xtask-faults`, built beside the plain one (crate::release_build).
fn fault_build() -> Result<PathBuf> {
    if cfg!(feature = "fault-injection") {
        return std::env::current_exe().context("locating the xtask binary");
    }
    eprintln!("building the fault-injection xtask beside this one (the plain build has no hooks)");
    crate::release_build::with_faults("xtask", "xtask")
}

/// One verify run of the fault build over `case` with `fault` active (`None`: the control).
fn run_one(exe: &PathBuf, args: &Args, case: &str, fault: Option<Fault>) -> Result<Value> {
    let label = fault.map_or("control".to_owned(), |f| f.name().to_owned());
    let out_dir = args.out.join("faults").join(&label);
    let mut cmd = Command::new(exe);
    cmd.args([
        "verify",
        "--json",
        "--no-bench",
        "--filter",
        case,
        "--exclude",
        "*/cpu-scalar/*",
    ])
    .arg("--out")
    .arg(&out_dir);
    // A CUDA fault runs its emulated case (even beside a GPU); the others run the CPU cases
    // their glob names, not the emulated ones the default matrix adds where no GPU is present.
    cmd.arg(if case.contains("cuda-emu") {
        "--cuda-emu"
    } else {
        "--no-cuda-emu"
    });
    match fault {
        Some(f) => cmd.env(engine::faults::ENV_VAR, f.name()),
        None => cmd.env_remove(engine::faults::ENV_VAR),
    };
    if let Some(t) = args.threads {
        cmd.args(["--threads", &t.to_string()]);
    }
    let output = cmd
        .output()
        .with_context(|| format!("running verify ({label})"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(&stdout).with_context(|| {
        format!(
            "{label}: verify printed no JSON report (exit {}); stderr:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

pub fn run(args: &Args) -> Result<()> {
    check_table()?;
    let chosen = selected(&args.fault)?;
    let exe = fault_build()?;

    // The clean control: every case the chosen faults use, no fault, must pass.
    let mut cases: Vec<&str> = chosen.iter().map(|e| e.case).collect();
    cases.sort_unstable();
    cases.dedup();
    let mut control_failures = Vec::new();
    // Emulated CUDA cases this machine cannot run (no NVRTC, no g++): their faults are reported
    // as skipped with the reason, never as caught.
    let mut unrunnable: Vec<(&str, String)> = Vec::new();
    for case in &cases {
        eprintln!("control (no fault): verify --filter '{case}'");
        let report = run_one(&exe, args, case, None)?;
        let (runnable, failed) = control_verdicts(&report);
        if runnable == 0 && case.contains("cuda-emu") {
            let reason = skip_reason(&report).unwrap_or_else(|| "no runnable case".to_owned());
            println!("control  {case}: skipped, because {reason}");
            unrunnable.push((case, reason));
            continue;
        }
        println!(
            "control  {case}: {runnable} case(s) run, {}",
            if failed.is_empty() {
                "all passed".to_owned()
            } else {
                format!("FAILED: {}", failed.join("; "))
            }
        );
        if runnable == 0 {
            control_failures.push(format!("{case}: no runnable case"));
        }
        control_failures.extend(failed);
    }
    if !control_failures.is_empty() {
        bail!(
            "the clean control run failed, so no fault result would mean anything: {}",
            control_failures.join("; ")
        );
    }

    let mut outcomes = Vec::new();
    let mut skipped = Vec::new();
    for e in chosen {
        if let Some((_, reason)) = unrunnable.iter().find(|(c, _)| *c == e.case) {
            skipped.push(format!("{} (skipped, because {reason})", e.fault));
            continue;
        }
        eprintln!("fault {}: verify --filter '{}'", e.fault, e.case);
        let report = run_one(&exe, args, e.case, Some(e.fault))?;
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
        .map(|o| o.fault.clone())
        .collect();
    let caught = outcomes.len() - escaped.len();
    for s in &skipped {
        println!("{s}");
    }
    println!(
        "{caught} passed, {} failed, {} skipped (control passed)",
        escaped.len(),
        skipped.len()
    );
    if !escaped.is_empty() {
        bail!(
            "faults not detected at the expected place: {}",
            escaped.join(", ")
        );
    }
    Ok(())
}

/// The control report: how many cases ran, and every one that did not pass.
fn control_verdicts(report: &Value) -> (usize, Vec<String>) {
    let mut runnable = 0;
    let mut failed = Vec::new();
    for c in report["cases"].as_array().into_iter().flatten() {
        let status = c["verdict"]["status"].as_str().unwrap_or("?");
        if status == "skipped" {
            continue;
        }
        runnable += 1;
        if status != "passed" {
            let why = c["verdict"]["finding"]
                .as_str()
                .or(c["verdict"]["message"].as_str())
                .unwrap_or("?");
            failed.push(format!(
                "{} {status}: {why}",
                c["case"].as_str().unwrap_or("?")
            ));
        }
    }
    (runnable, failed)
}

/// Why the report's first case was skipped, if it was.
fn skip_reason(report: &Value) -> Option<String> {
    report["cases"]
        .as_array()?
        .iter()
        .find(|c| c["verdict"]["status"] == "skipped")
        .and_then(|c| c["verdict"]["reason"].as_str())
        .map(str::to_owned)
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
            fault: e.fault.name().to_owned(),
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
        fault: e.fault.name().to_owned(),
        case: name,
        detected,
        finding,
        expect: e.expect,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_fault_has_exactly_one_expectation() {
        if let Err(e) = check_table() {
            panic!("{e:#}");
        }
    }

    #[test]
    fn unknown_fault_names_are_errors() {
        let err = selected(&["rope-positon-off-by-one".to_owned()]).err();
        let msg = err.map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(
            msg.contains("no such fault") && msg.contains("rope-position-off-by-one"),
            "{msg}"
        );
        assert_eq!(selected(&[]).map(|v| v.len()).ok(), Some(Fault::ALL.len()));
        assert_eq!(
            selected(&["skip-residual-add".to_owned()])
                .ok()
                .map(|v| v.iter().map(|e| e.fault).collect::<Vec<_>>()),
            Some(vec![Fault::SkipResidualAdd])
        );
    }
}
