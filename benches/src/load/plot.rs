//! CDF plots of TTFT, TPOT and end-to-end latency, one line per run, as PNG and SVG. Text is
//! drawn with DejaVu Sans embedded in the binary (plotters' `ab_glyph` backend), so no system
//! font library is needed.
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::runner::RequestRecord;

pub(crate) const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

pub(crate) fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for style in [FontStyle::Normal, FontStyle::Bold] {
            if plotters::style::register_font("sans-serif", style, dejavu::sans::regular()).is_err()
            {
                eprintln!("warning: the embedded font did not load; plots have no text");
            }
        }
    });
}

type Metric = (&'static str, fn(&RequestRecord) -> Option<f64>);

const METRICS: [Metric; 3] = [
    ("TTFT", |r| r.ttft_s),
    ("TPOT", |r| r.tpot_s),
    ("End-to-end latency", |r| r.e2e_s),
];

/// Writes `<stem>.png` and `<stem>.svg`; returns their paths.
pub fn write_cdfs(
    stem: &Path,
    title: &str,
    runs: &[(String, &[RequestRecord])],
) -> anyhow::Result<Vec<PathBuf>> {
    register_font();
    let png = stem.with_extension("png");
    let svg = stem.with_extension("svg");
    let size = (1500, 500);
    draw(
        BitMapBackend::new(&png, size).into_drawing_area(),
        title,
        runs,
    )?;
    draw(SVGBackend::new(&svg, size).into_drawing_area(), title, runs)?;
    Ok(vec![png, svg])
}

pub(crate) fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plotting: {e:?}")
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    runs: &[(String, &[RequestRecord])],
) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(title, ("sans-serif", 20).into_font())
        .map_err(err)?;
    let panels = root.split_evenly((1, METRICS.len()));
    for (panel, (name, get)) in panels.iter().zip(METRICS) {
        let series: Vec<(String, Vec<f64>)> = runs
            .iter()
            .map(|(label, recs)| {
                let mut v: Vec<f64> = recs.iter().filter_map(get).map(|s| s * 1e3).collect();
                v.sort_by(f64::total_cmp);
                (label.clone(), v)
            })
            .collect();
        let xmax = series
            .iter()
            .filter_map(|(_, v)| v.last().copied())
            .fold(0.0f64, f64::max)
            .max(1e-3)
            * 1.05;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{name} CDF"), ("sans-serif", 18).into_font())
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(48)
            .build_cartesian_2d(0f64..xmax, 0f64..1.0f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("ms")
            .y_desc("fraction of requests")
            .label_style(("sans-serif", 13).into_font())
            .draw()
            .map_err(err)?;
        for (i, (label, v)) in series.iter().enumerate() {
            if v.is_empty() {
                continue;
            }
            let color = COLORS[i % COLORS.len()];
            // A step function: the CDF jumps by 1/n at each sorted value.
            let n = v.len() as f64;
            let mut pts = vec![(0.0, 0.0), (v[0], 0.0)];
            for (k, &x) in v.iter().enumerate() {
                pts.push((x, k as f64 / n));
                pts.push((x, (k + 1) as f64 / n));
            }
            pts.push((xmax, 1.0));
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))
                .map_err(err)?
                .label(label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13).into_font())
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
