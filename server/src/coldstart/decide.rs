//! The `auto` cold-start decision as one pure function of where the adapter is and this
//! device's measured costs (DESIGN §4): the disk read and host encode before the host tier,
//! the link after it, the CPU workers' assist rate and the device's step time, all from the
//! one performance model ([`PerfModel`]). On an H100 (55 GB/s link) an adapter in host memory
//! lands in a few ms and waiting wins; one still on disk costs a read and an encode first,
//! which CPU assist hides when the workers can read the file.
use crate::perf::{PerfModel, Tier};

use super::cost::{AssistWork, ColdPlan};

/// Where a cold adapter is when `auto` decides for its request.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum ColdTier {
    /// On disk: read, encoded into the host tier, then copied.
    Disk,
    /// In the host tier, not yet copied.
    Host,
    /// Copying to the device: this fraction (0..=1) of its bytes has landed.
    Streaming { landed: f64 },
}

/// Everything `auto` decides a cold request from, besides the model.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ColdCase {
    pub tier: ColdTier,
    /// Bytes of the adapter as the copy sends them.
    pub bytes: u64,
    /// Bytes queued on the link ahead of it.
    pub backlog: u64,
    /// CPU work of assisting it per prefill row and layer.
    pub work: AssistWork,
    /// Prompt tokens still to prefill.
    pub prompt_left: usize,
    /// Largest prefill chunk the step may give it.
    pub cap: usize,
    /// Rows of other requests in the step.
    pub other_tokens: usize,
}

impl PerfModel {
    /// Seconds until every layer of the case's adapter is on the device.
    pub fn landed_in(&self, c: &ColdCase) -> f64 {
        match c.tier {
            ColdTier::Disk => self.load_time_from(Tier::Disk, c.bytes, c.backlog),
            ColdTier::Host => self.load_time_from(Tier::Host, c.bytes, c.backlog),
            ColdTier::Streaming { landed } => {
                let left = (1.0 - landed).clamp(0.0, 1.0);
                if left == 0.0 {
                    0.0
                } else {
                    self.load_time((c.bytes as f64 * left) as u64, c.backlog)
                }
            }
        }
    }

    /// Seconds until the CPU workers can start on the case's adapter: at once from memory
    /// (or from the file when they read it), after the read and encode otherwise.
    pub fn assist_starts_in(&self, c: &ColdCase) -> f64 {
        match c.tier {
            ColdTier::Disk if !self.assist_reads_disk => self.host_ready_time(c.bytes),
            _ => 0.0,
        }
    }

    /// The `auto` policy for one cold request: assist when its predicted TTFT (from when the
    /// workers can start) beats waiting for every layer to land, and its chunk keeps the
    /// co-batched decode within bounds; otherwise wait. A pure function of `c` and the model.
    pub fn decide_cold(&self, c: &ColdCase) -> ColdPlan {
        self.decide_times(
            c.work,
            c.prompt_left,
            c.cap,
            c.other_tokens,
            self.landed_in(c),
            self.assist_starts_in(c),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coldstart::ColdDecision;
    use proptest::prelude::*;
    use thaw_runtime::residency::LinkModel;

    /// Llama-2-7B shapes: hidden 4096, intermediate 11008, 32 layers.
    const LAYERS: usize = 32;

    /// CPU FLOPs per prefill row and layer of a rank-`r` adapter on q, k, v and o of a 7B
    /// model (the benchmark adapters): 2·r·(d_in + d_out) per projection.
    fn work_7b(r: f64) -> AssistWork {
        let h = 4096.0;
        AssistWork {
            flops_per_row: 2.0 * r * 4.0 * (h + h),
        }
    }

    /// Bytes of that adapter in bf16: r·(d_in + d_out) per projection and layer; 134 MB at
    /// rank 64, as the H100 run's adapters.
    fn bytes_7b(r: u64) -> u64 {
        LAYERS as u64 * r * 4 * (4096 + 4096) * 2
    }

    /// The model as the H100 measured it (issue 27, main 654e8f9, NVIDIA H100 80GB HBM3):
    /// a 55 GB/s link; a cached decode step of 13.2 ms and a 128-token prefill of about
    /// 32.7 − 13.2 ms more (the cached run's TPOT and TTFT); the disk tier took ~360 ms for a
    /// 134 MB adapter in page cache; the host encode ran at 0.8 GB/s
    /// (`runtime/src/backend/cuda/encode.rs`); four CPU LoRA workers of 25 GFLOP/s each (a
    /// server core's f32 rate on rank-64 products; no assisted step ran there to measure it).
    fn h100() -> PerfModel {
        let step = 13.2e-3 / LAYERS as f64;
        let per_token = (32.7e-3 - 13.2e-3) / 127.0 / LAYERS as f64;
        PerfModel {
            num_layers: LAYERS,
            layer_base_s: step - per_token,
            layer_per_token_s: per_token,
            cpu_flops: 4.0 * 25e9,
            cpu_overlaps: true,
            assist_layer_overhead_s: 100e-6,
            link: LinkModel {
                gbps: 55.0,
                latency_us: 10.0,
            },
            disk_bytes_per_s: 134e6 / 0.36,
            host_encode_bytes_per_s: 0.8e9,
            ..Default::default()
        }
    }

    /// A request of the benchmark: a 128-token prompt, nothing else in the step.
    fn case(tier: ColdTier) -> ColdCase {
        ColdCase {
            tier,
            bytes: bytes_7b(64),
            backlog: 0,
            work: work_7b(64.0),
            prompt_left: 128,
            cap: 2048,
            other_tokens: 0,
        }
    }

    #[test]
    fn h100_copies_from_host_memory() {
        let m = h100();
        // 134 MB over 55 GB/s: a few ms, against a CPU prefill of 32 layers × 128 rows.
        let p = m.decide_cold(&case(ColdTier::Host));
        assert_eq!(p.decision, ColdDecision::Wait, "{p:?}");
        // The copy (2.4 ms) and the 128-token prefill (32.7 ms): the cached run's TTFT.
        assert!(p.wait_s < 0.04, "{p:?}");
        // Also while it streams, and with a running decode beside it.
        let mut c = case(ColdTier::Streaming { landed: 0.25 });
        c.other_tokens = 1;
        assert_eq!(m.decide_cold(&c).decision, ColdDecision::Wait);
    }

    #[test]
    fn h100_assists_from_disk() {
        let mut m = h100();
        m.assist_reads_disk = true;
        let p = m.decide_cold(&case(ColdTier::Disk));
        assert!(
            matches!(p.decision, ColdDecision::Assist { max_chunk: 128 }),
            "{p:?}"
        );
        // The read (~360 ms) and encode (~170 ms) are what waiting pays; the CPU prefill of
        // 128 rows × 32 layers at 100 GFLOP/s takes ~175 ms.
        assert!(p.wait_s > 0.5 && p.assist_s.unwrap() < p.wait_s, "{p:?}");
        // Workers that must wait for the host tier gain nothing over the copy.
        m.assist_reads_disk = false;
        let p = m.decide_cold(&case(ColdTier::Disk));
        assert_eq!(p.decision, ColdDecision::Wait, "{p:?}");
    }

    #[test]
    fn a_slow_emulated_link_assists_from_host_memory() {
        // The CPU backend's emulated PCIe-like link (0.03 GB/s): the copy, not the CPU, is
        // the cold start.
        let mut m = h100();
        m.link.gbps = 0.03;
        let p = m.decide_cold(&case(ColdTier::Host));
        assert!(matches!(p.decision, ColdDecision::Assist { .. }), "{p:?}");
    }

    fn tier(i: u8, landed: f64) -> ColdTier {
        match i {
            0 => ColdTier::Disk,
            1 => ColdTier::Host,
            _ => ColdTier::Streaming { landed },
        }
    }

    proptest! {
        /// Over measured costs of any magnitude: an assist is never predicted slower than
        /// waiting and its chunk fits the prompt and the cap; an adapter further from the
        /// device (disk before host before streaming) never waits where a nearer one assists;
        /// a faster link never turns a wait into an assist.
        #[test]
        fn auto_is_consistent_over_measured_costs(
            gbps in 0.001f64..100.0,
            disk in 1e7f64..1e10,
            encode in 0.0f64..1e10,
            cpu in 1e9f64..1e12,
            base in 1e-5f64..1e-2,
            per_token in 1e-8f64..1e-4,
            reads_disk in any::<bool>(),
            rank in 1u64..256,
            prompt in 1usize..2048,
            other in 0usize..64,
            landed in 0.0f64..1.0,
            t in 0u8..3,
            faster in 1.0f64..100.0,
        ) {
            let m = PerfModel {
                num_layers: 16,
                layer_base_s: base,
                layer_per_token_s: per_token,
                cpu_flops: cpu,
                cpu_overlaps: true,
                link: LinkModel { gbps, latency_us: 10.0 },
                disk_bytes_per_s: disk,
                host_encode_bytes_per_s: encode,
                assist_reads_disk: reads_disk,
                ..Default::default()
            };
            let c = ColdCase {
                tier: tier(t, landed),
                bytes: bytes_7b(rank) / 4,
                backlog: 0,
                work: work_7b(rank as f64),
                prompt_left: prompt,
                cap: 512,
                other_tokens: other,
            };
            let p = m.decide_cold(&c);
            if let ColdDecision::Assist { max_chunk } = p.decision {
                prop_assert!(max_chunk >= 1 && max_chunk <= prompt.min(512));
                prop_assert!(p.assist_s.unwrap() <= p.wait_s);
                // Further from the device: the same assist (reading the file, or a disk
                // case whose workers wait for the host tier as long as it does).
                if t > 0 && reads_disk {
                    let d = m.decide_cold(&ColdCase { tier: ColdTier::Disk, ..c });
                    prop_assert_eq!(d.decision, p.decision);
                }
                if t == 2 {
                    let h = m.decide_cold(&ColdCase { tier: ColdTier::Host, ..c });
                    prop_assert_eq!(h.decision, p.decision);
                }
            } else {
                let mut fast = m.clone();
                fast.link.gbps = gbps * faster;
                prop_assert_eq!(fast.decide_cold(&c).decision, ColdDecision::Wait);
            }
        }
    }
}
