//! `gradwire plot`: test accuracy and training loss of several `gradwire train --csv` runs,
//! against wall time (or epoch, or MB sent per rank), side by side in one SVG. Written by
//! hand: two panels of polylines need no plotting library.

use gradwire::{Error, Result};
use std::fmt::Write;

struct Run {
    label: String,
    /// (x, train loss, test accuracy) per epoch.
    points: Vec<(f64, f64, f64)>,
}

fn load(path: &str, x_axis: &str) -> Result<Vec<Run>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::InvalidArgument(format!("{path}: {e}")))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let col = |name: &str| {
        header.iter().position(|h| *h == name).ok_or_else(|| Error::InvalidArgument(format!("{path}: no column '{name}' (not a gradwire train CSV?)")))
    };
    let x_col = col(match x_axis {
        "time" => "wall_s",
        "epoch" => "epoch",
        "bytes" => "mb_sent_per_rank_mean",
        other => return Err(Error::InvalidArgument(format!("--x {other}: time, epoch or bytes"))),
    })?;
    let (label, loss, acc) = (col("label")?, col("train_loss")?, col("test_acc")?);
    let mut runs: Vec<Run> = vec![];
    for (i, line) in lines.enumerate() {
        let f: Vec<&str> = line.split(',').collect();
        let num = |c: usize| f.get(c).and_then(|v| v.parse::<f64>().ok()).ok_or_else(|| Error::InvalidArgument(format!("{path}:{}: bad row '{line}'", i + 2)));
        let name = f.get(label).copied().unwrap_or("run").to_string();
        let p = (num(x_col)?, num(loss)?, num(acc)?);
        match runs.iter_mut().find(|r| r.label == name) {
            Some(r) => r.points.push(p),
            None => runs.push(Run { label: name, points: vec![p] }),
        }
    }
    Ok(runs)
}

const COLOURS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// Draws every run of every CSV in `csvs` into `out` (SVG).
pub fn draw(csvs: &[String], out: &str, x_axis: &str) -> Result<()> {
    let mut runs = vec![];
    for c in csvs {
        runs.extend(load(c, x_axis)?);
    }
    if runs.iter().all(|r| r.points.is_empty()) {
        return Err(Error::InvalidArgument("plot: the CSVs hold no rows".into()));
    }
    let all = || runs.iter().flat_map(|r| r.points.iter());
    let x_max = all().map(|p| p.0).fold(0.0, f64::max).max(1e-9);
    let loss_max = all().map(|p| p.1).fold(0.0, f64::max).max(1e-9);
    let (pw, ph, m) = (420.0, 300.0, 55.0);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">"#,
        2.0 * (pw + 2.0 * m),
        ph + 2.0 * m + 20.0 * runs.len() as f64
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let x_name = match x_axis {
        "time" => "wall time (s)",
        "epoch" => "epoch",
        _ => "MB sent per rank",
    };
    for (panel, (title, y_max)) in [("test accuracy", 1.0), ("training loss", loss_max)].into_iter().enumerate() {
        let ox = m + panel as f64 * (pw + 2.0 * m);
        let _ = writeln!(svg, r#"<rect x="{ox}" y="{m}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#);
        let _ = writeln!(svg, r#"<text x="{}" y="{}" text-anchor="middle" font-size="14">{title}</text>"#, ox + pw / 2.0, m - 12.0);
        let _ = writeln!(svg, r#"<text x="{}" y="{}" text-anchor="middle">{x_name}</text>"#, ox + pw / 2.0, m + ph + 35.0);
        for t in 0..=4 {
            let f = t as f64 / 4.0;
            let (gx, gy) = (ox + f * pw, m + ph - f * ph);
            let _ = writeln!(
                svg,
                r##"<line x1="{gx}" y1="{m}" x2="{gx}" y2="{}" stroke="#ddd"/><text x="{gx}" y="{}" text-anchor="middle">{:.3}</text>"##,
                m + ph,
                m + ph + 16.0,
                f * x_max
            );
            let _ = writeln!(
                svg,
                r##"<line x1="{ox}" y1="{gy}" x2="{}" y2="{gy}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{:.3}</text>"##,
                ox + pw,
                ox - 4.0,
                gy + 4.0,
                f * y_max
            );
        }
        for (i, r) in runs.iter().enumerate() {
            let pts: Vec<String> = r
                .points
                .iter()
                .map(|p| {
                    let y = if panel == 0 { p.2 } else { p.1 };
                    format!("{:.1},{:.1}", ox + p.0 / x_max * pw, m + ph - (y / y_max).clamp(0.0, 1.0) * ph)
                })
                .collect();
            let _ = writeln!(svg, r#"<polyline fill="none" stroke-width="2" stroke="{}" points="{}"/>"#, COLOURS[i % COLOURS.len()], pts.join(" "));
        }
    }
    for (i, r) in runs.iter().enumerate() {
        let y = ph + 2.0 * m + 20.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<rect x="{m}" y="{}" width="14" height="4" fill="{}"/><text x="{}" y="{y}">{}</text>"#,
            y - 6.0,
            COLOURS[i % COLOURS.len()],
            m + 20.0,
            r.label.replace('&', "&amp;").replace('<', "&lt;")
        );
    }
    svg.push_str("</svg>\n");
    std::fs::write(out, svg).map_err(|e| Error::InvalidArgument(format!("{out}: {e}")))
}
