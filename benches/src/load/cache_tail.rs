//! Where a `thaw-bench cache` cell's TTFT tail comes from, from the client's records alone:
//! requests that are the first in their run to name their adapter (first uses: a miss for
//! every policy unless the warm-up left the adapter cached) against reuses, and the TTFT by
//! adapter rank. Session 9 and 10 did this by hand over cache.json; a tail of reuses means
//! queueing (compute or a full batch), a tail that grows with rank means adapter loads.
//!
//! And from the server's side: the per-request line `thaw serve` logs at debug (target
//! `thaw::request`) names what each request waited for before its first token (a place in
//! the batch or compute, KV memory, its adapter's disk read, its adapter's copy over the
//! link) and whether its adapter was on the device ([`parse_waits`], [`reasons`]).
use std::collections::{BTreeMap, HashSet};

use serde::Serialize;

use super::report::Stats;
use super::runner::RequestRecord;

/// TTFT (seconds) of one cell's completed requests, split.
#[derive(Clone, Debug, PartialEq)]
pub struct TailSplit {
    pub first_use: Stats,
    pub reuse: Stats,
    /// By adapter rank (None: the base model or an adapter of unknown rank), smallest first.
    pub by_rank: Vec<(Option<usize>, Stats)>,
}

/// Splits the requests of `runs` (one record list per run; first use is per run, in send
/// order, failed requests included since they named their adapter too).
pub fn split<'a>(runs: impl IntoIterator<Item = &'a [RequestRecord]>) -> TailSplit {
    let (mut first, mut reuse) = (Vec::new(), Vec::new());
    let mut by_rank: BTreeMap<Option<usize>, Vec<f64>> = BTreeMap::new();
    for recs in runs {
        let mut order: Vec<&RequestRecord> = recs.iter().collect();
        order.sort_by(|a, b| {
            a.scheduled_s
                .total_cmp(&b.scheduled_s)
                .then(a.id.cmp(&b.id))
        });
        let mut seen: HashSet<&str> = HashSet::new();
        for r in order {
            let is_first = seen.insert(r.model.as_str());
            let Some(t) = r.ttft_s.filter(|_| r.ok()) else {
                continue;
            };
            if is_first { &mut first } else { &mut reuse }.push(t);
            by_rank.entry(r.rank).or_default().push(t);
        }
    }
    TailSplit {
        first_use: Stats::of(first),
        reuse: Stats::of(reuse),
        by_rank: by_rank
            .into_iter()
            .map(|(k, v)| (k, Stats::of(v)))
            .collect(),
    }
}

impl TailSplit {
    /// One line: counts and P50/P99 in ms for first uses, reuses and each rank.
    pub fn line(&self) -> String {
        let ms = |s: &Stats| format!("{:.0}/{:.0}", s.p50 * 1e3, s.p99 * 1e3);
        let ranks: Vec<String> = self
            .by_rank
            .iter()
            .map(|(r, s)| match r {
                Some(r) => format!("r{r} {}", ms(s)),
                None => format!("base {}", ms(s)),
            })
            .collect();
        format!(
            "first uses {} at P50/P99 {} ms, reuses {} at {} ms; by rank {}",
            self.first_use.count,
            ms(&self.first_use),
            self.reuse.count,
            ms(&self.reuse),
            ranks.join(", ")
        )
    }
}

/// What `RUST_LOG` the server needs for its per-request lines, given the caller's.
pub fn rust_log(existing: Option<&str>) -> String {
    let base = existing.filter(|s| !s.trim().is_empty()).unwrap_or("info");
    format!("{base},thaw::request=debug")
}

/// One request's waits before its first token, as the server logged them (milliseconds).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServerWait {
    /// Its adapter was on the device when it arrived; None for the base model.
    pub hit: Option<bool>,
    /// Its adapter's size (what its copy over the link moves), if it has one.
    pub adapter_bytes: Option<u64>,
    pub ttft_ms: f64,
    pub batch_ms: f64,
    pub kv_ms: f64,
    pub disk_ms: f64,
    pub link_ms: f64,
}

/// Drops ANSI escape sequences (`ESC [ ... letter`), which the server's log may carry.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The per-request lines of a server log (other lines are skipped; a line missing a field is
/// skipped too, so a changed format shows as no requests rather than wrong figures).
pub fn parse_waits(log: &str) -> Vec<ServerWait> {
    log.lines()
        .filter(|l| l.contains("thaw::request"))
        .filter_map(|l| {
            let l = strip_ansi(l);
            if !l.contains("first token") {
                return None;
            }
            let field = |k: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(k)?.strip_prefix('='))
            };
            let num = |k: &str| field(k)?.parse::<f64>().ok();
            Some(ServerWait {
                hit: field("hit").and_then(|v| v.parse().ok()),
                adapter_bytes: field("adapter_bytes").and_then(|v| v.parse().ok()),
                ttft_ms: num("ttft_ms")?,
                batch_ms: num("batch_ms")?,
                kv_ms: num("kv_ms")?,
                disk_ms: num("disk_ms")?,
                link_ms: num("link_ms")?,
            })
        })
        .collect()
}

/// The mean waits of a set of requests.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reasons {
    pub count: usize,
    pub misses: usize,
    /// Server TTFT at or above which a request is in the set (0 for all requests).
    pub threshold_ms: f64,
    pub ttft_ms: f64,
    pub batch_ms: f64,
    pub kv_ms: f64,
    pub disk_ms: f64,
    pub link_ms: f64,
}

/// Mean waits of the requests whose server TTFT is at or above the `q` quantile of all of
/// them (pooled over runs; `q` = 0 takes every request). The quantile is the nearest rank.
pub fn reasons<'a>(runs: impl IntoIterator<Item = &'a [ServerWait]>, q: f64) -> Reasons {
    let all: Vec<&ServerWait> = runs.into_iter().flatten().collect();
    if all.is_empty() {
        return Reasons::default();
    }
    let mut t: Vec<f64> = all.iter().map(|w| w.ttft_ms).collect();
    t.sort_by(f64::total_cmp);
    let rank = ((q * t.len() as f64).ceil() as usize).clamp(1, t.len());
    let threshold_ms = if q > 0.0 { t[rank - 1] } else { 0.0 };
    let tail: Vec<&&ServerWait> = all.iter().filter(|w| w.ttft_ms >= threshold_ms).collect();
    let n = tail.len() as f64;
    let mean = |f: &dyn Fn(&ServerWait) -> f64| tail.iter().map(|w| f(w)).sum::<f64>() / n;
    Reasons {
        count: tail.len(),
        misses: tail.iter().filter(|w| w.hit == Some(false)).count(),
        threshold_ms,
        ttft_ms: mean(&|w| w.ttft_ms),
        batch_ms: mean(&|w| w.batch_ms),
        kv_ms: mean(&|w| w.kv_ms),
        disk_ms: mean(&|w| w.disk_ms),
        link_ms: mean(&|w| w.link_ms),
    }
}

impl Reasons {
    /// One line: the set, then its mean wait per reason.
    pub fn line(&self) -> String {
        if self.count == 0 {
            return "no per-request lines in the server log".into();
        }
        format!(
            "{} requests ({} misses), server TTFT ≥ {:.0} ms, mean {:.1} ms = batch {:.1} + kv \
             {:.1} + disk {:.1} + link {:.1}",
            self.count,
            self.misses,
            self.threshold_ms,
            self.ttft_ms,
            self.batch_ms,
            self.kv_ms,
            self.disk_ms,
            self.link_ms
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_lines_parse_with_or_without_colour_and_others_are_skipped() {
        let log = "2026-11-24T00:00:00Z  INFO thaw_server: listening\n\
            2026-11-24T00:00:01Z DEBUG thaw::request: first token seq=3 adapter=7 \
            adapter_bytes=229376 hit=false \
            prompt_tokens=12 ttft_ms=120.5 batch_ms=0.5 kv_ms=0 disk_ms=0 link_ms=120\n\
            \u{1b}[2m2026\u{1b}[0m \u{1b}[34mDEBUG\u{1b}[0m \u{1b}[2mthaw::request\u{1b}[0m: first token \
            \u{1b}[3mseq\u{1b}[0m\u{1b}[2m=\u{1b}[0m4 \u{1b}[3mprompt_tokens\u{1b}[0m\u{1b}[2m=\u{1b}[0m5 \
            \u{1b}[3mttft_ms\u{1b}[0m\u{1b}[2m=\u{1b}[0m9 \u{1b}[3mbatch_ms\u{1b}[0m\u{1b}[2m=\u{1b}[0m9 \
            \u{1b}[3mkv_ms\u{1b}[0m\u{1b}[2m=\u{1b}[0m0 \u{1b}[3mdisk_ms\u{1b}[0m\u{1b}[2m=\u{1b}[0m0 \
            \u{1b}[3mlink_ms\u{1b}[0m\u{1b}[2m=\u{1b}[0m0\n\
            2026-11-24T00:00:02Z DEBUG thaw::request: first token seq=5 ttft_ms=3\n";
        let w = parse_waits(log);
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(
            w[0],
            ServerWait {
                hit: Some(false),
                adapter_bytes: Some(229_376),
                ttft_ms: 120.5,
                batch_ms: 0.5,
                kv_ms: 0.0,
                disk_ms: 0.0,
                link_ms: 120.0
            }
        );
        assert_eq!(
            (w[1].hit, w[1].adapter_bytes, w[1].ttft_ms, w[1].batch_ms),
            (None, None, 9.0, 9.0)
        );
        assert_eq!(rust_log(None), "info,thaw::request=debug");
        assert_eq!(rust_log(Some("warn")), "warn,thaw::request=debug");
    }

    #[test]
    fn the_tail_is_the_slowest_requests_pooled_over_runs() {
        let w = |ttft: f64, link: f64, hit: bool| ServerWait {
            hit: Some(hit),
            adapter_bytes: None,
            ttft_ms: ttft,
            batch_ms: ttft - link,
            kv_ms: 0.0,
            disk_ms: 0.0,
            link_ms: link,
        };
        // 10 requests over two runs; at or above the P85 (nearest rank: the 9th of 10) are the
        // two slowest, both link-bound misses.
        let one: Vec<ServerWait> = (1..=5).map(|i| w(i as f64, 0.0, true)).collect();
        let two = vec![
            w(6.0, 0.0, true),
            w(100.0, 90.0, false),
            w(7.0, 0.0, true),
            w(200.0, 150.0, false),
            w(8.0, 2.0, true),
        ];
        let r = reasons([one.as_slice(), two.as_slice()], 0.85);
        assert_eq!((r.count, r.misses, r.threshold_ms), (2, 2, 100.0));
        assert_eq!((r.ttft_ms, r.link_ms, r.batch_ms), (150.0, 120.0, 30.0));
        let all = reasons([one.as_slice(), two.as_slice()], 0.0);
        assert_eq!((all.count, all.misses), (10, 2));
        assert!((all.link_ms - 24.2).abs() < 1e-9, "{all:?}");
        assert!(r.line().contains("link 120.0"), "{}", r.line());
        let none = reasons(std::iter::empty(), 0.99);
        assert_eq!(none, Reasons::default());
        assert_eq!(none.line(), "no per-request lines in the server log");
    }

    fn rec(id: usize, at: f64, model: &str, rank: usize, ttft: Option<f64>) -> RequestRecord {
        RequestRecord {
            id,
            instance: 0,
            model: model.into(),
            rank: Some(rank),
            scheduled_s: at,
            sent_s: at,
            sent_unix_s: at,
            prompt_tokens: 10,
            cached_tokens: None,
            max_tokens: 4,
            output_tokens: 4,
            ttft_s: ttft,
            tpot_s: None,
            e2e_s: ttft,
            error: ttft.is_none().then(|| "refused".to_string()),
        }
    }

    #[test]
    fn first_use_is_per_run_in_send_order_and_failures_still_name_their_adapter() {
        // Listed out of send order; "a" first goes at t=0 (failed), so both its completed
        // requests are reuses. A second run starts afresh: "a" is a first use there.
        let one = vec![
            rec(2, 0.2, "a", 8, Some(0.010)),
            rec(0, 0.0, "a", 8, None),
            rec(1, 0.1, "b", 128, Some(0.300)),
            rec(3, 0.3, "a", 8, Some(0.020)),
        ];
        let two = vec![rec(0, 0.0, "a", 8, Some(0.050))];
        let s = split([one.as_slice(), two.as_slice()]);
        assert_eq!((s.first_use.count, s.reuse.count), (2, 2));
        assert_eq!((s.first_use.max, s.reuse.max), (0.300, 0.020));
        assert!((s.first_use.mean - 0.175).abs() < 1e-12 && (s.reuse.mean - 0.015).abs() < 1e-12);
        assert_eq!(
            s.by_rank
                .iter()
                .map(|(r, st)| (*r, st.count))
                .collect::<Vec<_>>(),
            vec![(Some(8), 3), (Some(128), 1)]
        );
        let line = s.line();
        assert!(
            line.contains("first uses 2") && line.contains("r128 300/300"),
            "{line}"
        );
    }
}
