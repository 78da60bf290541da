//! What a request waited for before its first token: a place in the batch or compute, device
//! memory for its KV, its adapter's read from disk, or its adapter's copy over the link. The
//! engine loop classifies every request not yet answered once per step ([`classify`], pure)
//! and charges the time since the last step to the reason it had ([`Waits::advance`]), so the
//! reasons of one request add up to its time to first token as the server measures it.
//! Exported as `thaw_request_wait_seconds{reason,use}` and in a per-request debug line
//! (target [`LOG_TARGET`]) that `thaw-bench cache` reads to split its tail.
use std::time::Instant;

use super::admission::{AdapterState, Device};

/// Why a request was not yet answered.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum WaitReason {
    /// Queued for a place in the batch (`--max-num-seqs`, `--max-loras`, the token budget,
    /// the queue ahead of it), or computing its prompt.
    Batch,
    /// Waiting for device memory: its KV (and adapter) do not fit even with every idle
    /// adapter evicted, so the queue waits for running requests to finish.
    Kv,
    /// Its adapter is being read from disk into the host tier.
    Disk,
    /// Its adapter's layers are being copied to the device (host → device link).
    Link,
}

impl WaitReason {
    pub const ALL: [WaitReason; 4] = [Self::Batch, Self::Kv, Self::Disk, Self::Link];

    /// The metric label and the log field's stem.
    pub fn label(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Kv => "kv",
            Self::Disk => "disk",
            Self::Link => "link",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The `tracing` target of the per-request line (`RUST_LOG=info,thaw::request=debug`).
pub const LOG_TARGET: &str = "thaw::request";

/// What the loop knows of one unanswered request at a step.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Moment {
    /// Its adapter's state, None for the base model or an adapter the manager no longer knows.
    pub adapter: Option<AdapterState>,
    /// Admitted to the running set.
    pub admitted: bool,
    /// This step computes some of its tokens.
    pub stepped: bool,
    /// The queue's head waits for device memory (admission's verdict this step).
    pub head_waits_for_memory: bool,
}

/// Why the request is waiting now. The adapter comes first: a request whose adapter is only on
/// disk waits for the read whatever else holds it, one whose adapter is streaming in and that
/// this step does not compute waits for the link (a request the CPU computes while its
/// adapter streams, `--cold-start auto`, waits for compute). A queued request behind a head
/// that waits for memory waits for memory too (FIFO: it cannot pass a head it would delay).
pub fn classify(m: &Moment) -> WaitReason {
    if let Some(a) = m.adapter {
        match a.device {
            Device::Absent if !a.in_host => return WaitReason::Disk,
            Device::Loading if !m.stepped => return WaitReason::Link,
            _ => {}
        }
    }
    if !m.admitted && m.head_waits_for_memory {
        WaitReason::Kv
    } else {
        WaitReason::Batch
    }
}

/// Seconds one request spent per reason, and the reason it has now.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Waits {
    secs: [f64; 4],
    now: WaitReason,
    since: Instant,
}

impl Waits {
    /// A request that arrived at `at`, waiting for `reason`.
    pub fn new(at: Instant, reason: WaitReason) -> Self {
        Self {
            secs: [0.0; 4],
            now: reason,
            since: at,
        }
    }

    /// Charges the time since the last call to the reason it had, and takes `next`.
    pub fn advance(&mut self, at: Instant, next: WaitReason) {
        let dt = at.saturating_duration_since(self.since).as_secs_f64();
        self.secs[self.now.index()] += dt;
        self.since = self.since.max(at);
        self.now = next;
    }

    /// Seconds waited for `r`.
    pub fn secs(&self, r: WaitReason) -> f64 {
        self.secs[r.index()]
    }

    /// Seconds waited in all.
    pub fn total(&self) -> f64 {
        self.secs.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    fn adapter(device: Device, in_host: bool) -> Option<AdapterState> {
        Some(AdapterState {
            pages: 3,
            device,
            in_host,
        })
    }

    fn m(adapter: Option<AdapterState>, admitted: bool, stepped: bool, mem: bool) -> Moment {
        Moment {
            adapter,
            admitted,
            stepped,
            head_waits_for_memory: mem,
        }
    }

    #[test]
    fn the_adapter_comes_first_then_memory_then_the_batch() {
        use WaitReason::*;
        let cases = [
            (m(adapter(Device::Absent, false), false, false, true), Disk),
            (m(adapter(Device::Loading, true), true, false, false), Link),
            (m(adapter(Device::Loading, true), false, false, true), Link),
            // Computed on the CPU while its adapter streams in: compute, not the link.
            (m(adapter(Device::Loading, true), true, true, false), Batch),
            (m(adapter(Device::Resident, true), false, false, true), Kv),
            (m(adapter(Device::Absent, true), false, false, true), Kv),
            (
                m(adapter(Device::Resident, true), false, false, false),
                Batch,
            ),
            (m(adapter(Device::Resident, true), true, true, true), Batch),
            (m(None, false, false, true), Kv),
            (m(None, true, false, false), Batch),
        ];
        for (moment, want) in cases {
            assert_eq!(classify(&moment), want, "{moment:?}");
        }
    }

    #[test]
    fn each_interval_goes_to_the_reason_it_had() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut w = Waits::new(t0, WaitReason::Disk);
        w.advance(at(30), WaitReason::Link);
        w.advance(at(45), WaitReason::Link);
        w.advance(at(100), WaitReason::Batch);
        w.advance(at(110), WaitReason::Batch);
        let ms = |r| (w.secs(r) * 1e3).round() as u64;
        assert_eq!(
            WaitReason::ALL.map(ms),
            [10, 0, 30, 70],
            "batch, kv, disk, link"
        );
        assert!((w.total() - 0.110).abs() < 1e-9);
    }

    proptest! {
        /// The reasons add up to the time from arrival to the last mark, whatever the order,
        /// and a mark earlier than the last one (clock reads out of order) adds nothing.
        #[test]
        fn reasons_add_up_to_the_elapsed_time(
            steps in prop::collection::vec((0u64..50_000, 0usize..4), 0..40),
        ) {
            let t0 = Instant::now();
            let mut w = Waits::new(t0, WaitReason::Batch);
            let mut latest = t0;
            for (us, r) in steps {
                let at = t0 + Duration::from_micros(us);
                w.advance(at, WaitReason::ALL[r]);
                latest = latest.max(at);
            }
            let want = latest.duration_since(t0).as_secs_f64();
            prop_assert!((w.total() - want).abs() < 1e-9, "{} vs {}", w.total(), want);
            for r in WaitReason::ALL {
                prop_assert!(w.secs(r) >= 0.0);
            }
        }
    }
}
