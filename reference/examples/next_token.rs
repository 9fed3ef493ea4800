//! Print the reference's top next tokens after a sequence of vocabulary pieces.
//!
//! `cargo run -p reference --release --example next_token -- MODEL.gguf [--f64] [--streaming] PIECE...`
//! (pieces spelled as in the vocabulary, e.g. `<bos> The ▁capital ▁of ▁France ▁is`).
//! `--streaming` reads each layer when the forward pass reaches it ([`Residency::Streaming`]):
//! run it under `/usr/bin/time -v` beside the default to see the two residencies' peak memory.

use std::path::PathBuf;
use std::process::ExitCode;

use reference::{Precision, ReferenceModel, Residency};

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        eprintln!("usage: next_token MODEL.gguf [--f64] [--streaming] PIECE...");
        return ExitCode::FAILURE;
    }
    let path = PathBuf::from(args.remove(0));
    let precision = if args.first().is_some_and(|a| a == "--f64") {
        args.remove(0);
        Precision::F64
    } else {
        Precision::F32
    };
    let residency = if args.first().is_some_and(|a| a == "--streaming") {
        args.remove(0);
        Residency::Streaming
    } else {
        Residency::Eager
    };
    let model = match ReferenceModel::open(&path, precision, residency) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    let mut tokens = Vec::new();
    for piece in &args {
        match model.token_id(piece) {
            Some(id) => tokens.push(id),
            None => {
                eprintln!("piece {piece:?} is not in the vocabulary");
                return ExitCode::FAILURE;
            }
        }
    }
    let t = std::time::Instant::now();
    let logits = match model.forward(&tokens, &mut |_, _, _| {}) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("forward: {e}");
            return ExitCode::FAILURE;
        }
    };
    let vocab = model.vocab_size();
    let last = &logits[(tokens.len() - 1) * vocab..];
    let max = last.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = last.iter().map(|&l| f64::from(l - max).exp()).sum();
    let mut order: Vec<usize> = (0..vocab).collect();
    order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
    println!(
        "tokens {tokens:?}, forward {:.2} s",
        t.elapsed().as_secs_f64()
    );
    for &i in order.iter().take(10) {
        let p = f64::from(last[i] - max).exp() / z;
        println!(
            "{i:>8} {:<20} logit {:>8.3} p {p:.4}",
            format!("{:?}", model.token_piece(i as u32).unwrap_or("?")),
            last[i]
        );
    }
    ExitCode::SUCCESS
}
