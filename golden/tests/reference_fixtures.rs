//! The reference on every fixture: finite logits, every tap of docs/TAPS.md present in forward
//! order with the right shape, and f32 agreeing with f64.

use std::path::PathBuf;

use golden::fixtures::{self, Dims, FixtureSpec, MlaMoeDims};
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
        if let Dims::MlaMoe(MlaMoeDims { dsa: Some(x), .. }) = spec.dims {
            if x.full[i] {
                push("indexer_top_k", x.top_k);
            }
        }
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

/// `forward_hidden` emits the same taps as `forward` up to `output_norm` and returns its values;
/// `logits_of` on any split of those rows gives `forward`'s logits rows (how verify's path cases
/// get the reference's logits a block at a time). An empty or ragged input is an error.
#[test]
fn logits_by_rows_equal_the_whole_forward() {
    let tokens = vocab::sample_tokens();
    let n = tokens.len();
    let (_dir, written) = write_all();
    for (spec, path) in written {
        for precision in [Precision::F32, Precision::Exact] {
            let m = ReferenceModel::load(&path, precision).expect("load");
            let (logits, taps) = run(&m, &tokens);
            let mut hidden_taps = Vec::new();
            let normed = m
                .forward_hidden(&tokens, &mut |name, _, data| {
                    hidden_taps.push((name.to_owned(), data.to_vec()))
                })
                .unwrap_or_else(|e| panic!("{} forward_hidden: {e}", spec.name));
            let before_head: Vec<_> = taps.iter().filter(|t| t.name != "logits").collect();
            assert_eq!(hidden_taps.len(), before_head.len(), "{}", spec.name);
            for ((name, data), t) in hidden_taps.iter().zip(&before_head) {
                assert_eq!((name, data), (&t.name, &t.data), "{}", spec.name);
            }
            assert_eq!(&normed, &row_block(&taps, "output_norm"), "{}", spec.name);
            let d = m.n_embd();
            let v = m.vocab_size();
            let k = n / 3 + 1;
            let mut by_rows = m.logits_of(&normed[..k * d]).expect("logits_of");
            by_rows.extend(m.logits_of(&normed[k * d..]).expect("logits_of"));
            assert_eq!(by_rows.len(), n * v);
            // The head's products are per row, but the product library may block a matrix of
            // k rows differently from one of n: allow f32 summation-order error of the largest
            // logit (8 ulps of it), far below any difference a wrong row would make.
            for (i, (a, b)) in by_rows.iter().zip(&logits).enumerate() {
                let row = &logits[i / v * v..(i / v + 1) * v];
                let scale = row.iter().fold(0f32, |m, x| m.max(x.abs()));
                assert!(
                    (a - b).abs() <= 8.0 * f32::EPSILON * scale,
                    "{} {precision:?} logit {i}: {a} by rows, {b} whole",
                    spec.name
                );
            }
            assert!(m.logits_of(&normed[..d + 1]).is_err(), "a ragged row");
        }
    }
}

/// Every value of a tap.
fn row_block(taps: &[Tap], name: &str) -> Vec<f32> {
    taps.iter()
        .find(|t| t.name == name)
        .map(|t| t.data.clone())
        .unwrap_or_default()
}

/// The reference following forced expert choices (verify's route-aware MoE comparison): its own
/// choice forced changes nothing; another choice for one token changes that token's MoE output
/// from that layer on and nothing before it; forcing a dense model or a wrong expert count is
/// an error.
#[test]
fn forced_routes_change_only_the_forced_token() {
    let tokens = vocab::sample_tokens();
    let (_dir, written) = write_all();
    let hidden = |m: &ReferenceModel, forced: &reference::ForcedRoutes| {
        let mut taps = Vec::new();
        m.forward_hidden_routed(&tokens, forced, &mut |name, shape, data| {
            taps.push(Tap {
                name: name.to_owned(),
                shape: shape.to_vec(),
                data: data.to_vec(),
            })
        })
        .map(|_| taps)
    };
    for (spec, path) in written {
        let m = ReferenceModel::load(&path, Precision::Exact).expect("load");
        let plain = hidden(&m, &Default::default()).expect("unforced");
        let moe_layer = (0..m.n_layers()).find(|&l| m.routing(l).ok().flatten().is_some());
        let Some(layer) = moe_layer else {
            let mut forced = reference::ForcedRoutes::new();
            forced.insert((0, 0), vec![0, 1]);
            assert!(
                hidden(&m, &forced).is_err(),
                "{}: forced a dense model",
                spec.name
            );
            continue;
        };
        let routing = m.routing(layer).ok().flatten().expect("routing");
        let router = row(&plain, &format!("blk.{layer}.router"), 3);
        let logits: Vec<f64> = router.iter().map(|&x| f64::from(x)).collect();
        let own = routing.choose(&logits);
        let mut forced = reference::ForcedRoutes::new();
        forced.insert((layer, 3), own.clone());
        let same = hidden(&m, &forced).expect("forced own choice");
        for (a, b) in plain.iter().zip(&same) {
            assert_eq!((&a.name, &a.data), (&b.name, &b.data), "{}", spec.name);
        }
        // The best expert it did not choose, in place of its last choice.
        let other = routing
            .ranking(&logits)
            .into_iter()
            .find(|e| !own.contains(e))
            .expect("an unchosen expert");
        let mut flipped = own.clone();
        let last = flipped.len() - 1;
        flipped[last] = other;
        forced.insert((layer, 3), flipped);
        let moved = hidden(&m, &forced).expect("forced another choice");
        let ffn = format!("blk.{layer}.ffn_out");
        for (a, b) in plain.iter().zip(&moved) {
            for p in 0..tokens.len() {
                let differs = row(&plain, &a.name, p) != row(&moved, &b.name, p);
                let id = harness_free_layer(&a.name);
                // Before the forced layer, and rows before the forced token: untouched.
                if id.is_some_and(|l| l < layer) || p < 3 || a.name == format!("blk.{layer}.router")
                {
                    assert!(!differs, "{} {} row {p} changed", spec.name, a.name);
                }
                if a.name == ffn {
                    assert_eq!(differs, p == 3, "{} {ffn} row {p}", spec.name);
                }
            }
        }
        forced.insert((layer, 3), vec![0]);
        assert!(
            hidden(&m, &forced).is_err(),
            "{}: one expert of two",
            spec.name
        );
    }
}

/// The layer of a `blk.{i}.…` tap name.
fn harness_free_layer(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}
