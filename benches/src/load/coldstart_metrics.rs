//! What `thaw-bench cold-start` reads from each server's `/metrics` after its run: how often
//! the CPU assisted, how many adapters it served from their mapped files, how many requests
//! started before their adapter landed waiting for its layers in the step and how many the
//! cold-start gate held for the copy, and what a request that missed its adapter waited for (the server's `thaw_request_wait_seconds{reason,use}`).
//! A server that lacks a metric gives None for it (an older `thaw`, another server).
use std::fmt::Write as _;

use serde::Serialize;

use super::metrics::metric_sum;

/// The wait reasons of `thaw_request_wait_seconds`, in the table's order: the adapter's read
/// from disk, a place in the batch (and computing the prompt), device memory, the copy.
pub const REASONS: [&str; 4] = ["disk", "batch", "kv", "link"];

/// One server's cold-start counters at the end of its run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ServerColdStats {
    /// `thaw_cpu_assisted_steps_total`.
    pub assisted_steps: Option<f64>,
    /// `thaw_cpu_assisted_rows_total` (row·modules).
    pub assisted_rows: Option<f64>,
    /// `thaw_adapter_disk_maps_total`.
    pub disk_maps: Option<f64>,
    /// `thaw_adapter_disk_reads_total`.
    pub disk_reads: Option<f64>,
    /// `thaw_cold_start_layer_waits_total`: requests started waiting for their adapter's
    /// layers in the step.
    pub layer_waits: Option<f64>,
    /// `thaw_cold_start_holds_total`: requests held for their adapter's copy.
    pub holds: Option<f64>,
    /// Requests that missed their adapter (`thaw_request_wait_seconds_count{use="miss"}`).
    pub misses: Option<f64>,
    /// Mean seconds a miss waited for each of [`REASONS`].
    pub miss_wait_s: [Option<f64>; 4],
}

impl ServerColdStats {
    /// Reads the counters from Prometheus text.
    pub fn read(text: &str) -> Self {
        let wait = |part: &str, reason: &str| {
            metric_sum(
                text,
                &format!("thaw_request_wait_seconds_{part}{{reason=\"{reason}\",use=\"miss\"}}"),
            )
        };
        let misses = wait("count", "batch");
        Self {
            assisted_steps: metric_sum(text, "thaw_cpu_assisted_steps_total"),
            assisted_rows: metric_sum(text, "thaw_cpu_assisted_rows_total"),
            disk_maps: metric_sum(text, "thaw_adapter_disk_maps_total"),
            disk_reads: metric_sum(text, "thaw_adapter_disk_reads_total"),
            layer_waits: metric_sum(text, "thaw_cold_start_layer_waits_total"),
            holds: metric_sum(text, "thaw_cold_start_holds_total"),
            misses,
            miss_wait_s: REASONS.map(|r| {
                let n = wait("count", r)?;
                (n > 0.0).then_some(wait("sum", r)? / n)
            }),
        }
    }
}

/// The per-policy table of [`ServerColdStats`].
pub fn table(rows: &[(String, Option<&ServerColdStats>)]) -> String {
    let mut s = String::from(
        "| policy | misses | a miss waited for (mean ms): disk / batch / kv / copy | started waiting per layer / held | assisted steps | assisted rows | disk reads | disk maps |\n|---|---|---|---|---|---|---|---|\n",
    );
    let n = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{v:.0}"));
    for (policy, st) in rows {
        let Some(st) = st else {
            let _ = writeln!(s, "| {policy} | — | — | — | — | — | — | — |");
            continue;
        };
        let waits: Vec<String> = st
            .miss_wait_s
            .iter()
            .map(|w| w.map_or("—".to_string(), |w| format!("{:.1}", w * 1e3)))
            .collect();
        let _ = writeln!(
            s,
            "| {policy} | {} | {} | {} / {} | {} | {} | {} | {} |",
            n(st.misses),
            waits.join(" / "),
            n(st.layer_waits),
            n(st.holds),
            n(st.assisted_steps),
            n(st.assisted_rows),
            n(st.disk_reads),
            n(st.disk_maps)
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# TYPE thaw_cpu_assisted_steps_total counter
thaw_cpu_assisted_steps_total 7
thaw_cpu_assisted_rows_total 1200
thaw_adapter_disk_maps_total 3
thaw_adapter_disk_reads_total 5
thaw_cold_start_layer_waits_total 3
thaw_cold_start_holds_total 1
thaw_request_wait_seconds_sum{reason=\"disk\",use=\"miss\"} 0.5
thaw_request_wait_seconds_count{reason=\"disk\",use=\"miss\"} 4
thaw_request_wait_seconds_sum{reason=\"batch\",use=\"miss\"} 0.2
thaw_request_wait_seconds_count{reason=\"batch\",use=\"miss\"} 4
thaw_request_wait_seconds_sum{reason=\"batch\",use=\"hit\"} 9
thaw_request_wait_seconds_count{reason=\"batch\",use=\"hit\"} 9
thaw_request_wait_seconds_sum{reason=\"link\",use=\"miss\"} 0
thaw_request_wait_seconds_count{reason=\"link\",use=\"miss\"} 4
thaw_request_wait_seconds_count{reason=\"kv\",use=\"miss\"} 0
";

    #[test]
    fn reads_the_misses_waits_and_the_assist_counters() {
        let s = ServerColdStats::read(TEXT);
        assert_eq!(s.assisted_steps, Some(7.0));
        assert_eq!(s.assisted_rows, Some(1200.0));
        assert_eq!(s.disk_maps, Some(3.0));
        assert_eq!(s.disk_reads, Some(5.0));
        assert_eq!((s.layer_waits, s.holds), (Some(3.0), Some(1.0)));
        assert_eq!(s.misses, Some(4.0));
        // Means over the misses only (the hits' batch wait is another series); no miss
        // counted for kv: unknown, not zero.
        assert_eq!(s.miss_wait_s, [Some(0.125), Some(0.05), None, Some(0.0)]);
        let t = table(&[("auto".into(), Some(&s)), ("old".into(), None)]);
        assert!(
            t.contains("| auto | 4 | 125.0 / 50.0 / — / 0.0 | 3 / 1 | 7 | 1200 | 5 | 3 |"),
            "{t}"
        );
        assert!(t.contains("| old | — |"), "{t}");
        assert_eq!(ServerColdStats::read(""), ServerColdStats::default());
    }
}
