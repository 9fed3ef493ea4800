//! `cargo xtask test [NEXTEST ARGS…]`: the README's test command. On a fresh machine (a clean
//! clone and a Rust toolchain, nothing else) it installs what the tests need when it is missing —
//! cargo-nextest (`cargo install --locked`), the `openai` Python package the serve tests drive the
//! server with, the NVRTC wheel the CUDA compile tests use — then runs
//! `cargo nextest run --workspace` with the given arguments. Each install says what it installs
//! and why; a failed install stops with the command that failed.

use std::process::Command;

use anyhow::{bail, Context, Result};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Only check and install the prerequisites; run no test
    #[arg(long)]
    pub install_only: bool,
    /// Arguments passed to `cargo nextest run --workspace` (after `--`)
    #[arg(last = true)]
    pub nextest: Vec<String>,
}

/// Whether `cmd args…` runs and exits 0 (its output discarded).
fn succeeds(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("{what}: starting {cmd:?}"))?;
    if !status.success() {
        bail!("{what}: {cmd:?} failed with {status}");
    }
    Ok(())
}

/// `python3 -m pip install PACKAGE`, retried with `--break-system-packages` where the system
/// Python refuses installs (PEP 668, Debian).
fn pip_install(package: &str, why: &str) -> Result<()> {
    eprintln!("xtask test: installing the {package} Python package ({why})");
    let base = [
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ];
    if succeeds("python3", &[&base[..], &[package]].concat()) {
        return Ok(());
    }
    run(
        Command::new("python3")
            .args(base)
            .arg("--break-system-packages")
            .arg(package),
        &format!("installing {package}"),
    )
}

/// Install what the tests need and is missing.
pub fn prerequisites() -> Result<()> {
    if !succeeds("cargo", &["nextest", "--version"]) {
        eprintln!("xtask test: installing cargo-nextest (the test runner; a few minutes)");
        run(
            Command::new("cargo").args(["install", "cargo-nextest", "--locked"]),
            "installing cargo-nextest",
        )?;
    }
    if !succeeds("python3", &["-m", "pip", "--version"]) {
        bail!(
            "python3 with pip is needed (the serve tests' OpenAI client, the NVRTC wheel, model \
             fetching): install it, e.g. `apt-get install python3 python3-pip`"
        );
    }
    if !succeeds("python3", &["-c", "import openai"]) {
        pip_install(
            "openai",
            "the serve tests drive plumbline serve with the official client",
        )?;
    }
    if !succeeds("python3", &["-c", "import nvidia.cuda_nvrtc"]) {
        pip_install(
            "nvidia-cuda-nvrtc-cu12",
            "NVRTC: the CUDA kernels compile on this machine without a GPU",
        )?;
    }
    Ok(())
}

pub fn run_tests(args: Args) -> Result<()> {
    prerequisites()?;
    if args.install_only {
        return Ok(());
    }
    let status = Command::new("cargo")
        .args(["nextest", "run", "--workspace"])
        .args(&args.nextest)
        .status()
        .context("starting cargo nextest")?;
    if !status.success() {
        bail!("cargo nextest run --workspace failed with {status}");
    }
    Ok(())
}
