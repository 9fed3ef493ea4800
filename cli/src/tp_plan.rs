//! `plumbline tp-plan --model FILE --tp N [--topology pcie|nvlink] [--json]`: how N
//! tensor-parallel ranks would hold the model (every tensor's split, bytes per rank, what is
//! replicated and why) and the communication per decoded token, modelled for the interconnect.
//! The ranks themselves are opened by `engine::exec::open` (`--tp N` on every model command).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use engine::model::Model;
use engine::tp::cost::{self, Link, TokenComm};
use serde_json::json;

/// An interconnect to model.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum TopologyArg {
    /// PCIe Gen5 ×16
    Pcie,
    /// NVLink 4 and NVLink 5
    Nvlink,
}

impl TopologyArg {
    fn links(self) -> Vec<Link> {
        match self {
            TopologyArg::Pcie => vec![cost::PCIE_GEN5_X16],
            TopologyArg::Nvlink => vec![cost::NVLINK4, cost::NVLINK5],
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// GGUF model file (any shard of a split set)
    #[arg(long)]
    pub model: PathBuf,
    /// Tensor-parallel degree
    #[arg(long)]
    pub tp: usize,
    /// Interconnect to model (default: PCIe Gen5 ×16 and NVLink 4/5)
    #[arg(long, value_enum)]
    pub topology: Option<TopologyArg>,
    /// Print one JSON object instead of tables
    #[arg(long)]
    pub json: bool,
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

pub fn run(args: Args) -> Result<()> {
    let model = Model::load(&args.model)
        .with_context(|| format!("loading model {}", args.model.display()))?;
    let c = model.config();
    let plan = engine::tp::ShardPlan::for_gguf(c, model.gguf(), args.tp)
        .with_context(|| format!("planning {} for TP {}", args.model.display(), args.tp))?;
    let comm = TokenComm::of(c, &plan);
    let links = args
        .topology
        .map_or_else(|| cost::LINKS.to_vec(), |t| t.links());
    let d = &plan.decisions;
    let decision = |x: &engine::tp::Decision| match x {
        engine::tp::Decision::Split => "split".to_owned(),
        engine::tp::Decision::Replicated { reason } => format!("replicated: {reason}"),
    };
    let moe = match &d.moe {
        engine::tp::MoeMode::None => "none".to_owned(),
        engine::tp::MoeMode::SplitExperts => "split experts".to_owned(),
        engine::tp::MoeMode::ExpertParallel => "expert parallel".to_owned(),
        engine::tp::MoeMode::Replicated { reason } => format!("replicated: {reason}"),
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        let tensors: Vec<_> = plan
            .tensors
            .iter()
            .map(|p| {
                json!({
                    "name": p.tensor.name,
                    "type": p.tensor.ty.name(),
                    "dims": p.tensor.dims,
                    "placement": p.placement.name(),
                    "bytes_per_rank": p.ranks.iter().map(|r| r.bytes).collect::<Vec<_>>(),
                    "rows": p.ranks.iter().map(|r| [r.rows.start, r.rows.end]).collect::<Vec<_>>(),
                    "cols": p.ranks.iter().map(|r| [r.cols.start, r.cols.end]).collect::<Vec<_>>(),
                    "experts": p.ranks.iter().map(|r| [r.experts.start, r.experts.end]).collect::<Vec<_>>(),
                    "note": p.note,
                })
            })
            .collect();
        let modelled: Vec<_> = links
            .iter()
            .map(|l| {
                json!({
                    "link": l.name,
                    "seconds_per_token": comm.modelled_s(l),
                    "bandwidth_bytes_per_s": l.bandwidth,
                    "step_latency_s": l.step_latency,
                    "base_latency_s": l.base_latency,
                    "source": l.source,
                    "modelled": true,
                })
            })
            .collect();
        let v = json!({
            "model": args.model,
            "degree": args.tp,
            "attention": decision(&d.attn),
            "kv_heads": d.kv_note,
            "ffn": decision(&d.ffn),
            "moe": moe,
            "vocab": decision(&d.vocab),
            "bytes_per_rank": plan.bytes_per_rank(),
            "tensors": tensors,
            "per_token": {
                "all_reduces": comm.all_reduces,
                "all_reduce_bytes": comm.all_reduce_bytes,
                "all_gathers": comm.all_gathers,
                "all_gather_bytes": comm.all_gather_bytes,
                "bytes": comm.bytes(),
                "modelled": modelled,
            },
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(out, "{} at TP {}", args.model.display(), args.tp)?;
    writeln!(out, "  attention: {}", decision(&d.attn))?;
    if let Some(n) = &d.kv_note {
        writeln!(out, "  kv heads:  {n}")?;
    }
    writeln!(out, "  ffn:       {}", decision(&d.ffn))?;
    writeln!(out, "  moe:       {moe}")?;
    writeln!(out, "  vocab:     {}", decision(&d.vocab))?;
    writeln!(out)?;
    let w = plan
        .tensors
        .iter()
        .map(|p| p.tensor.name.len())
        .max()
        .unwrap_or(6)
        .max(6);
    writeln!(
        out,
        "{:<w$}  {:<7}  {:<10}  {:>12}  {:>12}  note",
        "tensor", "type", "placement", "rank0 bytes", "all ranks"
    )?;
    for p in &plan.tensors {
        let total: u64 = p.ranks.iter().map(|r| r.bytes).sum();
        writeln!(
            out,
            "{:<w$}  {:<7}  {:<10}  {:>12}  {:>12}  {}",
            p.tensor.name,
            p.tensor.ty.name(),
            p.placement.name(),
            p.ranks.first().map_or(0, |r| r.bytes),
            total,
            p.note.as_deref().unwrap_or("")
        )?;
    }
    writeln!(out)?;
    let per_rank: Vec<String> = plan
        .bytes_per_rank()
        .iter()
        .map(|&b| format!("{:.1}", mib(b)))
        .collect();
    writeln!(out, "MiB per rank: {}", per_rank.join(", "))?;
    writeln!(
        out,
        "per decoded token: {} all-reduces of {} B, {} all-gather of {} B ({} B in all)",
        comm.all_reduces,
        comm.all_reduce_bytes,
        comm.all_gathers,
        comm.all_gather_bytes,
        comm.bytes()
    )?;
    for l in &links {
        writeln!(
            out,
            "  {:<14} {:>9.1} us per token (modelled: ring, {})",
            l.name,
            comm.modelled_s(l) * 1e6,
            l.source
        )?;
    }
    Ok(())
}
