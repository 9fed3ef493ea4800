//! `cargo xtask kernels [--json] [--arch N]...`: compile every CUDA kernel file for every
//! target architecture (sm_80 … sm_120) through NVRTC — no GPU and no CUDA install needed, only
//! the `nvidia-cuda-nvrtc-cu12` wheel — and print, per kernel and architecture, registers,
//! spills and shared memory. Fails on any compile error, any cubin built for the wrong
//! architecture, and any register spill.

use anyhow::{bail, Context, Result};
use engine::runtime::cuda::{self, FileReport, KernelStats, LibrarySearch, Nvrtc};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// Print JSON instead of tables
    #[arg(long)]
    json: bool,
    /// Only these architectures (e.g. `--arch 90 --arch 103`); default: all seven targets
    #[arg(long)]
    arch: Vec<u32>,
}

pub fn run(args: Args) -> Result<()> {
    let nvrtc = Nvrtc::load(&LibrarySearch::from_env())
        .context("loading NVRTC (pip install nvidia-cuda-nvrtc-cu12)")?;
    let archs = if args.arch.is_empty() {
        cuda::TARGET_ARCHS.to_vec()
    } else {
        args.arch.clone()
    };
    let (ma, mi) = nvrtc.version();
    eprintln!(
        "NVRTC {ma}.{mi} at {}; compiling {} files for {}",
        nvrtc.path().display(),
        cuda::FILES.len(),
        archs
            .iter()
            .map(|a| format!("sm_{a}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t = std::time::Instant::now();
    let reports = cuda::compile_all(&nvrtc, &cuda::FILES, &archs, threads);
    let seconds = t.elapsed().as_secs_f64();

    let errors: Vec<&FileReport> = reports.iter().filter(|r| r.result.is_err()).collect();
    let spills: Vec<(&FileReport, &KernelStats)> = reports
        .iter()
        .flat_map(|r| r.spills().into_iter().map(move |s| (r, s)))
        .collect();
    let all: Vec<(&FileReport, &KernelStats)> = reports
        .iter()
        .filter_map(|r| r.result.as_ref().ok().map(|k| (r, k)))
        .flat_map(|(r, k)| k.iter().map(move |s| (r, s)))
        .collect();
    let max_regs = all.iter().max_by_key(|(_, s)| s.registers);
    let max_smem = all.iter().max_by_key(|(_, s)| s.shared_bytes);
    let n_kernels = {
        let mut names: Vec<&str> = all.iter().map(|(_, s)| s.name.as_str()).collect();
        names.sort();
        names.dedup();
        names.len()
    };

    if args.json {
        let rows: Vec<_> = all
            .iter()
            .map(|(r, s)| {
                json!({"file": r.file, "kernel": s.name, "arch": format!("sm_{}", r.arch),
                       "registers": s.registers, "spill_stores": s.spill_stores,
                       "spill_loads": s.spill_loads, "shared_bytes": s.shared_bytes,
                       "stack_bytes": s.stack_bytes})
            })
            .collect();
        let errs: Vec<_> = errors
            .iter()
            .map(|r| {
                json!({"file": r.file, "arch": format!("sm_{}", r.arch),
                           "error": r.result.as_ref().err().map(|e| e.to_string())})
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "nvrtc": format!("{ma}.{mi}"), "nvrtc_path": nvrtc.path(),
                "archs": archs.iter().map(|a| format!("sm_{a}")).collect::<Vec<_>>(),
                "kernels": n_kernels, "compiled": all.len(), "errors": errs,
                "spills": spills.len(), "seconds": seconds, "rows": rows,
            }))?
        );
    } else {
        print_table(&reports, &archs);
        println!();
        println!(
            "{n_kernels} kernels × {} architectures: {} compiled, {} file errors, {} spilling, {seconds:.0} s on {threads} threads",
            archs.len(),
            all.len(),
            errors.len(),
            spills.len()
        );
        if let Some((r, s)) = max_regs {
            println!(
                "max registers: {} ({} on sm_{})",
                s.registers, s.name, r.arch
            );
        }
        if let Some((r, s)) = max_smem {
            println!(
                "max static shared memory: {} bytes ({} on sm_{})",
                s.shared_bytes, s.name, r.arch
            );
        }
    }
    for r in &errors {
        if let Err(e) = &r.result {
            eprintln!("error: {} for sm_{}: {e}", r.file, r.arch);
        }
    }
    for (r, s) in &spills {
        eprintln!(
            "error: {} spills on sm_{}: {} bytes stored, {} loaded",
            s.name, r.arch, s.spill_stores, s.spill_loads
        );
    }
    if !errors.is_empty() || !spills.is_empty() {
        bail!(
            "{} compile errors and {} spilling kernels",
            errors.len(),
            spills.len()
        );
    }
    Ok(())
}

/// One row per kernel, one column per architecture: `registers/spilled bytes/smem bytes`.
fn print_table(reports: &[FileReport], archs: &[u32]) {
    let mut names: Vec<(&str, &str)> = Vec::new();
    for r in reports {
        if let Ok(k) = &r.result {
            for s in k {
                if !names.iter().any(|(_, n)| *n == s.name) {
                    names.push((r.file, &s.name));
                }
            }
        }
    }
    names.sort();
    print!("{:<15} {:<20}", "file", "kernel");
    for a in archs {
        print!(" {:>13}", format!("sm_{a}"));
    }
    println!();
    print!("{:<15} {:<20}", "", "(regs/spill/smem)");
    println!();
    for (file, name) in names {
        print!("{file:<15} {name:<20}");
        for &a in archs {
            let cell = reports
                .iter()
                .find(|r| r.file == file && r.arch == a)
                .and_then(|r| r.result.as_ref().ok())
                .and_then(|k| k.iter().find(|s| s.name == name))
                .map_or("ERROR".to_string(), |s| {
                    format!(
                        "{}/{}/{}",
                        s.registers,
                        s.spill_stores + s.spill_loads,
                        s.shared_bytes
                    )
                });
            print!(" {cell:>13}");
        }
        println!();
    }
}
