//! The host → device link as the cost model sees it, and why an adapter crosses it. The copies
//! themselves are the upload pipeline's ([`crate::upload`]); on the CPU backend its DMA is
//! emulated at this link's rate.
use std::time::Duration;

/// A host → device link: bandwidth and per-transfer latency.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct LinkModel {
    /// Gigabytes (10⁹ bytes) per second.
    pub gbps: f64,
    /// Fixed cost of each transfer (one per layer).
    pub latency_us: f64,
}

impl Default for LinkModel {
    /// A PCIe 4.0 x16 link moving pinned memory (~25 GB/s, ~10 µs per transfer).
    fn default() -> Self {
        Self {
            gbps: 25.0,
            latency_us: 10.0,
        }
    }
}

impl LinkModel {
    /// Time to move `bytes` in one transfer.
    pub fn transfer_time(&self, bytes: usize) -> Duration {
        let secs = self.latency_us * 1e-6 + bytes as f64 / (self.gbps.max(1e-9) * 1e9);
        Duration::from_secs_f64(secs)
    }
}

/// Why an adapter crosses the link.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum LoadPriority {
    /// A running or admitted request computes with it now.
    Demand,
    /// A waiting request will need it; it yields to every demand load at the next layer
    /// boundary (one FIFO let a demand load queue behind a burst of prefetches, each a whole
    /// adapter's transfer on a slow link).
    Prefetch,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_time_is_latency_plus_bytes_over_bandwidth() {
        let l = LinkModel {
            gbps: 2.0,
            latency_us: 50.0,
        };
        let t = l.transfer_time(4_000_000);
        assert!((t.as_secs_f64() - (50e-6 + 2e-3)).abs() < 1e-9, "{t:?}");
    }
}
