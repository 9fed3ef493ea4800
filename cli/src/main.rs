//! `plumbline`: the command-line entry point of the engine. One module per subcommand.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[cfg(feature = "cuda")]
mod doctor;
mod dump;
mod engine_args;
mod generate;
mod inspect;
mod perplexity;
mod serve;
mod spec_bench;
mod tokenize;
mod tp_plan;

#[derive(Parser)]
#[command(
    name = "plumbline",
    version,
    about = "LLM inference engine and verification harness"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show a GGUF file's metadata, tensors (type, shape, bytes, shard, offset) and totals per type
    Inspect(inspect::Args),
    /// Write one tensor dequantized to f32 (raw little-endian, or .npy)
    Dump(dump::Args),
    /// Continue a prompt (greedy by default), streaming the text as it decodes
    Generate(generate::Args),
    /// Perplexity of a text file as llama.cpp's llama-perplexity computes it
    Perplexity(perplexity::Args),
    /// Show the token ids and pieces of a text under a model's vocabulary
    Tokenize(tokenize::Args),
    /// Tree speculation on code, repetitive text and prose: τ and speedup over plain decoding
    SpecBench(spec_bench::Args),
    /// Preflight: CPU, CUDA driver, NVRTC, devices, kernels compiled and run, the model; root causes
    #[cfg(feature = "cuda")]
    Doctor(doctor::Args),
    /// Show how N tensor-parallel ranks hold the model and the communication per token
    TpPlan(tp_plan::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (ready only once it can generate)
    Serve(serve::Args),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {
        Command::Inspect(args) => inspect::run(args),
        Command::Dump(args) => dump::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::SpecBench(args) => spec_bench::run(args),
        #[cfg(feature = "cuda")]
        Command::Doctor(args) => doctor::run(args),
        Command::TpPlan(args) => tp_plan::run(args),
        Command::Serve(args) => serve::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
