//! The `glm-dsa` fixture's sparse attention is not a no-op: its indexer top-k (8) is below the
//! contexts verify feeds, and the reference's logits change exactly where the selection leaves
//! visible positions out. Checked against the same fixture with a top-k no context reaches (the
//! dense MLA attention of `deepseek2`).

use golden::fixtures::{self, Dims, FixtureSpec};
use golden::vocab;
use reference::{Precision, ReferenceModel};

fn logits(spec: &FixtureSpec, tokens: &[u32]) -> Vec<f32> {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = fixtures::write(spec, dir.path()).expect("write fixture");
    let model = ReferenceModel::load(&path, Precision::F64).expect("load");
    model
        .forward(tokens, &mut |_, _, _| {})
        .unwrap_or_else(|e| panic!("{}: {e}", spec.name))
}

#[test]
fn sparse_attention_changes_the_result() {
    let sparse = fixtures::by_name("glm-dsa-q4_k").expect("glm-dsa fixture");
    let Dims::MlaMoe(d) = sparse.dims else {
        panic!("glm-dsa is MLA + MoE")
    };
    let top_k = d.dsa.expect("indexer").top_k;
    let mut dense = sparse.clone();
    if let Dims::MlaMoe(ref mut d) = dense.dims {
        if let Some(x) = d.dsa.as_mut() {
            x.top_k = 1 << 20;
        }
    }
    // 32 tokens, as verify's teacher-forced fixture cases feed (the sample sentence repeated).
    let mut tokens = vocab::sample_tokens();
    while tokens.len() < 32 {
        tokens.extend_from_within(1..);
    }
    tokens.truncate(32);
    assert!(top_k < tokens.len());
    let (a, b) = (logits(&sparse, &tokens), logits(&dense, &tokens));
    let n_vocab = vocab::pieces().len();
    for (p, (ra, rb)) in a.chunks(n_vocab).zip(b.chunks(n_vocab)).enumerate() {
        let num: f64 = ra
            .iter()
            .zip(rb)
            .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
            .sum();
        let den: f64 = rb.iter().map(|y| f64::from(*y).powi(2)).sum();
        let nmse = num / den;
        if p < top_k {
            // Every visible position selected: the dense computation, bit for bit.
            assert_eq!(ra, rb, "position {p}");
        } else if p >= top_k + 4 {
            // At least 5 positions left out of every layer's attention. f32/f64 rounding gives
            // NMSE ~1e-12 (reference_fixtures.rs); a dropped position changes the row by far
            // more.
            assert!(
                nmse > 1e-6,
                "position {p}: sparse equals dense (NMSE {nmse:e})"
            );
        }
    }
}
