//! One simulated instance's costs, all from a [`CostSnapshot`] that `thaw serve
//! --dump-cost-model` wrote: the engine's own [`PerfModel`] rebuilt from its snapshot (device
//! step time from prefill rows, decode rows and the ranks in the batch, plus the engine
//! loop's measured overhead per step; adapter load time per
//! tier, disk → host → device; CPU-assist throughput); the `auto` cold-start decision is the
//! engine's own function, asked with the same numbers.
use thaw_server::coldstart::{AssistWork, ColdDecision, CostSnapshot};
use thaw_server::perf::{PerfModel, StepShape, Tier};

/// The perf model's rank of an adapter rank (0: the base model, no adapter).
pub fn rank_of(rank: u32) -> Option<usize> {
    (rank > 0).then_some(rank as usize)
}

/// Costs of one instance, in seconds.
#[derive(Clone, Debug)]
pub struct InstanceModel {
    pub snap: CostSnapshot,
    /// The engine's performance model, as the snapshot describes it.
    pub perf: PerfModel,
    bytes_per_rank: f64,
    /// LoRA weights (A and B elements) per unit of rank in one layer.
    elems_per_rank_layer: f64,
}

impl InstanceModel {
    pub fn new(snap: CostSnapshot) -> anyhow::Result<Self> {
        let (Some(bytes_per_rank), true) = (
            snap.adapters.bytes_per_rank,
            snap.adapters.disk_rate_measured,
        ) else {
            anyhow::bail!(
                "the cost model has no adapter loads to learn load times from; dump it from a \
                 `thaw serve` that loaded adapters (--lora-dir / --lora-modules)"
            );
        };
        let f = &snap.perf;
        anyhow::ensure!(
            f.num_layers > 0
                && f.layer_per_token_s > 0.0
                && f.cpu_flops > 0.0
                && f.link_gbps > 0.0
                && f.disk_bytes_per_s > 0.0,
            "the cost model has a zero rate (layers {}, per-token {} s, CPU {} FLOP/s, link {} GB/s, \
             disk {} B/s); dump it again after the server has run some requests",
            f.num_layers,
            f.layer_per_token_s,
            f.cpu_flops,
            f.link_gbps,
            f.disk_bytes_per_s
        );
        let l = &snap.limits;
        anyhow::ensure!(
            l.max_loras > 0 && l.max_num_seqs > 0 && l.max_num_batched_tokens > 0,
            "the cost model's server limits are zero: {l:?}"
        );
        // Host copies are f32: 4 bytes per element.
        let elems_per_rank_layer = bytes_per_rank / 4.0 / f.num_layers as f64;
        Ok(Self {
            perf: PerfModel::from_snapshot(&snap.perf),
            snap,
            bytes_per_rank,
            elems_per_rank_layer,
        })
    }

    pub fn layers(&self) -> f64 {
        self.perf.num_layers as f64
    }

    /// Device time of one layer of a step of `shape`, under the kernel the engine would pick.
    pub fn layer_time(&self, shape: &StepShape) -> f64 {
        self.perf
            .layer_time_shape(shape, self.perf.choose_kernel(shape))
    }

    /// Wall time the engine thread spends per step beyond the device time (the mean gap
    /// between back-to-back steps the engine loop measured; 0 in dumps older than it).
    pub fn step_overhead(&self) -> f64 {
        self.perf.step_overhead_s
    }

    /// Wall time of a step of `shape`: its device time and the loop's overhead.
    pub fn step_time(&self, shape: &StepShape) -> f64 {
        self.perf.predict(shape) + self.step_overhead()
    }

    /// Wall time of a step of `tokens` rows without adapters.
    pub fn base_step_time(&self, tokens: usize) -> f64 {
        self.perf.step_time(tokens) + self.step_overhead()
    }

    /// What `rows` rows of one sequence (decode rows if `decode`) of a rank-`rank` adapter add
    /// to a step's device time (the model is linear in the rows).
    pub fn added_time(&self, rows: usize, decode: bool, rank: u32) -> f64 {
        let mut shape = StepShape::default();
        shape.add(rows, decode, rank_of(rank));
        self.step_time(&shape) - self.step_time(&StepShape::default())
    }

    /// The CPU work of assisting a rank-`rank` adapter: its A and B elements in one layer,
    /// two FLOPs each per row (what [`AssistWork::of`] counts on a real adapter).
    pub fn assist_work(&self, rank: u32) -> AssistWork {
        AssistWork {
            flops_per_row: 2.0 * rank as f64 * self.elems_per_rank_layer,
        }
    }

    /// CPU time of one layer's LoRA deltas for `rows` rows of a rank-`rank` adapter.
    pub fn cpu_layer_time(&self, rows: usize, rank: u32) -> f64 {
        self.perf.cpu_work_time(self.assist_work(rank), rows)
    }

    /// A layer's time with CPU assist alongside the device's `dev` seconds.
    pub fn assisted_layer(&self, dev: f64, cpu: f64) -> f64 {
        self.perf.assisted_layer_time(dev, cpu)
    }

    pub fn adapter_bytes(&self, rank: u32) -> f64 {
        self.bytes_per_rank * rank as f64
    }

    /// Host → device: the link transfer of every layer.
    pub fn link_time(&self, rank: u32) -> f64 {
        self.perf
            .load_time_from(Tier::Host, self.adapter_bytes(rank) as u64, 0)
    }

    /// Disk → host: reading and validating the adapter.
    pub fn disk_time(&self, rank: u32) -> f64 {
        let bytes = self.adapter_bytes(rank) as u64;
        self.perf.load_time_from(Tier::Disk, bytes, 0)
            - self.perf.load_time_from(Tier::Host, bytes, 0)
    }

    /// The `auto` policy for a prefill of `prompt_left` tokens of a rank-`rank` adapter whose
    /// load finishes in `load_left` seconds, next to `other_tokens` rows of running requests
    /// the nearest its end of which has `fewest_left` output tokens left: Some(chunk) to
    /// start now with CPU assist, None to wait. The engine's own rule
    /// ([`PerfModel::decide_work`]), asked as the engine's gate asks it: the whole remaining
    /// prompt as the cap.
    pub fn decide(
        &self,
        prompt_left: usize,
        (other_tokens, fewest_left): (usize, usize),
        rank: u32,
        load_left: f64,
    ) -> Option<usize> {
        match self.perf.decide_work(
            self.assist_work(rank),
            prompt_left,
            prompt_left,
            other_tokens,
            fewest_left,
            load_left,
        ) {
            ColdDecision::Wait => None,
            ColdDecision::Assist { max_chunk } => Some(max_chunk),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use thaw_server::coldstart::{AdapterCosts, ServerLimits, SNAPSHOT_FORMAT};

    /// A snapshot as `thaw serve` writes it; the tests' numbers are arbitrary but positive.
    pub fn snapshot() -> CostSnapshot {
        let perf = PerfModel {
            num_layers: 4,
            layer_base_s: 2e-4,
            layer_per_token_s: 1e-5,
            lora_sgmv_s: 1e-8,
            lora_bgmv_s: 1e-8,
            cpu_flops: 2e9,
            cpu_overlaps: true,
            assist_layer_overhead_s: 3e-5,
            link: thaw_runtime::residency::LinkModel {
                gbps: 10.0,
                latency_us: 10.0,
            },
            disk_bytes_per_s: 1e9,
            step_overhead_s: 5e-5,
            ..Default::default()
        };
        CostSnapshot {
            format: SNAPSHOT_FORMAT,
            written_unix_s: 0.0,
            steps_observed: 100,
            perf: perf.snapshot(),
            adapters: AdapterCosts {
                bytes_per_rank: Some(4.0 * 4.0 * 2048.0),
                disk_rate_measured: true,
            },
            limits: ServerLimits {
                max_loras: 4,
                max_cpu_loras: 16,
                max_num_seqs: 16,
                max_num_batched_tokens: 256,
                block_size: 16,
                kv_total_blocks: 4096,
            },
        }
    }

    #[test]
    fn times_follow_the_snapshot() {
        let m = InstanceModel::new(snapshot()).unwrap();
        assert!((m.base_step_time(10) - 4.0 * (2e-4 + 1e-4) - 5e-5).abs() < 1e-12);
        // The rank term the perf model fitted: 10 rows of rank 8 add 80 · 1e-8 s per layer.
        let mut shape = StepShape::default();
        shape.add(10, false, Some(8));
        assert!((m.step_time(&shape) - 4.0 * (2e-4 + 1e-4 + 8e-7) - 5e-5).abs() < 1e-12);
        assert!((m.added_time(10, false, 8) - 4.0 * (1e-4 + 8e-7)).abs() < 1e-12);
        // The link as the engine's model times it.
        assert_eq!(m.link_time(8), m.perf.load_time(8 * 32768, 0));
        assert!(m.link_time(16) > m.link_time(8));
        assert!(m.disk_time(16) > m.disk_time(8));
        // Idle device: assisting beats waiting for a slow load.
        assert!(m.decide(64, (0, 0), 8, 1.0).is_some());
        // A load that is about to land: wait.
        assert_eq!(m.decide(64, (0, 0), 8, 0.0), None);
        // Next to a decode at its last token, a stretch of its one step is more than the
        // budget of its time per token: wait.
        assert_eq!(m.decide(64, (1, 1), 8, 1.0), None);
    }

    #[test]
    fn a_snapshot_without_adapter_loads_is_refused() {
        let mut s = snapshot();
        s.adapters.disk_rate_measured = false;
        let e = InstanceModel::new(s).unwrap_err().to_string();
        assert!(e.contains("--lora-dir"), "{e}");
    }
}
