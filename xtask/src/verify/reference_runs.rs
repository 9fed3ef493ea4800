//! The reference's side of a case: one run per model (f32 and exact-numerics taps, greedy rows,
//! the golden gate), computed on first use and shared by every backend's case of that model.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use harness::gate::GateResult;
use harness::tap::Tap;
use reference::{Footprint, Precision, ReferenceModel, Residency};

use super::common::{argmax, truncate_text, Budget, PROMPT, TEXT};

/// What the reference computed for one model; shared by every backend's case of that model.
pub struct ReferenceRun {
    /// The reference tokenizer's ids for the whole fixed text (the `tokens` gate compares them).
    pub text_ids: Vec<u32>,
    /// The first `n_text` of [`Self::text_ids`]: what the reference's forward was fed.
    pub tokens: Vec<u32>,
    pub taps: Vec<Tap>,
    /// The exact-numerics reference's taps on the same tokens (reference::Precision::Exact).
    pub exact_taps: Vec<Tap>,
    pub n_vocab: usize,
    pub greedy: Vec<u32>,
    /// The reference's logits at each greedy step (`n_greedy × n_vocab`).
    pub greedy_rows: Vec<f32>,
    /// The reference tokenizer's ids for [`PROMPT`].
    pub prompt: Vec<u32>,
    /// `Some(id)` when the file's metadata asks for BOS (`add_bos_token`) and names it, read by
    /// the reference, not by the engine's tokenizer; `None` when the file does not ask for BOS.
    pub bos: Option<Option<u32>>,
    /// The `golden` gate: the reference's summary against its pinned snapshot.
    pub golden: GateResult,
    /// The model's f32 size, whole and per layer, as the reference counts it.
    pub footprint: Footprint,
    /// How each MoE layer chooses its experts (by layer; empty for a dense model), for the
    /// route-aware comparison ([`super::routes`]).
    pub routing: BTreeMap<usize, reference::Routing>,
    /// How the reference held its weights (a forced-route rerun holds them the same way).
    pub residency: Residency,
}

impl ReferenceRun {
    /// Bytes of reference output this run holds (taps of both precisions, greedy rows).
    pub fn held_bytes(&self) -> usize {
        let taps = |t: &[Tap]| t.iter().map(|t| t.data.len()).sum::<usize>();
        4 * (taps(&self.taps) + taps(&self.exact_taps) + self.greedy_rows.len())
    }

    /// The f32 reference's logits, `[tokens × n_vocab]`: its `logits` tap (kept once).
    pub fn logits(&self) -> &[f32] {
        self.taps
            .iter()
            .rev()
            .find(|t| t.name == "logits")
            .map_or(&[], |t| t.data.as_slice())
    }
}

/// Where the reference reads a model from.
#[derive(Clone, Copy)]
pub enum RefSource<'a> {
    /// A file (a shard of a split set opens the whole set beside it).
    File(&'a Path),
    /// A split set's shards in a listing order (placed by `split.no`, read in place), and the
    /// single file it was written from (whose golden snapshot judges the reference).
    Listed {
        shards: &'a [PathBuf],
        single: &'a Path,
    },
}

impl RefSource<'_> {
    /// The cache key: the file, or the first shard as listed.
    pub fn key(&self) -> &Path {
        match self {
            RefSource::File(p) => p,
            RefSource::Listed { shards, single } => shards.first().map_or(*single, |p| p.as_path()),
        }
    }

    pub fn golden_path(&self) -> &Path {
        match self {
            RefSource::File(p) => p,
            RefSource::Listed { single, .. } => single,
        }
    }

    pub fn open(&self, precision: Precision, residency: Residency) -> Result<ReferenceModel> {
        match self {
            RefSource::File(p) => ReferenceModel::open(p, precision, residency)
                .with_context(|| format!("loading {} in the reference", p.display())),
            RefSource::Listed { shards, .. } => {
                ReferenceModel::open_listed(shards, precision, residency).with_context(|| {
                    format!(
                        "loading the split set {} in the reference",
                        self.key().display()
                    )
                })
            }
        }
    }
}

/// Reference runs by model file, computed on first use.
#[derive(Default)]
pub struct ReferenceCache {
    runs: HashMap<PathBuf, ReferenceRun>,
}

impl ReferenceCache {
    /// Use `run` for `path` (computed beforehand, e.g. in a phase of its own).
    pub fn insert(&mut self, path: &Path, run: ReferenceRun) {
        self.runs.insert(path.to_owned(), run);
    }

    pub fn get(&mut self, src: RefSource<'_>, budget: Budget, real: bool) -> Result<&ReferenceRun> {
        let path = src.key();
        if !self.runs.contains_key(path) {
            let mut run = reference_run(src, budget, Residency::Eager)?;
            run.golden = golden_gate(src.golden_path(), real)?;
            self.runs.insert(path.to_owned(), run);
        }
        self.runs
            .get(path)
            .ok_or_else(|| anyhow!("reference run for {} vanished", path.display()))
    }
}

/// The `golden` gate: the reference's summary of this model now against the snapshot pinned in
/// `golden/tests/snapshots/` (a reference that drifted is a failure of its own, whatever the engine
/// does). A model without a snapshot is "not judged".
pub fn golden_gate(path: &Path, real: bool) -> Result<GateResult> {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let snap_path = golden::snapshot::snapshot_path(&stem);
    let Ok(snap) = std::fs::read_to_string(&snap_path) else {
        return Ok(GateResult::not_judged(
            "golden",
            0.0,
            format!("no golden snapshot {}", snap_path.display()),
        ));
    };
    let summary = if real {
        golden::snapshot::real_model_summary(path)
    } else {
        let tokens: Vec<u32> = golden::vocab::sample_tokens()
            .into_iter()
            .take(golden::snapshot::FIXTURE_PROMPT_TOKENS)
            .collect();
        golden::snapshot::summarize(
            path,
            &golden::snapshot::Prompt::Tokens(tokens),
            golden::snapshot::GREEDY_STEPS,
        )
    }
    .with_context(|| format!("golden summary of {}", path.display()))?;
    let diffs = golden::snapshot::drift(&summary, &snap)
        .map_err(|e| anyhow!("{}: {e}", snap_path.display()))?;
    let detail = if diffs.is_empty() {
        format!(
            "reference matches {} (numbers within {})",
            snap_path.display(),
            golden::snapshot::DRIFT_TOLERANCE
        )
    } else {
        let shown: Vec<&str> = diffs.iter().take(3).map(String::as_str).collect();
        format!(
            "the reference drifted from {}: {}{}",
            snap_path.display(),
            shown.join("; "),
            if diffs.len() > 3 { "; …" } else { "" }
        )
    };
    Ok(GateResult::at_most(
        "golden",
        diffs.len() as f64,
        0.0,
        detail,
    ))
}

/// The reference's side of a case: both tokenizations, the teacher-forced forward pass in f32 and
/// in exact numerics, and the greedy continuation, with the weights held as `residency` says.
/// The `golden` gate is left "not judged" for the caller to fill in ([`golden_gate`]).
pub fn reference_run(
    src: RefSource<'_>,
    budget: Budget,
    residency: Residency,
) -> Result<ReferenceRun> {
    let model = src.open(Precision::F32, residency)?;
    // A streaming pass over a large model takes minutes: say where it is (stderr).
    let progress = Progress {
        on: residency == Residency::Streaming,
        n_layers: model.n_layers(),
    };
    let footprint = model.footprint().clone();
    let n_vocab = model.vocab_size();
    // The reference's own tokenizer (reference/src/tokenizer.rs), sharing nothing with the
    // engine's: the `tokens` gate compares the two.
    let tok = model.tokenizer().context("the reference tokenizer")?;
    let text_ids = tok
        .encode(TEXT, true, false)
        .context("reference: tokenizing the fixed text")?;
    let tokens = truncate_text(&text_ids, budget.n_text)?;
    let mut taps = Vec::new();
    // The returned logits are the `logits` tap's values; only the tap is kept.
    let logits_len = model
        .forward(&tokens, &mut |name, shape, data| {
            progress.tap("f32 pass", name);
            taps.push(Tap::new(name, shape.to_vec(), data.to_vec()))
        })
        .context("reference forward pass")?
        .len();
    anyhow::ensure!(
        taps.iter()
            .any(|t| t.name == "logits" && t.data.len() == logits_len),
        "the reference emitted no `logits` tap of {logits_len} values"
    );
    // Greedy continuation without a KV cache: one full forward per new token (slow, obvious).
    let prompt = tok
        .encode(PROMPT, true, false)
        .context("reference: tokenizing the prompt")?;
    let mut seq = prompt.clone();
    let mut greedy = Vec::new();
    let mut greedy_rows = Vec::new();
    for step in 0..budget.n_greedy {
        let pass = format!("greedy step {}/{}", step + 1, budget.n_greedy);
        let logits = model
            .forward(&seq, &mut |name, _, _| progress.tap(&pass, name))
            .context("reference greedy step")?;
        let row = &logits[logits.len() - n_vocab..];
        let next = argmax(row);
        greedy_rows.extend_from_slice(row);
        greedy.push(next);
        seq.push(next);
    }
    let bos = model.add_bos().then(|| model.bos_token_id());
    drop(model);
    // The exact-numerics reference on the same tokens (loaded after the f32 one is dropped, so
    // that one copy of the dequantized weights is in memory at a time).
    let exact = src
        .open(Precision::Exact, residency)
        .context("the exact-numerics reference")?;
    let mut exact_taps = Vec::new();
    exact
        .forward(&tokens, &mut |name, shape, data| {
            progress.tap("exact-numerics pass", name);
            exact_taps.push(Tap::new(name, shape.to_vec(), data.to_vec()))
        })
        .context("exact-numerics reference forward pass")?;
    // The routing of every layer with a router tap (a streaming model reads those layers again).
    let routing = super::routes::routing_of(&exact, &exact_taps)?;
    Ok(ReferenceRun {
        text_ids,
        tokens,
        taps,
        exact_taps,
        n_vocab,
        greedy,
        greedy_rows,
        prompt,
        bos,
        golden: GateResult::not_judged("golden", 0.0, "not computed".to_owned()),
        footprint,
        routing,
        residency,
    })
}

/// Progress of the reference's passes on stderr: one line per pass, rewritten at each layer
/// when stderr is a terminal.
struct Progress {
    on: bool,
    n_layers: usize,
}

impl Progress {
    fn tap(&self, pass: &str, name: &str) {
        use std::io::IsTerminal;
        if !self.on {
            return;
        }
        if !std::io::stderr().is_terminal() {
            if name == "logits" {
                eprintln!("      reference {pass}: done");
            }
            return;
        }
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.strip_suffix(".out"))
            .and_then(|i| i.parse::<usize>().ok());
        if let Some(i) = layer {
            eprint!(
                "\r      reference {pass}: layer {}/{}",
                i + 1,
                self.n_layers
            );
        } else if name == "logits" {
            eprintln!("\r      reference {pass}: done{:20}", "");
        }
    }
}
