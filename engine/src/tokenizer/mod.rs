//! Text ↔ token ids, as llama.cpp does it for the vocabularies GGUF files carry.
//!
//! Two models:
//! - `llama`: SentencePiece-style (SPM). Spaces become `▁` (U+2581), an optional space is put in
//!   front (`add_space_prefix`), adjacent symbols are merged best-score-first, and anything left
//!   that is not a token falls back to byte tokens `<0xHH>` ([`spm`]).
//! - `gpt2`: byte-level BPE. A pre-tokenizer regex (chosen by `tokenizer.ggml.pre`) splits the
//!   text into words, each word's bytes are mapped to printable characters, and merges are
//!   applied by rank ([`bpe`]).
//!
//! Before either runs, special tokens are cut out of the raw text (llama.cpp's
//! `tokenizer_st_partition`): user-defined tokens always, control and unknown tokens only when
//! `parse_special` is on. A literal `<bos>` in user text is therefore plain text unless asked.
//!
//! Invariants: no panic on any vocabulary or input; every failure is a [`TokenizerError`].
//! [`Tokenizer::decode`] loses nothing until the final UTF-8 conversion; [`StreamDecoder`] holds
//! incomplete UTF-8 sequences back until they complete.
//!
//! Start reading at [`Tokenizer::encode`]. The vocabulary comes from [`TokenizerSpec`] (plain
//! data, for tests) or [`Tokenizer::from_gguf`].

mod bpe;
mod error;
mod gguf;
mod index;
mod spm;
mod stream;

use std::collections::{HashMap, HashSet};

pub use bpe::PreTokenizer;
pub use error::TokenizerError;
pub use stream::StreamDecoder;

/// `▁` (U+2581), SentencePiece's visible space.
pub const SPM_SPACE: &str = "\u{2581}";

/// The tokenizer algorithm (`tokenizer.ggml.model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerModel {
    /// SentencePiece-style, `"llama"` in GGUF.
    Llama,
    /// Byte-level BPE, `"gpt2"` in GGUF.
    Gpt2,
}

impl TokenizerModel {
    /// Parses the GGUF name.
    pub fn from_name(name: &str) -> Result<Self, TokenizerError> {
        match name {
            "llama" => Ok(TokenizerModel::Llama),
            "gpt2" => Ok(TokenizerModel::Gpt2),
            other => Err(TokenizerError::UnsupportedModel(other.to_string())),
        }
    }

    /// The GGUF name.
    pub fn name(self) -> &'static str {
        match self {
            TokenizerModel::Llama => "llama",
            TokenizerModel::Gpt2 => "gpt2",
        }
    }
}

/// A token's type (`tokenizer.ggml.token_type`, llama.cpp's `llama_token_type` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    Undefined = 0,
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

impl TokenType {
    /// From the GGUF integer; values outside 0..=6 are `Undefined`, as llama.cpp reads them.
    pub fn from_i32(v: i32) -> Self {
        match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// Whether the partition step cuts tokens of this type out of raw text.
    fn is_special(self) -> bool {
        matches!(
            self,
            TokenType::Control | TokenType::UserDefined | TokenType::Unknown
        )
    }

    /// Special tokens that are matched in text only with `parse_special`, and that decode to
    /// nothing unless asked.
    fn is_hidden(self) -> bool {
        matches!(self, TokenType::Control | TokenType::Unknown)
    }
}

/// Everything a tokenizer is made of, as plain data (what the `tokenizer.ggml.*` keys hold).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerSpec {
    pub model: TokenizerModel,
    /// Token texts; the index is the id.
    pub tokens: Vec<String>,
    /// SPM merge scores (higher merges first); empty means all 0.
    pub scores: Vec<f32>,
    /// Token types; empty means all `Normal`.
    pub token_types: Vec<TokenType>,
    /// BPE merges, `"left right"`, in rank order (gpt2 only).
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End of turn; found by name (`<end_of_turn>`, `<|eot_id|>`, …) when `None`.
    pub eot: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// `tokenizer.ggml.pre` (gpt2 only); `None` means `default`.
    pub pre: Option<String>,
}

/// Token texts that llama.cpp takes for an end-of-turn token when the file names none.
const EOT_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
];

/// Token texts that end generation wherever they appear (llama.cpp's EOG auto-detection).
const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// A loaded vocabulary that encodes and decodes.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    model: TokenizerModel,
    tokens: Vec<Box<str>>,
    scores: Vec<f32>,
    types: Vec<TokenType>,
    index: index::VocabIndex,
    /// Token for each byte value used by byte fallback, if the vocabulary has one.
    byte_tokens: [Option<u32>; 256],
    /// For BYTE tokens, the byte they stand for.
    byte_of: HashMap<u32, u8>,
    /// Ids of special tokens, longest text first (ties: lower id first).
    special: Vec<u32>,
    eog: HashSet<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    bpe: Option<bpe::Bpe>,
}

/// One piece of the input after special tokens are cut out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fragment {
    /// `text[start..end]`, not yet tokenized.
    Text {
        start: usize,
        end: usize,
    },
    Token(u32),
}

impl Tokenizer {
    /// Builds a tokenizer, checking every id and array length against the vocabulary.
    pub fn new(spec: TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        let check_len = |field, found: usize| {
            if found != 0 && found < n {
                Err(TokenizerError::LengthMismatch {
                    field,
                    expected: n,
                    found,
                })
            } else {
                Ok(())
            }
        };
        check_len("tokenizer.ggml.scores", spec.scores.len())?;
        check_len("tokenizer.ggml.token_type", spec.token_types.len())?;
        let check_id = |field, id: Option<u32>| match id {
            Some(id) if id as usize >= n => Err(TokenizerError::IdOutOfRange {
                field,
                id,
                n_vocab: n,
            }),
            _ => Ok(id),
        };
        let bos = check_id("tokenizer.ggml.bos_token_id", spec.bos)?;
        let eos = check_id("tokenizer.ggml.eos_token_id", spec.eos)?;
        let eot = check_id("tokenizer.ggml.eot_token_id", spec.eot)?;
        let unk = check_id("tokenizer.ggml.unknown_token_id", spec.unk)?;
        let pad = check_id("tokenizer.ggml.padding_token_id", spec.pad)?;

        let mut scores = spec.scores;
        scores.resize(n, 0.0);
        let mut types = spec.token_types;
        types.truncate(n);
        types.resize(n, TokenType::Normal);

        // llama.cpp renames empty tokens so that no token matches the empty string.
        let tokens: Vec<Box<str>> = spec
            .tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]").into_boxed_str()
                } else {
                    t.into_boxed_str()
                }
            })
            .collect();
        let index = index::VocabIndex::new(&tokens);
        let lookup = |text: &str| index.get(&tokens, text);

        let mut byte_of = HashMap::new();
        for (i, t) in types.iter().enumerate() {
            if *t == TokenType::Byte {
                let b =
                    parse_byte_token(&tokens[i]).ok_or_else(|| TokenizerError::BadByteToken {
                        id: i as u32,
                        piece: tokens[i].to_string(),
                    })?;
                byte_of.insert(i as u32, b);
            }
        }

        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let b = b as u8;
            *slot = match spec.model {
                TokenizerModel::Llama => {
                    lookup(&format!("<0x{b:02X}>")).or_else(|| single_byte_token(&lookup, b))
                }
                TokenizerModel::Gpt2 => single_byte_token(&lookup, b),
            };
        }

        // End of turn by name when the file names none; such tokens become control tokens.
        let eot = eot.or_else(|| EOT_NAMES.iter().find_map(|name| lookup(name)));
        let mut eog: HashSet<u32> = [eos, eot].into_iter().flatten().collect();
        for name in EOG_NAMES {
            if let Some(id) = lookup(name) {
                eog.insert(id);
            }
        }
        for &id in eog.iter().chain(eot.iter()) {
            let t = &mut types[id as usize];
            if !t.is_special() {
                *t = TokenType::Control;
            }
        }

        let mut special: Vec<u32> = (0..n as u32)
            .filter(|&i| types[i as usize].is_special())
            .collect();
        special.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));

        let bpe = match spec.model {
            TokenizerModel::Llama => None,
            TokenizerModel::Gpt2 => {
                if spec.merges.is_empty() {
                    return Err(TokenizerError::MissingMerges);
                }
                let pre = PreTokenizer::from_name(spec.pre.as_deref())?;
                Some(bpe::Bpe::new(pre, &spec.merges)?)
            }
        };

        Ok(Tokenizer {
            model: spec.model,
            tokens,
            scores,
            types,
            index,
            byte_tokens,
            byte_of,
            special,
            eog,
            bos,
            eos,
            eot,
            unk,
            pad,
            add_bos: spec.add_bos,
            add_eos: spec.add_eos,
            add_space_prefix: spec.add_space_prefix,
            bpe,
        })
    }

    /// Text to token ids.
    ///
    /// `add_special`: put BOS first (and EOS last) where the model asks for them
    /// (`add_bos_token`, `add_eos_token`). `parse_special`: also recognize control tokens such
    /// as `<start_of_turn>` written literally in `text`; user-defined tokens are always
    /// recognized.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let fragments = self.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        let drop_bos = crate::faults::is_active(crate::faults::Fault::TokenizerDropsBos);
        if add_special && self.add_bos && !drop_bos {
            out.push(
                self.bos
                    .ok_or(TokenizerError::MissingSpecial { which: "BOS" })?,
            );
        }
        // SPM puts a space in front of the first text and of each text after a special token.
        let mut prev_special = true;
        for frag in fragments {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text { start, end } => {
                    let piece = &text[start..end];
                    match &self.bpe {
                        None => {
                            let mut s = String::with_capacity(piece.len() + 4);
                            if self.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(piece);
                            let escaped = s.replace(' ', SPM_SPACE);
                            spm::tokenize(self, &escaped, &mut out)?;
                        }
                        Some(bpe) => bpe.tokenize(self, piece, &mut out)?,
                    }
                    prev_special = false;
                }
            }
        }
        if add_special && self.add_eos {
            out.push(
                self.eos
                    .ok_or(TokenizerError::MissingSpecial { which: "EOS" })?,
            );
        }
        Ok(out)
    }

    /// Cuts special tokens out of `text`: each special token in turn (longest first), every
    /// occurrence left to right in every piece of text not yet cut.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut present = [false; 256];
        for &b in text.as_bytes() {
            present[b as usize] = true;
        }
        let mut frags = vec![Fragment::Text {
            start: 0,
            end: text.len(),
        }];
        for &id in &self.special {
            let ty = self.types[id as usize];
            if !parse_special && ty.is_hidden() {
                continue;
            }
            let needle: &str = &self.tokens[id as usize];
            if !present[needle.as_bytes()[0] as usize] || needle.len() > text.len() {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len());
            let mut changed = false;
            for frag in &frags {
                let Fragment::Text { start, end } = *frag else {
                    next.push(*frag);
                    continue;
                };
                let mut pos = start;
                for (m, _) in text[start..end].match_indices(needle) {
                    let m = start + m;
                    if m > pos {
                        next.push(Fragment::Text { start: pos, end: m });
                    }
                    next.push(Fragment::Token(id));
                    pos = m + needle.len();
                    changed = true;
                }
                if pos < end {
                    next.push(Fragment::Text { start: pos, end });
                }
            }
            if changed {
                frags = next;
            }
        }
        frags
    }

    /// Token ids to text: the bytes of every token (control tokens contribute nothing), then
    /// one lossy UTF-8 conversion. With `add_space_prefix` the space that encoding put in front
    /// is removed again, as SentencePiece does.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut first = true;
        for &id in ids {
            let b = self.token_bytes(id);
            if b.is_empty() {
                continue;
            }
            let b = if first && self.add_space_prefix && b[0] == b' ' {
                &b[1..]
            } else {
                &b[..]
            };
            first = false;
            bytes.extend_from_slice(b);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw vocabulary text of a token (`▁Hello`, `<0x0A>`, `Ġworld`); empty for an id
    /// outside the vocabulary.
    pub fn token_piece(&self, id: u32) -> &str {
        self.tokens.get(id as usize).map_or("", |t| t)
    }

    /// The bytes a token stands for in output text: `▁` as a space, `<0xHH>` as the byte, GPT-2
    /// byte characters as bytes. Control and unknown tokens (and ids outside the vocabulary)
    /// give nothing; see [`Tokenizer::token_bytes_special`] to render them.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.token_bytes_special(id, false)
    }

    /// [`Tokenizer::token_bytes`], with control and unknown tokens rendered as their text when
    /// `render_special` is set.
    pub fn token_bytes_special(&self, id: u32, render_special: bool) -> Vec<u8> {
        let Some(text) = self.tokens.get(id as usize) else {
            return Vec::new();
        };
        match self.types[id as usize] {
            TokenType::Control | TokenType::Unknown => {
                if render_special {
                    text.as_bytes().to_vec()
                } else {
                    Vec::new()
                }
            }
            TokenType::UserDefined => text.as_bytes().to_vec(),
            TokenType::Byte => self.byte_of.get(&id).map(|&b| vec![b]).unwrap_or_default(),
            TokenType::Normal => match &self.bpe {
                None => text.replace(SPM_SPACE, " ").into_bytes(),
                Some(_) => bpe::decode_bytes(text),
            },
            TokenType::Undefined | TokenType::Unused => Vec::new(),
        }
    }

    /// A decoder that turns ids into text one at a time.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    /// The id of an exact token text, if the vocabulary has it.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.index.get(&self.tokens, piece)
    }

    /// The type of a token; `None` outside the vocabulary.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// The SPM score of a token; `None` outside the vocabulary.
    pub fn token_score(&self, id: u32) -> Option<f32> {
        self.scores.get(id as usize).copied()
    }

    /// Whether generation ends at this token: EOS, EOT, and end-of-turn tokens such as Gemma's
    /// `<end_of_turn>`.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Every end-of-generation id, ascending.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eog.iter().copied().collect();
        v.sort_unstable();
        v
    }

    pub fn model(&self) -> TokenizerModel {
        self.model
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    pub fn unk(&self) -> Option<u32> {
        self.unk
    }

    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// Whether `encode(.., add_special = true, ..)` puts BOS first.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    fn byte_token(&self, b: u8) -> Result<u32, TokenizerError> {
        self.byte_tokens[b as usize].ok_or(TokenizerError::NoByteToken { byte: b })
    }
}

/// `<0xHH>` → the byte.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The token whose text is the single byte `b` (only ASCII can be a one-byte string).
fn single_byte_token(lookup: &impl Fn(&str) -> Option<u32>, b: u8) -> Option<u32> {
    let s = [b];
    std::str::from_utf8(&s).ok().and_then(lookup)
}

#[cfg(test)]
mod tests;
