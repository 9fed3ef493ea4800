//! `junit.xml`: one `<testcase>` per case; skipped cases as `<skipped message=…>`, failures with
//! the finding as the message and every failed gate in the body, errors as `<error>`.

use std::fmt::Write;

use super::{Report, Verdict};

/// Escape for XML text and attribute values, dropping characters XML 1.0 forbids.
pub(super) fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => {}
            c => out.push(c),
        }
    }
    out
}

pub fn junit_xml(report: &Report) -> String {
    let s = report.summary();
    let errors = report
        .cases
        .iter()
        .filter(|c| matches!(c.verdict, Verdict::Error { .. }))
        .count();
    let failures = s.failed - errors;
    let tests = report.cases.len();
    let time: f64 = report.cases.iter().filter_map(|c| c.duration_s).sum();
    let mut x = String::new();
    // `write!` into a String cannot fail.
    let _ = writeln!(x, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        x,
        r#"<testsuites name="plumbline-verify" tests="{tests}" failures="{failures}" errors="{errors}" skipped="{}" time="{time:.3}">"#,
        s.skipped
    );
    let _ = writeln!(
        x,
        r#"  <testsuite name="verify" tests="{tests}" failures="{failures}" errors="{errors}" skipped="{}" time="{time:.3}">"#,
        s.skipped
    );
    for c in &report.cases {
        let model = c.case.split('/').next().unwrap_or_default();
        let _ = write!(
            x,
            r#"    <testcase classname="verify.{}" name="{}" time="{:.3}""#,
            xml_escape(model),
            xml_escape(&c.case),
            c.duration_s.unwrap_or(0.0)
        );
        match &c.verdict {
            Verdict::Passed => {
                let _ = writeln!(x, "/>");
            }
            Verdict::Skipped { reason } => {
                let _ = writeln!(
                    x,
                    ">\n      <skipped message=\"{}\"/>\n    </testcase>",
                    xml_escape(reason)
                );
            }
            Verdict::Error { message } => {
                let _ = writeln!(
                    x,
                    ">\n      <error message=\"{0}\">{0}</error>\n    </testcase>",
                    xml_escape(message)
                );
            }
            Verdict::Failed { finding } => {
                let mut body = Vec::new();
                if let Some(d) = &c.first_divergence {
                    body.push(format!(
                        "first divergence (forward position {}): {}",
                        d.position, d.finding
                    ));
                }
                body.extend(c.gates.iter().filter(|g| !g.passed).map(|g| g.to_string()));
                let _ = writeln!(
                    x,
                    ">\n      <failure message=\"{}\">{}</failure>\n    </testcase>",
                    xml_escape(finding),
                    xml_escape(&body.join("\n"))
                );
            }
        }
    }
    let _ = writeln!(x, "  </testsuite>\n</testsuites>");
    x
}
