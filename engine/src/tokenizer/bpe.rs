//! GPT-2 byte-level BPE (llama.cpp's `llm_tokenizer_bpe`).
//!
//! 1. Pre-tokenize: the pre-tokenizer's patterns split the text into words, one pattern after
//!    the other, each splitting the pieces the previous one left; text between matches stays a
//!    piece of its own.
//! 2. Map every byte of a word to a printable character (GPT-2's `bytes_to_unicode`: the
//!    printable Latin-1 bytes stand for themselves, the other 68 bytes for U+0100 onwards).
//! 3. Merge adjacent symbols lowest merge rank first (equal ranks: leftmost first); with
//!    `ignore_merges` (llama3) a word that is a whole token is taken as is.
//! 4. Each final symbol is its token; if the vocabulary lacks it, each of its bytes that is a
//!    one-byte token is emitted and the rest dropped, exactly as llama.cpp does.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::OnceLock;

use fancy_regex::Regex;

use super::{Tokenizer, TokenizerError};

/// GPT-2's pattern, with the trailing `\s+` that tokenizer.json has (llama.cpp keeps unmatched
/// whitespace as a piece, which gives the same split).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's pattern with the case-insensitive group spelled out, as llama.cpp adapts it.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's pattern: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's fallback for `tokenizer.ggml.pre = default`: four patterns applied in turn.
const DEFAULT: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];

/// How text is split into words before BPE (`tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `default` or no key: llama.cpp's four-pattern fallback.
    Default,
    /// `gpt2`, `gpt-2`, `phi-2`.
    Gpt2,
    /// `llama3`, `llama-v3`, `llama-bpe` (also takes whole-word tokens before merging).
    Llama3,
    /// `qwen2`, `deepseek-r1-qwen`.
    Qwen2,
}

impl PreTokenizer {
    /// From `tokenizer.ggml.pre`; `None` is `default`.
    pub fn from_name(name: Option<&str>) -> Result<Self, TokenizerError> {
        Ok(match name {
            None | Some("default") => PreTokenizer::Default,
            Some("gpt2" | "gpt-2" | "phi-2") => PreTokenizer::Gpt2,
            Some("llama3" | "llama-v3" | "llama-bpe") => PreTokenizer::Llama3,
            Some("qwen2" | "deepseek-r1-qwen") => PreTokenizer::Qwen2,
            Some(other) => return Err(TokenizerError::UnsupportedPre(other.to_string())),
        })
    }

    fn patterns(self) -> &'static [&'static str] {
        match self {
            PreTokenizer::Default => DEFAULT,
            PreTokenizer::Gpt2 => &[GPT2],
            PreTokenizer::Llama3 => &[LLAMA3],
            PreTokenizer::Qwen2 => &[QWEN2],
        }
    }

    /// llama.cpp sets `ignore_merges` for llama3-style vocabularies.
    fn ignore_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Splits `text` into words (byte ranges that cover `text` exactly, in order).
    pub fn split(self, text: &str) -> Result<Vec<&str>, TokenizerError> {
        let mut pieces = vec![text];
        for re in compiled(self)? {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                let mut pos = 0;
                for m in re.find_iter(piece) {
                    let m = m.map_err(|e| TokenizerError::Regex(e.to_string()))?;
                    if m.start() > pos {
                        next.push(&piece[pos..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                    }
                    pos = m.end();
                }
                if pos < piece.len() {
                    next.push(&piece[pos..]);
                }
            }
            pieces = next;
        }
        Ok(pieces)
    }
}

/// The compiled patterns of a pre-tokenizer, compiled once per process.
fn compiled(pre: PreTokenizer) -> Result<&'static [Regex], TokenizerError> {
    static CELLS: [OnceLock<Result<Vec<Regex>, String>>; 4] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    let cell = &CELLS[pre as usize];
    let res = cell.get_or_init(|| {
        pre.patterns()
            .iter()
            .map(|p| Regex::new(p).map_err(|e| e.to_string()))
            .collect()
    });
    match res {
        Ok(v) => Ok(v),
        Err(e) => Err(TokenizerError::Regex(e.clone())),
    }
}

/// The character GPT-2 writes for each byte.
fn byte_to_char() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = ['\0'; 256];
        let mut extra = 0u32;
        for b in 0..=255u8 {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let cp = if printable {
                u32::from(b)
            } else {
                extra += 1;
                255 + extra
            };
            // All code points are below U+0144, so never a surrogate.
            table[b as usize] = char::from_u32(cp).unwrap_or('\u{FFFD}');
        }
        table
    })
}

/// The inverse of [`byte_to_char`].
fn char_to_byte() -> &'static HashMap<char, u8> {
    static MAP: OnceLock<HashMap<char, u8>> = OnceLock::new();
    MAP.get_or_init(|| {
        byte_to_char()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect()
    })
}

/// GPT-2 byte characters back to bytes; a character outside the table stands for itself.
pub(super) fn decode_bytes(text: &str) -> Vec<u8> {
    let map = char_to_byte();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match map.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// Merge ranks and the pre-tokenizer of one vocabulary.
#[derive(Debug, Clone)]
pub(super) struct Bpe {
    pre: PreTokenizer,
    /// `"left right"` → rank (first occurrence wins).
    ranks: HashMap<String, u32>,
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bigram {
    rank: u32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The max-heap pops the lowest rank first; among equal ranks the smallest `left`.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl Bpe {
    pub(super) fn new(pre: PreTokenizer, merges: &[String]) -> Result<Bpe, TokenizerError> {
        compiled(pre)?;
        let mut ranks = HashMap::with_capacity(merges.len());
        for (i, m) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte; a merge without a space
            // becomes ("", "") and can never match.
            let space = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
            let key = match space {
                // A space is ASCII, so both sides of it are character boundaries.
                Some(p) => format!("{} {}", &m[..p], &m[p + 1..]),
                None => " ".to_string(),
            };
            ranks.entry(key).or_insert(i as u32);
        }
        Ok(Bpe { pre, ranks })
    }

    fn rank(&self, key: &mut String, left: &str, right: &str) -> Option<u32> {
        key.clear();
        key.push_str(left);
        key.push(' ');
        key.push_str(right);
        self.ranks.get(key.as_str()).copied()
    }

    /// Appends the tokens of one text fragment (between special tokens).
    pub(super) fn tokenize(
        &self,
        tok: &Tokenizer,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let table = byte_to_char();
        let mut word = String::new();
        let mut key = String::new();
        let mut symbols: Vec<Symbol> = Vec::new();
        let mut queue = BinaryHeap::new();
        for raw in self.pre.split(text)? {
            word.clear();
            word.extend(raw.bytes().map(|b| table[b as usize]));

            symbols.clear();
            queue.clear();
            if self.pre.ignore_merges() && tok.token_id(&word).is_some() {
                symbols.push(Symbol {
                    start: 0,
                    len: word.len(),
                    prev: None,
                    next: None,
                });
            } else {
                for (start, c) in word.char_indices() {
                    let i = symbols.len();
                    symbols.push(Symbol {
                        start,
                        len: c.len_utf8(),
                        prev: i.checked_sub(1),
                        next: None,
                    });
                    if i > 0 {
                        symbols[i - 1].next = Some(i);
                    }
                }
            }
            let w = word.as_str();
            let mut try_add = |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, l, r| {
                let (Some(left), Some(right)) = (l, r) else {
                    return;
                };
                let (ls, rs): (&Symbol, &Symbol) = (&symbols[left], &symbols[right]);
                let lt = &w[ls.start..ls.start + ls.len];
                let rt = &w[rs.start..rs.start + rs.len];
                if let Some(rank) = self.rank(&mut key, lt, rt) {
                    queue.push(Bigram {
                        rank,
                        left,
                        right,
                        size: ls.len + rs.len,
                    });
                }
            };
            for i in 1..symbols.len() {
                try_add(&symbols, &mut queue, Some(i - 1), Some(i));
            }
            while let Some(b) = queue.pop() {
                let (l, r) = (symbols[b.left], symbols[b.right]);
                if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                    continue;
                }
                symbols[b.left].len += r.len;
                symbols[b.right].len = 0;
                symbols[b.left].next = r.next;
                if let Some(n) = r.next {
                    symbols[n].prev = Some(b.left);
                }
                try_add(&symbols, &mut queue, l.prev, Some(b.left));
                try_add(&symbols, &mut queue, Some(b.left), r.next);
            }

            for s in symbols.iter().filter(|s| s.len > 0) {
                let piece = &w[s.start..s.start + s.len];
                match tok.token_id(piece) {
                    Some(id) => out.push(id),
                    None => {
                        for &byte in piece.as_bytes() {
                            if let Some(id) = tok.byte_tokens[byte as usize] {
                                out.push(id);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2s() {
        // From GPT-2's encoder.py: space (0x20) is the 33rd non-printable byte → U+0120 'Ġ',
        // newline (0x0A) the 11th → U+010A 'Ċ', 'a' stands for itself, 0xAD (soft hyphen) is
        // the last non-printable byte → U+0143.
        let t = byte_to_char();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0xAD], '\u{143}');
        assert_eq!(decode_bytes("ĠhelloĊ"), b" hello\n");
    }

    fn check_split(pre: PreTokenizer, text: &str, expect: &[&str]) {
        let got = pre.split(text).expect("split");
        assert_eq!(got, expect, "{pre:?} on {text:?}");
    }

    #[test]
    fn gpt2_split() {
        check_split(
            PreTokenizer::Gpt2,
            "Hello world, it's 2024!",
            &["Hello", " world", ",", " it", "'s", " 2024", "!"],
        );
        // Whitespace before a word leaves its last space to the word: `\s+(?!\S)`.
        check_split(PreTokenizer::Gpt2, "a   b", &["a", "  ", " b"]);
        // A newline run before a letter: `\s+(?!\S)` backs off to the first newline, then `\s+`.
        check_split(PreTokenizer::Gpt2, "a\n\nb ", &["a", "\n", "\n", "b", " "]);
    }

    #[test]
    fn llama3_split() {
        // Digits in groups of three, letters take one leading non-letter, newlines grouped.
        check_split(
            PreTokenizer::Llama3,
            "12345 apples\n\nI'M",
            &["123", "45", " apples", "\n\n", "I", "'M"],
        );
    }

    #[test]
    fn qwen2_split_single_digits() {
        check_split(PreTokenizer::Qwen2, "x 123", &["x", " ", "1", "2", "3"]);
    }

    #[test]
    fn default_split_applies_patterns_in_turn() {
        // Punctuation runs first, then the GPT-2 pattern (" 12345"), then `\p{N}+` cuts the
        // space off, then `[0-9]{3}` cuts "123" and leaves "45" as a gap.
        check_split(
            PreTokenizer::Default,
            "hi, 12345!",
            &["hi", ",", " ", "123", "45", "!"],
        );
    }

    #[test]
    fn unknown_pre_is_an_error() {
        assert!(matches!(
            PreTokenizer::from_name(Some("klingon")),
            Err(TokenizerError::UnsupportedPre(_))
        ));
    }
}
