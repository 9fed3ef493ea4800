//! Golden summaries: what the reference makes of one model file, condensed for a person to review.
//!
//! [`summarize`] loads a model with the reference (f64), runs it on a prompt, and records the
//! prompt, a summary of every tap (docs/TAPS.md), and an 8-step greedy continuation with the
//! top-5 candidates at every step. `tests/golden_snapshots.rs` pins these as `insta` snapshots, so
//! any change to the reference's numerics, to a fixture, or to the tokenizer shows up as a diff that
//! somebody must accept with `cargo insta review`.
//!
//! Floats are rounded to [`SIG_DIGITS`] significant digits *here*, not with insta's
//! `rounded_redaction`: that rounds to a fixed number of decimals, which is wrong for values that
//! span 1e-4 (fixture taps) to 1e3 (Gemma's scaled embeddings). Any real change to a layer
//! (relative ≥ 1e-3) still shows.
//!
//! The reference computes in **f64** here, so that a snapshot is a function of the code and not of
//! the machine: candle's CPU matmul picks its kernel (AVX2, AVX-512, …) at run time, and each sums
//! in its own order. In f32 that order moves a value by ~1e-6 of itself, enough to carry a
//! four-digit rounding across a boundary now and then (a tap mean of 0.00095125 printed as
//! 0.0009513 on one machine and 0.0009512 on another, which failed CI on an AVX-512 machine for
//! snapshots taken on an AVX2 one). In f64 the order moves a value by ~1e-15, and the chance that
//! any of a snapshot's few thousand numbers sits that close to a boundary is ~1e-11.
//!
//! Greedy decoding runs without a KV cache: one full forward pass over the whole sequence per
//! step, the simplest thing that can be trusted.

use std::path::{Path, PathBuf};

use engine::gguf::{Gguf, GgufError};
use engine::tokenizer::{Tokenizer, TokenizerError};
use reference::{Precision, ReferenceError, ReferenceModel};
use serde::Serialize;

use crate::fixtures::{self, FixtureError, FixtureSpec};
use crate::vocab;

/// Significant digits every float in a summary is rounded to (see the module docs).
pub const SIG_DIGITS: usize = 4;

/// Greedy steps recorded per model.
pub const GREEDY_STEPS: usize = 8;

/// Candidates recorded per greedy step.
pub const TOP_K: usize = 5;

/// Tokens of [`vocab::SAMPLE_PIECES`] used as the fixtures' prompt: `<s>` and five words, so that
/// prompt plus continuation (14 tokens) crosses the gemma3 fixture's sliding window of 8.
pub const FIXTURE_PROMPT_TOKENS: usize = 6;

/// The real model's prompt (tokenized with BOS by the engine's tokenizer).
pub const REAL_MODEL_PROMPT: &str = "The capital of France is";

/// The real model's file name in the model cache.
pub const REAL_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

/// Why a summary could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("reference on {path}: {source}")]
    Reference {
        path: PathBuf,
        source: ReferenceError,
    },
    #[error("opening {path} for its tokenizer: {source}")]
    Gguf { path: PathBuf, source: GgufError },
    #[error("tokenizer of {path}: {source}")]
    Tokenizer {
        path: PathBuf,
        source: TokenizerError,
    },
    #[error(transparent)]
    Fixture(#[from] FixtureError),
    #[error("prompt for {path} has no tokens")]
    EmptyPrompt { path: PathBuf },
    #[error("expected {expected} logits ({n_tokens} tokens × vocab {vocab}), found {found}")]
    LogitsLength {
        expected: usize,
        n_tokens: usize,
        vocab: usize,
        found: usize,
    },
}

/// What to feed the model.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Text, tokenized by the engine's tokenizer read from the model file (with BOS).
    Text(String),
    /// Token ids used as they are; the recorded text is their decoding.
    Tokens(Vec<u32>),
}

/// The golden summary of one model on one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct GoldenSummary {
    /// The file stem, e.g. `gemma-3-270m-q4_k_m` or a fixture's name.
    pub model: String,
    /// `general.architecture`.
    pub architecture: String,
    pub vocab_size: usize,
    pub prompt: PromptSummary,
    /// Every tap of the forward pass on the prompt, in forward order.
    pub taps: Vec<TapSummary>,
    pub greedy: Greedy,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptSummary {
    pub text: String,
    pub tokens: Vec<u32>,
}

/// One tap, condensed: its shape and the mean, RMS, min and max over all its values.
#[derive(Debug, Clone, Serialize)]
pub struct TapSummary {
    pub name: String,
    pub shape: Vec<usize>,
    pub mean: f64,
    pub rms: f64,
    pub min: f64,
    pub max: f64,
}

/// The greedy continuation of the prompt.
#[derive(Debug, Clone, Serialize)]
pub struct Greedy {
    pub tokens: Vec<u32>,
    /// The decoding of `tokens` alone (without the prompt).
    pub text: String,
    /// One entry per generated token: the candidates it was chosen from.
    pub steps: Vec<Step>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Step {
    /// The [`TOP_K`] most likely next tokens, most likely first; the first is the one taken.
    pub top: Vec<Candidate>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub id: u32,
    pub piece: Option<String>,
    pub logit: f64,
    pub log_prob: f64,
}

/// `x` rounded to [`SIG_DIGITS`] significant digits (non-finite values pass through, and serialize
/// as `null`, which a reviewer will notice).
pub fn round_sig(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    // Through the decimal representation, so that the stored f64 is the one nearest the rounded
    // decimal and serializes as exactly SIG_DIGITS digits.
    format!("{:.*e}", SIG_DIGITS - 1, x).parse().unwrap_or(x)
}

/// The model cache: `$PLUMBLINE_MODELS`, else `~/.cache/plumbline/models` (as `xtask fetch-model`).
pub fn models_dir() -> Option<PathBuf> {
    match std::env::var_os("PLUMBLINE_MODELS") {
        Some(dir) => Some(PathBuf::from(dir)),
        None => Some(PathBuf::from(std::env::var_os("HOME")?).join(".cache/plumbline/models")),
    }
}

/// The real model's path, if it has been fetched.
pub fn real_model_path() -> Option<PathBuf> {
    let path = models_dir()?.join(REAL_MODEL_FILE);
    path.is_file().then_some(path)
}

/// The summary of fixture `spec`, written under `dir`, on its standard prompt.
pub fn fixture_summary(spec: &FixtureSpec, dir: &Path) -> Result<GoldenSummary, SnapshotError> {
    let path = fixtures::write(spec, dir)?;
    let tokens: Vec<u32> = vocab::sample_tokens()
        .into_iter()
        .take(FIXTURE_PROMPT_TOKENS)
        .collect();
    summarize(&path, &Prompt::Tokens(tokens), GREEDY_STEPS)
}

/// The summary of the real model at `path` on [`REAL_MODEL_PROMPT`].
pub fn real_model_summary(path: &Path) -> Result<GoldenSummary, SnapshotError> {
    summarize(
        path,
        &Prompt::Text(REAL_MODEL_PROMPT.to_string()),
        GREEDY_STEPS,
    )
}

/// Load `path` with the reference (f64, see the module docs) and summarize it on `prompt` with `steps` greedy steps.
pub fn summarize(
    path: &Path,
    prompt: &Prompt,
    steps: usize,
) -> Result<GoldenSummary, SnapshotError> {
    let gguf = Gguf::open(path).map_err(|source| SnapshotError::Gguf {
        path: path.to_path_buf(),
        source,
    })?;
    let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|source| SnapshotError::Tokenizer {
        path: path.to_path_buf(),
        source,
    })?;
    drop(gguf);
    let (text, tokens) = match prompt {
        Prompt::Text(text) => {
            let ids =
                tokenizer
                    .encode(text, true, false)
                    .map_err(|source| SnapshotError::Tokenizer {
                        path: path.to_path_buf(),
                        source,
                    })?;
            (text.clone(), ids)
        }
        Prompt::Tokens(ids) => (tokenizer.decode(ids), ids.clone()),
    };
    if tokens.is_empty() {
        return Err(SnapshotError::EmptyPrompt {
            path: path.to_path_buf(),
        });
    }

    let reference_err = |source| SnapshotError::Reference {
        path: path.to_path_buf(),
        source,
    };
    let model = ReferenceModel::load(path, Precision::F64).map_err(reference_err)?;
    let vocab_size = model.vocab_size();

    let mut taps = Vec::new();
    let mut logits = model
        .forward(&tokens, &mut |name, shape, data| {
            taps.push(tap_summary(name, shape, data));
        })
        .map_err(reference_err)?;

    let mut seq = tokens.clone();
    let mut generated = Vec::with_capacity(steps);
    let mut greedy_steps = Vec::with_capacity(steps);
    for step in 0..steps {
        if step > 0 {
            logits = model
                .forward(&seq, &mut |_, _, _| {})
                .map_err(reference_err)?;
        }
        let last = last_row(&logits, seq.len(), vocab_size)?;
        let top = top_k(last, TOP_K, &model);
        let Some(next) = top.first().map(|c| c.id) else {
            break;
        };
        generated.push(next);
        seq.push(next);
        greedy_steps.push(Step { top });
    }

    Ok(GoldenSummary {
        model: path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        architecture: model.architecture().to_string(),
        vocab_size,
        prompt: PromptSummary { text, tokens },
        taps,
        greedy: Greedy {
            text: tokenizer.decode(&generated),
            tokens: generated,
            steps: greedy_steps,
        },
    })
}

fn tap_summary(name: &str, shape: &[usize], data: &[f32]) -> TapSummary {
    let n = data.len().max(1) as f64;
    let (mut sum, mut sum_sq) = (0.0f64, 0.0f64);
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for &v in data {
        let v = f64::from(v);
        sum += v;
        sum_sq += v * v;
        min = min.min(v);
        max = max.max(v);
    }
    TapSummary {
        name: name.to_string(),
        shape: shape.to_vec(),
        mean: round_sig(sum / n),
        rms: round_sig((sum_sq / n).sqrt()),
        min: round_sig(min),
        max: round_sig(max),
    }
}

fn last_row(logits: &[f32], n_tokens: usize, vocab: usize) -> Result<&[f32], SnapshotError> {
    let expected = n_tokens * vocab;
    if logits.len() != expected || vocab == 0 {
        return Err(SnapshotError::LogitsLength {
            expected,
            n_tokens,
            vocab,
            found: logits.len(),
        });
    }
    Ok(&logits[(n_tokens - 1) * vocab..])
}

/// The `k` largest logits of `last` (ties broken by the lower id), with log-softmax in f64.
fn top_k(last: &[f32], k: usize, model: &ReferenceModel) -> Vec<Candidate> {
    let max = f64::from(last.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    // log p = (l - max) - ln Σ exp(l_j - max), relative to the max so that a near-certain top-1
    // (log p ≈ -1e-11 on llama-q4_0) keeps its significant digits instead of cancelling.
    let log_sum = last
        .iter()
        .map(|&l| (f64::from(l) - max).exp())
        .sum::<f64>()
        .ln();
    let mut order: Vec<usize> = (0..last.len()).collect();
    order.sort_by(|&a, &b| last[b].total_cmp(&last[a]).then(a.cmp(&b)));
    order
        .into_iter()
        .take(k)
        .filter_map(|i| {
            let id = u32::try_from(i).ok()?;
            Some(Candidate {
                id,
                piece: model.token_piece(id).map(str::to_string),
                logit: round_sig(f64::from(last[i])),
                log_prob: round_sig((f64::from(last[i]) - max) - log_sum),
            })
        })
        .collect()
}

/// The pinned snapshot of the model with file stem `stem` (`tests/snapshots/{stem}.snap`).
pub fn snapshot_path(stem: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(format!("{stem}.snap"))
}

/// Relative drift allowed per number when a fresh summary is compared with its pinned snapshot
/// outside insta (verify's `golden` gate, which runs on any machine): the snapshot keeps
/// [`SIG_DIGITS`] = 4 digits, so rounding alone moves a value by up to 5e-4 of itself, and a
/// snapshot may come from an older revision whose reference summed in another order (f32 did, see
/// the module docs). 2e-3 is four such units; a real change to a layer moves its summary by ≥ 1e-2
/// (module docs). Tap means are judged against the tap's RMS (a mean near 0 has no relative
/// precision).
pub const DRIFT_TOLERANCE: f64 = 2e-3;

/// Where a fresh summary differs from the pinned snapshot `snap` (the `.snap` file's text, insta
/// header included): token ids exactly, every number within [`DRIFT_TOLERANCE`]. Empty when they
/// agree.
pub fn drift(summary: &GoldenSummary, snap: &str) -> Result<Vec<String>, String> {
    // insta's header is a `---`-delimited block before the JSON body.
    let body = match snap.strip_prefix("---") {
        Some(rest) => rest
            .split_once("\n---\n")
            .map(|(_, body)| body)
            .ok_or("the snapshot's insta header is not closed by a --- line")?,
        None => snap,
    };
    let pinned: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("the snapshot is not JSON: {e}"))?;
    let fresh = serde_json::to_value(summary).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    diff_value("", &fresh, &pinned, 1.0, &mut out);
    Ok(out)
}

fn diff_value(
    at: &str,
    fresh: &serde_json::Value,
    pinned: &serde_json::Value,
    scale: f64,
    out: &mut Vec<String>,
) {
    use serde_json::Value as V;
    match (fresh, pinned) {
        (V::Object(a), V::Object(b)) => {
            // A tap summary: its mean is judged against its RMS.
            let rms = b.get("rms").and_then(V::as_f64).map(f64::abs);
            for (k, bv) in b {
                let path = format!("{at}.{k}");
                match a.get(k) {
                    None => out.push(format!("{path}: missing from the fresh summary")),
                    Some(av) => {
                        let s = match (k.as_str(), rms) {
                            ("mean", Some(r)) => r,
                            _ => scale,
                        };
                        diff_value(&path, av, bv, s, out)
                    }
                }
            }
            for k in a.keys().filter(|k| !b.contains_key(*k)) {
                out.push(format!("{at}.{k}: not in the snapshot"));
            }
        }
        (V::Array(a), V::Array(b)) if a.len() == b.len() => {
            for (i, (av, bv)) in a.iter().zip(b).enumerate() {
                diff_value(&format!("{at}[{i}]"), av, bv, scale, out);
            }
        }
        (V::Array(a), V::Array(b)) => out.push(format!(
            "{at}: {} entries, the snapshot has {}",
            a.len(),
            b.len()
        )),
        (V::Number(a), V::Number(b)) if a.is_f64() || b.is_f64() => {
            let (x, y) = (
                a.as_f64().unwrap_or(f64::NAN),
                b.as_f64().unwrap_or(f64::NAN),
            );
            let s = scale.max(x.abs()).max(y.abs());
            let within = (x - y).abs() <= DRIFT_TOLERANCE * s;
            if !within {
                out.push(format!("{at}: {x} now, {y} in the snapshot"));
            }
        }
        (a, b) if a != b => out.push(format!("{at}: {a} now, {b} in the snapshot")),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::round_sig;

    #[test]
    fn drift_compares_ids_exactly_and_numbers_within_tolerance() {
        let summary = super::GoldenSummary {
            model: "m".into(),
            architecture: "llama".into(),
            vocab_size: 3,
            prompt: super::PromptSummary {
                text: "a".into(),
                tokens: vec![1, 2],
            },
            taps: vec![super::TapSummary {
                name: "embed".into(),
                shape: vec![2, 4],
                mean: 0.001,
                rms: 1.0,
                min: -2.0,
                max: 2.0,
            }],
            greedy: super::Greedy {
                tokens: vec![2],
                text: "b".into(),
                steps: vec![],
            },
        };
        let pin = |tokens: &str, mean: f64, max: f64| {
            format!(
                "---\nsource: x\n---\n{{\"model\":\"m\",\"architecture\":\"llama\",\"vocab_size\":3,\
                 \"prompt\":{{\"text\":\"a\",\"tokens\":{tokens}}},\"taps\":[{{\"name\":\"embed\",\
                 \"shape\":[2,4],\"mean\":{mean},\"rms\":1.0,\"min\":-2.0,\"max\":{max}}}],\
                 \"greedy\":{{\"tokens\":[2],\"text\":\"b\",\"steps\":[]}}}}"
            )
        };
        let d = |snap: String| super::drift(&summary, &snap).unwrap_or_else(|e| vec![e]);
        assert_eq!(d(pin("[1,2]", 0.001, 2.0)), Vec::<String>::new());
        // A mean of 0.0015 against RMS 1 is 5e-4 of the scale: rounding, not drift.
        assert_eq!(d(pin("[1,2]", 0.0015, 2.001)), Vec::<String>::new());
        assert_eq!(d(pin("[1,3]", 0.001, 2.0)).len(), 1);
        assert_eq!(
            d(pin("[1,2]", 0.001, 2.1)),
            vec![".taps[0].max: 2 now, 2.1 in the snapshot"]
        );
        assert_eq!(d(pin("[1,2,3]", 0.001, 2.0)).len(), 1);
    }

    fn check(x: f64, expect: f64) {
        assert_eq!(round_sig(x), expect, "round_sig({x})");
    }

    #[test]
    fn rounds_to_four_significant_digits() {
        check(19.0873, 19.09);
        check(-0.000123456, -0.0001235);
        check(1234.56, 1235.0);
        check(0.0, 0.0);
        check(1.0, 1.0);
    }

    #[test]
    fn passes_non_finite_through() {
        assert!(round_sig(f64::NAN).is_nan());
        assert_eq!(round_sig(f64::INFINITY), f64::INFINITY);
    }
}
