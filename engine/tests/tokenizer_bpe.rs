//! GPT-2 byte-level BPE.
//!
//! 1. A hand-made vocabulary whose expected ids are derived by hand in the comments (GPT-2's
//!    published byte table, the pre-tokenizer pattern, then merges lowest rank first).
//! 2. Small vocabularies written as GGUF by `data/tokenizer/gen_expected.py` (gguf-py, no
//!    download), one per pre-tokenizer, with the ids llama.cpp gives them in
//!    `data/tokenizer/tiny_gpt2.json`: these exercise `Tokenizer::from_gguf` as well.

use std::path::Path;

use engine::gguf::Gguf;
use engine::tokenizer::{TokenType, Tokenizer, TokenizerModel, TokenizerSpec};
use proptest::prelude::*;
use serde_json::Value;

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the other 68 map to
/// U+0100.. in byte order. Token id `b` is the character for byte `b`.
fn byte_chars() -> Vec<char> {
    let mut extra = 0;
    (0u32..256)
        .map(|b| {
            let printable = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            if printable {
                char::from_u32(b).expect("latin-1")
            } else {
                extra += 1;
                char::from_u32(255 + extra).expect("U+0100..")
            }
        })
        .collect()
}

const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),   // rank 0 → id 256 "Ġt"
    ("h", "e"),   // rank 1 → id 257 "he"
    ("Ġt", "he"), // rank 2 → id 258 "Ġthe"
    ("Ġ", "Ġ"),   // rank 3 → id 259 "ĠĠ"
    ("l", "o"),   // rank 4 → id 260 "lo"
    ("t", "h"),   // rank 5 → id 261 "th"
    ("th", "e"),  // rank 6 → id 262 "the"
];
const ENDOFTEXT: u32 = 263;

fn hand_tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = byte_chars().into_iter().map(String::from).collect();
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.push("<|endoftext|>".into());
    let mut types = vec![TokenType::Normal; tokens.len()];
    types[ENDOFTEXT as usize] = TokenType::Control;
    Tokenizer::new(TokenizerSpec {
        model: TokenizerModel::Gpt2,
        tokens,
        scores: Vec::new(),
        token_types: types,
        merges: MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect(),
        bos: Some(ENDOFTEXT),
        eos: Some(ENDOFTEXT),
        eot: None,
        unk: None,
        pad: None,
        add_bos: false,
        add_eos: false,
        add_space_prefix: false,
        pre: Some("gpt2".into()),
    })
    .expect("valid vocabulary")
}

fn id(c: char) -> u32 {
    byte_chars()
        .iter()
        .position(|&x| x == c)
        .expect("a byte character") as u32
}

fn check(text: &str, parse_special: bool, expect: &[u32]) {
    let tok = hand_tokenizer();
    let got = tok.encode(text, true, parse_special).expect("encode");
    assert_eq!(got, expect, "{text:?}");
    let visible = if parse_special {
        text.replace("<|endoftext|>", "")
    } else {
        text.to_string()
    };
    assert_eq!(tok.decode(&got), visible);
}

#[test]
fn merges_apply_lowest_rank_first() {
    // Words "the", " the" → "the", "Ġthe".
    // "the": pairs th (rank 5) and he (rank 1): he merges first, leaving t|he; "t he" is no
    // merge, so th+e (rank 6) never gets a chance: [t, he].
    // "Ġthe": Ġt (0) merges, then he (1), then Ġt+he (2): [Ġthe].
    check("the the", false, &[id('t'), 257, 258]);
}

#[test]
fn whitespace_runs_leave_one_space_to_the_next_word() {
    // GPT-2's `\s+(?!\S)` takes "  " of three spaces before a word and leaves " the":
    // "ĠĠ" merges (rank 3) into 259, then "Ġthe" is 258.
    check("   the", false, &[259, 258]);
    // A newline pair before a word: `\s+(?!\S)` backs off to "\n", then `\s+` takes "\n";
    // newline is byte 0x0A → Ċ (the 11th non-printable byte, U+010A).
    check("\n\nlo", false, &[id('Ċ'), id('Ċ'), 260]);
}

#[test]
fn non_ascii_text_is_byte_level() {
    // "é" is C3 A9 → characters Ã (U+00C3) and © (U+00A9), no merge between them.
    check("é", false, &[id('Ã'), id('©')]);
    // 👋 is F0 9F 91 8B; no merge involves their characters, so each byte is its own token,
    // and token id b is byte b's character.
    let tok = hand_tokenizer();
    let ids = tok.encode("👋", false, false).expect("encode");
    assert_eq!(ids, vec![0xF0, 0x9F, 0x91, 0x8B]);
}

#[test]
fn special_tokens_need_parse_special() {
    check("lo<|endoftext|>lo", true, &[260, ENDOFTEXT, 260]);
    // Literal: "<|" and "|>" are punctuation words, "endoftext" a letter word, byte by byte.
    let tok = hand_tokenizer();
    let ids = tok.encode("<|endoftext|>", false, false).expect("encode");
    let expect: Vec<u32> = "<|endoftext|>".bytes().map(u32::from).collect();
    assert_eq!(ids, expect);
}

#[test]
fn token_bytes_undo_the_byte_table() {
    let tok = hand_tokenizer();
    assert_eq!(tok.token_piece(258), "Ġthe");
    assert_eq!(tok.token_bytes(258), b" the");
    assert_eq!(tok.token_bytes(id('Ċ')), b"\n");
    assert_eq!(tok.token_bytes(ENDOFTEXT), b"");
    assert!(tok.is_eog(ENDOFTEXT));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Byte-level BPE loses nothing: every string comes back.
    #[test]
    fn roundtrip_arbitrary_text(text in "\\PC{0,40}|[ \t\n\r]{0,10}") {
        let tok = hand_tokenizer();
        let ids = tok.encode(&text, false, false).expect("encode");
        prop_assert_eq!(tok.decode(&ids), text);
    }
}

/// The tiny GGUF vocabularies against llama.cpp, per pre-tokenizer.
#[test]
fn tiny_gguf_vocabularies_match_llama_cpp() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer");
    let doc: Value = serde_json::from_str(include_str!("data/tokenizer/tiny_gpt2.json"))
        .expect("tiny_gpt2.json parses");
    let pres = doc["pres"].as_object().expect("pres");
    assert_eq!(pres.len(), 4, "gpt-2, llama-bpe, qwen2, default");
    let mut failures = Vec::new();
    for (pre, cases) in pres {
        let path = dir.join(format!("tiny-gpt2-{pre}.gguf"));
        let gguf = Gguf::open(&path).expect("open tiny gguf");
        let tok = Tokenizer::from_gguf(&gguf).expect("read the vocabulary");
        for c in cases.as_array().expect("cases") {
            let text = c["text"].as_str().expect("text");
            let expect: Vec<u32> = c["ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect();
            let add = c["add_special"].as_bool().expect("add_special");
            let parse = c["parse_special"].as_bool().expect("parse_special");
            let got = tok.encode(text, add, parse).expect("encode");
            if got != expect {
                failures.push(format!(
                    "{pre}/{}: {text:?}\n  expected {expect:?}\n  got      {got:?}",
                    c["name"]
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
