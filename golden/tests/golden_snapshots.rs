//! Golden snapshots: the reference's summary ([`golden::snapshot`]) of every fixture and of the real
//! Gemma 3 270M, pinned in `tests/snapshots/`. A change to the reference's numerics, a fixture, the
//! quantizers or the tokenizer changes a snapshot; locally insta writes a `.snap.new` beside it and
//! fails, and `cargo insta review` (or `cargo xtask golden`, which regenerates all of them first)
//! is how a person accepts it. Under `CI=true` insta writes nothing and fails, so an unreviewed
//! change cannot land.
//!
//! Why the snapshots can be trusted as a baseline: `tests/reference_fixtures.rs` checks the
//! reference's taps and f32/f64 agreement on every fixture, and `reference/tests/gemma3_270m.rs`
//! checks that the real model ranks "▁Paris" in its top 5 after this prompt; the real-model test
//! below re-asserts that, so a snapshot accepted in a hurry still cannot lose it.

use golden::fixtures;
use golden::snapshot::{self, GoldenSummary};

fn assert_snapshot(summary: &GoldenSummary) {
    let mut settings = insta::Settings::clone_current();
    settings.set_prepend_module_to_snapshot(false);
    settings.set_description(format!(
        "reference (f64) summary of {}: taps on the prompt, {} greedy steps with top-{}",
        summary.model,
        snapshot::GREEDY_STEPS,
        snapshot::TOP_K
    ));
    settings.bind(|| insta::assert_json_snapshot!(summary.model.clone(), summary));
}

fn check_fixture(name: &str) {
    let spec = fixtures::by_name(name).unwrap_or_else(|| panic!("no fixture called {name}"));
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temp dir: {e}"));
    let summary = snapshot::fixture_summary(&spec, dir.path())
        .unwrap_or_else(|e| panic!("summary of {name}: {e}"));
    assert_eq!(summary.greedy.tokens.len(), snapshot::GREEDY_STEPS);
    assert!(!summary.taps.is_empty(), "{name}: no taps");
    assert_snapshot(&summary);
}

/// One test per fixture, so that one changed fixture does not hide another.
macro_rules! fixture_tests {
    ($($test:ident => $name:literal,)*) => {
        $(
            #[test]
            fn $test() {
                check_fixture($name);
            }
        )*

        /// Every fixture has a snapshot test above (a new fixture must be added to the list).
        #[test]
        fn every_fixture_has_a_snapshot_test() {
            let listed = [$($name),*];
            for spec in fixtures::all() {
                assert!(
                    listed.contains(&spec.name),
                    "fixture {} has no golden snapshot test: add it to fixture_tests!",
                    spec.name
                );
            }
        }
    };
}

fixture_tests! {
    llama_f16 => "llama-f16",
    llama_q8_0 => "llama-q8_0",
    llama_q4_0 => "llama-q4_0",
    llama_q4_k_m => "llama-q4_k_m",
    llama_mix_all => "llama-mix-all",
    gemma3_q4_k_m => "gemma3-q4_k_m",
    deepseek2_q4_k => "deepseek2-q4_k",
    deepseek2_lite_q8_0 => "deepseek2-lite-q8_0",
    glm_dsa_q4_k => "glm-dsa-q4_k",
    glm_dsa_q8_0 => "glm-dsa-q8_0",
}

#[test]
fn real_model_gemma3_270m() {
    let Some(path) = snapshot::real_model_path() else {
        engine::testing::model_absent(snapshot::REAL_MODEL_FILE);
        return;
    };
    let summary =
        snapshot::real_model_summary(&path).unwrap_or_else(|e| panic!("summary of gemma: {e}"));
    // Independent of the snapshot (reference/tests/gemma3_270m.rs, and the model's known
    // behaviour): "▁Paris" is among the top 5 after the bare prompt.
    let first = summary
        .greedy
        .steps
        .first()
        .map(|s| s.top.as_slice())
        .unwrap_or_default();
    assert!(
        first.iter().any(|c| c.piece.as_deref() == Some("▁Paris")),
        "▁Paris not in the top 5 after {:?}: {first:?}",
        snapshot::REAL_MODEL_PROMPT
    );
    assert_snapshot(&summary);
}
