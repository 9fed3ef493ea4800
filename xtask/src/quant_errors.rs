//! `cargo xtask quant-errors [--json]`: quantize→dequantize error of every supported weight type on
//! ggml's test signal and on random data, against ggml's published thresholds
//! (`tests/test-quantize-fns.cpp`). Exits non-zero if any type is past its threshold.

use anyhow::{bail, Result};
use kernels::quant::accuracy;
use serde_json::json;

pub fn run(json: bool) -> Result<()> {
    let rows = accuracy::error_table();
    if json {
        let rows: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "type": r.ty.name(), "bits_per_weight": r.bits_per_weight,
                    "ggml_error": r.ggml_error, "rmse_signal": r.rmse_signal,
                    "max_abs_signal": r.max_abs_signal, "rmse_random": r.rmse_random,
                    "ggml_error_random": r.ggml_error_random, "threshold": r.threshold,
                    "threshold_random": r.threshold_random, "pass": r.pass,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", accuracy::format_table(&rows));
    }
    let failed: Vec<_> = rows
        .iter()
        .filter(|r| !r.pass)
        .map(|r| r.ty.name())
        .collect();
    if rows.len() != kernels::quant::GgmlType::SUPPORTED.len() {
        bail!(
            "only {} of {} supported types could be measured",
            rows.len(),
            kernels::quant::GgmlType::SUPPORTED.len()
        );
    }
    if !failed.is_empty() {
        bail!("types past ggml's threshold: {}", failed.join(", "));
    }
    Ok(())
}
