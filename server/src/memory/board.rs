//! What the memory manager publishes for the registry, `/v1/models` and `/metrics`: each
//! adapter's tier and landed layers, and the budget's split. Written by the engine thread,
//! read by the HTTP side; nothing here decides anything.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;
use thaw_runtime::ids::AdapterId;

/// Where an adapter currently lives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Only its metadata is in memory.
    Disk,
    /// Its weights are in host memory, not on the device.
    Host,
    /// Registered with the engine (its layers may still be streaming in).
    Device,
}

impl Tier {
    /// Gauge value in /metrics.
    pub fn code(self) -> u8 {
        match self {
            Tier::Disk => 0,
            Tier::Host => 1,
            Tier::Device => 2,
        }
    }
}

/// One adapter's place.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Residence {
    pub tier: Tier,
    pub landed_layers: usize,
}

macro_rules! stats {
    ($($(#[$m:meta])* $name:ident),* $(,)?) => {
        /// Counters and gauges of the memory manager (bytes, counts, events).
        #[derive(Debug, Default)]
        pub struct MemoryStats { $($(#[$m])* pub $name: AtomicU64,)* }

        /// A plain copy of [`MemoryStats`].
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
        pub struct MemorySnapshot { $($(#[$m])* pub $name: u64,)* }

        impl MemoryStats {
            pub fn snapshot(&self) -> MemorySnapshot {
                MemorySnapshot { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

stats!(
    /// Bytes of one page (one KV block over every layer).
    page_bytes,
    /// Pages in the device budget.
    total_pages,
    /// Pages reserved by admitted requests' KV.
    kv_reserved_pages,
    /// Pages KV blocks hold now.
    kv_used_pages,
    /// Pages adapters hold (the adapter cache's size).
    adapter_pages,
    device_adapters,
    device_bytes,
    host_adapters,
    host_bytes,
    disk_adapters,
    /// Requests whose adapter was on the device when they arrived.
    hits,
    misses,
    /// Adapters dropped from the device to make room.
    evictions,
    /// Adapters dropped from the host tier.
    host_evictions,
    /// Host → device loads, and how many of them were prefetches.
    loads,
    prefetches,
    /// Missed requests whose adapter a prefetch had on the device by their admission.
    prefetch_hits,
    /// Disk reads of adapters (start-up loads excluded).
    fetches,
    /// Adapters served from their mapped files while their disk read ran.
    mapped,
    /// The pinned upload arena (`--max-cpu-lora-bytes`): its size, bytes reserved, and bytes
    /// of complete images no load uses (the host tier's adapters, encoded for the device).
    arena_capacity_bytes,
    arena_used_bytes,
    arena_retained_bytes,
    /// Bytes loader threads encoded into the arena, and bytes of images loads found there.
    arena_encoded_bytes,
    arena_reused_bytes,
);

/// The published state.
#[derive(Debug, Default)]
pub struct Board {
    residences: Mutex<HashMap<AdapterId, Residence>>,
    pub stats: MemoryStats,
}

impl Board {
    pub fn residence(&self, id: AdapterId) -> Option<Residence> {
        self.lock().get(&id).copied()
    }

    pub fn set(&self, id: AdapterId, r: Residence) {
        self.lock().insert(id, r);
    }

    pub fn remove(&self, id: AdapterId) {
        self.lock().remove(&id);
    }

    /// Adapters on the device.
    pub fn device_ids(&self) -> Vec<AdapterId> {
        self.lock()
            .iter()
            .filter(|(_, r)| r.tier == Tier::Device)
            .map(|(id, _)| *id)
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<AdapterId, Residence>> {
        self.residences.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A Prometheus series: name, help (empty after its first sample), labels, value.
type Series<V> = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
    V,
);

impl MemorySnapshot {
    /// The device budget's split and the tiers' counters in Prometheus text.
    pub fn render(&self, out: &mut String) {
        use crate::metrics::{header, sample};
        let pb = self.page_bytes as f64;
        let gauges: [Series<f64>; 12] = [
            (
                "thaw_device_memory_bytes",
                "Device memory KV blocks and adapters share.",
                &[],
                self.total_pages as f64 * pb,
            ),
            (
                "thaw_device_memory_used_bytes",
                "Device memory by use: KV reserved by admitted requests, KV blocks written, and the adapter cache.",
                &[("use", "kv_reserved")],
                self.kv_reserved_pages as f64 * pb,
            ),
            ("thaw_device_memory_used_bytes", "", &[("use", "kv_used")], self.kv_used_pages as f64 * pb),
            ("thaw_device_memory_used_bytes", "", &[("use", "adapters")], self.adapter_pages as f64 * pb),
            (
                "thaw_adapters",
                "Registered adapters by tier (disk keeps metadata only).",
                &[("tier", "device")],
                self.device_adapters as f64,
            ),
            ("thaw_adapters", "", &[("tier", "host")], self.host_adapters as f64),
            ("thaw_adapters", "", &[("tier", "disk")], self.disk_adapters as f64),
            (
                "thaw_adapter_tier_bytes",
                "Bytes of adapter weights by tier: device, its weights; host, what host memory holds for adapters off the device (the heap copy and the device image in the upload arena, as --max-cpu-lora-bytes counts them); host_arena, the arena's kept images of every adapter.",
                &[("tier", "device")],
                self.device_bytes as f64,
            ),
            ("thaw_adapter_tier_bytes", "", &[("tier", "host")], self.host_bytes as f64),
            (
                "thaw_adapter_tier_bytes",
                "",
                &[("tier", "host_arena")],
                self.arena_retained_bytes as f64,
            ),
            (
                "thaw_host_arena_bytes",
                "The pinned host upload arena (--max-cpu-lora-bytes): its size, and bytes reserved by adapter images (kept for the host tier, or being written or copied).",
                &[("use", "capacity")],
                self.arena_capacity_bytes as f64,
            ),
            ("thaw_host_arena_bytes", "", &[("use", "used")], self.arena_used_bytes as f64),
        ];
        let counters: [Series<u64>; 11] = [
            (
                "thaw_adapter_cache_lookups_total",
                "Requests by whether their adapter was on the device when they arrived.",
                &[("result", "hit")],
                self.hits,
            ),
            ("thaw_adapter_cache_lookups_total", "", &[("result", "miss")], self.misses),
            (
                "thaw_adapter_evictions_total",
                "Adapters dropped from a tier to make room.",
                &[("tier", "device")],
                self.evictions,
            ),
            ("thaw_adapter_evictions_total", "", &[("tier", "host")], self.host_evictions),
            (
                "thaw_adapter_device_loads_total",
                "Host-to-device adapter loads, by cause.",
                &[("cause", "demand")],
                self.loads.saturating_sub(self.prefetches),
            ),
            ("thaw_adapter_device_loads_total", "", &[("cause", "prefetch")], self.prefetches),
            (
                "thaw_adapter_prefetch_hits_total",
                "Requests that missed their adapter on arrival and found it prefetched at admission.",
                &[],
                self.prefetch_hits,
            ),
            (
                "thaw_adapter_disk_reads_total",
                "Adapters read from disk into the host tier after start-up.",
                &[],
                self.fetches,
            ),
            (
                "thaw_adapter_disk_maps_total",
                "Adapters registered from their memory-mapped files while being read from disk (a disk miss read layer by layer by the upload pipeline, and by the CPU workers where they assist).",
                &[],
                self.mapped,
            ),
            (
                "thaw_adapter_upload_bytes_total",
                "Adapter image bytes loads needed in the host arena: encoded by the loader threads, or found there already.",
                &[("source", "encoded")],
                self.arena_encoded_bytes,
            ),
            ("thaw_adapter_upload_bytes_total", "", &[("source", "reused")], self.arena_reused_bytes),
        ];
        let kinds = gauges
            .iter()
            .map(|(n, h, l, v)| (*n, *h, *l, *v, "gauge"))
            .chain(
                counters
                    .iter()
                    .map(|(n, h, l, v)| (*n, *h, *l, *v as f64, "counter")),
            );
        for (name, help, labels, v, kind) in kinds {
            if !help.is_empty() {
                header(out, name, help, kind);
            }
            sample(out, name, labels, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arena's bytes are published under the host tier's byte metric and their own.
    #[test]
    fn the_host_arena_is_rendered() {
        let s = MemorySnapshot {
            host_bytes: 7,
            arena_capacity_bytes: 4096,
            arena_used_bytes: 1024,
            arena_retained_bytes: 768,
            arena_encoded_bytes: 5000,
            arena_reused_bytes: 3000,
            ..Default::default()
        };
        let mut out = String::new();
        s.render(&mut out);
        for line in [
            "thaw_adapter_tier_bytes{tier=\"host\"} 7",
            "thaw_adapter_tier_bytes{tier=\"host_arena\"} 768",
            "thaw_host_arena_bytes{use=\"capacity\"} 4096",
            "thaw_host_arena_bytes{use=\"used\"} 1024",
            "thaw_adapter_upload_bytes_total{source=\"encoded\"} 5000",
            "thaw_adapter_upload_bytes_total{source=\"reused\"} 3000",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} not in\n{out}");
        }
    }
}
