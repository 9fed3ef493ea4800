//! The error type of [`crate::tokenizer`].

use crate::gguf::GgufError;

/// Everything that can go wrong building a tokenizer from a vocabulary or encoding text with it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// Reading a `tokenizer.ggml.*` key from the GGUF file failed (missing key, wrong type).
    #[error(transparent)]
    Gguf(#[from] GgufError),

    /// `tokenizer.ggml.model` names a tokenizer this engine does not implement.
    #[error("tokenizer.ggml.model: expected \"llama\" or \"gpt2\", found {0:?}")]
    UnsupportedModel(String),

    /// `tokenizer.ggml.pre` names a pre-tokenizer this engine does not implement.
    #[error(
        "tokenizer.ggml.pre: expected one of default, gpt2, gpt-2, llama3, llama-v3, llama-bpe, qwen2, found {0:?}"
    )]
    UnsupportedPre(String),

    /// The vocabulary has no tokens.
    #[error("tokenizer.ggml.tokens: expected at least one token, found none")]
    EmptyVocab,

    /// A per-token array is shorter than the token list.
    #[error("{field}: expected {expected} entries (one per token), found {found}")]
    LengthMismatch {
        field: &'static str,
        expected: usize,
        found: usize,
    },

    /// A special token id (`bos`, `eos`, …) is outside the vocabulary.
    #[error("{field}: expected a token id below the vocabulary size {n_vocab}, found {id}")]
    IdOutOfRange {
        field: &'static str,
        id: u32,
        n_vocab: usize,
    },

    /// A token of type BYTE whose text is not `<0xHH>`.
    #[error("token {id}: type BYTE expects text of the form <0xHH>, found {piece:?}")]
    BadByteToken { id: u32, piece: String },

    /// A GPT-2 BPE vocabulary without merges.
    #[error("tokenizer.ggml.merges: a gpt2 tokenizer needs BPE merges, found none")]
    MissingMerges,

    /// Encoding needed a byte-fallback token (`<0xHH>`) that the vocabulary lacks.
    #[error("byte 0x{byte:02X} of the input has no token: the vocabulary has neither <0x{byte:02X}> nor the byte itself")]
    NoByteToken { byte: u8 },

    /// `add_special` asked for a BOS or EOS token that the vocabulary does not define.
    #[error("add_special: the model asks for a {which} token but defines none")]
    MissingSpecial { which: &'static str },

    /// The pre-tokenizer pattern failed at run time (backtracking limit on pathological input).
    #[error("pre-tokenizer: {0}")]
    Regex(String),
}
