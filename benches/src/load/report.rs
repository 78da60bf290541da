//! Summaries of a run's records, the stdout tables and the JSON report.
use std::fmt::Write as _;

use serde::Serialize;

use super::runner::RequestRecord;

/// Distribution of one metric over the completed requests, in seconds.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Stats {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Stats {
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Self {
                count: 0,
                mean: f64::NAN,
                p50: f64::NAN,
                p90: f64::NAN,
                p99: f64::NAN,
                max: f64::NAN,
            };
        }
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
        Self {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
            max: v[v.len() - 1],
        }
    }
}

/// One run's totals.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
    pub wall_s: f64,
    /// Completed requests per second of wall time.
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    pub ttft: Stats,
    pub tpot: Stats,
    pub e2e: Stats,
    /// The first few distinct error messages.
    pub errors: Vec<String>,
}

impl Summary {
    pub fn of(records: &[RequestRecord], wall_s: f64) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
        let mut errors: Vec<String> = Vec::new();
        for e in records.iter().filter_map(|r| r.error.as_ref()) {
            if errors.len() < 5 && !errors.contains(e) {
                errors.push(e.clone());
            }
        }
        Self {
            sent: records.len(),
            completed: ok.len(),
            failed: records.len() - ok.len(),
            wall_s,
            throughput_rps: ok.len() as f64 / wall_s.max(1e-9),
            output_tokens_per_s: ok.iter().map(|r| r.output_tokens).sum::<usize>() as f64
                / wall_s.max(1e-9),
            ttft: Stats::of(ok.iter().filter_map(|r| r.ttft_s)),
            tpot: Stats::of(ok.iter().filter_map(|r| r.tpot_s)),
            e2e: Stats::of(ok.iter().filter_map(|r| r.e2e_s)),
            errors,
        }
    }
}

fn ms(v: f64) -> String {
    if v.is_finite() {
        format!("{:.1}", v * 1e3)
    } else {
        "-".into()
    }
}

/// One row per run: counts, rates, TTFT / TPOT / E2E in ms.
pub fn table(runs: &[(String, &Summary)]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| run | sent | done | failed | req/s | out tok/s | TTFT mean | TTFT P50 | TTFT P99 | TPOT mean | TPOT P99 | E2E mean | E2E P99 |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, r) in runs {
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {:.2} | {:.1} | {} | {} | {} | {} | {} | {} | {} |",
            r.sent,
            r.completed,
            r.failed,
            r.throughput_rps,
            r.output_tokens_per_s,
            ms(r.ttft.mean),
            ms(r.ttft.p50),
            ms(r.ttft.p99),
            ms(r.tpot.mean),
            ms(r.tpot.p99),
            ms(r.e2e.mean),
            ms(r.e2e.p99),
        );
    }
    s
}

/// The side-by-side policy table: each cell in ms, with the overhead relative to the
/// `baseline` run in parentheses (CaraServe Fig. 10/13/14 shape).
pub fn overhead_table(runs: &[(String, &Summary)], baseline: &str) -> String {
    let base = runs.iter().find(|(n, _)| n == baseline).map(|(_, s)| *s);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| policy | TTFT mean | TTFT P50 | TTFT P99 | TPOT mean | TPOT P99 | E2E mean | E2E P99 | done/failed |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for (name, r) in runs {
        let cell = |v: f64, b: Option<f64>| match b {
            Some(b) if name != baseline && b > 0.0 && v.is_finite() && b.is_finite() => {
                format!("{} ({:+.0}%)", ms(v), (v / b - 1.0) * 100.0)
            }
            _ => ms(v),
        };
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {}/{} |",
            cell(r.ttft.mean, base.map(|b| b.ttft.mean)),
            cell(r.ttft.p50, base.map(|b| b.ttft.p50)),
            cell(r.ttft.p99, base.map(|b| b.ttft.p99)),
            cell(r.tpot.mean, base.map(|b| b.tpot.mean)),
            cell(r.tpot.p99, base.map(|b| b.tpot.p99)),
            cell(r.e2e.mean, base.map(|b| b.e2e.mean)),
            cell(r.e2e.p99, base.map(|b| b.e2e.p99)),
            r.completed,
            r.failed,
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: usize, ttft: f64, e2e: f64, err: bool) -> RequestRecord {
        RequestRecord {
            id,
            instance: 0,
            model: "a".into(),
            rank: Some(8),
            scheduled_s: 0.0,
            sent_s: 0.0,
            sent_unix_s: 0.0,
            prompt_tokens: 4,
            cached_tokens: None,
            max_tokens: 5,
            output_tokens: 5,
            ttft_s: (!err).then_some(ttft),
            tpot_s: (!err).then_some((e2e - ttft) / 4.0),
            e2e_s: (!err).then_some(e2e),
            error: err.then(|| "HTTP 429: busy".to_string()),
        }
    }

    #[test]
    fn summary_accounts_for_every_request() {
        let r: Vec<_> = (0..10)
            .map(|i| rec(i, 0.01 * i as f64, 0.5, i == 3))
            .collect();
        let s = Summary::of(&r, 2.0);
        assert_eq!((s.sent, s.completed, s.failed), (10, 9, 1));
        assert_eq!(s.ttft.count, 9);
        assert_eq!(s.ttft.max, 0.09);
        assert_eq!(s.ttft.p50, 0.05);
        assert_eq!(s.errors, vec!["HTTP 429: busy".to_string()]);
        let t = overhead_table(&[("cached".into(), &s), ("auto".into(), &s)], "cached");
        assert!(t.contains("| auto | 46.7 (+0%) |"), "{t}");
        assert!(Stats::of([]).mean.is_nan());
    }

    /// The sample `load.json` the GPU scripts' dry run (`benches/gpu/dryrun.py`) feeds
    /// `tables.py` has exactly the keys, at the same depths, that this report's summary
    /// serializes: a rename here fails this test, not the next GPU lease.
    #[test]
    fn the_dry_runs_sample_load_json_has_the_summarys_keys() {
        fn keys(v: &serde_json::Value, at: &str, out: &mut Vec<String>) {
            if let Some(m) = v.as_object() {
                for (k, x) in m {
                    let path = format!("{at}.{k}");
                    out.push(path.clone());
                    keys(x, &path, out);
                }
            }
        }
        let r: Vec<_> = (0..4).map(|i| rec(i, 0.01, 0.5, i == 3)).collect();
        let real = serde_json::to_value(Summary::of(&r, 1.0)).unwrap();
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/gpu/testdata/load.json");
        let text = std::fs::read_to_string(path).unwrap();
        let sample: serde_json::Value = serde_json::from_str(&text).unwrap();
        let (mut want, mut got) = (Vec::new(), Vec::new());
        keys(&real, "summary", &mut want);
        keys(&sample["summary"], "summary", &mut got);
        want.sort();
        got.sort();
        assert!(!want.is_empty());
        assert_eq!(
            got, want,
            "{path}: update it to the keys Summary serializes"
        );
    }
}
