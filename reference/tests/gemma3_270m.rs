//! Sanity check on the real Gemma 3 270M (Q4_K_M): greedy next token after
//! "<bos>The capital of France is" must be "▁Paris".
//!
//! Skipped (with a printed reason) when the model file has not been fetched
//! (`cargo xtask fetch-model`); it lives at `$PLUMBLINE_MODELS/gemma-3-270m-q4_k_m.gguf` or
//! `~/.cache/plumbline/models/gemma-3-270m-q4_k_m.gguf`.

use std::path::PathBuf;
use std::time::Instant;

use reference::{Precision, ReferenceModel};

const FILE: &str = "gemma-3-270m-q4_k_m.gguf";

fn model_path() -> Option<PathBuf> {
    let dir = match std::env::var_os("PLUMBLINE_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/plumbline/models"),
    };
    let path = dir.join(FILE);
    path.is_file().then_some(path)
}

#[test]
fn gemma3_270m_says_paris() {
    let Some(path) = model_path() else {
        println!("skipped: model not fetched ({FILE})");
        return;
    };
    let t0 = Instant::now();
    let model = ReferenceModel::load(&path, Precision::F32).expect("load gemma-3-270m");
    let load_s = t0.elapsed().as_secs_f64();
    assert_eq!(model.architecture(), "gemma3");

    // Gemma's SentencePiece vocabulary has no dummy prefix: the first word is "The", later words
    // carry "▁". `<bos>` is id 2 in every Gemma 3 vocabulary; check that the file agrees.
    assert_eq!(model.token_piece(2), Some("<bos>"));
    let pieces = ["The", "▁capital", "▁of", "▁France", "▁is"];
    let mut tokens = vec![2u32];
    for p in pieces {
        tokens.push(
            model
                .token_id(p)
                .unwrap_or_else(|| panic!("piece {p:?} is not in the vocabulary")),
        );
    }
    let paris = model.token_id("▁Paris").expect("▁Paris in the vocabulary");

    let mut names = Vec::new();
    let t1 = Instant::now();
    let logits = model
        .forward(&tokens, &mut |name, shape, data| {
            assert_eq!(shape.iter().product::<usize>(), data.len(), "{name}");
            names.push(name.to_string());
        })
        .expect("forward");
    let forward_s = t1.elapsed().as_secs_f64();

    let vocab = model.vocab_size();
    assert_eq!(logits.len(), tokens.len() * vocab);
    assert!(logits.iter().all(|v| v.is_finite()));
    // 18 dense layers × 9 taps (no router) + embed, output_norm, logits
    assert_eq!(names.len(), 18 * 9 + 3);
    let last = &logits[(tokens.len() - 1) * vocab..];
    let (top, top_logit) = last
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .expect("non-empty vocabulary");
    println!(
        "tokens {tokens:?}; top-1 {top} {:?} logit {top_logit:.3}; ▁Paris = {paris} logit {:.3}; \
         load {load_s:.2} s, forward of {} tokens {forward_s:.2} s",
        model.token_piece(top as u32),
        last[paris as usize],
        tokens.len()
    );
    assert_eq!(top as u32, paris, "greedy next token should be ▁Paris");
}
