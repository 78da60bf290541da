//! The `auto` cold-start decision as one pure function of where the adapter is and this
//! device's measured costs (DESIGN §4): the disk read and host encode before the host tier,
//! the link after it, the CPU workers' assist rate and the device's step time, all from the
//! one performance model ([`PerfModel`]). On an H100 (55 GB/s link) an adapter in host memory
//! lands in a few ms and waiting wins; one still on disk costs a read and an encode first,
//! which CPU assist hides when the workers can read the file.
use crate::perf::{DiskQueue, PerfModel};

use super::cost::{AssistWork, ColdPlan, ColdTimes};

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

impl ColdTier {
    /// The tier of an adapter registered with the engine, `landed` of its `layers` on the
    /// device: still read from its mapped file with nothing landed, the copy waits for the
    /// disk (its own read of the file, behind no loader queue); otherwise it streams.
    pub fn registered(landed: usize, layers: usize, mapped: bool) -> Self {
        if landed == 0 && mapped {
            ColdTier::Disk
        } else {
            ColdTier::Streaming {
                landed: landed as f64 / layers.max(1) as f64,
            }
        }
    }
}

/// Everything `auto` decides a cold request from, besides the model.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ColdCase {
    pub tier: ColdTier,
    /// Bytes of the adapter as the copy sends them.
    pub bytes: u64,
    /// Bytes queued on the link ahead of it.
    pub backlog: u64,
    /// The loader's reads ahead of its own, when it is on disk and waits for the loader
    /// (nothing ahead where its read has not been queued behind others).
    pub reads: DiskQueue,
    /// CPU work of assisting it per prefill row and layer.
    pub work: AssistWork,
    /// Prompt tokens still to prefill.
    pub prompt_left: usize,
    /// Largest prefill chunk the step may give it.
    pub cap: usize,
    /// Rows of other requests in the step.
    pub other_tokens: usize,
    /// Requests already running: each waits for every step the assist stretches.
    pub running: usize,
    /// Output tokens left to the running request nearest its end, whose time per token a
    /// stretched step raises most (see [`ColdTimes::fewest_left`]).
    pub fewest_left: usize,
    /// Tokens it may still generate.
    pub max_new_tokens: usize,
}

impl PerfModel {
    /// Seconds until every layer of the case's adapter is on the device, layer by layer
    /// ([`PerfModel::layer_landing`]): from disk, each layer read from its file, checked and
    /// encoded, then copied, behind the reads queued ahead of it; from the host tier, the
    /// copies alone.
    pub fn landed_in(&self, c: &ColdCase) -> f64 {
        self.layer_landing(c, true).all_landed_s()
    }

    /// Seconds until the CPU workers can start on the case's adapter: at once from memory
    /// (or from the file when they read it), after the read and encode otherwise.
    pub fn assist_starts_in(&self, c: &ColdCase) -> f64 {
        match c.tier {
            ColdTier::Disk if !self.assist_reads_disk => {
                self.queued_host_ready_time(c.bytes, c.reads)
            }
            _ => 0.0,
        }
    }

    /// Seconds until every layer is on the device when the case is assisted: from disk, with
    /// workers that read the file, the adapter is served from its mapped file and read layer
    /// by layer at once, so no read queued ahead of it delays that ([`Self::landed_in`]
    /// otherwise).
    pub fn assisted_landed_in(&self, c: &ColdCase) -> f64 {
        match c.tier {
            ColdTier::Disk if self.assist_reads_disk => self.layer_landing(c, false).all_landed_s(),
            _ => self.landed_in(c),
        }
    }

    /// Seconds the CPU workers spend reading the case's adapter from its file on their first
    /// pass over its layers, when they read the file; nothing from memory.
    pub fn assist_read_time(&self, c: &ColdCase) -> f64 {
        match c.tier {
            ColdTier::Disk if self.assist_reads_disk => c.bytes as f64 / self.file_read_rate(),
            _ => 0.0,
        }
    }

    /// The `auto` policy for one cold request ([`PerfModel::decide_times`]): the copy path
    /// starts its prefill once the layers land ahead of its forward (each read from disk,
    /// encoded and copied as soon as it is in, [`PerfModel::layer_wise_wait`]); the assist
    /// path starts when the workers can, pays the workers' read of the file on its first
    /// step, and is taken only when the wait it hides outweighs what it costs the running
    /// requests. A pure function of `c` and the model.
    pub fn decide_cold(&self, c: &ColdCase) -> ColdPlan {
        self.decide_times(&ColdTimes {
            work: c.work,
            prompt_left: c.prompt_left,
            cap: c.cap,
            other_tokens: c.other_tokens,
            running: c.running,
            fewest_left: c.fewest_left,
            decode_left: c.max_new_tokens.saturating_sub(1),
            load_left_s: self.layer_wise_wait(c),
            assist_load_left_s: self.assisted_landed_in(c),
            assist_start_s: self.assist_starts_in(c),
            assist_read_s: self.assist_read_time(c),
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::coldstart::ColdDecision;
    use proptest::prelude::*;
    use thaw_runtime::residency::LinkModel;

    /// Llama-2-7B shapes: hidden 4096, intermediate 11008, 32 layers.
    const LAYERS: usize = 32;

    /// CPU FLOPs per prefill row and layer of a rank-`r` adapter on q, k, v and o of a 7B
    /// model (the benchmark adapters): 2·r·(d_in + d_out) per projection.
    pub(in crate::coldstart) fn work_7b(r: f64) -> AssistWork {
        let h = 4096.0;
        AssistWork {
            flops_per_row: 2.0 * r * 4.0 * (h + h),
        }
    }

    /// Bytes of that adapter in bf16: r·(d_in + d_out) per projection and layer; 134 MB at
    /// rank 64, as the H100 run's adapters.
    pub(in crate::coldstart) fn bytes_7b(r: u64) -> u64 {
        LAYERS as u64 * r * 4 * (4096 + 4096) * 2
    }

    /// The model as the H100 measured it (issue 27, main 654e8f9, NVIDIA H100 80GB HBM3):
    /// a 55 GB/s link; a cached decode step of 13.2 ms and a 128-token prefill of about
    /// 32.7 − 13.2 ms more (the cached run's TPOT and TTFT); the disk tier took ~360 ms for a
    /// 134 MB adapter in page cache; the host encode ran at 0.8 GB/s
    /// (`runtime/src/backend/cuda/encode.rs`); four CPU LoRA workers of 25 GFLOP/s each (a
    /// server core's f32 rate on rank-64 products; no assisted step ran there to measure it);
    /// a page-cache read of 4 GB/s; the workers do not slow the GPU.
    pub(in crate::coldstart) fn h100() -> PerfModel {
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
            file_read_bytes_per_s: 4e9,
            host_encode_bytes_per_s: 0.8e9,
            ..Default::default()
        }
    }

    /// A request of the benchmark: a 128-token prompt, 32 output tokens, nothing
    /// else in the step.
    pub(in crate::coldstart) fn case(tier: ColdTier) -> ColdCase {
        ColdCase {
            tier,
            bytes: bytes_7b(64),
            backlog: 0,
            reads: DiskQueue::default(),
            work: work_7b(64.0),
            prompt_left: 128,
            cap: 2048,
            other_tokens: 0,
            running: 0,
            fewest_left: 0,
            max_new_tokens: 32,
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
        c.running = 1;
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
        // 128 rows × 32 layers at 100 GFLOP/s takes ~175 ms, the workers' first read of the
        // file from the page cache ~34 ms of it.
        assert!(p.wait_s > 0.5 && p.assist_s.unwrap() < p.wait_s, "{p:?}");
        // With eight requests decoding beside it, half-way through their 32 tokens: its
        // cheapest stretch (chunks of 8: 16 steps 3.2 ms longer and the file read, ~0.12 s
        // with its own assisted decode) spread over 16 tokens of 13.2 ms is a 58% rise of
        // their TPOT, far past MAX_TPOT_SLOWDOWN: no chunk passes, it waits.
        let mut c = case(ColdTier::Disk);
        c.other_tokens = 8;
        c.running = 8;
        c.fewest_left = 16;
        let busy = m.decide_cold(&c);
        assert_eq!(busy.decision, ColdDecision::Wait, "{busy:?}");
        assert_eq!(busy.assist_s, None, "{busy:?}");
        // Workers that must wait for the host tier gain nothing over the copy.
        m.assist_reads_disk = false;
        let p = m.decide_cold(&case(ColdTier::Disk));
        assert_eq!(p.decision, ColdDecision::Wait, "{p:?}");
    }

    /// The H200 run of `benches/results/cuda-h100.md` §6 had every miss wait ~2.8 s for reads
    /// queued ahead of its own. With a read of 50 ms and no host encode (the arena), a
    /// request alone waits for its adapter when nothing is queued (its forward follows the
    /// layers as they are read and land, ~18 ms behind the read, and beats a CPU prefill of
    /// ~0.2 s); behind eight reads on one loader thread (~0.4 s more, every layer later by
    /// that) `auto` assists, the workers reading the file at once; four loader threads cut
    /// that queue to a quarter, and it waits again.
    #[test]
    fn a_queue_of_disk_reads_is_assisted() {
        let mut m = h100();
        m.assist_reads_disk = true;
        m.disk_bytes_per_s = bytes_7b(64) as f64 / 0.05;
        m.host_encode_bytes_per_s = 0.0;
        let c = case(ColdTier::Disk);
        let alone = m.decide_cold(&c);
        assert_eq!(alone.decision, ColdDecision::Wait, "{alone:?}");
        let queued = ColdCase {
            reads: DiskQueue {
                ahead_bytes: 8 * bytes_7b(64),
                readers: 1,
            },
            ..c
        };
        let p = m.decide_cold(&queued);
        assert!(matches!(p.decision, ColdDecision::Assist { .. }), "{p:?}");
        assert!(
            (p.wait_s - alone.wait_s - 0.4).abs() < 1e-9,
            "{alone:?} {p:?}"
        );
        assert_eq!(p.assist_s, alone.assist_s, "the file read does not queue");
        let four = m.decide_cold(&ColdCase {
            reads: DiskQueue {
                readers: 4,
                ..queued.reads
            },
            ..queued
        });
        assert!((four.wait_s - alone.wait_s - 0.1).abs() < 1e-9, "{four:?}");
        assert_eq!(four.decision, ColdDecision::Wait, "{four:?}");
    }

    /// With the priors `calibrate` starts from on a GPU (100 µs of assist overhead a layer,
    /// against a 0.41 ms decode layer), a request behind a long queue of disk reads (64
    /// adapters ahead: ~34 s) next to one running decode. What decides is what the assist
    /// costs that decode over the tokens it has left ([`MAX_TPOT_SLOWDOWN`]):
    /// - chunks of 11 (the largest whose CPU work, 11 × 42 µs, the device's 0.47 ms layer
    ///   hides): 12 steps, each 3.2 ms longer (the overhead × 32 layers), the first also
    ///   ~33 ms for the workers' read of the file; then ~17 assisted decode steps of its own,
    ///   3.2 ms longer, until its adapter lands (~0.53 s after it arrives). ~0.126 s in all.
    /// - 1,000 tokens left (13.2 s of decode): 0.126 / 13.2 = 0.96% ≤ 2%: it assists, and saves
    ///   ~34 s of TTFT.
    /// - 300 tokens left (3.96 s): 3.2% with chunks of 11, no chunk under 2%: it waits.
    /// - Eight running requests at their last token: a 3.2 ms stretch on a 13.2 ms token
    ///   alone is 24%: it waits, however long the queue.
    ///
    /// The bound per step this replaces (5% of a step) kept every such request waiting.
    #[test]
    fn a_running_decode_blocks_assist_under_the_gpu_priors() {
        use crate::coldstart::MAX_TPOT_SLOWDOWN;
        let mut m = h100();
        m.assist_reads_disk = true;
        let c = ColdCase {
            other_tokens: 1,
            running: 1,
            fewest_left: 1000,
            reads: DiskQueue {
                ahead_bytes: 64 * bytes_7b(64),
                readers: 1,
            },
            ..case(ColdTier::Disk)
        };
        let p = m.decide_cold(&c);
        assert_eq!(p.decision, ColdDecision::Assist { max_chunk: 11 }, "{p:?}");
        assert!(p.tpot_rise > 0.009 && p.tpot_rise < 0.01, "{p:?}");
        assert!(p.wait_s > 34.0 && p.assist_s.unwrap() < 0.26, "{p:?}");
        let nearer = ColdCase {
            fewest_left: 300,
            ..c
        };
        let p = m.decide_cold(&nearer);
        assert_eq!(
            (p.decision, p.assist_s),
            (ColdDecision::Wait, None),
            "{p:?}"
        );
        let last = ColdCase {
            other_tokens: 8,
            running: 8,
            fewest_left: 1,
            ..c
        };
        let p = m.decide_cold(&last);
        assert_eq!(
            (p.decision, p.assist_s),
            (ColdDecision::Wait, None),
            "{p:?}"
        );
        // Without the overhead the 300-token decode only pays the first step's read (~33 ms
        // over 3.96 s: 0.8%): it assists.
        m.assist_layer_overhead_s = 0.0;
        let p = m.decide_cold(&nearer);
        assert!(matches!(p.decision, ColdDecision::Assist { .. }), "{p:?}");
        assert!(p.tpot_rise <= MAX_TPOT_SLOWDOWN, "{p:?}");
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

    /// The CPU backend on the 2-core VM (benches/results/coldstart-disk-cpu.md, "Over HTTP"):
    /// preset small (8 layers of hidden 1024), a 7.3 MB rank-64 adapter on q, k, v, o read
    /// from the page cache in a few ms, a 25 GB/s emulated link, and assisted steps that
    /// take the backend's second core (the worker's): 1.8× the device time and 0.3 ms per
    /// layer of exchange. Assisting would hide a few ms and cost tens: copy, with or without
    /// others running. Behind the engine benchmark's slow link (0.053 GB/s, 137 ms a copy)
    /// the same costs are worth paying.
    #[test]
    fn a_cheap_load_copies_where_assist_slows_the_device() {
        let small_work = AssistWork {
            flops_per_row: 2.0 * 64.0 * 4.0 * 2048.0,
        };
        let m = PerfModel {
            num_layers: 8,
            layer_base_s: 0.4e-3,
            layer_per_token_s: 0.1e-3,
            cpu_flops: 10e9,
            cpu_overlaps: true,
            assist_layer_overhead_s: 0.3e-3,
            assist_device_factor: 1.8,
            link: LinkModel {
                gbps: 25.0,
                latency_us: 10.0,
            },
            disk_bytes_per_s: 7.3e6 / 4e-3,
            file_read_bytes_per_s: 2e9,
            host_encode_bytes_per_s: 4e9,
            assist_reads_disk: true,
            ..Default::default()
        };
        let c = ColdCase {
            tier: ColdTier::Disk,
            bytes: 7_300_000,
            backlog: 0,
            reads: DiskQueue::default(),
            work: small_work,
            prompt_left: 64,
            cap: 64,
            other_tokens: 0,
            running: 0,
            fewest_left: 0,
            max_new_tokens: 16,
        };
        let p = m.decide_cold(&c);
        assert_eq!(p.decision, ColdDecision::Wait, "{p:?}");
        let busy = ColdCase {
            other_tokens: 2,
            running: 2,
            fewest_left: 100,
            ..c
        };
        assert_eq!(m.decide_cold(&busy).decision, ColdDecision::Wait);
        let mut slow = m.clone();
        slow.link.gbps = 0.053;
        let p = slow.decide_cold(&c);
        assert!(matches!(p.decision, ColdDecision::Assist { .. }), "{p:?}");
    }

    fn tier(i: u8, landed: f64) -> ColdTier {
        match i {
            0 => ColdTier::Disk,
            1 => ColdTier::Host,
            _ => ColdTier::Streaming { landed },
        }
    }

    /// A value between `lo` and `hi`, uniform in its logarithm: every magnitude as likely.
    fn log(lo: f64, hi: f64) -> impl Strategy<Value = f64> {
        (lo.ln()..hi.ln()).prop_map(f64::exp)
    }

    prop_compose! {
        /// A performance model over measured costs of any magnitude.
        fn any_model()(
            gbps in log(0.001, 100.0),
            disk in log(1e7, 1e10),
            file in prop_oneof![Just(0.0), log(1e7, 1e10)],
            encode in prop_oneof![Just(0.0), log(1e7, 1e10)],
            cpu in log(1e9, 1e12),
            base in log(1e-5, 1e-2),
            per_token in log(1e-8, 1e-4),
            overhead in log(1e-6, 1e-3),
            factor in 1.0f64..3.0,
            reads_disk in any::<bool>(),
        ) -> PerfModel {
            PerfModel {
                num_layers: 16,
                layer_base_s: base,
                layer_per_token_s: per_token,
                cpu_flops: cpu,
                cpu_overlaps: true,
                assist_layer_overhead_s: overhead,
                assist_device_factor: factor,
                link: LinkModel { gbps, latency_us: 10.0 },
                disk_bytes_per_s: disk,
                file_read_bytes_per_s: file,
                host_encode_bytes_per_s: encode,
                assist_reads_disk: reads_disk,
                ..Default::default()
            }
        }
    }

    prop_compose! {
        /// A cold request of any size, alone in its step (`running` 0) or beside others.
        fn any_case()(
            rank in 1u64..256,
            prompt in log(1.0, 2048.0),
            other in 0usize..64,
            landed in 0.0f64..1.0,
            t in 0u8..3,
            out in 1usize..256,
            ahead in 0u64..8,
            readers in 1usize..8,
            left in log(1.0, 1e5),
        ) -> ColdCase {
            ColdCase {
                tier: tier(t, landed),
                bytes: bytes_7b(rank) / 4,
                backlog: 0,
                reads: DiskQueue { ahead_bytes: ahead * bytes_7b(rank) / 4, readers },
                work: work_7b(rank as f64),
                prompt_left: prompt as usize,
                cap: 512,
                other_tokens: other,
                running: other,
                fewest_left: left as usize,
                max_new_tokens: out,
            }
        }
    }

    /// The properties below are not vacuous: over their own inputs `auto` assists beside
    /// running requests in a fair share of cases (and waits in others).
    #[test]
    fn the_properties_see_assists_beside_running_requests() {
        use proptest::strategy::ValueTree;
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let (mut assists, mut waits, n) = (0, 0, 2000);
        for _ in 0..n {
            let m = any_model().new_tree(&mut runner).unwrap().current();
            let c = any_case().new_tree(&mut runner).unwrap().current();
            if c.running > 0 {
                match m.decide_cold(&c).decision {
                    ColdDecision::Assist { .. } => assists += 1,
                    ColdDecision::Wait => waits += 1,
                }
            }
        }
        assert!(
            assists >= 20 && waits >= 20,
            "{assists} assists, {waits} waits of {n}"
        );
    }

    proptest! {
        /// An assist is never predicted slower than waiting, nor to cost the running requests
        /// more than it saves, nor to raise their time per token over the tokens they have
        /// left past [`MAX_TPOT_SLOWDOWN`](crate::coldstart::MAX_TPOT_SLOWDOWN); its chunk
        /// fits the prompt and the cap. A predicted TTFT no shorter than the wait's is never
        /// an assist.
        #[test]
        fn an_assist_pays_for_itself(m in any_model(), c in any_case()) {
            let p = m.decide_cold(&c);
            if let ColdDecision::Assist { max_chunk } = p.decision {
                prop_assert!(max_chunk >= 1 && max_chunk <= c.prompt_left.min(512));
                let assist = p.assist_s.unwrap();
                prop_assert!(assist < p.wait_s);
                prop_assert!(p.wait_s - assist > p.others_s);
                prop_assert!(p.tpot_rise <= crate::coldstart::MAX_TPOT_SLOWDOWN, "{:?}", p);
                if c.running == 0 {
                    prop_assert_eq!(p.tpot_rise, 0.0);
                }
            }
            if p.assist_s.is_some_and(|a| a >= p.wait_s) {
                prop_assert_eq!(p.decision, ColdDecision::Wait);
            }
        }

        /// The amortized bound, checked against the stretch it is computed from: the plan's
        /// chunk, replayed through the model, spreads over the fewest tokens left no more than
        /// [`MAX_TPOT_SLOWDOWN`](crate::coldstart::MAX_TPOT_SLOWDOWN) of their time: the
        /// extra seconds of the first `fewest_left` assisted steps alone (a lower bound of
        /// what the plan predicts) stay within the budget of those tokens.
        #[test]
        fn an_admitted_assist_keeps_the_running_tpot_within_the_budget(
            m in any_model(),
            c in any_case(),
        ) {
            let p = m.decide_cold(&c);
            if let (ColdDecision::Assist { max_chunk }, true) = (p.decision, c.running > 0) {
                // Its first step alone: the longest of the prefill's (it carries the read).
                let layers = m.num_layers as f64;
                let rows = max_chunk.min(c.prompt_left);
                let dev = m.layer_time(c.other_tokens + rows);
                let read = m.assist_read_time(&c) / layers;
                let first = (m.assisted_layer_time(dev, m.cpu_work_time(c.work, rows) + read)
                    - dev) * layers;
                let tpot = m.step_time(c.other_tokens.max(1)) + m.step_overhead_s;
                let left = c.fewest_left.max(1) as f64;
                prop_assert!(
                    first / (left * tpot) <= crate::coldstart::MAX_TPOT_SLOWDOWN * (1.0 + 1e-9),
                    "{:?}: first step {} s over {} tokens of {} s", p, first, left, tpot
                );
            }
        }

        /// A larger assist overhead never makes `auto` assist where it waited: every step it
        /// stretches is stretched more, and the TTFT it saves is smaller.
        #[test]
        fn more_assist_overhead_never_starts_an_assist(
            m in any_model(),
            c in any_case(),
            more in 0.0f64..1e-3,
        ) {
            if m.decide_cold(&c).decision == ColdDecision::Wait {
                let mut costly = m.clone();
                costly.assist_layer_overhead_s += more;
                prop_assert_eq!(costly.decide_cold(&c).decision, ColdDecision::Wait);
            }
        }

        /// The acceptance's host tier on an H100 (55 GB/s): with an assist overhead of at least
        /// the prior (100 µs a layer, 3.2 ms a step of 32 layers) an adapter of up to 134 MB
        /// (rank ≤ 64 on q, k, v, o of a 7B model) copies in less than one assisted step's
        /// overhead, so `auto` copies, whatever the CPU, the device's step, the prompt and
        /// the running requests.
        #[test]
        fn the_h100_host_tier_always_copies(
            m in any_model(),
            c in any_case(),
            rank in 1u64..=64,
            overhead in 100e-6f64..1e-3,
            landed in 0.0f64..1.0,
            streaming in any::<bool>(),
        ) {
            let m = PerfModel {
                num_layers: LAYERS,
                link: LinkModel { gbps: 55.0, latency_us: 10.0 },
                assist_layer_overhead_s: overhead,
                ..m
            };
            let c = ColdCase {
                tier: if streaming { ColdTier::Streaming { landed } } else { ColdTier::Host },
                bytes: bytes_7b(rank),
                work: work_7b(rank as f64),
                ..c
            };
            let p = m.decide_cold(&c);
            prop_assert_eq!(p.decision, ColdDecision::Wait, "{:?}", p);
        }

        /// Cheap load ⇒ copy: a load that finishes before an assisted prefill has paid its
        /// own overhead is waited for.
        #[test]
        fn a_cheap_load_is_waited_for(m in any_model(), c in any_case()) {
            if m.landed_in(&c) <= m.assist_layer_overhead_s * m.num_layers as f64 {
                prop_assert_eq!(m.decide_cold(&c).decision, ColdDecision::Wait);
            }
        }

        /// Slow disk read with workers that read the file ⇒ assist: a request alone in its
        /// step assists once the loader's read is long enough, whatever else the model says.
        #[test]
        fn a_slow_disk_read_is_assisted(m in any_model(), c in any_case()) {
            let mut m = m;
            m.assist_reads_disk = true;
            m.file_read_bytes_per_s = m.file_read_bytes_per_s.max(1e8);
            let c = ColdCase { tier: ColdTier::Disk, other_tokens: 0, running: 0, ..c };
            // A read of 10⁵ s: longer than any assisted prefill these models predict.
            m.disk_bytes_per_s = c.bytes as f64 / 1e5;
            let p = m.decide_cold(&c);
            prop_assert!(matches!(p.decision, ColdDecision::Assist { .. }), "{:?}", p);
        }

        /// The copy path's predicted wait is monotone: a slower disk read never shortens it, a
        /// faster link never lengthens it, and an adapter further from the device (disk
        /// before host before streaming) never waits less. (The decision itself need not
        /// follow: landing layer by layer, the copy path hides a slower read behind the
        /// forward where the assist path, whose workers read the same file in its first
        /// step, may not; and a faster link shortens the assisted decode until the adapter
        /// lands by every layer's copy, the copy path's wait by as little as one layer's.)
        #[test]
        fn the_predicted_wait_is_monotone_in_read_time_link_and_tier(
            m in any_model(),
            c in any_case(),
            slower in 1.0f64..100.0,
            faster in 1.0f64..100.0,
        ) {
            let p = m.decide_cold(&c);
            let eps = 1e-12 * p.wait_s.max(1.0);
            let mut slow = m.clone();
            slow.disk_bytes_per_s /= slower;
            prop_assert!(slow.decide_cold(&c).wait_s >= p.wait_s - eps);
            let mut fast = m.clone();
            fast.link.gbps *= faster;
            prop_assert!(fast.decide_cold(&c).wait_s <= p.wait_s + eps);
            let disk = m.decide_cold(&ColdCase { tier: ColdTier::Disk, ..c });
            let host = m.decide_cold(&ColdCase { tier: ColdTier::Host, ..c });
            prop_assert!(disk.wait_s >= host.wait_s - eps);
            if matches!(c.tier, ColdTier::Streaming { .. }) {
                prop_assert!(host.wait_s >= p.wait_s - eps);
            }
        }

        /// For a request alone in its step whose adapter is in host memory: a faster link
        /// never makes its copy path slower than it was, so a wait stays a wait as long as
        /// the assisted decode it would pay until the adapter lands is not what decided.
        #[test]
        fn a_faster_link_never_starts_an_assist_from_host_memory_alone(
            m in any_model(),
            c in any_case(),
            faster in 1.0f64..100.0,
        ) {
            let c = ColdCase { tier: ColdTier::Host, other_tokens: 0, running: 0, max_new_tokens: 1, ..c };
            if m.decide_cold(&c).decision == ColdDecision::Wait {
                let mut fast = m.clone();
                fast.link.gbps *= faster;
                prop_assert_eq!(fast.decide_cold(&c).decision, ColdDecision::Wait);
            }
        }

        /// The loader's queue: more reads ahead of a disk-tier adapter's own, or fewer loader
        /// threads to share them, never make `auto` less willing to assist (the copy path waits
        /// longer; served from its mapped file, the assist path does not wait for the queue),
        /// and never shorten the predicted wait. With workers that read the file the assist
        /// prediction does not move at all.
        #[test]
        fn more_queued_reads_never_make_auto_less_willing_to_assist(
            m in any_model(),
            c in any_case(),
            more in 1u64..20,
            fewer in 0usize..8,
        ) {
            let c = ColdCase { tier: ColdTier::Disk, ..c };
            let busier = ColdCase {
                reads: DiskQueue {
                    ahead_bytes: c.reads.ahead_bytes + more * c.bytes,
                    readers: c.reads.readers.saturating_sub(fewer).max(1),
                },
                ..c
            };
            let (p, q) = (m.decide_cold(&c), m.decide_cold(&busier));
            prop_assert!(q.wait_s >= p.wait_s, "{:?} -> {:?}", p, q);
            if m.assist_reads_disk {
                prop_assert_eq!(q.assist_s, p.assist_s);
                prop_assert_eq!(q.others_s, p.others_s);
            }
            if matches!(p.decision, ColdDecision::Assist { .. }) && m.assist_reads_disk {
                prop_assert_eq!(q.decision, p.decision);
            }
        }

        /// The queue's share: its reads split over the loader threads, so `n` threads reading
        /// `n` adapters ahead wait as long as one thread reading one (and an empty queue adds
        /// nothing).
        #[test]
        fn reads_ahead_are_shared_by_the_loader_threads(
            m in any_model(),
            bytes in 1u64..1_000_000_000,
            n in 1usize..16,
        ) {
            let alone = m.queued_host_ready_time(bytes, DiskQueue::default());
            prop_assert!((alone - m.host_ready_time(bytes)).abs() <= 1e-12 * alone.max(1.0));
            let one = m.queued_host_ready_time(bytes, DiskQueue { ahead_bytes: bytes, readers: 1 });
            let many = m.queued_host_ready_time(
                bytes,
                DiskQueue { ahead_bytes: bytes * n as u64, readers: n },
            );
            prop_assert!((one - many).abs() <= 1e-9 * one, "{} vs {}", one, many);
            prop_assert!((one - 2.0 * alone).abs() <= 1e-9 * one);
        }

        /// More running requests never turn a wait into an assist: they only add to its cost,
        /// and one nearer its end (fewer tokens left to spread a stretch over) only tightens
        /// the bound on their time per token.
        #[test]
        fn more_running_requests_never_start_an_assist(
            m in any_model(),
            c in any_case(),
            more in 1usize..64,
            newcomer_left in 0usize..20_000,
        ) {
            if m.decide_cold(&c).decision == ColdDecision::Wait {
                let busier = ColdCase { running: c.running + more, ..c };
                prop_assert_eq!(m.decide_cold(&busier).decision, ColdDecision::Wait);
                let nearer = ColdCase {
                    fewest_left: if c.running == 0 {
                        newcomer_left
                    } else {
                        c.fewest_left.min(newcomer_left)
                    },
                    ..busier
                };
                prop_assert_eq!(m.decide_cold(&nearer).decision, ColdDecision::Wait);
            }
        }
    }
}
