//! `plumbline tokenize --model FILE [--json] [--no-bos] [--parse-special] TEXT`: the token ids of
//! a text under a model's vocabulary, one row per token with its vocabulary text.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use engine::gguf::Gguf;
use engine::tokenizer::Tokenizer;
use serde_json::json;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model whose vocabulary to use
    #[arg(long)]
    pub model: PathBuf,
    /// Print a JSON array of {id, piece} instead of a table
    #[arg(long)]
    pub json: bool,
    /// Do not add BOS (or EOS) even where the model asks for it
    #[arg(long)]
    pub no_bos: bool,
    /// Recognize control tokens such as <start_of_turn> written in the text
    #[arg(long)]
    pub parse_special: bool,
    /// The text to tokenize
    pub text: String,
}

pub fn run(args: Args) -> Result<()> {
    let gguf =
        Gguf::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?;
    let tok = Tokenizer::from_gguf(&gguf)
        .with_context(|| format!("reading the vocabulary of {}", args.model.display()))?;
    let ids = tok
        .encode(&args.text, !args.no_bos, args.parse_special)
        .with_context(|| format!("tokenizing {:?}", args.text))?;
    let out = if args.json {
        let rows: Vec<_> = ids
            .iter()
            .map(|&id| json!({ "id": id, "piece": tok.token_piece(id) }))
            .collect();
        serde_json::to_string_pretty(&rows)? + "\n"
    } else {
        table(&tok, &ids)
    };
    print!("{out}");
    Ok(())
}

/// `id  piece` rows; pieces are shown escaped (`"\n"`, `"▁the"`) so whitespace is visible.
fn table(tok: &Tokenizer, ids: &[u32]) -> String {
    let w = ids
        .iter()
        .map(|id| id.to_string().len())
        .max()
        .unwrap_or(2)
        .max(2);
    let mut s = String::new();
    let _ = writeln!(s, "{:>w$}  piece", "id");
    for &id in ids {
        let _ = writeln!(s, "{id:>w$}  {:?}", tok.token_piece(id));
    }
    let _ = writeln!(s, "{} tokens", ids.len());
    s
}
