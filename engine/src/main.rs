//! `plumbline`: the command-line entry point of the engine.

mod cli;

// The subcommands live in the binary and reach the library as `crate::gguf`.
use engine::gguf;

fn main() -> std::process::ExitCode {
    cli::main()
}
