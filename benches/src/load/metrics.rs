//! What a run reads from the server's Prometheus `/metrics`: vLLM's prefix-cache and
//! preemption counters (their change over the run) and the running batch, polled while the run
//! lasts. Every figure is optional: a server that does not export a metric (today's Thaw has no
//! prefix cache; other servers name things differently) gives None, never a failed run.
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;

use super::client::OpenAiClient;

/// Prompt tokens looked up in the prefix cache (vLLM V1: a counter of tokens).
pub const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries_total";
/// Prompt tokens found there.
pub const PREFIX_HITS: &str = "vllm:prefix_cache_hits_total";
/// Running sequences preempted (by recompute).
pub const PREEMPTIONS: &str = "vllm:num_preemptions_total";
pub const RUNNING: &str = "vllm:num_requests_running";
pub const WAITING: &str = "vllm:num_requests_waiting";

/// The sum over every sample of `name` (any labels) in Prometheus text; `name` may carry its
/// own labels to pick one series. None when no sample has that name.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let value = if let Some(v) = rest.strip_prefix(' ') {
            v
        } else if rest.starts_with('{') && !name.contains('{') {
            match rest.find("} ") {
                Some(i) => &rest[i + 2..],
                None => continue,
            }
        } else {
            continue;
        };
        // A sample may end with a timestamp after the value.
        if let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// The counters a run compares before and after.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Counters {
    pub prefix_queries: Option<f64>,
    pub prefix_hits: Option<f64>,
    pub preemptions: Option<f64>,
}

impl Counters {
    pub fn read(text: &str) -> Self {
        Self {
            prefix_queries: metric_sum(text, PREFIX_QUERIES),
            prefix_hits: metric_sum(text, PREFIX_HITS),
            preemptions: metric_sum(text, PREEMPTIONS),
        }
    }

    /// What changed from `before` to `self` (None where either side lacks the metric).
    pub fn since(&self, before: &Self) -> Self {
        let d = |a: Option<f64>, b: Option<f64>| Some(a? - b?);
        Self {
            prefix_queries: d(self.prefix_queries, before.prefix_queries),
            prefix_hits: d(self.prefix_hits, before.prefix_hits),
            preemptions: d(self.preemptions, before.preemptions),
        }
    }

    /// Hits ÷ queries, when both are known and something was queried.
    pub fn hit_rate(&self) -> Option<f64> {
        match (self.prefix_hits, self.prefix_queries) {
            (Some(h), Some(q)) if q > 0.0 => Some(h / q),
            _ => None,
        }
    }
}

/// The largest running batch and queue seen by [`poll_peaks`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Peaks {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// Scrapes that answered.
    pub samples: usize,
}

impl Peaks {
    /// Folds one scrape in.
    pub fn observe(&mut self, text: &str) {
        let max = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.running = max(self.running, metric_sum(text, RUNNING));
        self.waiting = max(self.waiting, metric_sum(text, WAITING));
        self.samples += 1;
    }
}

/// Scrapes `/metrics` every `every` until `stop` turns true; returns the peaks.
pub async fn poll_peaks(
    client: Arc<OpenAiClient>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) -> Peaks {
    let mut peaks = Peaks::default();
    loop {
        if let Ok(text) = client.get_text("/metrics").await {
            peaks.observe(&text);
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() {
            break;
        }
    }
    // One last look, so a run shorter than `every` is still sampled at its end.
    if let Ok(text) = client.get_text("/metrics").await {
        peaks.observe(&text);
    }
    peaks
}

/// The current counters, or all None if `/metrics` does not answer.
pub async fn counters(client: &OpenAiClient) -> Counters {
    client
        .get_text("/metrics")
        .await
        .map(|t| Counters::read(&t))
        .unwrap_or_default()
}

/// Waits (up to `limit`) until the server runs and queues nothing, so the next run starts on
/// an idle server; true if it did. A server without the gauges counts as idle.
pub async fn wait_idle(client: &OpenAiClient, limit: Duration) -> bool {
    let t0 = std::time::Instant::now();
    loop {
        let busy = match client.get_text("/metrics").await {
            Ok(t) => {
                metric_sum(&t, RUNNING).unwrap_or(0.0) + metric_sum(&t, WAITING).unwrap_or(0.0)
            }
            Err(_) => 0.0,
        };
        if busy == 0.0 {
            return true;
        }
        if t0.elapsed() >= limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP vllm:num_requests_running x\n\
        # TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{engine=\"0\",model_name=\"base\"} 3\n\
        vllm:num_requests_running_other 100\n\
        vllm:prefix_cache_queries_total{model_name=\"a\"} 1000\n\
        vllm:prefix_cache_queries_total{model_name=\"b\"} 500 1700000000\n\
        vllm:prefix_cache_hits_total 600\n";

    #[test]
    fn samples_sum_over_labels_and_absent_metrics_are_none() {
        assert_eq!(metric_sum(TEXT, RUNNING), Some(3.0));
        assert_eq!(metric_sum(TEXT, PREFIX_QUERIES), Some(1500.0));
        assert_eq!(
            metric_sum(TEXT, "vllm:prefix_cache_queries_total{model_name=\"b\"}"),
            Some(500.0)
        );
        assert_eq!(metric_sum(TEXT, WAITING), None);
        let c = Counters::read(TEXT);
        assert_eq!(c.preemptions, None);
        assert_eq!(c.hit_rate(), Some(0.4));
        let later = Counters::read(&TEXT.replace("600", "900").replace("1000", "1300"));
        let d = later.since(&c);
        assert_eq!(
            (d.prefix_hits, d.prefix_queries),
            (Some(300.0), Some(300.0))
        );
        assert_eq!(d.hit_rate(), Some(1.0));
        assert_eq!(Counters::default().since(&c).hit_rate(), None);
        let mut p = Peaks::default();
        p.observe(TEXT);
        p.observe(&TEXT.replace("} 3\n", "} 1\n"));
        assert_eq!((p.running, p.waiting, p.samples), (Some(3.0), None, 2));
    }
}
