//! `plumbline`: the command-line entry point of the engine.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
