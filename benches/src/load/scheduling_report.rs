//! `thaw-bench scheduling`'s numbers: each (variant, rate, seed) run, the median over the
//! seeds per point, the SLOs, throughput at SLO and the printed table.
use serde::Serialize;

use super::report::Summary;

/// One (variant, rate, seed) run.
#[derive(Clone, Debug, Serialize)]
pub struct RateRun {
    pub variant: String,
    pub rate: f64,
    pub seed: u64,
    pub summary: Summary,
    /// Every completed request's time per output token (its mean time between tokens).
    pub tpot_s: Vec<f64>,
    /// The server's `thaw_sched_*` and `thaw_perf_*` lines after the run.
    pub metrics: Vec<String>,
    /// Every request as measured (who is at the tail: its lengths and rank).
    pub records: Vec<super::runner::RequestRecord>,
}

/// One (variant, rate): the median over its seeds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Point {
    pub variant: String,
    pub rate: f64,
    pub repeats: usize,
    pub ttft_mean_s: f64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub tpot_mean_s: f64,
    pub tpot_p99_s: f64,
    /// Share of requests whose time per output token met the TBT SLO.
    pub tbt_attained: f64,
    pub completed: usize,
    pub sent: usize,
    pub failed: usize,
}

/// The median of `v` (the mean of the middle two when even); NaN when empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The medians per (variant, rate), in the order of `labels` then `rates`.
pub fn points(runs: &[RateRun], labels: &[String], rates: &[f64], tpot_slo: f64) -> Vec<Point> {
    let mut out = Vec::new();
    for rate in rates {
        for label in labels {
            let mine: Vec<&RateRun> = runs
                .iter()
                .filter(|r| &r.variant == label && r.rate == *rate)
                .collect();
            if mine.is_empty() {
                continue;
            }
            let med = |f: &dyn Fn(&RateRun) -> f64| median(mine.iter().map(|r| f(r)).collect());
            out.push(Point {
                variant: label.clone(),
                rate: *rate,
                repeats: mine.len(),
                ttft_mean_s: med(&|r| r.summary.ttft.mean),
                ttft_p50_s: med(&|r| r.summary.ttft.p50),
                ttft_p99_s: med(&|r| r.summary.ttft.p99),
                tpot_mean_s: med(&|r| r.summary.tpot.mean),
                tpot_p99_s: med(&|r| r.summary.tpot.p99),
                tbt_attained: med(&|r| attained(&r.tpot_s, tpot_slo)),
                completed: mine.iter().map(|r| r.summary.completed).sum(),
                sent: mine.iter().map(|r| r.summary.sent).sum(),
                failed: mine.iter().map(|r| r.summary.failed).sum(),
            });
        }
    }
    out
}

/// Share of `values` within `slo` (1 when there are none).
pub fn attained(values: &[f64], slo: f64) -> f64 {
    if values.is_empty() {
        return 1.0;
    }
    values.iter().filter(|v| **v <= slo).count() as f64 / values.len() as f64
}

/// The SLOs from `label`'s lowest-rate runs: `factor` × the median of their mean TTFT and
/// TPOT (Chameleon: 5× the low-load latency).
pub fn slos(runs: &[RateRun], label: &str, factor: f64) -> (f64, f64) {
    let mine: Vec<&RateRun> = runs.iter().filter(|r| r.variant == label).collect();
    let Some(low) = mine.iter().map(|r| r.rate).min_by(f64::total_cmp) else {
        return (f64::NAN, f64::NAN);
    };
    let at_low: Vec<&&RateRun> = mine.iter().filter(|r| r.rate == low).collect();
    (
        factor * median(at_low.iter().map(|r| r.summary.ttft.mean).collect()),
        factor
            * median(
                at_low
                    .iter()
                    .map(|r| r.summary.tpot.mean.max(0.0))
                    .collect(),
            ),
    )
}

/// Highest rate up to which every rate of `points` (one variant's) met both SLOs at P99 with
/// no failures; 0 when even the lowest did not.
pub fn throughput_at_slo(points: &[&Point], ttft_slo: f64, tpot_slo: f64) -> f64 {
    let mut sorted: Vec<&&Point> = points.iter().collect();
    sorted.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let mut best = 0.0;
    for p in sorted {
        let ok = p.failed == 0
            && p.completed > 0
            && p.ttft_p99_s <= ttft_slo
            && (p.tpot_p99_s.is_nan() || p.tpot_p99_s <= tpot_slo);
        if !ok {
            break;
        }
        best = p.rate;
    }
    best
}

/// Seconds as milliseconds for the tables: one decimal below 100 ms, `-` when undefined.
pub(super) fn ms(s: f64) -> String {
    if s.is_finite() && s < 0.1 {
        format!("{:.1}", s * 1e3)
    } else if s.is_finite() {
        format!("{:.0}", s * 1e3)
    } else {
        "-".into()
    }
}

/// The printed table: one row per point, then the SLOs, throughput at SLO and the P99 TTFT
/// ratio against the first variant at the highest rate.
pub fn table(
    labels: &[String],
    points: &[Point],
    factor: f64,
    ttft_slo: f64,
    tpot_slo: f64,
) -> String {
    let mut out = format!(
        "{:>6} {:>9} {:>9} {:>9} {:>9} {:>8} {:>11} {:>6}\n",
        "rate", "variant", "TTFT p50", "TTFT p99", "TBT p99", "TBT≤SLO", "done/sent", "failed"
    );
    for p in points {
        out.push_str(&format!(
            "{:>6.2} {:>9} {:>9} {:>9} {:>9} {:>7.1}% {:>11} {:>6}\n",
            p.rate,
            p.variant,
            ms(p.ttft_p50_s),
            ms(p.ttft_p99_s),
            ms(p.tpot_p99_s),
            p.tbt_attained * 100.0,
            format!("{}/{}", p.completed, p.sent),
            p.failed
        ));
    }
    let first = labels.first().map_or("-", String::as_str);
    out.push_str(&format!(
        "\nSLO ({factor}× the low-load mean of {first}): TTFT {} ms, TBT {} ms\n",
        ms(ttft_slo),
        ms(tpot_slo)
    ));
    let tput = |l: &str| {
        let mine: Vec<&Point> = points.iter().filter(|p| p.variant == l).collect();
        throughput_at_slo(&mine, ttft_slo, tpot_slo)
    };
    // With TTFT alone too: a tiny model's TBT is a few ms, within the shared machine's noise.
    let tput_ttft = |l: &str| {
        let mine: Vec<&Point> = points.iter().filter(|p| p.variant == l).collect();
        throughput_at_slo(&mine, ttft_slo, f64::INFINITY)
    };
    let rel = |t: f64, base: f64| {
        if base > 0.0 {
            format!(" ({:.2}×)", t / base)
        } else {
            String::new()
        }
    };
    let (base, base_ttft) = (tput(first), tput_ttft(first));
    for l in labels {
        let (t, tt) = (tput(l), tput_ttft(l));
        out.push_str(&format!(
            "throughput at SLO, {l:>9}: {t:.2} req/s{}; TTFT SLO alone: {tt:.2} req/s{}\n",
            rel(t, base),
            rel(tt, base_ttft)
        ));
    }
    let top = points.iter().map(|p| p.rate).fold(f64::NAN, f64::max);
    let p99 = |l: &str| {
        points
            .iter()
            .find(|p| p.variant == l && p.rate == top)
            .map(|p| p.ttft_p99_s)
    };
    if let Some(b) = p99(first) {
        for l in labels.iter().skip(1) {
            if let Some(x) = p99(l) {
                out.push_str(&format!(
                    "P99 TTFT at {top} req/s, {l} / {first}: {:.2}\n",
                    x / b
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::report::Stats;

    fn run(variant: &str, rate: f64, seed: u64, ttft_p99: f64, tpot: &[f64]) -> RateRun {
        let summary = Summary {
            sent: 10,
            completed: 10,
            failed: 0,
            wall_s: 1.0,
            throughput_rps: 10.0,
            output_tokens_per_s: 0.0,
            e2e: Stats::default(),
            errors: Vec::new(),
            ttft: Stats {
                count: 10,
                mean: ttft_p99 / 2.0,
                p50: ttft_p99 / 4.0,
                p99: ttft_p99,
                ..Default::default()
            },
            tpot: Stats::of(tpot.iter().copied()),
        };
        RateRun {
            variant: variant.into(),
            rate,
            seed,
            summary,
            tpot_s: tpot.to_vec(),
            metrics: Vec::new(),
            records: Vec::new(),
        }
    }

    #[test]
    fn points_take_the_median_over_seeds_and_throughput_stops_at_the_first_miss() {
        let runs = vec![
            run("a", 1.0, 0, 0.2, &[0.01, 0.02]),
            run("a", 1.0, 1, 0.4, &[0.01, 0.02]),
            run("a", 1.0, 2, 9.0, &[0.01, 0.05]),
            run("a", 2.0, 0, 3.0, &[0.01]),
            run("b", 1.0, 0, 0.1, &[0.01]),
            run("b", 2.0, 0, 0.5, &[0.01]),
        ];
        let labels = vec!["a".to_string(), "b".to_string()];
        let (ttft_slo, tpot_slo) = slos(&runs, "a", 5.0);
        // Mean TTFTs at rate 1 of a: 0.1, 0.2, 4.5 → median 0.2, × 5.
        assert!((ttft_slo - 1.0).abs() < 1e-12, "{ttft_slo}");
        assert!(tpot_slo > 0.0);
        let pts = points(&runs, &labels, &[1.0, 2.0], 0.03);
        let a1 = &pts[0];
        assert_eq!((a1.variant.as_str(), a1.repeats), ("a", 3));
        assert!((a1.ttft_p99_s - 0.4).abs() < 1e-12);
        // Attainment per seed 1, 1, 0.5 → median 1.
        assert_eq!(a1.tbt_attained, 1.0);
        let of = |l: &str| -> Vec<&Point> { pts.iter().filter(|p| p.variant == l).collect() };
        assert_eq!(throughput_at_slo(&of("a"), ttft_slo, 1.0), 1.0);
        assert_eq!(throughput_at_slo(&of("b"), ttft_slo, 1.0), 2.0);
        let t = table(&labels, &pts, 5.0, ttft_slo, 1.0);
        assert!(
            t.contains("throughput at SLO,         b: 2.00 req/s (2.00×); TTFT SLO alone: 2.00"),
            "{t}"
        );
        assert!(t.contains("P99 TTFT at 2 req/s, b / a: 0.17"), "{t}");
    }

    #[test]
    fn median_and_attainment() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0]), 2.5);
        assert!(median(vec![]).is_nan());
        assert_eq!(attained(&[0.1, 0.2, 0.3, 0.4], 0.25), 0.5);
        assert_eq!(attained(&[], 0.25), 1.0);
    }
}
