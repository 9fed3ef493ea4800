//! `cargo xtask golden [--json]`: regenerate the golden snapshots (`golden/tests/snapshots/`) and
//! list the ones that changed.
//!
//! Runs `cargo test -p golden --test golden_snapshots` with `INSTA_UPDATE=new` and
//! `INSTA_FORCE_PASS=1`, so every snapshot that differs is written beside the old one as
//! `*.snap.new` (all of them, not only the first) and nothing is accepted. A person then reviews
//! the diffs with `cargo insta review` (or `cargo insta accept` / `cargo insta reject`).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// Print the changed and new snapshots as JSON instead of text
    #[arg(long)]
    json: bool,
}

const TEST: &str = "golden_snapshots";

fn snapshots_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/tests/snapshots");
    // Only for a tidier path in messages; the joined path works as well.
    dir.canonicalize().unwrap_or(dir)
}

/// The pending `*.snap.new` files in `dir`, sorted.
fn pending(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    for entry in entries {
        let path = entry
            .with_context(|| format!("listing {}", dir.display()))?
            .path();
        if path.to_string_lossy().ends_with(".snap.new") {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

pub fn run(args: Args) -> Result<()> {
    let dir = snapshots_dir();
    // Stale `.snap.new` files from an earlier run would be reported as changes; start clean.
    for stale in pending(&dir)? {
        std::fs::remove_file(&stale)
            .with_context(|| format!("removing stale {}", stale.display()))?;
    }

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    tracing::info!("running cargo test -p golden --test {TEST} with INSTA_UPDATE=new");
    let status = Command::new(&cargo)
        .args(["test", "-p", "golden", "--test", TEST])
        .env("INSTA_UPDATE", "new")
        .env("INSTA_FORCE_PASS", "1")
        .status()
        .with_context(|| format!("running {} test", cargo.to_string_lossy()))?;
    if !status.success() {
        bail!("expected `cargo test -p golden --test {TEST}` to pass (snapshot mismatches are not failures here), found {status}");
    }

    let mut changed = Vec::new();
    let mut new = Vec::new();
    for path in pending(&dir)? {
        let name = path
            .file_name()
            .map(|n| {
                n.to_string_lossy()
                    .trim_end_matches(".snap.new")
                    .to_string()
            })
            .unwrap_or_default();
        if path.with_extension("").is_file() {
            changed.push(name);
        } else {
            new.push(name);
        }
    }

    if args.json {
        println!(
            "{}",
            json!({ "snapshots_dir": dir, "changed": changed, "new": new })
        );
        return Ok(());
    }
    if changed.is_empty() && new.is_empty() {
        println!("all golden snapshots are up to date ({})", dir.display());
        return Ok(());
    }
    for name in &changed {
        println!("changed: {name}");
    }
    for name in &new {
        println!("new:     {name}");
    }
    println!(
        "{} snapshot(s) pending in {}: review them with `cargo insta review` \
         (or `cargo insta accept` / `cargo insta reject` for all)",
        changed.len() + new.len(),
        dir.display()
    );
    Ok(())
}
