//! Sanity check on the real Gemma 3 270M (Q4_K_M): does the reference forward pass make the model
//! answer "Paris"?
//!
//! The bare prompt "<bos>The capital of France is" is ambiguous for a 270M base model: "▁the",
//! "▁a" and "▁Paris" are all reasonable continuations ("…is the city of Paris"), and this model
//! ranks "▁Paris" third (p ≈ 0.08 behind "▁the" 0.19, "▁a" 0.11, in f32 and f64 alike). So the test
//! asserts two things a broken forward pass would not satisfy:
//! - with one example in context ("The capital of Germany is Berlin. The capital of France is"),
//!   the greedy next token is "▁Paris" with probability above one half;
//! - after the bare prompt, "▁Paris" is among the five most likely tokens.
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

/// Ids of vocabulary pieces; panics naming a piece the vocabulary lacks.
fn ids(model: &ReferenceModel, pieces: &[&str]) -> Vec<u32> {
    pieces
        .iter()
        .map(|p| {
            model
                .token_id(p)
                .unwrap_or_else(|| panic!("piece {p:?} is not in the vocabulary"))
        })
        .collect()
}

/// Last-position logits and the number of taps seen.
fn last_logits(model: &ReferenceModel, tokens: &[u32]) -> (Vec<f32>, usize, f64) {
    let mut n_taps = 0;
    let t = Instant::now();
    let logits = model
        .forward(tokens, &mut |name, shape, data| {
            assert_eq!(shape.iter().product::<usize>(), data.len(), "{name}");
            assert_eq!(shape[0], tokens.len(), "{name}");
            n_taps += 1;
        })
        .expect("forward");
    let secs = t.elapsed().as_secs_f64();
    let vocab = model.vocab_size();
    assert_eq!(logits.len(), tokens.len() * vocab);
    assert!(logits.iter().all(|v| v.is_finite()));
    (logits[(tokens.len() - 1) * vocab..].to_vec(), n_taps, secs)
}

fn ranked(last: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..last.len()).collect();
    order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
    order
}

fn softmax_at(last: &[f32], i: usize) -> f64 {
    let max = last.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = last.iter().map(|&l| f64::from(l - max).exp()).sum();
    f64::from(last[i] - max).exp() / z
}

#[test]
fn gemma3_270m_says_paris() {
    let Some(path) = model_path() else {
        // Under CI the model is fetched first: its absence fails (the reference shares no code
        // with the engine, so this is engine::testing::model_absent's rule written again).
        if std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false") {
            panic!("{FILE} is not fetched and CI is set: run cargo xtask fetch-model gemma3-270m");
        }
        eprintln!("skipped: model not fetched ({FILE})");
        return;
    };
    let t0 = Instant::now();
    let model = ReferenceModel::load(&path, Precision::F32).expect("load gemma-3-270m");
    let load_s = t0.elapsed().as_secs_f64();
    assert_eq!(model.architecture(), "gemma3");
    assert_eq!(model.vocab_size(), 262_144);

    // Gemma's SentencePiece vocabulary has no dummy prefix: the first word is "The", later words
    // carry "▁". `<bos>` is id 2 in every Gemma 3 vocabulary; check that the file agrees.
    assert_eq!(model.token_piece(2), Some("<bos>"));
    let paris = ids(&model, &["▁Paris"])[0];

    let bare = ids(
        &model,
        &["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"],
    );
    let (last, n_taps, forward_s) = last_logits(&model, &bare);
    // 18 dense layers × 9 taps (no router) + embed, output_norm, logits
    assert_eq!(n_taps, 18 * 9 + 3);
    let order = ranked(&last);
    println!(
        "bare prompt {bare:?}: top-1 {} {:?} logit {:.3}; ▁Paris rank {} logit {:.3} p {:.3}; \
         load {load_s:.2} s, forward of {} tokens {forward_s:.2} s",
        order[0],
        model.token_piece(order[0] as u32),
        last[order[0]],
        order
            .iter()
            .position(|&i| i as u32 == paris)
            .unwrap_or(usize::MAX),
        last[paris as usize],
        softmax_at(&last, paris as usize),
        bare.len()
    );
    assert!(
        order[..5].contains(&(paris as usize)),
        "▁Paris should be among the top 5 after the bare prompt"
    );

    let one_shot = ids(
        &model,
        &[
            "<bos>",
            "The",
            "▁capital",
            "▁of",
            "▁Germany",
            "▁is",
            "▁Berlin",
            ".",
            "▁The",
            "▁capital",
            "▁of",
            "▁France",
            "▁is",
        ],
    );
    let (last, _, forward_s) = last_logits(&model, &one_shot);
    let order = ranked(&last);
    let p = softmax_at(&last, paris as usize);
    println!(
        "one-shot prompt: top-1 {} {:?} logit {:.3} p {p:.3}; forward of {} tokens {forward_s:.2} s",
        order[0],
        model.token_piece(order[0] as u32),
        last[order[0]],
        one_shot.len()
    );
    assert_eq!(order[0] as u32, paris, "greedy next token should be ▁Paris");
    assert!(p > 0.5, "▁Paris should be the clear answer, p = {p}");
}
