//! The copy path of a cold request, layer by layer ([`LayerLanding`]): a disk miss is read
//! from its mapped file one layer at a time into the arena and each layer's copy is queued as
//! soon as it is in (commit cbb7044), a host-tier miss only copies, and a request's forward can
//! start once layer 0 has landed. What `auto` weighs against CPU assist is therefore not the
//! whole read plus the whole copy, but the earliest start at which the forward never reaches a
//! layer before it lands, after the reads queued ahead of the adapter's own
//! ([`crate::perf::DiskQueue`]).
use crate::perf::{LayerLanding, PerfModel};

use super::decide::{ColdCase, ColdTier};

impl PerfModel {
    /// How the case's layers still to land reach the device: each layer's read, check and
    /// encode (from disk: the loader's measured read rate and the host encode rate, spread
    /// over the layers; from the host tier: nothing, its image is in the arena) and its copy
    /// (the link's rate and latency), behind the reads queued ahead of it (`queued`: the
    /// case's [`DiskQueue`](crate::perf::DiskQueue) share, or none) and the copies queued
    /// on the link ahead of it.
    pub fn layer_landing(&self, c: &ColdCase, queued: bool) -> LayerLanding {
        let n = self.num_layers.max(1);
        let per_layer = c.bytes as f64 / n as f64;
        let rate = self.link.gbps.max(1e-9) * 1e9;
        let copy_s = per_layer / rate + self.link.latency_us * 1e-6;
        let link_busy_s = c.backlog as f64 / rate;
        let none = LayerLanding {
            layers: 0,
            first: n,
            queue_s: 0.0,
            read_s: 0.0,
            copy_s,
            link_busy_s,
        };
        match c.tier {
            ColdTier::Disk => LayerLanding {
                layers: n,
                first: 0,
                queue_s: if queued {
                    self.host_ready_time(c.reads.ahead_bytes) / c.reads.readers.max(1) as f64
                } else {
                    0.0
                },
                read_s: self.host_ready_time(c.bytes) / n as f64,
                ..none
            },
            ColdTier::Host => LayerLanding {
                layers: n,
                first: 0,
                ..none
            },
            ColdTier::Streaming { landed } => {
                // `landed` is landed layers over layers: round off its float error first.
                let left = (1.0 - landed).clamp(0.0, 1.0) * n as f64;
                let layers = ((left - 1e-9).ceil().max(0.0) as usize).min(n);
                LayerLanding {
                    layers,
                    first: n - layers,
                    ..none
                }
            }
        }
    }

    /// Seconds the case's request waits for its adapter before its prefill starts on the copy
    /// path: the layer-wise wait ([`LayerLanding::wait_s`]) next to the device's time per
    /// layer of its first prefill step (the case's other rows and its first chunk), behind
    /// the reads queued ahead of it.
    pub fn layer_wise_wait(&self, c: &ColdCase) -> f64 {
        let rows = c.cap.min(c.prompt_left).max(1);
        self.layer_landing(c, true)
            .wait_s(self.layer_time(c.other_tokens + rows))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coldstart::decide::tests as decide_tests;
    use crate::coldstart::ColdDecision;
    use crate::perf::DiskQueue;
    use proptest::prelude::*;
    use thaw_runtime::residency::LinkModel;

    /// The H100 of issue 27 (`decide.rs`' model), its workers reading a disk-tier adapter's
    /// file themselves.
    fn h100() -> PerfModel {
        PerfModel {
            assist_reads_disk: true,
            ..decide_tests::h100()
        }
    }

    // Rank 64 on q, k, v, o of a 7B model (134 MB in bf16), a 128-token prompt alone.
    use crate::coldstart::decide::tests::case;

    /// The two settings on the H100: in host memory it copies (the 55 GB/s copy of
    /// each layer is far shorter than the forward's layer, so the request waits for layer 0
    /// alone: ~0.1 ms); on disk it assists (the reads, 16.5 ms a layer, outpace the forward,
    /// so it waits ~0.5 s for the last layer, against ~0.2 s of assisted prefill).
    #[test]
    fn the_h100_copies_from_host_memory_and_assists_from_disk() {
        let m = h100();
        let host = case(ColdTier::Host);
        let w = m.layer_wise_wait(&host);
        let layer = m.layer_landing(&host, true).copy_s;
        assert!((w - layer).abs() < 1e-12, "waits for layer 0 only: {w}");
        assert!(m.landed_in(&host) > 30.0 * layer);
        assert_eq!(m.decide_cold(&host).decision, ColdDecision::Wait);
        let disk = case(ColdTier::Disk);
        let w = m.layer_wise_wait(&disk);
        let l = m.layer_landing(&disk, true);
        let reach = m.layer_time(128);
        let want = 32.0 * l.read_s + l.copy_s - 31.0 * reach;
        assert!((w - want).abs() < 1e-9, "{w} vs {want}");
        assert!(w > 0.45 && w < m.landed_in(&disk), "{w}");
        let p = m.decide_cold(&disk);
        assert!(matches!(p.decision, ColdDecision::Assist { .. }), "{p:?}");
        assert!(p.assist_s.unwrap() < p.wait_s, "{p:?}");
    }

    /// Where the whole-file model assisted and layer-wise landing waits: a disk read of 60 ms
    /// (1.9 ms a layer, beside a 1 ms prefill layer, no encode) cost the whole-file model the
    /// read and 2.8 ms of copies before a 33 ms prefill (~0.095 s), more than an assisted
    /// prefill from fast workers that read the file as fast (~0.08 s: their first pass over
    /// it is the step's bottleneck); landing layer by layer, the forward follows the reads and
    /// waits ~29 ms (~0.061 s with the prefill): waiting is cheaper, and `auto` copies.
    #[test]
    fn layer_wise_landing_turns_a_marginal_assist_into_a_copy() {
        let mut m = h100();
        m.cpu_flops = 1e12;
        m.assist_layer_overhead_s = 10e-6;
        m.disk_bytes_per_s = case(ColdTier::Disk).bytes as f64 / 0.06;
        m.host_encode_bytes_per_s = 0.0;
        m.file_read_bytes_per_s = 0.0;
        let c = case(ColdTier::Disk);
        let p = m.decide_cold(&c);
        let assist = p.assist_s.expect("a chunk was weighed");
        let whole = m.layer_landing(&c, true).whole_file_wait_s() + m.step_time(128);
        assert!(
            whole > assist,
            "the whole-file model would assist: {whole} vs {assist}"
        );
        assert!(p.wait_s < assist, "{p:?}");
        assert_eq!(p.decision, ColdDecision::Wait, "{p:?}");
    }

    /// A streaming adapter's layers still to land are exactly those the engine reports
    /// unlanded (its landed fraction's float error rounded off), the first of them where the
    /// forward reaches it.
    #[test]
    fn a_streaming_adapter_lands_its_unlanded_layers() {
        let m = PerfModel {
            num_layers: 3,
            ..h100()
        };
        for landed in 0..=3usize {
            let c = case(ColdTier::Streaming {
                landed: landed as f64 / 3.0,
            });
            let l = m.layer_landing(&c, true);
            assert_eq!((l.layers, l.first), (3 - landed, landed), "{landed} landed");
        }
    }

    proptest! {
        /// Through the model: a slower disk, more reads ahead, a slower link or more bytes on
        /// it never shorten the predicted wait of a disk miss; the layer-wise wait is within
        /// the whole-file wait, equal for a one-layer model.
        #[test]
        fn the_predicted_wait_is_monotone_and_within_the_whole_file_wait(
            disk in 1e7f64..1e10,
            slower in 1.0f64..10.0,
            encode in prop_oneof![Just(0.0), 1e7f64..1e10],
            gbps in 0.01f64..100.0,
            ahead in 0u64..4_000_000_000,
            backlog in 0u64..1_000_000_000,
            bytes in 1u64..1_000_000_000,
            prompt in 1usize..2048,
            other in 0usize..64,
            layers in 1usize..64,
        ) {
            let m = PerfModel {
                num_layers: layers,
                disk_bytes_per_s: disk,
                host_encode_bytes_per_s: encode,
                link: LinkModel { gbps, latency_us: 10.0 },
                ..h100()
            };
            let c = ColdCase {
                bytes,
                backlog,
                reads: DiskQueue { ahead_bytes: ahead, readers: 2 },
                prompt_left: prompt,
                other_tokens: other,
                ..case(ColdTier::Disk)
            };
            let w = m.layer_wise_wait(&c);
            let eps = 1e-12 * w.max(1.0);
            let whole = m.layer_landing(&c, true).whole_file_wait_s();
            prop_assert!(w <= whole + eps, "{} > {}", w, whole);
            let slow = PerfModel { disk_bytes_per_s: disk / slower, ..m.clone() };
            prop_assert!(slow.layer_wise_wait(&c) >= w - eps);
            let link = PerfModel { link: LinkModel { gbps: gbps / slower, latency_us: 10.0 }, ..m.clone() };
            prop_assert!(link.layer_wise_wait(&c) >= w - eps);
            let queued = ColdCase { reads: DiskQueue { ahead_bytes: ahead + bytes, readers: 2 }, ..c };
            prop_assert!(m.layer_wise_wait(&queued) >= w - eps);
            let busy = ColdCase { backlog: backlog + bytes, ..c };
            prop_assert!(m.layer_wise_wait(&busy) >= w - eps);
            // The plan's wait is this wait plus the prefill.
            let p = m.decide_cold(&c);
            prop_assert!(p.wait_s >= w);
            if layers == 1 {
                prop_assert!((w - whole).abs() <= eps);
            }
        }
    }
}
