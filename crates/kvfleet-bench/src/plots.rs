//! Small self-contained SVG charts (line charts and bar charts), so reports need no
//! plotting dependency.

use std::fmt::Write;

const W: f64 = 640.0;
const H: f64 = 360.0;
const L: f64 = 70.0;
const R: f64 = 170.0;
const T: f64 = 40.0;
const B: f64 = 50.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn nice(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{:.0}", v)
    } else if v.abs() >= 10.0 {
        format!("{:.1}", v)
    } else {
        format!("{:.2}", v)
    }
}

/// A line chart of named series of (x, y) points. With `log_x`, x is drawn on a log10
/// scale (non-positive x are dropped).
pub fn line_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
) -> String {
    let tx = |x: f64| if log_x { x.max(1e-9).log10() } else { x };
    let pts = series
        .iter()
        .flat_map(|(_, v)| v.iter())
        .filter(|p| !log_x || p.0 > 0.0);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, 0.0f64, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(tx(x));
        x1 = x1.max(tx(x));
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1, y1) = (0.0, 1.0, 1.0);
    }
    if x1 - x0 < 1e-12 {
        x1 = x0 + 1.0;
    }
    if y1 - y0 < 1e-12 {
        y1 = y0 + 1.0;
    }
    let px = |x: f64| L + (tx(x) - x0) / (x1 - x0) * (W - L - R);
    let py = |y: f64| H - B - (y - y0) / (y1 - y0) * (H - T - B);
    let mut s = header(title);
    axes(&mut s, x_label, y_label);
    for i in 0..=4 {
        let f = i as f64 / 4.0;
        let xv = x0 + f * (x1 - x0);
        let xs = if log_x { 10f64.powf(xv) } else { xv };
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            L + f * (W - L - R),
            H - B + 16.0,
            nice(xs)
        );
        let yv = y0 + f * (y1 - y0);
        let _ = write!(
            s,
            r##"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text><line x1="{L}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#eee"/>"##,
            L - 6.0,
            py(yv) + 4.0,
            nice(yv),
            W - R,
            py(yv),
            py(yv)
        );
    }
    for (k, (name, v)) in series.iter().enumerate() {
        let c = COLORS[k % COLORS.len()];
        let d: Vec<String> = v
            .iter()
            .filter(|p| !log_x || p.0 > 0.0)
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="1.8" points="{}"/>"#,
            d.join(" ")
        );
        legend(&mut s, k, name, c);
    }
    s.push_str("</svg>\n");
    s
}

/// A bar chart of labelled values.
pub fn bar_chart(title: &str, y_label: &str, bars: &[(String, f64)]) -> String {
    let max = bars.iter().map(|b| b.1).fold(0.0f64, f64::max).max(1e-12);
    let mut s = header(title);
    axes(&mut s, "", y_label);
    let n = bars.len().max(1) as f64;
    let slot = (W - L - R) / n;
    for (i, (label, v)) in bars.iter().enumerate() {
        let h = v / max * (H - T - B);
        let x = L + i as f64 * slot + slot * 0.1;
        let _ = write!(
            s,
            r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"/>"#,
            H - B - h,
            slot * 0.8,
            COLORS[0]
        );
        if bars.len() <= 32 {
            let _ = write!(
                s,
                r#"<text x="{:.1}" y="{:.1}" font-size="10" text-anchor="middle">{}</text>"#,
                x + slot * 0.4,
                H - B + 14.0,
                esc(label)
            );
        }
    }
    let _ = write!(
        s,
        r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"#,
        L - 6.0,
        T + 4.0,
        nice(max)
    );
    s.push_str("</svg>\n");
    s
}

fn header(title: &str) -> String {
    format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="14" text-anchor="middle">{}</text>"#,
        (W - R + L) / 2.0,
        esc(title)
    )
}

fn axes(s: &mut String, x_label: &str, y_label: &str) {
    let _ = write!(
        s,
        r#"<line x1="{L}" y1="{T}" x2="{L}" y2="{yb}" stroke="black"/><line x1="{L}" y1="{yb}" x2="{xr}" y2="{yb}" stroke="black"/><text x="{cx}" y="{xl}" font-size="12" text-anchor="middle">{}</text><text x="16" y="{cy}" font-size="12" text-anchor="middle" transform="rotate(-90 16 {cy})">{}</text>"#,
        esc(x_label),
        esc(y_label),
        yb = H - B,
        xr = W - R,
        cx = (W - R + L) / 2.0,
        xl = H - 12.0,
        cy = (H - B + T) / 2.0,
    );
}

fn legend(s: &mut String, k: usize, name: &str, c: &str) {
    let y = T + 16.0 * k as f64;
    let _ = write!(
        s,
        r#"<rect x="{:.1}" y="{:.1}" width="12" height="3" fill="{c}"/><text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
        W - R + 10.0,
        y + 4.0,
        W - R + 26.0,
        y + 8.0,
        esc(name)
    );
}

/// The empirical CDF of `sorted` values as (value, fraction) points, at most `n`.
pub fn cdf_points(sorted: &[f64], n: usize) -> Vec<(f64, f64)> {
    if sorted.is_empty() {
        return Vec::new();
    }
    let step = (sorted.len() / n.max(1)).max(1);
    let mut v: Vec<(f64, f64)> = sorted
        .iter()
        .enumerate()
        .step_by(step)
        .map(|(i, &x)| (x, (i + 1) as f64 / sorted.len() as f64))
        .collect();
    v.push((sorted[sorted.len() - 1], 1.0));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_svg() {
        let s = line_chart(
            "t <1>",
            "x",
            "y",
            &[("a".into(), vec![(1.0, 0.0), (10.0, 1.0)])],
            true,
        );
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert!(s.contains("t &lt;1&gt;") && s.contains("<polyline"));
        let b = bar_chart("b", "y", &[("w0".into(), 3.0), ("w1".into(), 1.0)]);
        assert_eq!(b.matches("<rect").count(), 3);
        assert_eq!(
            cdf_points(&[1.0, 2.0, 3.0, 4.0], 2).last(),
            Some(&(4.0, 1.0))
        );
    }
}
