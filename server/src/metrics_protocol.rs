//! The Gateway API Inference Extension's model-server protocol on `/metrics`, under vLLM's
//! names, types and semantics, so an endpoint picker (EPP) reading vLLM servers reads Thaw:
//!
//! | metric | type | value |
//! | --- | --- | --- |
//! | `vllm:num_requests_waiting` | gauge | requests queued, not yet admitted |
//! | `vllm:num_requests_running` | gauge | requests in the running batch |
//! | `vllm:kv_cache_usage_perc` | gauge | KV blocks in use / KV blocks, a 0–1 fraction |
//! | `vllm:gpu_cache_usage_perc` | gauge | the same, under the name older EPPs read |
//! | `vllm:lora_requests_info` | gauge | Unix time of the last update of its label set |
//! | `vllm:num_preemptions_total` | counter | running requests preempted (KV recomputed later) |
//! | `vllm:prefix_cache_queries_total` | counter | prompt tokens looked up in the prefix cache |
//! | `vllm:prefix_cache_hits_total` | counter | of those, tokens found cached |
//!
//! The first four carry vLLM's `model_name` and `engine` labels. `vllm:lora_requests_info`
//! carries `max_lora` (`--max-loras`), `running_lora_adapters` and `waiting_lora_adapters`
//! (adapter names joined by commas, in the order their first request entered the batch or the
//! queue; base-model requests are not listed). Like vLLM, which sets a new child of the gauge
//! to the current time whenever the label set changes and never drops the old ones, Thaw keeps
//! the previous label sets with the time each was last current; an EPP takes the series with
//! the largest value. Unlike vLLM, the history is bounded ([`LORA_INFO_HISTORY`] series).
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use thaw_runtime::ids::AdapterId;

use crate::metrics::{header, sample};

/// Past label sets of `vllm:lora_requests_info` kept besides the current one.
pub const LORA_INFO_HISTORY: usize = 15;

/// One label set of `vllm:lora_requests_info` and when it was last current.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSeries {
    /// Distinct adapters of running requests, in order of first appearance.
    pub running: Vec<AdapterId>,
    /// Distinct adapters of waiting requests, in order of first appearance.
    pub waiting: Vec<AdapterId>,
    /// Unix seconds of the last update that found this label set.
    pub updated: f64,
}

/// Which adapters the engine loop is running and queueing, as it last published them.
#[derive(Debug)]
pub struct LoraActivity {
    inner: Mutex<ActivityInner>,
}

#[derive(Debug)]
struct ActivityInner {
    current: LoraSeries,
    /// Earlier label sets, oldest first; none equals `current` or another.
    history: VecDeque<LoraSeries>,
    scratch_running: Vec<AdapterId>,
    scratch_waiting: Vec<AdapterId>,
    /// Adapters already in the scratch list being built (cleared per list, never shrunk).
    seen: HashSet<AdapterId>,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Appends the distinct adapters of `seqs` to `out` (cleared first), in first-seen order.
/// O(len) with `seen` as the membership index: the engine loop calls this every step over
/// the whole waiting queue, and a `contains` scan of `out` made that O(queue × distinct
/// adapters), which grew with the registered count (issue 11's cache-scale table).
fn distinct(
    out: &mut Vec<AdapterId>,
    seen: &mut HashSet<AdapterId>,
    seqs: impl IntoIterator<Item = Option<AdapterId>>,
) {
    out.clear();
    seen.clear();
    for id in seqs.into_iter().flatten() {
        if seen.insert(id) {
            out.push(id);
        }
    }
}

impl Default for LoraActivity {
    fn default() -> Self {
        Self {
            inner: Mutex::new(ActivityInner {
                current: LoraSeries {
                    running: Vec::new(),
                    waiting: Vec::new(),
                    updated: unix_now(),
                },
                history: VecDeque::new(),
                scratch_running: Vec::new(),
                scratch_waiting: Vec::new(),
                seen: HashSet::new(),
            }),
        }
    }
}

impl LoraActivity {
    /// Records the adapters of the running and the waiting requests (None: base model) at
    /// the current time. Allocates only when the label set changes.
    pub fn publish(
        &self,
        running: impl IntoIterator<Item = Option<AdapterId>>,
        waiting: impl IntoIterator<Item = Option<AdapterId>>,
    ) {
        self.publish_at(running, waiting, unix_now());
    }

    /// [`Self::publish`] at a given Unix time (tests).
    pub fn publish_at(
        &self,
        running: impl IntoIterator<Item = Option<AdapterId>>,
        waiting: impl IntoIterator<Item = Option<AdapterId>>,
        now: f64,
    ) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &mut *g;
        distinct(&mut inner.scratch_running, &mut inner.seen, running);
        distinct(&mut inner.scratch_waiting, &mut inner.seen, waiting);
        let same = inner.scratch_running == inner.current.running
            && inner.scratch_waiting == inner.current.waiting;
        if !same {
            let next = LoraSeries {
                running: inner.scratch_running.clone(),
                waiting: inner.scratch_waiting.clone(),
                updated: now,
            };
            let prev = std::mem::replace(&mut inner.current, next);
            // vLLM's gauge child for a label set is one series: coming back to a set
            // updates that series rather than adding another.
            let c = &inner.current;
            inner
                .history
                .retain(|s| !(s.running == c.running && s.waiting == c.waiting));
            inner.history.push_back(prev);
            while inner.history.len() > LORA_INFO_HISTORY {
                inner.history.pop_front();
            }
        }
        inner.current.updated = now;
    }

    /// Every label set kept, oldest first; the last is the current one.
    pub fn series(&self) -> Vec<LoraSeries> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.history
            .iter()
            .cloned()
            .chain(std::iter::once(g.current.clone()))
            .collect()
    }
}

/// What the protocol metrics are rendered from: a snapshot of the server's state.
#[derive(Clone, Debug)]
pub struct ProtocolSnapshot<'a> {
    /// The base model's served name (vLLM's `model_name` label).
    pub model_name: &'a str,
    pub waiting: usize,
    pub running: usize,
    pub kv_used_blocks: usize,
    pub kv_total_blocks: usize,
    /// `--max-loras`.
    pub max_loras: usize,
    /// [`LoraActivity::series`].
    pub lora_series: Vec<LoraSeries>,
    /// Adapter names; ids without one (unloaded since) are left out of the labels.
    pub names: HashMap<AdapterId, &'a str>,
    /// Running requests preempted since start.
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and of those found, since start.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

fn join_names(ids: &[AdapterId], names: &HashMap<AdapterId, &str>) -> String {
    let mut out = String::new();
    for n in ids.iter().filter_map(|id| names.get(id)) {
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(n);
    }
    out
}

/// Writes the protocol metrics in the text exposition format.
pub fn render(out: &mut String, s: &ProtocolSnapshot<'_>) {
    let labels = [("engine", "0"), ("model_name", s.model_name)];
    let usage = s.kv_used_blocks as f64 / s.kv_total_blocks.max(1) as f64;
    let gauges: [(&str, &str, f64); 4] = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            usage,
        ),
        (
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            usage,
        ),
    ];
    for (name, help, v) in gauges {
        header(out, name, help, "gauge");
        sample(out, name, &labels, v);
    }
    let counters: [(&str, &str, u64); 3] = [
        (
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            s.preemptions,
        ),
        (
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_queries,
        ),
        (
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_hits,
        ),
    ];
    for (name, help, v) in counters {
        header(out, name, help, "counter");
        sample(out, name, &labels, v as f64);
    }
    const INFO: &str = "vllm:lora_requests_info";
    header(out, INFO, "Running stats on lora requests.", "gauge");
    // Two kept label sets can render alike once an adapter is unloaded; one series each.
    let mut by_labels: BTreeMap<(String, String), f64> = BTreeMap::new();
    for series in &s.lora_series {
        let key = (
            join_names(&series.waiting, &s.names),
            join_names(&series.running, &s.names),
        );
        let t = by_labels.entry(key).or_insert(series.updated);
        *t = t.max(series.updated);
    }
    let max_lora = s.max_loras.to_string();
    for ((waiting, running), t) in &by_labels {
        sample(
            out,
            INFO,
            &[
                ("max_lora", &max_lora),
                ("waiting_lora_adapters", waiting),
                ("running_lora_adapters", running),
            ],
            *t,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(v: &[u32]) -> Vec<Option<AdapterId>> {
        v.iter().map(|&i| (i > 0).then_some(AdapterId(i))).collect()
    }

    #[test]
    fn label_sets_keep_their_last_time_and_revisits_update_one_series() {
        let a = LoraActivity::default();
        a.publish_at(ids(&[1, 0, 1]), ids(&[2]), 10.0);
        a.publish_at(ids(&[1]), ids(&[2, 2]), 11.0);
        a.publish_at(ids(&[]), ids(&[]), 12.0);
        a.publish_at(ids(&[1]), ids(&[2]), 13.0);
        let s = a.series();
        let find = |r: &[u32], w: &[u32]| {
            let r: Vec<AdapterId> = r.iter().map(|&i| AdapterId(i)).collect();
            let w: Vec<AdapterId> = w.iter().map(|&i| AdapterId(i)).collect();
            s.iter()
                .filter(|x| x.running == r && x.waiting == w)
                .map(|x| x.updated)
                .collect::<Vec<_>>()
        };
        assert_eq!(find(&[1], &[2]), vec![13.0]);
        assert_eq!(find(&[], &[]), vec![12.0]);
        assert_eq!(s.last().map(|x| x.updated), Some(13.0));
    }

    /// The oracle: the quadratic first-seen scan `distinct` replaced.
    fn scan_distinct(seqs: &[Option<AdapterId>]) -> Vec<AdapterId> {
        let mut out: Vec<AdapterId> = Vec::new();
        for id in seqs.iter().flatten() {
            if !out.contains(id) {
                out.push(*id);
            }
        }
        out
    }

    proptest! {
        /// The hash-indexed dedup gives the scan's list (same adapters, first-seen order),
        /// also when its buffers are reused across calls.
        #[test]
        fn distinct_matches_the_scan(
            lists in proptest::collection::vec(proptest::collection::vec(0u32..40, 0..80), 1..6)
        ) {
            let (mut out, mut seen) = (Vec::new(), HashSet::new());
            for l in &lists {
                distinct(&mut out, &mut seen, ids(l));
                prop_assert_eq!(&out, &scan_distinct(&ids(l)));
            }
        }

        /// The history stays bounded and distinct, and the current set is the last one
        /// published with the largest time.
        #[test]
        fn history_is_bounded_distinct_and_current_is_newest(
            steps in proptest::collection::vec(
                (proptest::collection::vec(0u32..5, 0..6), proptest::collection::vec(0u32..5, 0..6)),
                1..60,
            )
        ) {
            let a = LoraActivity::default();
            // After the start-up series' time, as the engine loop publishes.
            let t0 = unix_now() + 1.0;
            for (t, (r, w)) in steps.iter().enumerate() {
                a.publish_at(ids(r), ids(w), t0 + t as f64);
            }
            let s = a.series();
            prop_assert!(s.len() <= LORA_INFO_HISTORY + 1);
            for (i, x) in s.iter().enumerate() {
                for y in &s[i + 1..] {
                    prop_assert!(x.running != y.running || x.waiting != y.waiting);
                }
            }
            let last = s.last().unwrap();
            prop_assert!(s.iter().all(|x| x.updated <= last.updated));
            let (r, w) = steps.last().unwrap();
            let (want_r, want_w) = (scan_distinct(&ids(r)), scan_distinct(&ids(w)));
            prop_assert_eq!(&last.running, &want_r);
            prop_assert_eq!(&last.waiting, &want_w);
        }
    }

    #[test]
    fn renders_vllm_names_labels_and_a_fraction() {
        let a = LoraActivity::default();
        a.publish_at(ids(&[1]), ids(&[2, 9]), 5.0);
        a.publish_at(ids(&[1, 2]), ids(&[9]), 6.0);
        let names = HashMap::from([(AdapterId(1), "sql"), (AdapterId(2), "chat")]);
        let snap = ProtocolSnapshot {
            model_name: "base",
            waiting: 3,
            running: 2,
            kv_used_blocks: 5,
            kv_total_blocks: 20,
            max_loras: 4,
            lora_series: a.series(),
            names,
            preemptions: 7,
            prefix_queries: 1000,
            prefix_hits: 992,
        };
        let mut out = String::new();
        render(&mut out, &snap);
        assert!(out.contains("# TYPE vllm:lora_requests_info gauge\n"));
        assert!(out.contains("# TYPE vllm:num_preemptions_total counter\n"));
        assert!(out.contains("vllm:num_preemptions_total{engine=\"0\",model_name=\"base\"} 7\n"));
        assert!(
            out.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"base\"} 992\n")
        );
        assert!(out.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"base\"} 0.25\n"));
        assert!(out.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"base\"} 3\n"));
        // Adapter 9 has no name (unloaded): it is left out of the labels.
        assert!(out.contains(
            "vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"\",running_lora_adapters=\"sql,chat\"} 6\n"
        ));
        assert!(out.contains(
            "vllm:lora_requests_info{max_lora=\"4\",waiting_lora_adapters=\"chat\",running_lora_adapters=\"sql\"} 5\n"
        ));
    }
}
