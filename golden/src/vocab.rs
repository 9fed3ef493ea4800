//! The fixtures' tokenizer section: a small SentencePiece-style (`tokenizer.ggml.model = "llama"`)
//! vocabulary in which real English text tokenizes.
//!
//! Layout: `<unk>` 0, `<s>` 1 (BOS), `</s>` 2 (EOS); the 256 byte tokens `<0x00>`…`<0xFF>` at 3…258
//! (the SPM byte fallback); then `▁`, digits, ASCII letters and punctuation; then words, each with
//! every prefix of two or more characters, so that the greedy SPM merge can always reach the whole
//! word. Longer pieces score higher, so merges prefer them.

/// llama.cpp token types (`llama_token_type`).
pub const TYPE_NORMAL: i32 = 1;
pub const TYPE_UNKNOWN: i32 = 2;
pub const TYPE_CONTROL: i32 = 3;
pub const TYPE_BYTE: i32 = 6;

pub const UNK_ID: u32 = 0;
pub const BOS_ID: u32 = 1;
pub const EOS_ID: u32 = 2;

/// Words given whole-word pieces (with the `▁` word-start marker).
const WORDS: &[&str] = &[
    "the", "The", "of", "and", "to", "in", "is", "it", "a", "capital", "France", "Paris", "city",
    "hello", "world", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "one", "two",
    "three", "model", "test",
];

/// One vocabulary entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub text: String,
    pub score: f32,
    pub token_type: i32,
}

/// The fixture vocabulary, in id order.
pub fn pieces() -> Vec<Piece> {
    let mut v = vec![
        piece("<unk>", 0.0, TYPE_UNKNOWN),
        piece("<s>", 0.0, TYPE_CONTROL),
        piece("</s>", 0.0, TYPE_CONTROL),
    ];
    for b in 0..=255u8 {
        v.push(piece(&format!("<0x{b:02X}>"), 0.0, TYPE_BYTE));
    }
    let mut singles: Vec<String> = vec!["▁".to_string()];
    singles.extend(
        ('0'..='9')
            .chain('a'..='z')
            .chain('A'..='Z')
            .map(String::from),
    );
    singles.extend([".", ",", "!", "?", "'", "-", ":"].map(String::from));
    for s in singles {
        v.push(piece(&s, -10.0, TYPE_NORMAL));
    }
    // every prefix (≥ 2 chars) of every "▁word", once, scored by length
    let mut seen: std::collections::BTreeSet<String> = v.iter().map(|p| p.text.clone()).collect();
    for w in WORDS {
        let word: Vec<char> = format!("▁{w}").chars().collect();
        for len in 2..=word.len() {
            let prefix: String = word[..len].iter().collect();
            if seen.insert(prefix.clone()) {
                v.push(piece(&prefix, len as f32 - 10.0, TYPE_NORMAL));
            }
        }
    }
    v
}

fn piece(text: &str, score: f32, token_type: i32) -> Piece {
    Piece {
        text: text.to_string(),
        score,
        token_type,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_spm_like() {
        let v = pieces();
        assert_eq!(v[UNK_ID as usize].text, "<unk>");
        assert_eq!(v[BOS_ID as usize].text, "<s>");
        assert_eq!(v[EOS_ID as usize].text, "</s>");
        assert_eq!(v[3].text, "<0x00>");
        assert_eq!(v[3 + 0x41].text, "<0x41>");
        assert_eq!(v[258].text, "<0xFF>");
        assert!(v[3..259].iter().all(|p| p.token_type == TYPE_BYTE));
        // pieces are unique
        let unique: std::collections::BTreeSet<_> = v.iter().map(|p| &p.text).collect();
        assert_eq!(unique.len(), v.len());
        // a few hundred tokens, as the fixtures want
        assert!((300..=500).contains(&v.len()), "{} pieces", v.len());
    }

    #[test]
    fn every_word_is_reachable_by_prefix_merges() {
        let v = pieces();
        let has = |s: &str| v.iter().any(|p| p.text == s);
        for w in WORDS {
            let word: Vec<char> = format!("▁{w}").chars().collect();
            for len in 1..=word.len() {
                let prefix: String = word[..len].iter().collect();
                assert!(has(&prefix), "missing {prefix:?}");
            }
        }
    }
}

/// The pieces of the standard teacher-forced test sequence: `<s>` and 20 word pieces, long enough
/// to cross the gemma3 fixture's sliding window of 8 more than twice.
pub const SAMPLE_PIECES: &[&str] = &[
    "<s>",
    "▁the",
    "▁quick",
    "▁brown",
    "▁fox",
    "▁jumps",
    "▁over",
    "▁the",
    "▁lazy",
    "▁dog",
    ".",
    "▁The",
    "▁capital",
    "▁of",
    "▁France",
    "▁is",
    "▁Paris",
    ",",
    "▁one",
    "▁two",
    "▁three",
];

/// [`SAMPLE_PIECES`] as token ids of the fixture vocabulary.
pub fn sample_tokens() -> Vec<u32> {
    let v = pieces();
    SAMPLE_PIECES
        .iter()
        .filter_map(|s| v.iter().position(|p| p.text == *s))
        .filter_map(|i| u32::try_from(i).ok())
        .collect()
}

#[cfg(test)]
mod sample_tests {
    use super::*;

    #[test]
    fn every_sample_piece_is_in_the_vocabulary() {
        assert_eq!(sample_tokens().len(), SAMPLE_PIECES.len());
        assert_eq!(sample_tokens()[0], BOS_ID);
    }
}
