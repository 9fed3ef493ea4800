//! The tokenizer on the real Gemma 3 270M vocabulary (262144 tokens, SPM with byte fallback)
//! against llama.cpp.
//!
//! The expected ids in `data/tokenizer/gemma3.json` were written by
//! `data/tokenizer/gen_expected.py`, which runs llama.cpp's own tokenizer (llama-cpp-python,
//! built from source) on the same file with `vocab_only=True`; nothing in them comes from
//! plumbline. Without the model (`cargo xtask fetch-model`) each test prints
//! "skipped: model not fetched" and returns.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use engine::gguf::Gguf;
use engine::tokenizer::{TokenType, Tokenizer, TokenizerSpec};
use proptest::prelude::*;
use serde_json::Value;

const MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
const EXPECTED: &str = include_str!("data/tokenizer/gemma3.json");

fn model_path() -> Option<PathBuf> {
    let dir = match std::env::var_os("PLUMBLINE_MODELS") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/plumbline/models"),
    };
    let p = dir.join(MODEL_FILE);
    p.exists().then_some(p)
}

/// The tokenizer, loaded once for all tests of this file.
fn tokenizer() -> Option<&'static Tokenizer> {
    static TOK: OnceLock<Option<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = model_path()?;
        let t0 = Instant::now();
        let gguf = Gguf::open(&path).expect("open the model");
        let t1 = Instant::now();
        let spec = TokenizerSpec::from_gguf(&gguf).expect("read the vocabulary");
        let t2 = Instant::now();
        let tok = Tokenizer::new(spec).expect("build the tokenizer");
        // Printed, not asserted: performance is measured by `cargo xtask bench`.
        eprintln!(
            "gemma3 vocabulary: Gguf::open {:?}, TokenizerSpec::from_gguf {:?}, Tokenizer::new {:?}",
            t1 - t0,
            t2 - t1,
            t2.elapsed()
        );
        Some(tok)
    })
    .as_ref()
}

macro_rules! tokenizer_or_skip {
    () => {
        match tokenizer() {
            Some(t) => t,
            None => {
                engine::testing::model_absent("the real model");
                return;
            }
        }
    };
}

struct Case {
    name: String,
    text: String,
    add_special: bool,
    parse_special: bool,
    ids: Vec<u32>,
    detokenized: String,
}

fn cases() -> Vec<Case> {
    let doc: Value = serde_json::from_str(EXPECTED).expect("gemma3.json parses");
    doc["cases"]
        .as_array()
        .expect("cases array")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("name").to_string(),
            text: c["text"].as_str().expect("text").to_string(),
            add_special: c["add_special"].as_bool().expect("add_special"),
            parse_special: c["parse_special"].as_bool().expect("parse_special"),
            ids: c["ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect(),
            detokenized: c["detokenized"].as_str().expect("detokenized").to_string(),
        })
        .collect()
}

#[test]
fn expected_file_covers_the_required_cases() {
    let names: Vec<String> = cases().into_iter().map(|c| c.name).collect();
    for required in [
        "ascii",
        "accents",
        "cjk",
        "emoji",
        "digits",
        "spaces",
        "tabs",
        "newlines",
        "chat_special",
        "chat_literal",
        "bos_special",
        "bos_literal",
        "empty",
        "byte_fallback",
    ] {
        assert!(
            names.iter().any(|n| n == required),
            "missing case {required}"
        );
    }
}

#[test]
fn encode_matches_llama_cpp() {
    let tok = tokenizer_or_skip!();
    let mut failures = Vec::new();
    for c in cases() {
        let got = tok
            .encode(&c.text, c.add_special, c.parse_special)
            .expect("encode");
        if got != c.ids {
            failures.push(format!(
                "{}: {:?}\n  expected {:?}\n  got      {:?}",
                c.name, c.text, c.ids, got
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn decode_matches_llama_cpp_detokenize() {
    let tok = tokenizer_or_skip!();
    for c in cases() {
        assert_eq!(tok.decode(&c.ids), c.detokenized, "case {}", c.name);
    }
}

#[test]
fn decode_of_encode_is_identity_on_the_cases() {
    let tok = tokenizer_or_skip!();
    for c in cases() {
        // Gemma has no space prefix and byte fallback, so text comes back exactly; the only
        // exceptions are a literal ▁ (it is the space symbol) and control tokens parsed out of
        // the text (they decode to nothing).
        if c.text.contains('\u{2581}') || c.parse_special {
            continue;
        }
        let ids = tok.encode(&c.text, true, false).expect("encode");
        assert_eq!(tok.decode(&ids), c.text, "case {}", c.name);
    }
}

#[test]
fn vocabulary_facts() {
    let tok = tokenizer_or_skip!();
    // Values from the file's metadata as gguf-py prints them.
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos(), Some(2));
    assert_eq!(tok.eos(), Some(1));
    assert_eq!(tok.token_piece(105), "<start_of_turn>");
    assert_eq!(tok.token_piece(106), "<end_of_turn>");
    assert_eq!(tok.token_type(106), Some(TokenType::Control));
    assert!(tok.is_eog(1));
    assert!(tok.is_eog(106), "<end_of_turn> ends generation");
    assert!(!tok.is_eog(2));
    assert!(!tok.add_space_prefix());
    // Byte fallback tokens render as their byte; ▁ as a space; control tokens as nothing.
    let nl = tok.token_id("<0x0A>").expect("<0x0A> exists");
    assert_eq!(tok.token_bytes(nl), b"\n");
    assert_eq!(tok.token_bytes(236743), b" ");
    assert_eq!(tok.token_bytes(105), b"");
    assert_eq!(tok.token_bytes_special(105, true), b"<start_of_turn>");
}

#[test]
fn stream_decoding_equals_decode() {
    let tok = tokenizer_or_skip!();
    for c in cases() {
        let mut d = tok.stream_decoder();
        let mut s: String = c.ids.iter().map(|&id| d.push(id)).collect();
        s.push_str(&d.finish());
        assert_eq!(s, tok.decode(&c.ids), "case {}", c.name);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any text without ▁ comes back from decode(encode(text)), and streaming gives the same.
    #[test]
    fn roundtrip_arbitrary_text(text in "[^\u{2581}]{0,40}") {
        let Some(tok) = tokenizer() else {
            engine::testing::model_absent("the real model");
            return Ok(());
        };
        let ids = tok.encode(&text, true, false).expect("encode");
        prop_assert_eq!(&tok.decode(&ids), &text);
        let mut d = tok.stream_decoder();
        let mut s: String = ids.iter().map(|&id| d.push(id)).collect();
        s.push_str(&d.finish());
        prop_assert_eq!(s, text);
    }
}
