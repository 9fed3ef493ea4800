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
    /// `false` when the gate had nothing to judge against (no baseline, no snapshot): it did not
    /// pass, it was not judged, and the reports say so in their own column.
    pub judged: bool,
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
            judged: true,
        }
    }

    /// A gate with nothing to judge against (`why`): counted neither as passed nor as failed, and
    /// shown as "not judged" with its reason.
    pub fn not_judged(gate: &'static str, value: f64, why: String) -> Self {
        GateResult {
            gate,
            passed: true,
            value,
            threshold: f64::NAN,
            detail: why,
            judged: false,
        }
    }

    /// `pass`, `FAIL` or `NOT JUDGED`.
    pub fn label(&self) -> &'static str {
        match (self.judged, self.passed) {
            (false, _) => "NOT JUDGED",
            (true, true) => "pass",
            (true, false) => "FAIL",
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
            judged: true,
        }
    }
}

impl std::fmt::Display for GateResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.judged {
            return write!(
                f,
                "{} not judged: {} ({})",
                self.gate,
                fmt_sig(self.value),
                self.detail
            );
        }
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
    fn not_judged_is_neither_pass_nor_fail_in_its_label() {
        let g = GateResult::not_judged("decode_ratio", 0.4, "no baseline".into());
        assert_eq!(g.label(), "NOT JUDGED");
        assert_eq!(
            g.to_string(),
            "decode_ratio not judged: 0.400 (no baseline)"
        );
        assert_eq!(
            GateResult::at_most("g", 2.0, 1.0, String::new()).label(),
            "FAIL"
        );
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
