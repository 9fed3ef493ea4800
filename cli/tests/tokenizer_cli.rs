//! `plumbline tokenize` end to end on the tiny GPT-2 vocabulary (always present), expected ids
//! from llama.cpp in `engine/tests/data/tokenizer/tiny_gpt2.json` (case "words" of pre-tokenizer
//! gpt-2). The test data stays with the engine's tokenizer tests; this crate reads it from there.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn plumbline(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_plumbline"))
        .args(args)
        .output()
        .expect("run plumbline");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn model() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/data/tokenizer/tiny-gpt2-gpt-2.gguf")
        .display()
        .to_string()
}

#[test]
fn json_output_has_ids_and_pieces() {
    let (ok, stdout, stderr) =
        plumbline(&["tokenize", "--model", &model(), "--json", "Hello the world"]);
    assert!(ok, "{stderr}");
    let rows: Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    let ids: Vec<u64> = rows
        .as_array()
        .expect("array")
        .iter()
        .map(|r| r["id"].as_u64().expect("id"))
        .collect();
    // BOS (<|endoftext|>, 277), "Hello", "Ġthe", "Ġworld".
    assert_eq!(ids, [277, 272, 258, 265]);
    assert_eq!(rows[2]["piece"], "Ġthe");
}

#[test]
fn table_and_flags() {
    let (ok, stdout, stderr) = plumbline(&[
        "tokenize",
        "--model",
        &model(),
        "--no-bos",
        "--parse-special",
        "Hello<|endoftext|>",
    ]);
    assert!(ok, "{stderr}");
    let rows: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        rows.first()
            .map(|r| r.split_whitespace().collect::<Vec<_>>()),
        Some(vec!["id", "piece"])
    );
    assert!(
        rows[1].contains("272") && rows[1].contains("\"Hello\""),
        "{stdout}"
    );
    assert!(
        rows[2].contains("277") && rows[2].contains("<|endoftext|>"),
        "{stdout}"
    );
    assert_eq!(rows.last(), Some(&"2 tokens"));
}

#[test]
fn missing_model_is_a_clear_error() {
    let (ok, _, stderr) = plumbline(&["tokenize", "--model", "/nonexistent.gguf", "x"]);
    assert!(!ok);
    assert!(stderr.contains("/nonexistent.gguf"), "{stderr}");
}
