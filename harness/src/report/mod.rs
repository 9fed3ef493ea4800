//! Reports: case results and their writers — console table, `report.json`, `junit.xml`,
//! `report.md` with one SVG plot per case under `plots/`.
//!
//! Every writer ends with (or contains, alone on a line) the summary `N passed, N failed, N skipped`
//! where errors count as failed: a case that could not be judged did not pass.

mod console;
mod junit;
mod markdown;
mod svg;

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::compare::{Comparison, Divergence, LayerSeries};
use crate::error::{HarnessError, Result};
use crate::gate::GateResult;
use crate::tolerance::ThresholdRow;

pub use console::console_table;
pub use junit::junit_xml;
pub use markdown::markdown;
pub use svg::layer_plot_svg;

/// How a case ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Verdict {
    Passed,
    Failed { finding: String },
    Skipped { reason: String },
    Error { message: String },
}

impl Verdict {
    pub fn label(&self) -> &'static str {
        match self {
            Verdict::Passed => "PASS",
            Verdict::Failed { .. } => "FAIL",
            Verdict::Skipped { .. } => "SKIP",
            Verdict::Error { .. } => "ERROR",
        }
    }
}

/// A named figure of a case (tokens/s, KLD, roofline fraction, …).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figure {
    pub name: String,
    #[serde(with = "crate::float")]
    pub value: f64,
    pub unit: String,
}

impl Figure {
    pub fn new(name: &str, value: f64, unit: &str) -> Figure {
        Figure {
            name: name.to_owned(),
            value,
            unit: unit.to_owned(),
        }
    }
}

/// One case's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaseResult {
    pub case: String,
    pub verdict: Verdict,
    pub first_divergence: Option<Divergence>,
    pub gates: Vec<GateResult>,
    /// Key figures, in the order the console shows them.
    pub figures: Vec<Figure>,
    pub layer_series: Vec<LayerSeries>,
    /// The tolerance policy as applied to this case (empty when no taps were compared).
    pub tolerances: Vec<ThresholdRow>,
    pub duration_s: Option<f64>,
    /// Which comparison `first_divergence` comes from (e.g. `layer-isolated, exact numerics`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub divergence_mode: Option<String>,
    /// Every comparison of the case, tap by tap (NMSE, its bound, pass), by comparison name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub comparisons: Vec<ComparisonSeries>,
}

/// One comparison of a case, every tap's NMSE and bound, for the report and for review.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComparisonSeries {
    pub name: String,
    pub taps: Vec<TapPoint>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TapPoint {
    pub tap: String,
    #[serde(with = "crate::float")]
    pub nmse: f64,
    #[serde(with = "crate::float")]
    pub nmse_max: f64,
    pub passed: bool,
    /// An f16 cache's rows: the mean signed error in f16 units, and its bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rounding_bias: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rounding_bias_max: Option<f64>,
}

impl CaseResult {
    fn bare(case: &str, verdict: Verdict) -> CaseResult {
        CaseResult {
            case: case.to_owned(),
            verdict,
            first_divergence: None,
            gates: Vec::new(),
            figures: Vec::new(),
            layer_series: Vec::new(),
            tolerances: Vec::new(),
            duration_s: None,
            divergence_mode: None,
            comparisons: Vec::new(),
        }
    }

    pub fn skipped(case: &str, reason: &str) -> CaseResult {
        CaseResult::bare(
            case,
            Verdict::Skipped {
                reason: reason.to_owned(),
            },
        )
    }

    pub fn error(case: &str, message: &str) -> CaseResult {
        CaseResult::bare(
            case,
            Verdict::Error {
                message: message.to_owned(),
            },
        )
    }

    /// A judged case: the tap comparison (when taps were compared) decides first; its first
    /// divergence is the finding. Otherwise the first failed gate is. Otherwise it passed.
    pub fn judged(
        case: &str,
        comparison: Option<&Comparison>,
        gates: Vec<GateResult>,
        figures: Vec<Figure>,
    ) -> CaseResult {
        let first_divergence = comparison.and_then(|c| c.first_divergence.clone());
        let verdict = match (&first_divergence, gates.iter().find(|g| !g.passed)) {
            (Some(d), _) => Verdict::Failed {
                finding: d.finding.to_string(),
            },
            (None, Some(g)) => Verdict::Failed {
                finding: g.to_string(),
            },
            (None, None) => Verdict::Passed,
        };
        CaseResult {
            verdict,
            first_divergence,
            gates,
            figures,
            layer_series: comparison.map(|c| c.layer_series()).unwrap_or_default(),
            ..CaseResult::bare(case, Verdict::Passed)
        }
    }

    pub fn with_tolerances(mut self, rows: Vec<ThresholdRow>) -> CaseResult {
        self.tolerances = rows;
        self
    }

    /// Name the comparison the first divergence comes from (shown with the finding).
    pub fn with_divergence_mode(mut self, mode: &str) -> CaseResult {
        if self.first_divergence.is_some() {
            self.divergence_mode = Some(mode.to_owned());
        }
        self
    }

    /// Keep a comparison's per-tap NMSE and bounds under `name`.
    pub fn with_comparison_series(mut self, name: &str, c: &Comparison) -> CaseResult {
        self.comparisons.push(ComparisonSeries {
            name: name.to_owned(),
            taps: c
                .taps
                .iter()
                .map(|t| TapPoint {
                    tap: t.tap.clone(),
                    nmse: t.metrics.nmse,
                    nmse_max: t.tolerance.nmse_max,
                    passed: t.passed(),
                    rounding_bias: t.metrics.rounding_bias,
                    rounding_bias_max: t.tolerance.rounding_bias_max,
                })
                .collect(),
        });
        self
    }

    pub fn with_duration(mut self, seconds: f64) -> CaseResult {
        self.duration_s = Some(seconds);
        self
    }

    /// What the console and JUnit show as the reason: the finding, skip reason or error.
    pub fn headline(&self) -> String {
        match &self.verdict {
            Verdict::Passed => {
                let open: Vec<String> = self
                    .gates
                    .iter()
                    .filter(|g| !g.judged)
                    .map(|g| format!("{} ({})", g.gate, g.detail))
                    .collect();
                if open.is_empty() {
                    String::new()
                } else {
                    format!("not judged: {}", open.join(", "))
                }
            }
            Verdict::Failed { finding } => match (&self.divergence_mode, &self.first_divergence) {
                (Some(mode), Some(_)) => format!("{finding} [{mode}]"),
                _ => finding.clone(),
            },
            Verdict::Skipped { reason } => reason.clone(),
            Verdict::Error { message } => message.clone(),
        }
    }
}

/// Counts of a report; `failed` includes errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Summary {
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
    /// Cases (passed or not) with at least one gate that had nothing to judge against.
    pub not_judged: usize,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} passed, {} failed, {} skipped",
            self.passed, self.failed, self.skipped
        )?;
        if self.not_judged > 0 {
            write!(f, " ({} with gates not judged)", self.not_judged)?;
        }
        Ok(())
    }
}

/// A verify run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    pub cases: Vec<CaseResult>,
}

#[derive(Serialize)]
struct ReportJson<'a> {
    summary: Summary,
    cases: &'a [CaseResult],
}

/// The files [`Report::write_all`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub json: PathBuf,
    pub junit: PathBuf,
    pub markdown: PathBuf,
    pub plots: Vec<PathBuf>,
}

impl Report {
    pub fn push(&mut self, r: CaseResult) {
        self.cases.push(r);
    }

    pub fn summary(&self) -> Summary {
        let mut s = Summary {
            passed: 0,
            failed: 0,
            skipped: 0,
            not_judged: 0,
        };
        for c in &self.cases {
            s.not_judged += usize::from(c.gates.iter().any(|g| !g.judged));
            match c.verdict {
                Verdict::Passed => s.passed += 1,
                Verdict::Failed { .. } | Verdict::Error { .. } => s.failed += 1,
                Verdict::Skipped { .. } => s.skipped += 1,
            }
        }
        s
    }

    /// Whether the run must exit non-zero.
    pub fn has_failures(&self) -> bool {
        self.summary().failed > 0
    }

    /// `report.json`: `{"summary": {...}, "cases": [...]}`.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(&ReportJson {
            summary: self.summary(),
            cases: &self.cases,
        })
    }

    /// Write `report.json`, `junit.xml`, `report.md` and `plots/<case>.svg` into `dir`.
    pub fn write_all(&self, dir: &Path) -> Result<Written> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| HarnessError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let json = dir.join("report.json");
        let text = self.to_json().map_err(|source| HarnessError::Json {
            path: json.clone(),
            source,
        })?;
        std::fs::write(&json, text + "\n").map_err(io(&json))?;
        let junit = dir.join("junit.xml");
        std::fs::write(&junit, junit_xml(self)).map_err(io(&junit))?;
        let mut plots = Vec::new();
        for c in self.cases.iter().filter(|c| !c.layer_series.is_empty()) {
            let path = dir.join(plot_path(&c.case));
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io(parent))?;
            }
            std::fs::write(&path, layer_plot_svg(&c.case, &c.layer_series)).map_err(io(&path))?;
            plots.push(path);
        }
        let md = dir.join("report.md");
        std::fs::write(&md, markdown(self)).map_err(io(&md))?;
        Ok(Written {
            json,
            junit,
            markdown: md,
            plots,
        })
    }
}

/// Relative path of a case's plot: `plots/<case>.svg`, each `/`-separated part of the name kept
/// as a directory, characters outside `[A-Za-z0-9._-]` replaced by `_`, and `.`/`..` parts
/// neutralized so a name can never point outside `plots/`.
pub fn plot_path(case: &str) -> String {
    let parts: Vec<String> = case
        .split('/')
        .map(|p| {
            let s: String = p
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || "._-".contains(c) {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            if s.is_empty() || s.chars().all(|c| c == '.') {
                "_".repeat(s.len().max(1))
            } else {
                s
            }
        })
        .collect();
    format!("plots/{}.svg", parts.join("/"))
}

#[cfg(test)]
pub(crate) mod tests;
