//! The console summary table.

use super::{CaseResult, Report};
use crate::float::fmt_sig;

/// Longest finding shown in the table; the full text is in `report.json` and `report.md`.
const MAX_FINDING: usize = 72;

pub(super) fn figures_text(c: &CaseResult) -> String {
    c.figures
        .iter()
        .map(|f| {
            if f.unit.is_empty() {
                format!("{}={}", f.name, fmt_sig(f.value))
            } else {
                format!("{}={} {}", f.name, fmt_sig(f.value), f.unit)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max - 1).collect();
        t.push('…');
        t
    }
}

/// Columns: case, verdict, first divergence or failed gate (or skip reason), key figures; then a
/// blank line and the summary line.
pub fn console_table(report: &Report) -> String {
    let header = ["CASE", "VERDICT", "FIRST DIVERGENCE / GATE", "KEY FIGURES"];
    let rows: Vec<[String; 4]> = report
        .cases
        .iter()
        .map(|c| {
            let headline = c.headline();
            [
                c.case.clone(),
                c.verdict.label().to_owned(),
                if headline.is_empty() {
                    "-".into()
                } else {
                    truncate(&headline, MAX_FINDING)
                },
                figures_text(c),
            ]
        })
        .collect();
    let mut width = header.map(|h| h.chars().count());
    for r in &rows {
        for (w, cell) in width.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: [&str; 4]| {
        let mut l = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 < cells.len() {
                l.push_str(cell);
                l.push_str(&" ".repeat(width[i] - cell.chars().count() + 2));
            } else {
                l.push_str(cell);
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(header);
    for r in &rows {
        line([&r[0], &r[1], &r[2], &r[3]]);
    }
    out.push('\n');
    out.push_str(&report.summary().to_string());
    out.push('\n');
    out
}
