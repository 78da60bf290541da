//! What the loop publishes after each turn: /metrics' scheduler and protocol numbers, the
//! adapters still landing, the cost model and the memory budget's split.
use std::sync::atomic::Ordering;

use thaw_runtime::backend::Backend as _;

use super::Loop;

impl Loop {
    /// Publishes the loop's state for /metrics and tests.
    pub(super) fn publish(&self) {
        if self.stats.steps.load(Ordering::Relaxed).is_multiple_of(32) {
            self.metrics
                .sched
                .publish(self.sched.snapshot(&self.state), self.cold.cost.snapshot());
        }
        {
            let mut landing = self.stats.landing.lock().unwrap_or_else(|e| e.into_inner());
            landing.retain(|id, v| match self.engine.adapter_landed(*id) {
                Some((l, n)) if l < n => {
                    *v = (l, n);
                    true
                }
                _ => false,
            });
        }
        self.stats.lora.publish(
            self.state.running.iter().map(|s| s.adapter),
            self.state.waiting.iter().map(|s| s.adapter),
        );
        *self.stats.cost.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(self.cold.cost.snapshot());
        let kv = self.engine.kv_usage();
        self.mem.publish(self.state.reserved_blocks, kv.used_blocks);
        if let Some(u) = self.engine.backend().upload_arena() {
            self.mem.publish_arena(u);
        }
        let prefix = self.engine.prefix_stats();
        self.stats
            .prefix_queries
            .store(prefix.queries, Ordering::Relaxed);
        self.stats.prefix_hits.store(prefix.hits, Ordering::Relaxed);
        self.stats
            .preemptions
            .store(self.state.preemptions, Ordering::Relaxed);
        self.stats
            .running
            .store(self.state.running.len(), Ordering::Relaxed);
        self.stats
            .kv_used_blocks
            .store(kv.used_blocks, Ordering::Relaxed);
        self.stats
            .kv_total_blocks
            .store(kv.total_blocks, Ordering::Relaxed);
    }
}
