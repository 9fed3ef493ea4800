//! The reference on every fixture: finite logits, every tap of docs/TAPS.md present in forward
//! order with the right shape, and f32 agreeing with f64.

use std::path::PathBuf;

use golden::fixtures::{self, Dims, FixtureSpec};
use golden::vocab;
use reference::{Precision, ReferenceModel};

struct Tap {
    name: String,
    shape: Vec<usize>,
    data: Vec<f32>,
}

fn run(model: &ReferenceModel, tokens: &[u32]) -> (Vec<f32>, Vec<Tap>) {
    let mut taps = Vec::new();
    let logits = model
        .forward(tokens, &mut |name, shape, data| {
            taps.push(Tap {
                name: name.to_string(),
                shape: shape.to_vec(),
                data: data.to_vec(),
            })
        })
        .unwrap_or_else(|e| panic!("forward: {e}"));
    (logits, taps)
}

/// The taps docs/TAPS.md promises for `spec` on `n` tokens, in order, with their shapes.
fn expected_taps(spec: &FixtureSpec, n: usize) -> Vec<(String, Vec<usize>)> {
    let n_vocab = vocab::pieces().len();
    let mut t = Vec::new();
    let (n_embd, n_layer) = match spec.dims {
        Dims::Dense(d) => (d.n_embd, d.n_layer),
        Dims::MlaMoe(d) => (d.n_embd, d.n_layer),
    };
    t.push(("embed".to_string(), vec![n, n_embd]));
    for i in 0..n_layer {
        let (q, k, v, att, router) = match spec.dims {
            Dims::Dense(d) => (
                d.n_head * d.head_dim,
                d.n_head_kv * d.head_dim,
                d.n_head_kv * d.head_dim,
                d.n_head * d.head_dim,
                None,
            ),
            Dims::MlaMoe(d) => {
                let qk = d.n_head * (d.qk_nope + d.qk_rope);
                let v = d.n_head * d.v_head_dim;
                (qk, qk, v, v, (i >= d.n_dense_lead).then_some(d.n_expert))
            }
        };
        let mut push = |s: &str, w: usize| t.push((format!("blk.{i}.{s}"), vec![n, w]));
        push("attn_norm", n_embd);
        push("q", q);
        push("k", k);
        push("v", v);
        push("attn", att);
        push("attn_out", n_embd);
        push("ffn_norm", n_embd);
        if let Some(e) = router {
            push("router", e);
        }
        push("ffn_out", n_embd);
        push("out", n_embd);
    }
    t.push(("output_norm".to_string(), vec![n, n_embd]));
    t.push(("logits".to_string(), vec![n, n_vocab]));
    t
}

fn write_all() -> (tempfile::TempDir, Vec<(FixtureSpec, PathBuf)>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let written = fixtures::all()
        .into_iter()
        .map(|spec| {
            let path = fixtures::write(&spec, dir.path()).expect("write fixture");
            (spec, path)
        })
        .collect();
    (dir, written)
}

#[test]
fn every_fixture_runs_with_every_tap_in_order() {
    let tokens = vocab::sample_tokens();
    let n = tokens.len();
    let (_dir, written) = write_all();
    for (spec, path) in written {
        let model = ReferenceModel::load(&path, Precision::F32)
            .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
        assert_eq!(model.architecture(), spec.arch.name());
        assert_eq!(model.vocab_size(), vocab::pieces().len());
        assert_eq!(model.token_id("<s>"), Some(vocab::BOS_ID));
        let (logits, taps) = run(&model, &tokens);
        assert_eq!(logits.len(), n * model.vocab_size());
        assert!(
            logits.iter().all(|v| v.is_finite()),
            "{}: non-finite logits",
            spec.name
        );
        let got: Vec<(String, Vec<usize>)> = taps
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        assert_eq!(got, expected_taps(&spec, n), "{}", spec.name);
        for t in &taps {
            assert_eq!(
                t.data.len(),
                t.shape.iter().product::<usize>(),
                "{} {}",
                spec.name,
                t.name
            );
            assert!(
                t.data.iter().all(|v| v.is_finite()),
                "{}: {} not finite",
                spec.name,
                t.name
            );
        }
        // the logits tap is the returned logits
        assert_eq!(taps.last().map(|t| &t.data), Some(&logits));
        // activations stay O(1), as the fixture weights are scaled to keep them
        let out = taps
            .iter()
            .rev()
            .find(|t| t.name.ends_with(".out"))
            .expect("an out tap");
        let rms = (out.data.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>()
            / out.data.len() as f64)
            .sqrt();
        assert!(
            (0.1..100.0).contains(&rms),
            "{}: last residual RMS {rms}",
            spec.name
        );
    }
}

#[test]
fn f32_and_f64_agree_on_every_fixture() {
    let tokens = vocab::sample_tokens();
    let (_dir, written) = write_all();
    for (spec, path) in written {
        let f32m = ReferenceModel::load(&path, Precision::F32).expect("load f32");
        let f64m = ReferenceModel::load(&path, Precision::F64).expect("load f64");
        let (_, a) = run(&f32m, &tokens);
        let (_, b) = run(&f64m, &tokens);
        assert_eq!(a.len(), b.len());
        for (ta, tb) in a.iter().zip(&b) {
            assert_eq!(ta.name, tb.name);
            let num: f64 = ta
                .data
                .iter()
                .zip(&tb.data)
                .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
                .sum();
            let den: f64 = tb.data.iter().map(|y| f64::from(*y).powi(2)).sum();
            let nmse = num / den.max(f64::MIN_POSITIVE);
            // f32 keeps 24 bits (relative rounding 6e-8 per operation). Through ≤ 7 layers of
            // O(1) activations, dot products of ≤ 640 terms and softmaxes, the relative error
            // stays around 1e-6, i.e. NMSE around 1e-12; 1e-9 leaves three orders of margin
            // while any real difference (a wrong op, a flipped MoE route) is far above it.
            assert!(
                nmse < 1e-9,
                "{} {}: f32 vs f64 NMSE {nmse:e}",
                spec.name,
                ta.name
            );
        }
    }
}

/// Position `p`, all columns, of a `[n, width]` tap.
fn row<'a>(taps: &'a [Tap], name: &str, p: usize) -> &'a [f32] {
    let t = taps.iter().find(|t| t.name == name).expect("tap");
    let w = t.shape[1];
    &t.data[p * w..(p + 1) * w]
}

#[test]
fn gemma3_fixture_local_layers_see_only_the_window() {
    // Window 8: at position 19 a local layer sees positions 12..=19, so changing token 1 cannot
    // change layer 0's output there; layer 5 is global and must see it.
    let spec = fixtures::by_name("gemma3-q4_k_m").expect("fixture");
    let Dims::Dense(d) = spec.dims else {
        panic!("gemma3 fixture is dense")
    };
    assert_eq!(d.sliding_window, 8);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = fixtures::write(&spec, dir.path()).expect("write");
    let model = ReferenceModel::load(&path, Precision::F64).expect("load");
    let a_tokens = vocab::sample_tokens();
    let mut b_tokens = a_tokens.clone();
    b_tokens[1] = model.token_id("▁hello").expect("▁hello");
    let (_, a) = run(&model, &a_tokens);
    let (_, b) = run(&model, &b_tokens);
    let last = a_tokens.len() - 1;
    assert!(last >= 8 + 1 + 8, "the sequence must reach past the window");
    assert_eq!(row(&a, "blk.0.out", last), row(&b, "blk.0.out", last));
    // ...but position 8 of layer 0 still sees position 1
    assert_ne!(row(&a, "blk.0.out", 8), row(&b, "blk.0.out", 8));
    // layer 5 (global) at the last position sees it (through its own attention)
    assert_ne!(row(&a, "blk.5.attn", last), row(&b, "blk.5.attn", last));
}
