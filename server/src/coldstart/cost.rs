//! The cold-start decision (DESIGN §4) on the one performance model ([`PerfModel`]): CPU
//! LoRA time, and for a cold request whether to wait for the load or assist with a prefill
//! chunk sized so the CPU work per layer fits under the device's time per layer.
use thaw_runtime::adapter::LoraAdapter;

use crate::perf::PerfModel;

/// The cold-start planner's name for the one performance model.
pub type CostModel = PerfModel;

/// Largest predicted slowdown of co-batched decode that CPU assist may cause.
pub const MAX_DECODE_SLOWDOWN: f64 = 0.05;

/// What the policy does with a cold request this step.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ColdDecision {
    /// Hold the request until its adapter is resident.
    Wait,
    /// Run a prefill chunk of at most this many tokens with CPU assist for unlanded layers.
    Assist { max_chunk: usize },
}

/// One prediction next to what happened, for reading the model's error.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    pub predicted_s: f64,
    pub actual_s: f64,
}

/// The CPU work of assisting one adapter: FLOPs per prefill row in one layer (its A and B
/// products over every projection it adapts). The engine takes it from the adapter's
/// weights ([`AssistWork::of`]); the simulator from the dumped bytes per rank.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct AssistWork {
    pub flops_per_row: f64,
}

impl AssistWork {
    /// The work of `adapter`, from its middle layer (layers of one adapter are alike).
    pub fn of(adapter: &LoraAdapter) -> Self {
        let layer = adapter
            .num_layers()
            .saturating_sub(1)
            .min(adapter.num_layers() / 2);
        let flops_per_row = thaw_runtime::adapter::LoraModule::ALL
            .iter()
            .filter_map(|&m| adapter.get(layer, m))
            .map(|w| 2.0 * w.rank as f64 * ((w.a.numel() + w.b.numel()) / w.rank.max(1)) as f64)
            .sum();
        Self { flops_per_row }
    }
}

impl PerfModel {
    /// CPU time of one layer's LoRA deltas for `rows` rows of `adapter`.
    pub fn cpu_layer_time(&self, adapter: &LoraAdapter, rows: usize) -> f64 {
        self.cpu_work_time(AssistWork::of(adapter), rows)
    }

    /// CPU time of one layer's LoRA deltas for `rows` rows of work `w`.
    pub fn cpu_work_time(&self, w: AssistWork, rows: usize) -> f64 {
        rows as f64 * w.flops_per_row / self.cpu_flops.max(1.0)
    }

    /// A layer's time with CPU assist next to `dev` seconds of device work and `cpu` seconds
    /// of CPU work: overlapped or not, plus the assist path's own overhead.
    pub fn assisted_layer_time(&self, dev: f64, cpu: f64) -> f64 {
        let t = if self.cpu_overlaps {
            dev.max(cpu)
        } else {
            dev + cpu
        };
        t + self.assist_layer_overhead_s
    }

    /// Largest chunk whose CPU work per layer fits under the device's time per layer for a
    /// step that also carries `other_tokens` rows of other requests.
    pub fn max_assist_chunk(&self, w: AssistWork, other_tokens: usize, cap: usize) -> usize {
        if cap == 0 {
            return 0;
        }
        let fits = |c: usize| {
            let dev = self.layer_time(other_tokens + c);
            // What co-batched requests see: the step's layer time with assist against
            // without it (their decode would run alongside this chunk either way).
            let with = self.assisted_layer_time(dev, self.cpu_work_time(w, c));
            other_tokens == 0 || with <= dev * (1.0 + MAX_DECODE_SLOWDOWN)
        };
        if fits(cap) {
            return cap;
        }
        // Bisection over the chunk size: cpu time grows linearly in c, device time too.
        let (mut lo, mut hi) = (0usize, cap);
        while lo + 1 < hi {
            let mid = (lo + hi) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Predicted TTFT of a cold request that waits for its load, then prefills in chunks of
    /// `cap` next to `other_tokens` rows per step.
    pub fn ttft_wait(&self, prompt: usize, cap: usize, other_tokens: usize, load_s: f64) -> f64 {
        load_s + self.prefill_time(prompt, cap.max(1), other_tokens)
    }

    /// Predicted TTFT when it starts now with CPU assist in chunks of `chunk`.
    pub fn ttft_assist(
        &self,
        w: AssistWork,
        prompt: usize,
        chunk: usize,
        other_tokens: usize,
    ) -> f64 {
        let steps = prompt.div_ceil(chunk.max(1));
        let mut t = 0.0;
        let mut left = prompt;
        for _ in 0..steps {
            let c = left.min(chunk);
            let dev = self.layer_time(other_tokens + c);
            t += self.assisted_layer_time(dev, self.cpu_work_time(w, c)) * self.num_layers as f64;
            left -= c;
        }
        t
    }

    fn prefill_time(&self, prompt: usize, cap: usize, other_tokens: usize) -> f64 {
        let mut t = 0.0;
        let mut left = prompt;
        while left > 0 {
            let c = left.min(cap);
            t += self.step_time(other_tokens + c);
            left -= c;
        }
        t
    }

    /// The `auto` policy: assist when its predicted TTFT beats waiting and its chunk keeps
    /// co-batched decode within [`MAX_DECODE_SLOWDOWN`]; otherwise wait. The engine's gate
    /// (through [`Self::decide_cold`]) and `thaw-bench simulate` both decide with this rule.
    pub fn decide_work(
        &self,
        w: AssistWork,
        prompt_left: usize,
        cap: usize,
        other_tokens: usize,
        load_left_s: f64,
    ) -> ColdDecision {
        self.decide_times(w, prompt_left, cap, other_tokens, load_left_s, 0.0)
            .decision
    }

    /// [`Self::decide_work`] when the CPU can start only `assist_start_s` from now (the bytes
    /// it computes from are not in memory yet), with both predicted TTFTs.
    pub fn decide_times(
        &self,
        w: AssistWork,
        prompt_left: usize,
        cap: usize,
        other_tokens: usize,
        load_left_s: f64,
        assist_start_s: f64,
    ) -> ColdPlan {
        let wait = self.ttft_wait(prompt_left, cap, other_tokens, load_left_s);
        let chunk = self.max_assist_chunk(w, other_tokens, cap.min(prompt_left));
        if chunk == 0 {
            return ColdPlan {
                decision: ColdDecision::Wait,
                wait_s: wait,
                assist_s: None,
            };
        }
        let assist = assist_start_s + self.ttft_assist(w, prompt_left, chunk, other_tokens);
        ColdPlan {
            decision: if assist <= wait {
                ColdDecision::Assist { max_chunk: chunk }
            } else {
                ColdDecision::Wait
            },
            wait_s: wait,
            assist_s: Some(assist),
        }
    }
}

/// A cold-start decision with the predictions it was made from.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ColdPlan {
    pub decision: ColdDecision,
    /// Predicted TTFT if the request waits for its load.
    pub wait_s: f64,
    /// Predicted TTFT with CPU assist (None: no chunk keeps co-batched decode in bounds).
    pub assist_s: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn model(overlaps: bool) -> PerfModel {
        PerfModel {
            num_layers: 8,
            layer_base_s: 2e-3,
            layer_per_token_s: 6e-4,
            cpu_flops: 2e10,
            cpu_overlaps: overlaps,
            assist_layer_overhead_s: 1e-5,
            ..Default::default()
        }
    }

    proptest! {
        /// The `auto` rule (one function for the engine and the simulator): an assisted
        /// chunk is within the prompt and the cap, and a longer wait for the load never turns
        /// an assist into a wait.
        #[test]
        fn assist_chunks_are_bounded_and_monotone_in_the_load(
            flops_per_row in 1e3f64..1e8,
            prompt in 1usize..3000,
            cap in 1usize..2048,
            other in 0usize..64,
            load in 0.0f64..2.0,
            extra in 0.0f64..2.0,
            overlaps in any::<bool>(),
        ) {
            let m = model(overlaps);
            let w = AssistWork { flops_per_row };
            if let ColdDecision::Assist { max_chunk } = m.decide_work(w, prompt, cap, other, load) {
                prop_assert!(max_chunk >= 1 && max_chunk <= prompt.min(cap));
                let later = m.decide_work(w, prompt, cap, other, load + extra);
                prop_assert_eq!(later, ColdDecision::Assist { max_chunk });
            }
        }
    }
}
