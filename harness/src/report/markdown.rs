//! `report.md`: the summary line, the case table, then per judged case its verdict, first
//! divergence, layer plot (`plots/<case>.svg`, embedded as an image), gates and tolerances.

use std::fmt::Write;

use super::console::figures_text;
use super::{plot_path, Report, Verdict};
use crate::float::{fmt_cosine, fmt_sig};

/// A table cell: no line breaks, pipes escaped.
fn cell(s: &str) -> String {
    s.replace('\n', " ").replace('|', "\\|")
}

pub fn markdown(report: &Report) -> String {
    let mut m = String::new();
    // `write!` into a String cannot fail.
    let _ = writeln!(m, "# plumbline verify report\n");
    let _ = writeln!(m, "{}\n", report.summary());
    let _ = writeln!(
        m,
        "| case | verdict | first divergence / gate | key figures |"
    );
    let _ = writeln!(m, "|---|---|---|---|");
    for c in &report.cases {
        let _ = writeln!(
            m,
            "| `{}` | {} | {} | {} |",
            cell(&c.case),
            c.verdict.label(),
            cell(&c.headline()),
            cell(&figures_text(c))
        );
    }
    for c in &report.cases {
        if matches!(c.verdict, Verdict::Skipped { .. }) {
            continue;
        }
        let _ = writeln!(m, "\n## `{}`\n", c.case);
        match &c.verdict {
            Verdict::Passed => {
                let _ = writeln!(m, "**PASS**");
            }
            v => {
                let _ = writeln!(m, "**{}**: {}", v.label(), c.headline());
            }
        }
        if let Some(d) = &c.first_divergence {
            let _ = writeln!(
                m,
                "\nFirst divergence, at position {} in forward order: {}",
                d.position, d.finding
            );
        }
        if !c.layer_series.is_empty() {
            let _ = writeln!(
                m,
                "\n![NMSE by layer for {}]({})",
                c.case,
                plot_path(&c.case)
            );
        }
        if !c.gates.is_empty() {
            let _ = writeln!(m, "\n| gate | result | value | threshold | detail |");
            let _ = writeln!(m, "|---|---|---|---|---|");
            for g in &c.gates {
                let _ = writeln!(
                    m,
                    "| {} | {} | {} | {} | {} |",
                    g.gate,
                    g.label(),
                    fmt_sig(g.value),
                    fmt_sig(g.threshold),
                    cell(&g.detail)
                );
            }
        }
        if !c.tolerances.is_empty() {
            let _ = writeln!(m, "\n<details><summary>Tolerances</summary>\n");
            let _ = writeln!(m, "| tap kind | NMSE max (first layer) | NMSE max (last layer) | cosine min (last layer) |");
            let _ = writeln!(m, "|---|---|---|---|");
            for r in &c.tolerances {
                let _ = writeln!(
                    m,
                    "| {} | {} | {} | {} |",
                    r.kind,
                    fmt_sig(r.first.nmse_max),
                    fmt_sig(r.last.nmse_max),
                    fmt_cosine(r.last.cosine_min)
                );
            }
            let _ = writeln!(m, "\n</details>");
        }
    }
    m
}
