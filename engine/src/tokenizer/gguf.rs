//! [`Tokenizer::from_gguf`]: the `tokenizer.ggml.*` keys, with llama.cpp's defaults where a key
//! is absent.

use super::{PreTokenizer, TokenType, Tokenizer, TokenizerError, TokenizerModel, TokenizerSpec};
use crate::gguf::Gguf;

impl TokenizerSpec {
    /// Reads the vocabulary of a GGUF file.
    ///
    /// Defaults as llama.cpp's `llama_vocab::load`: for `llama`, BOS 1, EOS 2, UNK 0, a space
    /// prefix and BOS on; for `gpt2`, no space prefix, BOS on only for llama3-style
    /// pre-tokenizers. Keys that are present always win.
    pub fn from_gguf(gguf: &Gguf) -> Result<TokenizerSpec, TokenizerError> {
        let model = TokenizerModel::from_name(gguf.get_str("tokenizer.ggml.model")?)?;
        let pre = gguf.get_str_opt("tokenizer.ggml.pre")?.map(str::to_string);
        let tokens: Vec<String> = gguf
            .get_str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(str::to_string)
            .collect();
        let n = tokens.len();
        let scores = gguf
            .get_f32_array_opt("tokenizer.ggml.scores")?
            .unwrap_or_default();
        let token_types = gguf
            .get_i32_array_opt("tokenizer.ggml.token_type")?
            .unwrap_or_default()
            .into_iter()
            .map(TokenType::from_i32)
            .collect();
        let merges = match model {
            TokenizerModel::Llama => Vec::new(),
            TokenizerModel::Gpt2 => gguf
                .get_str_array_opt("tokenizer.ggml.merges")?
                .unwrap_or_default()
                .into_iter()
                .map(str::to_string)
                .collect(),
        };

        // A default id only counts when it is inside the vocabulary (llama.cpp disables it).
        let in_vocab = |id: u32| (id as usize) < n;
        let (def_bos, def_eos, def_unk, def_space, def_add_bos) = match model {
            TokenizerModel::Llama => (Some(1), Some(2), Some(0), true, true),
            TokenizerModel::Gpt2 => {
                let llama3 = PreTokenizer::from_name(pre.as_deref())? == PreTokenizer::Llama3;
                (None, None, None, false, llama3)
            }
        };
        let id = |key: &str, default: Option<u32>| -> Result<Option<u32>, TokenizerError> {
            Ok(gguf
                .get_u32_opt(key)?
                .or_else(|| default.filter(|&d| in_vocab(d))))
        };

        Ok(TokenizerSpec {
            model,
            bos: id("tokenizer.ggml.bos_token_id", def_bos)?,
            eos: id("tokenizer.ggml.eos_token_id", def_eos)?,
            eot: id("tokenizer.ggml.eot_token_id", None)?,
            unk: id("tokenizer.ggml.unknown_token_id", def_unk)?,
            pad: id("tokenizer.ggml.padding_token_id", None)?,
            add_bos: gguf
                .get_bool_opt("tokenizer.ggml.add_bos_token")?
                .unwrap_or(def_add_bos),
            add_eos: gguf
                .get_bool_opt("tokenizer.ggml.add_eos_token")?
                .unwrap_or(false),
            add_space_prefix: gguf
                .get_bool_opt("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(def_space),
            tokens,
            scores,
            token_types,
            merges,
            pre,
        })
    }
}

impl Tokenizer {
    /// The tokenizer of a GGUF model.
    pub fn from_gguf(gguf: &Gguf) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::new(TokenizerSpec::from_gguf(gguf)?)
    }
}
