//! `thaw-bench scheduling --large-tokens N`: which class a point's TTFT tail belongs to, from
//! the client's records alone. A request is *large* when its prompt plus `max_tokens` — what
//! the scheduler reserves KV for — is at least N tokens. Per (variant, rate), every seed's
//! requests pooled: how many were large, the TTFT of the rest and of the large ones, and how
//! long the server took after the last send (a backlog shows as a drain well above one
//! request's service time). Sessions 8–11 split the JSON records by hand to see whether P99
//! was a large request waiting for memory or a small one queued behind it; and a bimodal
//! `--long-fraction 0.01` window of 200 requests can hold no long request at all, which the
//! main table does not show.
use super::report::Stats;
use super::runner::RequestRecord;
use super::scheduling_report::{median, ms, RateRun};

/// One (variant, rate), its seeds pooled.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassRow {
    pub variant: String,
    pub rate: f64,
    /// Requests sent, over all seeds.
    pub sent: usize,
    /// Of those, large (completed or not).
    pub large: usize,
    /// TTFT (seconds) of the completed requests that are not large.
    pub rest: Stats,
    /// TTFT (seconds) of the completed large requests.
    pub large_ttft: Stats,
    /// Seconds from the last planned send to the last response, median over the seeds.
    pub drain_s: f64,
}

/// Whether `r` reserves at least `large_tokens` tokens of KV.
pub fn is_large(r: &RequestRecord, large_tokens: usize) -> bool {
    r.prompt_tokens + r.max_tokens >= large_tokens
}

/// Seconds from the last planned send of `records` to its last response (NaN when none
/// completed).
pub fn drain_s(records: &[RequestRecord]) -> f64 {
    let last_send = records
        .iter()
        .map(|r| r.scheduled_s)
        .fold(f64::NAN, f64::max);
    let last_done = records
        .iter()
        .filter(|r| r.ok())
        .filter_map(|r| Some(r.sent_s + r.e2e_s?))
        .fold(f64::NAN, f64::max);
    last_done - last_send
}

/// The rows per (variant, rate), in the order of `labels` then `rates`.
pub fn class_rows(
    runs: &[RateRun],
    labels: &[String],
    rates: &[f64],
    large_tokens: usize,
) -> Vec<ClassRow> {
    let mut out = Vec::new();
    for &rate in rates {
        for label in labels {
            let mine: Vec<&RateRun> = runs
                .iter()
                .filter(|r| &r.variant == label && r.rate == rate)
                .collect();
            if mine.is_empty() {
                continue;
            }
            let all = mine.iter().flat_map(|r| r.records.iter());
            let ttft = |large: bool| {
                Stats::of(
                    all.clone()
                        .filter(|r| r.ok() && is_large(r, large_tokens) == large)
                        .filter_map(|r| r.ttft_s),
                )
            };
            out.push(ClassRow {
                variant: label.clone(),
                rate,
                sent: all.clone().count(),
                large: all.clone().filter(|r| is_large(r, large_tokens)).count(),
                rest: ttft(false),
                large_ttft: ttft(true),
                drain_s: median(mine.iter().map(|r| drain_s(&r.records)).collect()),
            });
        }
    }
    out
}

/// The printed table under the main one.
pub fn class_table(rows: &[ClassRow], large_tokens: usize) -> String {
    let mut out =
        format!(
        "\nby class (large: prompt + max_tokens ≥ {large_tokens} tokens; seeds pooled; TTFT ms):\n\
         {:>6} {:>9} {:>11} {:>9} {:>9} {:>9} {:>9} {:>8}\n",
        "rate", "variant", "large/sent", "rest p50", "rest p99", "large p50", "large max", "drain s"
    );
    for r in rows {
        out.push_str(&format!(
            "{:>6.2} {:>9} {:>11} {:>9} {:>9} {:>9} {:>9} {:>8.2}\n",
            r.rate,
            r.variant,
            format!("{}/{}", r.large, r.sent),
            ms(r.rest.p50),
            ms(r.rest.p99),
            ms(r.large_ttft.p50),
            ms(r.large_ttft.max),
            r.drain_s
        ));
    }
    if rows.iter().any(|r| r.large == 0) {
        out.push_str("a row with 0 large requests says nothing about how the large ones fare\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::report::Summary;

    fn rec(id: usize, at: f64, prompt: usize, max: usize, ttft: f64, e2e: f64) -> RequestRecord {
        RequestRecord {
            id,
            instance: 0,
            model: "a".into(),
            rank: Some(8),
            scheduled_s: at,
            sent_s: at,
            sent_unix_s: 0.0,
            prompt_tokens: prompt,
            cached_tokens: None,
            max_tokens: max,
            output_tokens: max,
            ttft_s: Some(ttft),
            tpot_s: None,
            e2e_s: Some(e2e),
            error: None,
        }
    }

    fn run(variant: &str, rate: f64, seed: u64, records: Vec<RequestRecord>) -> RateRun {
        RateRun {
            variant: variant.into(),
            rate,
            seed,
            summary: Summary::of(&records, 1.0),
            tpot_s: Vec::new(),
            metrics: Vec::new(),
            records,
        }
    }

    #[test]
    fn seeds_are_pooled_and_split_at_the_token_threshold() {
        // Seed 0: two small (TTFT 10, 30 ms) and one large (500 ms); the last response at
        // 2.0 + 0.6 s, 0.6 s after the last send. Seed 1: one small (20 ms), one large that
        // failed, the last response 0.2 s after the last send.
        let mut failed = rec(5, 0.4, 500, 12, 0.9, 1.0);
        failed.error = Some("boom".into());
        failed.ttft_s = None;
        failed.e2e_s = None;
        let runs = vec![
            run(
                "fcfs",
                4.0,
                0,
                vec![
                    rec(0, 0.0, 32, 16, 0.010, 0.1),
                    rec(1, 1.0, 500, 2, 0.500, 0.6),
                    rec(2, 2.0, 32, 16, 0.030, 0.6),
                ],
            ),
            run(
                "fcfs",
                4.0,
                1,
                vec![rec(3, 0.5, 100, 23, 0.020, 0.2), failed],
            ),
            run("mlq", 4.0, 0, vec![rec(0, 0.0, 32, 16, 0.010, 0.1)]),
        ];
        let labels = vec!["fcfs".to_string(), "mlq".to_string()];
        let rows = class_rows(&runs, &labels, &[4.0, 8.0], 124);
        assert_eq!(rows.len(), 2, "no row for a rate nobody ran");
        let f = &rows[0];
        assert_eq!((f.variant.as_str(), f.sent, f.large), ("fcfs", 5, 2));
        // 100 + 23 = 123 < 124: small. Rest: 10, 20, 30 ms.
        assert_eq!(f.rest.count, 3);
        assert!((f.rest.p50 - 0.020).abs() < 1e-12);
        assert!((f.rest.max - 0.030).abs() < 1e-12);
        // The failed large request counts as large but has no TTFT.
        assert_eq!(f.large_ttft.count, 1);
        assert!((f.large_ttft.max - 0.500).abs() < 1e-12);
        // Drains 0.6 and 0.2 s: the median of two is their mean.
        assert!((f.drain_s - 0.4).abs() < 1e-12, "{}", f.drain_s);
        let m = &rows[1];
        assert_eq!((m.sent, m.large, m.large_ttft.count), (1, 0, 0));
        let t = class_table(&rows, 124);
        assert!(t.contains("2/5"), "{t}");
        assert!(t.contains("0 large requests says nothing"), "{t}");
    }

    #[test]
    fn drain_is_measured_from_the_last_send_to_the_last_response() {
        let recs = vec![rec(0, 0.0, 8, 8, 0.01, 3.0), rec(1, 1.5, 8, 8, 0.01, 0.5)];
        assert!((drain_s(&recs) - 1.5).abs() < 1e-12);
        assert!(drain_s(&[]).is_nan());
    }
}
