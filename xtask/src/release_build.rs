//! Release builds that xtask makes of this workspace's binaries, and the fault-injection builds
//! beside them.
//!
//! A fault-injection build (`--features fault-injection`) shares the plain build's target
//! directory, so everything the feature does not touch (every third-party crate, the kernels,
//! the reference) is compiled once and only the engine and what depends on it compile again,
//! under other artifact hashes. Cargo puts the result at the plain binary's path, so it is copied
//! to `NAME-faults` beside it and the plain binary is put back (a fresh build: nothing compiles):
//! the plain build never carries the hooks.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// `target/release` of this workspace (or of `CARGO_TARGET_DIR`).
pub fn release_dir() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("release")
}

/// `cargo build --release --package PACKAGE` with `extra` arguments.
pub fn cargo_build(package: &str, extra: &[&str]) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .args(["build", "--release", "--package", package])
        .args(extra)
        .status()
        .with_context(|| format!("running cargo build --release --package {package}"))?;
    if !status.success() {
        bail!(
            "cargo build --release --package {package} {} failed ({status})",
            extra.join(" ")
        );
    }
    Ok(())
}

/// The plain release binary `bin` of `package`, built.
pub fn plain(package: &str, bin: &str) -> Result<PathBuf> {
    cargo_build(package, &[])?;
    Ok(release_dir().join(format!("{bin}{}", std::env::consts::EXE_SUFFIX)))
}

/// The fault-injection build of `package`'s binary `bin`, as `target/release/BIN-faults`, with
/// the plain `bin` put back (module docs).
pub fn with_faults(package: &str, bin: &str) -> Result<PathBuf> {
    let dir = release_dir();
    let exe = |name: &str| dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    cargo_build(package, &["--features", "fault-injection"])?;
    let faulty = exe(&format!("{bin}-faults"));
    std::fs::copy(exe(bin), &faulty).with_context(|| {
        format!(
            "copying the fault-injection build of {bin} to {}",
            faulty.display()
        )
    })?;
    cargo_build(package, &[])?;
    Ok(faulty)
}
