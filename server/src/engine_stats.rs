//! What the engine loop publishes for `/metrics`, the HTTP handlers and tests: atomics and
//! small locked maps the engine thread writes and everyone else reads.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

use thaw_runtime::ids::AdapterId;

/// Numbers the loop publishes for /metrics and tests.
#[derive(Debug, Default)]
pub struct LoopStats {
    /// Requests submitted and not yet admitted (the queue `--max-queued-requests` bounds).
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub kv_used_blocks: AtomicUsize,
    pub kv_total_blocks: AtomicUsize,
    /// `vllm:num_preemptions_total`.
    pub preemptions: AtomicU64,
    /// `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub steps: AtomicU64,
    /// Nanoseconds the engine thread slept to pad steps to `--emulated-step-time`.
    pub emulated_pad_ns: AtomicU64,
    pub alive: AtomicBool,
    /// Row·modules whose LoRA delta CPU assist computed.
    pub cpu_assisted_rows: AtomicU64,
    /// Steps in which CPU assist computed a delta.
    pub cpu_assisted_steps: AtomicU64,
    /// Requests that ran before their adapter landed, their step waiting in the forward for
    /// its layers (`on-demand`, and `auto` where it chose the copy).
    pub cold_layer_waits: AtomicU64,
    /// Requests the cold-start gate held for their adapter's copy for at least one step
    /// (admitted; `cached` also keeps misses out of admission until they land, uncounted).
    pub cold_holds: AtomicU64,
    /// Per adapter still streaming: (landed layers, layers). Resident adapters are absent.
    pub landing: std::sync::Mutex<HashMap<AdapterId, (usize, usize)>>,
    /// Adapters of the running and the waiting requests (`vllm:lora_requests_info`).
    pub lora: crate::metrics_protocol::LoraActivity,
    /// The one dtype the backend computes adapters from (set at start when it reads only
    /// one): adapter reads convert to it on their own threads.
    pub lora_dtype: std::sync::OnceLock<thaw_runtime::adapter::WeightDtype>,
    /// The engine thread's time by cause (`thaw_engine_time_seconds_total`).
    pub time: crate::perf::EngineTime,
    /// The performance model's fitted parameters as of the last step (`--dump-cost-model`).
    pub cost: std::sync::Mutex<Option<crate::perf::PerfSnapshot>>,
}

impl LoopStats {
    /// Counts one step in which CPU assist computed `rows` row·modules.
    pub fn count_assisted(&self, rows: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.cpu_assisted_rows.fetch_add(rows, Relaxed);
        self.cpu_assisted_steps.fetch_add(1, Relaxed);
    }

    /// Landed layers of a registered adapter, if it is still streaming.
    pub fn landing(&self, id: AdapterId) -> Option<(usize, usize)> {
        self.landing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .copied()
    }
}
