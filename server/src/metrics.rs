//! Prometheus metrics, written in the text exposition format by hand (no registry crate):
//! counters and histograms the server updates, plus gauges read at scrape time.
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::memory::waits::{WaitReason, Waits};

/// Latency buckets in seconds (TTFT, E2E, adapter loads).
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Per-output-token buckets in seconds.
pub const TPOT_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0,
];

/// A cumulative histogram with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistInner>,
}

#[derive(Debug, Default, Clone)]
struct HistInner {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            inner: Mutex::new(HistInner {
                counts: vec![0; bounds.len()],
                ..Default::default()
            }),
        }
    }

    pub fn observe(&self, v: f64) {
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            h.counts[i] += 1;
        }
        h.sum += v;
        h.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        header(out, name, help, "histogram");
        self.series(out, name, &[]);
    }

    /// The bucket, sum and count lines of one labelled series (no header).
    fn series(&self, out: &mut String, name: &str, labels: &[(&str, &str)]) {
        let h = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut acc = 0;
        let bucket = format!("{name}_bucket");
        let with_le = |le: &str| {
            let mut l: Vec<(&str, &str)> = labels.to_vec();
            l.push(("le", le));
            l.iter()
                .map(|(k, v)| format!("{k}=\"{v}\""))
                .collect::<Vec<_>>()
                .join(",")
        };
        for (b, c) in self.bounds.iter().zip(&h.counts) {
            acc += c;
            let _ = writeln!(out, "{bucket}{{{}}} {acc}", with_le(&b.to_string()));
        }
        let _ = writeln!(out, "{bucket}{{{}}} {}", with_le("+Inf"), h.count);
        sample(out, &format!("{name}_sum"), labels, h.sum);
        sample(out, &format!("{name}_count"), labels, h.count as f64);
    }
}

/// Labels of [`RequestWaits`]: whether the request's adapter was on the device (resident or
/// streaming in) when it arrived, the cache's hit as `thaw_adapter_cache_lookups_total` counts it.
pub const WAIT_USES: [&str; 3] = ["hit", "miss", "base"];

/// `thaw_request_wait_seconds{reason, use}`: per request, the seconds it waited for each reason
/// before its first token (every reason observed once per request, zeros included, so each
/// series counts the requests and the sums over reasons add up to their TTFT).
#[derive(Debug)]
pub struct RequestWaits {
    /// [use][reason], in the order of [`WAIT_USES`] and [`WaitReason::ALL`].
    hist: [[Histogram; 4]; 3],
}

impl Default for RequestWaits {
    fn default() -> Self {
        Self {
            hist: std::array::from_fn(|_| {
                std::array::from_fn(|_| Histogram::new(&LATENCY_BUCKETS))
            }),
        }
    }
}

impl RequestWaits {
    /// Records one request's waits; `hit` is None for the base model.
    pub fn observe(&self, hit: Option<bool>, waits: &Waits) {
        let u = match hit {
            Some(true) => 0,
            Some(false) => 1,
            None => 2,
        };
        for (i, r) in WaitReason::ALL.into_iter().enumerate() {
            self.hist[u][i].observe(waits.secs(r));
        }
    }

    fn render(&self, out: &mut String) {
        const NAME: &str = "thaw_request_wait_seconds";
        header(
            out,
            NAME,
            "Per request, seconds waited before the first token, by reason (batch: a place in \
             the batch or compute; kv: device memory; disk: its adapter's read; link: its \
             adapter's copy to the device) and use (hit: adapter on the device, or streaming in, \
             at arrival; miss; base: no adapter).",
            "histogram",
        );
        for (u, use_) in WAIT_USES.iter().enumerate() {
            for (i, r) in WaitReason::ALL.into_iter().enumerate() {
                self.hist[u][i].series(out, NAME, &[("reason", r.label()), ("use", use_)]);
            }
        }
    }
}

/// Writes `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// One gauge or counter sample line with labels.
pub fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    out.push_str(name);
    if !labels.is_empty() {
        out.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let v = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            let _ = write!(out, "{k}=\"{v}\"");
        }
        out.push('}');
    }
    let _ = writeln!(out, " {value}");
}

/// Counters and histograms the server updates as requests run.
#[derive(Debug)]
pub struct Metrics {
    /// (endpoint, status code) -> count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub ttft: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub adapter_load: Histogram,
    /// What requests waited for before their first token.
    pub waits: RequestWaits,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Requests the engine loop finished, by reason ("stop", "length", "abort", "cancelled").
    finished: Mutex<BTreeMap<&'static str, u64>>,
    /// The scheduler's queues and the models' errors, as the engine loop last published them.
    pub sched: crate::scheduler::SchedBoard,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: Mutex::default(),
            ttft: Histogram::new(&LATENCY_BUCKETS),
            tpot: Histogram::new(&TPOT_BUCKETS),
            e2e: Histogram::new(&LATENCY_BUCKETS),
            adapter_load: Histogram::new(&LATENCY_BUCKETS),
            waits: RequestWaits::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished: Mutex::default(),
            sched: Default::default(),
        }
    }
}

impl Metrics {
    pub fn count_request(&self, endpoint: &str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((endpoint.to_string(), status)).or_default() += 1;
    }

    pub fn count_finished(&self, reason: &'static str) {
        let mut m = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry(reason).or_default() += 1;
    }

    pub fn add_tokens(&self, prompt: usize, generated: usize) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.generation_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
    }

    /// Writes the request counters and histograms.
    pub fn render(&self, out: &mut String) {
        header(
            out,
            "thaw_http_requests_total",
            "HTTP requests by endpoint and status code.",
            "counter",
        );
        for ((ep, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let status = status.to_string();
            sample(
                out,
                "thaw_http_requests_total",
                &[("endpoint", ep), ("status", &status)],
                *n as f64,
            );
        }
        header(
            out,
            "thaw_request_finished_total",
            "Engine requests finished, by reason (stop, length, abort, cancelled).",
            "counter",
        );
        for (reason, n) in self
            .finished
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            sample(
                out,
                "thaw_request_finished_total",
                &[("reason", reason)],
                *n as f64,
            );
        }
        for (name, help, v) in [
            (
                "thaw_prompt_tokens_total",
                "Prompt tokens prefilled.",
                &self.prompt_tokens,
            ),
            (
                "thaw_generation_tokens_total",
                "Tokens generated.",
                &self.generation_tokens,
            ),
        ] {
            header(out, name, help, "counter");
            sample(out, name, &[], v.load(Ordering::Relaxed) as f64);
        }
        self.ttft.render(
            out,
            "thaw_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
        );
        self.tpot.render(
            out,
            "thaw_time_per_output_token_seconds",
            "Time between consecutive generated tokens of a request.",
        );
        self.e2e.render(
            out,
            "thaw_e2e_request_latency_seconds",
            "Time from arrival to the last token.",
        );
        self.adapter_load.render(
            out,
            "thaw_adapter_load_seconds",
            "Time to read, validate and register an adapter.",
        );
        self.waits.render(out);
        self.sched.render(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_labels_are_escaped() {
        let h = Histogram::new(&TPOT_BUCKETS);
        h.observe(0.003);
        h.observe(0.5);
        h.observe(7.0);
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.0025\"} 0"));
        assert!(out.contains("x_bucket{le=\"0.005\"} 1"));
        assert!(out.contains("x_bucket{le=\"1\"} 2"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3"));
        assert!(out.contains("x_count 3"));
        let mut out = String::new();
        sample(&mut out, "y", &[("adapter", "a\"b")], 1.0);
        assert_eq!(out, "y{adapter=\"a\\\"b\"} 1\n");
    }
}
