//! The real Gemma 3 270M (Q4_K_M) model: a greedy continuation must be sensible.
//!
//! The model comes from `cargo xtask fetch-model` into `$PLUMBLINE_MODELS` or
//! `~/.cache/plumbline/models`; without it each test prints "skipped: model not fetched" and
//! returns.

use std::path::PathBuf;

use engine::model::Model;
use engine::runtime::{CpuBackend, Session};

const MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";

fn model_path() -> Option<PathBuf> {
    let dir = match std::env::var_os("PLUMBLINE_MODELS") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/plumbline/models"),
    };
    let p = dir.join(MODEL_FILE);
    p.exists().then_some(p)
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Token ids of `<bos>The▁capital▁of▁France▁is`, looked up by exact string in the file's
/// vocabulary with gguf-py (independent of the engine's tokenizer): `<bos>` 2, `The` 818,
/// `▁capital` 5279, `▁of` 529, `▁France` 7001, `▁is` 563. `▁Paris` is 9079.
const PROMPT: [u32; 6] = [2, 818, 5279, 529, 7001, 563];
const PARIS: u32 = 9079;

#[test]
fn greedy_capital_of_france_is_paris_from_token_ids() {
    let Some(path) = model_path() else {
        println!("skipped: model not fetched");
        return;
    };
    let model = Model::load(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
    let backend = CpuBackend::new(None, None).unwrap_or_else(|e| panic!("{e}"));
    let mut session = Session::new(&model, &backend, 64);
    let mut logits = session
        .forward(&PROMPT, None)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut out = Vec::new();
    for _ in 0..40 {
        let id = argmax(logits.last());
        out.push(id);
        logits = session
            .forward(&[id], None)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    println!("greedy ids: {out:?}");
    assert!(out.contains(&PARIS), "expected ▁Paris (9079) in {out:?}");
}

#[test]
fn dev_print_top5() {
    let Some(path) = model_path() else {
        println!("skipped: model not fetched");
        return;
    };
    let model = Model::load(&path).unwrap_or_else(|e| panic!("{e}"));
    let backend = CpuBackend::new(None, None).unwrap_or_else(|e| panic!("{e}"));
    let mut session = Session::new(&model, &backend, 64);
    session.set_logits_all(true);
    let mut rec = engine::taps::TapRecorder::new();
    let logits = session
        .forward(&PROMPT, Some(&mut rec))
        .unwrap_or_else(|e| panic!("{e}"));
    let o = rec.get("blk.0.out").unwrap();
    println!(
        "blk0 out[0,:4] {:?} last {:?}",
        &o.data[..4],
        &o.data[5 * 640..5 * 640 + 4]
    );
    for t in 0..logits.n_rows {
        let row = logits.row(t);
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap());
        println!(
            "{t} {:?}",
            idx[..5].iter().map(|&i| (i, row[i])).collect::<Vec<_>>()
        );
    }
}

#[test]
fn dev_dump_taps() {
    let Some(path) = model_path() else {
        return;
    };
    let model = Model::load(&path).unwrap_or_else(|e| panic!("{e}"));
    let isa = std::env::var("PLUMBLINE_ISA").ok().and_then(|s| kernels::cpu::Isa::from_name(&s));
    let backend = CpuBackend::new(isa, None).unwrap_or_else(|e| panic!("{e}"));
    let mut session = Session::new(&model, &backend, 64);
    let mut rec = engine::taps::TapRecorder::new();
    session.forward(&PROMPT, Some(&mut rec)).unwrap_or_else(|e| panic!("{e}"));
    let _ = backend;
    std::fs::create_dir_all("/tmp/taps").unwrap();
    for t in &rec.taps {
        if t.name.starts_with("blk.0.") || t.name == "embed" {
            let bytes: Vec<u8> = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(format!("/tmp/taps/{}.f32", t.name), bytes).unwrap();
        }
    }
}
