//! A hand-written SVG line plot: NMSE by layer (log-scale y axis) for the main tap kinds, with the
//! tolerance as a dashed line.

use std::fmt::Write;

use super::junit::xml_escape;
use crate::compare::LayerSeries;
use crate::tap::TapKind;

/// The kinds plotted, and their colours (colour-blind-safe Okabe–Ito palette).
const MAIN: [(TapKind, &str); 6] = [
    (TapKind::Q, "#0072B2"),
    (TapKind::K, "#56B4E9"),
    (TapKind::Attn, "#009E73"),
    (TapKind::AttnOut, "#E69F00"),
    (TapKind::FfnOut, "#D55E00"),
    (TapKind::Out, "#000000"),
];

const W: f64 = 640.0;
const H: f64 = 360.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 120.0;
const TOP: f64 = 32.0;
const BOTTOM: f64 = 44.0;
/// NMSE of exactly 0 is drawn at the bottom of the axis, which never goes below this.
const FLOOR: f64 = 1e-16;

/// Render the plot. Zero NMSE is drawn at the bottom edge, infinite or NaN at the top edge.
pub fn layer_plot_svg(title: &str, series: &[LayerSeries]) -> String {
    let plotted: Vec<(&LayerSeries, &str)> = MAIN
        .iter()
        .filter_map(|(k, colour)| series.iter().find(|s| s.kind == *k).map(|s| (s, *colour)))
        .collect();
    // Tolerance line: that of the residual stream (`out`), else of the first plotted kind
    // (the legend says "tolerance"; report.md's tolerance table has every kind).
    let tol = plotted
        .iter()
        .find(|(s, _)| s.kind == TapKind::Out)
        .or(plotted.first())
        .map(|(s, _)| *s);
    let values = plotted
        .iter()
        .flat_map(|(s, _)| s.points.iter().map(|p| p.nmse))
        .chain(tol.iter().flat_map(|s| s.points.iter().map(|p| p.nmse_max)))
        .filter(|v| v.is_finite() && *v > 0.0);
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let (mut d_lo, mut d_hi) = if lo.is_finite() {
        (
            lo.max(FLOOR).log10().floor() as i32,
            hi.log10().ceil() as i32,
        )
    } else {
        (-8, 0)
    };
    if d_hi <= d_lo {
        d_hi = d_lo + 1;
    }
    d_lo = d_lo.min(d_hi - 1);
    let max_layer = plotted
        .iter()
        .flat_map(|(s, _)| s.points.iter().map(|p| p.layer))
        .max()
        .unwrap_or(0);
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let x = |layer: usize| {
        if max_layer == 0 {
            LEFT + pw / 2.0
        } else {
            LEFT + pw * layer as f64 / max_layer as f64
        }
    };
    let y = |v: f64| {
        let d = if v.is_nan() || v == f64::INFINITY {
            d_hi as f64
        } else if v <= 0.0 {
            d_lo as f64
        } else {
            v.log10().clamp(d_lo as f64, d_hi as f64)
        };
        TOP + ph * (d_hi as f64 - d) / (d_hi - d_lo) as f64
    };

    let mut s = String::new();
    // `write!` into a String cannot fail.
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="18" font-size="12" font-weight="bold">NMSE by layer: {}</text>"#,
        xml_escape(title)
    );
    // Decade grid lines and labels; every second decade when there are many.
    let step = if d_hi - d_lo > 10 { 2 } else { 1 };
    for d in (d_lo..=d_hi).step_by(step) {
        let yy = y(10f64.powi(d));
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#dddddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">1e{d}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            yy + 4.0
        );
    }
    // Layer ticks: at most ~12 labels.
    let tick = (max_layer / 12).max(1);
    for l in (0..=max_layer).step_by(tick) {
        let xx = x(l);
        let _ = writeln!(
            s,
            r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle">{l}</text>"#,
            TOP + ph + 16.0
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444444"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">layer</text>"#,
        LEFT + pw / 2.0,
        H - 8.0
    );
    let _ = writeln!(
        s,
        r#"<text x="14" y="{:.1}" text-anchor="middle" transform="rotate(-90 14 {:.1})">NMSE (log)</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    let polyline = |s: &mut String, pts: Vec<(f64, f64)>, style: &str| {
        let coords: Vec<String> = pts.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" {style} points="{}"/>"#,
            coords.join(" ")
        );
    };
    if let Some(t) = tol {
        polyline(
            &mut s,
            t.points
                .iter()
                .map(|p| (x(p.layer), y(p.nmse_max)))
                .collect(),
            r##"stroke="#CC0000" stroke-width="1.5" stroke-dasharray="6 4""##,
        );
    }
    for (series, colour) in &plotted {
        let pts: Vec<(f64, f64)> = series
            .points
            .iter()
            .map(|p| (x(p.layer), y(p.nmse)))
            .collect();
        polyline(
            &mut s,
            pts.clone(),
            &format!(r#"stroke="{colour}" stroke-width="1.5""#),
        );
        for (a, b) in pts {
            let _ = writeln!(
                s,
                r#"<circle cx="{a:.1}" cy="{b:.1}" r="2" fill="{colour}"/>"#
            );
        }
    }
    // Legend.
    let lx = LEFT + pw + 12.0;
    let mut ly = TOP + 8.0;
    for (series, colour) in &plotted {
        let _ = writeln!(
            s,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 18.0,
            lx + 24.0,
            ly + 4.0,
            series.kind
        );
        ly += 16.0;
    }
    if tol.is_some() {
        let _ = writeln!(
            s,
            r##"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="#CC0000" stroke-width="1.5" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}">tolerance</text>"##,
            lx + 18.0,
            lx + 24.0,
            ly + 4.0
        );
    }
    let _ = writeln!(s, "</svg>");
    s
}
