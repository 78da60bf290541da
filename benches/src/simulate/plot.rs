//! Plots of a simulation: per adapter count and popularity, P99 TTFT, goodput per instance and
//! adapter loads per second per instance against cluster size, one line per router (PNG, SVG).
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

use super::report::Row;
use super::router::RouterKind;
use crate::load::plot::{err, register_font, COLORS};

type Get = fn(&Row) -> f64;

const PANELS: [(&str, &str, Get); 3] = [
    ("P99 TTFT", "ms", |r| r.p99_ttft_s * 1e3),
    ("Goodput per instance", "requests/s in SLO", |r| {
        r.goodput / r.instances as f64
    }),
    ("Adapter loads per instance", "loads/s", |r| {
        r.loads_per_s / r.instances as f64
    }),
];

/// Writes `simulate-<adapters>-<popularity>.{png,svg}` per combination into `dir`.
pub fn write(dir: &Path, rows: &[Row]) -> anyhow::Result<Vec<PathBuf>> {
    register_font();
    let mut combos: Vec<(usize, String, bool)> = rows
        .iter()
        .map(|r| {
            let pop = format!("{:?}", r.popularity).to_lowercase();
            (r.adapters, pop, r.prefix_caching)
        })
        .collect();
    combos.sort();
    combos.dedup();
    let mut out = Vec::new();
    for (adapters, pop, caching) in combos {
        let sel: Vec<&Row> = rows
            .iter()
            .filter(|r| {
                r.adapters == adapters
                    && r.prefix_caching == caching
                    && format!("{:?}", r.popularity).to_lowercase() == pop
            })
            .collect();
        // Without prefix caching (issue 28's comparison) the files say so.
        let tail = if caching { "" } else { "-no-prefix-cache" };
        let stem = dir.join(format!("simulate-{adapters}-{pop}{tail}"));
        let title = format!(
            "{adapters} adapters, {pop} popularity{}",
            if caching { "" } else { ", no prefix cache" }
        );
        let (png, svg) = (stem.with_extension("png"), stem.with_extension("svg"));
        draw(
            BitMapBackend::new(&png, (1500, 480)).into_drawing_area(),
            &title,
            &sel,
        )?;
        draw(
            SVGBackend::new(&svg, (1500, 480)).into_drawing_area(),
            &title,
            &sel,
        )?;
        out.extend([png, svg]);
    }
    Ok(out)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    rows: &[&Row],
) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(title, ("sans-serif", 20).into_font())
        .map_err(err)?;
    // Each router once, in the table's order (so colours match across plots).
    let routers: Vec<RouterKind> = RouterKind::ALL
        .into_iter()
        .filter(|k| rows.iter().any(|r| r.router == *k))
        .collect();
    let (xmin, xmax) = rows.iter().fold((f64::MAX, 1.0f64), |(lo, hi), r| {
        (lo.min(r.instances as f64), hi.max(r.instances as f64))
    });
    let xmin = xmin.min(xmax);
    for (panel, (name, unit, get)) in root.split_evenly((1, PANELS.len())).iter().zip(PANELS) {
        let ymax = rows.iter().map(|r| get(r)).fold(0.0f64, f64::max).max(1e-9) * 1.1;
        let mut chart = ChartBuilder::on(panel)
            .caption(name, ("sans-serif", 18).into_font())
            .margin(12)
            .x_label_area_size(42)
            .y_label_area_size(56)
            .build_cartesian_2d((xmin..xmax * 1.01).log_scale(), 0f64..ymax)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("instances")
            .y_desc(unit)
            .label_style(("sans-serif", 13).into_font())
            .draw()
            .map_err(err)?;
        for (i, router) in routers.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.router == *router)
                .map(|r| (r.instances as f64, get(r)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(err)?
                .label(router.name())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart
                .draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled())))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13).into_font())
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
