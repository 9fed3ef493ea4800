//! The reference's own SentencePiece tokenizer (`tokenizer.ggml.model = "llama"`), written plainly
//! from the GGUF vocabulary, scores and token types. It shares nothing with the engine's tokenizer:
//! verify compares the two sides' ids (the `tokens` gate), so a tokenizer bug in the engine shows up
//! as a difference instead of being fed to both forward passes.
//!
//! What it does, in the order llama.cpp documents for SPM vocabularies:
//!
//! 1. **Special tokens are cut out of the text.** User-defined tokens always; control and unknown
//!    tokens only with `parse_special`. Longer token texts are cut first; every occurrence, left to
//!    right, in every piece of text not cut yet.
//! 2. **Each remaining piece** gets a leading space when `add_space_prefix` is set and it is the
//!    first piece or follows a special token; then every space becomes `▁` (U+2581).
//! 3. **Merging.** The piece starts as one symbol per character. Repeatedly, of all adjacent pairs
//!    whose concatenation is a vocabulary entry, the one with the highest score is merged (on equal
//!    scores the leftmost). This is the O(n²) form of the priority-queue loop: slow, obviously
//!    the same result.
//! 4. **Output.** A symbol that is a vocabulary entry is its id; any other (a single character with
//!    no entry) is spelled as its UTF-8 bytes with the `<0xHH>` byte tokens, or the unknown token
//!    where the vocabulary has no byte tokens.
//! 5. BOS in front when `add_bos_token` asks (and `add_special`), EOS at the end for `add_eos_token`.

use std::collections::HashMap;

use crate::error::ReferenceError;
use crate::gguf::{self, GgufFile};

/// `▁`, SentencePiece's visible space.
const SPACE: char = '\u{2581}';

/// llama.cpp `llama_token_type` values used here.
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// A SentencePiece vocabulary read from a GGUF file.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    pieces: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i64>,
    /// Piece text → id (a later duplicate replaces an earlier one, as llama.cpp's map does).
    by_text: HashMap<String, u32>,
    /// Special token ids, longest text first.
    special: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

/// A piece of input after the special tokens are cut out.
enum Part<'a> {
    Text(&'a str),
    Special(u32),
}

impl Tokenizer {
    /// The tokenizer of an open GGUF file; `Ok(None)` when the file has no vocabulary.
    pub(crate) fn from_gguf(file: &GgufFile) -> Result<Option<Tokenizer>, ReferenceError> {
        let pieces = file.token_pieces()?;
        if pieces.is_empty() {
            return Ok(None);
        }
        let model = match file.metadata("tokenizer.ggml.model") {
            None => "llama",
            Some(_) => file.get_string("tokenizer.ggml.model")?,
        };
        if model != "llama" {
            return Err(ReferenceError::Unsupported(format!(
                "tokenizer model `{model}` (the reference tokenizer implements SentencePiece, `llama`, only)"
            )));
        }
        let n = pieces.len();
        let scores = number_array(file, "tokenizer.ggml.scores", n, gguf::as_f64)?
            .into_iter()
            .map(|s| s as f32)
            .collect();
        let types = number_array(file, "tokenizer.ggml.token_type", n, as_i64)?;
        let id = |key: &str| -> Result<Option<u32>, ReferenceError> {
            match file.metadata(key) {
                None => Ok(None),
                Some(v) => match gguf::as_u64(v).and_then(|x| u32::try_from(x).ok()) {
                    Some(x) if (x as usize) < n => Ok(Some(x)),
                    _ => Err(ReferenceError::BadKey {
                        key: key.to_string(),
                        expected: "a token id inside the vocabulary",
                        found: format!("{v:?} (vocabulary of {n})"),
                    }),
                },
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let unk = id("tokenizer.ggml.unknown_token_id")?;
        let add_bos = file.get_bool_or("tokenizer.ggml.add_bos_token", true)?;
        let add_eos = file.get_bool_or("tokenizer.ggml.add_eos_token", false)?;
        let add_space_prefix = file.get_bool_or("tokenizer.ggml.add_space_prefix", true)?;
        Ok(Some(Tokenizer::new(
            pieces,
            scores,
            types,
            bos,
            eos,
            unk,
            [add_bos, add_eos, add_space_prefix],
        )))
    }

    fn new(
        pieces: Vec<String>,
        scores: Vec<f32>,
        types: Vec<i64>,
        bos: Option<u32>,
        eos: Option<u32>,
        unk: Option<u32>,
        [add_bos, add_eos, add_space_prefix]: [bool; 3],
    ) -> Tokenizer {
        let mut by_text = HashMap::with_capacity(pieces.len());
        for (i, p) in pieces.iter().enumerate() {
            by_text.insert(p.clone(), i as u32);
        }
        let mut special: Vec<u32> = (0..pieces.len() as u32)
            .filter(|&i| {
                matches!(
                    types[i as usize],
                    TYPE_CONTROL | TYPE_USER_DEFINED | TYPE_UNKNOWN
                ) && !pieces[i as usize].is_empty()
            })
            .collect();
        special.sort_by_key(|&i| std::cmp::Reverse(pieces[i as usize].len()));
        Tokenizer {
            pieces,
            scores,
            types,
            by_text,
            special,
            bos,
            eos,
            unk,
            add_bos,
            add_eos,
            add_space_prefix,
        }
    }

    /// Whether the file asks for BOS in front of every sequence.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn n_vocab(&self) -> usize {
        self.pieces.len()
    }

    /// The text of token `id`.
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// Text to ids. `add_special`: BOS/EOS where the file asks for them; `parse_special`: also cut
    /// control tokens written literally in the text (user-defined tokens are always cut).
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, ReferenceError> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.push(self.bos.ok_or_else(|| ReferenceError::BadKey {
                key: "tokenizer.ggml.bos_token_id".to_string(),
                expected: "a BOS id (add_bos_token is set)",
                found: "no key".to_string(),
            })?);
        }
        let mut after_special = true;
        for part in self.split_special(text, parse_special) {
            match part {
                Part::Special(id) => {
                    out.push(id);
                    after_special = true;
                }
                Part::Text(t) => {
                    let mut s = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && after_special {
                        s.push(' ');
                    }
                    s.push_str(t);
                    let s: String = s
                        .chars()
                        .map(|c| if c == ' ' { SPACE } else { c })
                        .collect();
                    self.merge(&s, &mut out)?;
                    after_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.push(self.eos.ok_or_else(|| ReferenceError::BadKey {
                key: "tokenizer.ggml.eos_token_id".to_string(),
                expected: "an EOS id (add_eos_token is set)",
                found: "no key".to_string(),
            })?);
        }
        Ok(out)
    }

    /// Step 1: cut special tokens out, longest first.
    fn split_special<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Part<'a>> {
        let mut parts = vec![Part::Text(text)];
        for &id in &self.special {
            let ty = self.types[id as usize];
            if !parse_special && ty != TYPE_USER_DEFINED {
                continue;
            }
            let needle = self.pieces[id as usize].as_str();
            let mut next = Vec::with_capacity(parts.len());
            for part in parts {
                let Part::Text(t) = part else {
                    next.push(part);
                    continue;
                };
                let mut rest = t;
                while let Some(at) = rest.find(needle) {
                    if at > 0 {
                        next.push(Part::Text(&rest[..at]));
                    }
                    next.push(Part::Special(id));
                    rest = &rest[at + needle.len()..];
                }
                if !rest.is_empty() {
                    next.push(Part::Text(rest));
                }
            }
            parts = next;
        }
        parts
    }

    /// Steps 3 and 4 for one escaped piece of text.
    fn merge(&self, text: &str, out: &mut Vec<u32>) -> Result<(), ReferenceError> {
        let mut symbols: Vec<String> = text.chars().map(String::from).collect();
        loop {
            let mut best: Option<(f32, usize)> = None;
            for i in 0..symbols.len().saturating_sub(1) {
                let joined = format!("{}{}", symbols[i], symbols[i + 1]);
                if let Some(&id) = self.by_text.get(&joined) {
                    let score = self.scores[id as usize];
                    // Strictly greater: on equal scores the leftmost pair stays the best.
                    if best.is_none_or(|(s, _)| score > s) {
                        best = Some((score, i));
                    }
                }
            }
            let Some((_, i)) = best else { break };
            let right = symbols.remove(i + 1);
            symbols[i].push_str(&right);
        }
        for s in &symbols {
            if let Some(&id) = self.by_text.get(s) {
                out.push(id);
                continue;
            }
            for b in s.bytes() {
                match self
                    .by_text
                    .get(&format!("<0x{b:02X}>"))
                    .or(self.unk.as_ref())
                {
                    Some(&id) => out.push(id),
                    None => {
                        return Err(ReferenceError::Unsupported(format!(
                            "text needs byte {b:#04x}, and the vocabulary has neither a byte token \
                             <0x{b:02X}> nor an unknown token"
                        )))
                    }
                }
            }
        }
        Ok(())
    }
}

fn as_i64(v: &candle_core::quantized::gguf_file::Value) -> Option<i64> {
    use candle_core::quantized::gguf_file::Value as V;
    match v {
        V::I8(x) => Some(*x as i64),
        V::I16(x) => Some(*x as i64),
        V::I32(x) => Some(*x as i64),
        V::I64(x) => Some(*x),
        other => gguf::as_u64(other).and_then(|x| i64::try_from(x).ok()),
    }
}

/// A numeric array of exactly `n` elements; an absent key is `n` default values.
fn number_array<T: Default + Clone>(
    file: &GgufFile,
    key: &str,
    n: usize,
    conv: fn(&candle_core::quantized::gguf_file::Value) -> Option<T>,
) -> Result<Vec<T>, ReferenceError> {
    use candle_core::quantized::gguf_file::Value as V;
    match file.metadata(key) {
        None => Ok(vec![T::default(); n]),
        Some(V::Array(items)) if items.len() == n => items
            .iter()
            .map(|v| {
                conv(v).ok_or_else(|| ReferenceError::BadKey {
                    key: key.to_string(),
                    expected: "an array of numbers",
                    found: format!("an element {v:?}"),
                })
            })
            .collect(),
        Some(V::Array(items)) => Err(ReferenceError::BadKey {
            key: key.to_string(),
            expected: "one entry per vocabulary piece",
            found: format!("{} entries for {n} pieces", items.len()),
        }),
        Some(v) => Err(ReferenceError::BadKey {
            key: key.to_string(),
            expected: "an array",
            found: format!("{:?}", v.value_type()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small vocabulary: `<unk>`, `<s>`, `</s>`, byte tokens for 'x' and 0xC3/0xA9, a
    /// user-defined `<tab>`, and pieces with scores chosen so that merge order matters.
    fn vocab(add_space_prefix: bool) -> Tokenizer {
        let entries: &[(&str, f32, i64)] = &[
            ("<unk>", 0.0, TYPE_UNKNOWN),
            ("<s>", 0.0, TYPE_CONTROL),
            ("</s>", 0.0, TYPE_CONTROL),
            ("<0x78>", 0.0, 6),
            ("<0xC3>", 0.0, 6),
            ("<0xA9>", 0.0, 6),
            ("<tab>", 0.0, TYPE_USER_DEFINED),
            ("▁", -1.0, 1),
            ("a", -1.0, 1),
            ("b", -1.0, 1),
            ("c", -1.0, 1),
            ("ab", -3.0, 1),
            ("bc", -2.0, 1),
            ("▁a", -5.0, 1),
            ("abc", -1.5, 1),
        ];
        Tokenizer::new(
            entries.iter().map(|e| e.0.to_string()).collect(),
            entries.iter().map(|e| e.1).collect(),
            entries.iter().map(|e| e.2).collect(),
            Some(1),
            Some(2),
            Some(0),
            [true, false, add_space_prefix],
        )
    }

    fn check(t: &Tokenizer, text: &str, parse_special: bool, expect: &[u32]) {
        match t.encode(text, true, parse_special) {
            Ok(ids) => assert_eq!(ids, expect, "{text:?}"),
            Err(e) => panic!("{text:?}: {e}"),
        }
    }

    #[test]
    fn highest_score_merges_first() {
        // "abc": bc (-2) beats ab (-3), then a + bc makes abc.
        check(&vocab(false), "abc", false, &[1, 14]);
        // "bcab" would be b|c|a|b: bc (-2) first, then ab (-3): bc, ab.
        check(&vocab(false), "bcab", false, &[1, 12, 11]);
        // "ab": only one pair.
        check(&vocab(false), "ab", false, &[1, 11]);
    }

    #[test]
    fn space_prefix_and_escaping() {
        check(&vocab(true), "a", false, &[1, 13]);
        check(&vocab(false), "a", false, &[1, 8]);
        check(&vocab(false), "b a", false, &[1, 9, 13]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes_or_unk() {
        // 'x' has a byte token, 'é' (C3 A9) too, 'y' has none: unknown.
        check(&vocab(false), "xéy", false, &[1, 3, 4, 5, 0]);
    }

    #[test]
    fn user_defined_always_control_only_when_parsing_special() {
        check(&vocab(false), "a<tab>b", false, &[1, 8, 6, 9]);
        // With the space prefix, the text after a special token gets one too.
        check(&vocab(true), "a<tab>b", false, &[1, 13, 6, 7, 9]);
        // `</s>` as literal text: no piece for '<' or '/': bytes, and no byte tokens → unk.
        let t = vocab(false);
        let plain = t.encode("</s>", false, false).unwrap_or_default();
        assert!(!plain.contains(&2), "{plain:?}");
        check(&t, "</s>", true, &[1, 2]);
    }
}
