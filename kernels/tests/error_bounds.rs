//! Quantize → dequantize error within ggml's published per-type thresholds
//! (`tests/test-quantize-fns.cpp`; the table and its sources are in `quant::accuracy`).
//!
//! The metric is ggml's own (`sqrt(Σ(x − x̂)²) / n` at n = 4096), so the thresholds apply
//! unchanged: on ggml's signal `0.1 + 2·cos(i)`, and as a property on random data in the
//! signal's range.

use kernels::quant::accuracy::{
    error_table, format_table, ggml_total_error, round_trip, test_signal, threshold,
    threshold_random, TEST_SIZE,
};
use kernels::quant::GgmlType;
use proptest::prelude::*;

fn total_error(ty: GgmlType, src: &[f32]) -> f32 {
    match round_trip(ty, src) {
        Ok(back) => ggml_total_error(src, &back),
        Err(e) => panic!("{ty}: {e}"),
    }
}

#[test]
fn ggml_signal_within_thresholds_for_every_supported_type() {
    for offset in [0.0f32, 1.0, 3.0] {
        let signal = test_signal(offset, TEST_SIZE);
        for ty in GgmlType::SUPPORTED {
            let err = total_error(ty, &signal);
            assert!(
                err < threshold(ty),
                "{ty}, offset {offset}: expected error below {}, found {err}",
                threshold(ty)
            );
        }
    }
}

#[test]
fn lossless_formats_are_lossless_where_they_should_be() {
    // f32 is exact; f16 and bf16 are exact on values they represent: k·2^e with |k| ≤ 128
    // (8 significant bits) and e in [-8, 7].
    let exact: Vec<f32> = (0..TEST_SIZE)
        .map(|i| ((i % 256) as f32 - 128.0) * 2f32.powi((i / 256) as i32 - 8))
        .collect();
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        assert_eq!(total_error(ty, &exact), 0.0, "{ty}");
    }
}

#[test]
fn error_table_report() {
    let rows = error_table();
    assert_eq!(rows.len(), GgmlType::SUPPORTED.len());
    println!("{}", format_table(&rows));
    for r in &rows {
        assert!(r.pass, "{}: {r:?}", r.ty);
        // More bits, less error: a sanity check on the table itself (k-quants vs legacy at the
        // same width need not order, so only compare against 8-bit formats).
        if r.bits_per_weight < 8.0 {
            let q8 = rows
                .iter()
                .find(|q| q.ty == GgmlType::Q8_0)
                .map(|q| q.rmse_signal);
            assert!(Some(r.rmse_signal) > q8, "{}: rmse below q8_0's", r.ty);
        }
    }
}

fn data(amplitude: f32) -> impl Strategy<Value = Vec<f32>> {
    proptest::collection::vec(-amplitude..amplitude, TEST_SIZE)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_data_within_thresholds(src in data(2.1)) {
        for ty in GgmlType::SUPPORTED {
            let err = total_error(ty, &src);
            prop_assert!(err < threshold_random(ty), "{}: expected error below {}, found {}", ty, threshold_random(ty), err);
        }
    }

    /// Scale invariance: the quantizers work relative to each block's range, so weights at other
    /// scales quantize as well as unit-scale ones (0.05 keeps f16 super-block scales normal).
    #[test]
    fn scaled_down_data_within_scaled_thresholds(src in data(2.1), scale in 0.05f32..20.0) {
        let small: Vec<f32> = src.iter().map(|v| v * scale).collect();
        for ty in GgmlType::SUPPORTED {
            let err = total_error(ty, &small);
            let bound = threshold_random(ty) * scale;
            prop_assert!(err < bound, "{}: scale {}: expected error below {}, found {}", ty, scale, bound, err);
        }
    }
}
