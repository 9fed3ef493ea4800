//! The result of one gate, as every gate (coherence, throughput) reports it.

use serde::Serialize;

use crate::float::fmt_sig;

/// One gate's verdict with the number it judged and the bound it used.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateResult {
    /// Stable gate name, e.g. `greedy_prefix`, `kld_mean`, `decode_tps`.
    pub gate: &'static str,
    pub passed: bool,
    #[serde(with = "crate::float")]
    pub value: f64,
    #[serde(with = "crate::float")]
    pub threshold: f64,
    /// What a person needs to act on it (first mismatch, baseline, …).
    pub detail: String,
}

impl GateResult {
    /// Passed when `value <= threshold` (a NaN value fails).
    pub fn at_most(gate: &'static str, value: f64, threshold: f64, detail: String) -> Self {
        GateResult {
            gate,
            passed: value <= threshold,
            value,
            threshold,
            detail,
        }
    }

    /// Passed when `value >= threshold` (a NaN value fails).
    pub fn at_least(gate: &'static str, value: f64, threshold: f64, detail: String) -> Self {
        GateResult {
            gate,
            passed: value >= threshold,
            value,
            threshold,
            detail,
        }
    }
}

impl std::fmt::Display for GateResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {} (threshold {})",
            self.gate,
            if self.passed { "passed" } else { "failed" },
            fmt_sig(self.value),
            fmt_sig(self.threshold)
        )?;
        if !self.detail.is_empty() {
            write!(f, "; {}", self.detail)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons_fail_on_nan() {
        assert!(GateResult::at_most("g", 1.0, 1.0, String::new()).passed);
        assert!(!GateResult::at_most("g", 1.1, 1.0, String::new()).passed);
        assert!(!GateResult::at_most("g", f64::NAN, 1.0, String::new()).passed);
        assert!(GateResult::at_least("g", 1.0, 1.0, String::new()).passed);
        assert!(!GateResult::at_least("g", f64::NAN, 1.0, String::new()).passed);
    }

    #[test]
    fn displays_value_threshold_and_detail() {
        let g = GateResult::at_most("kld_mean", 0.02, 0.005, "worst at position 7".into());
        assert_eq!(
            g.to_string(),
            "kld_mean failed: 0.0200 (threshold 0.00500); worst at position 7"
        );
    }
}
