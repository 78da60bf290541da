//! The cold-start decision (DESIGN §4) on the one performance model ([`PerfModel`]): CPU
//! LoRA time, and for a cold request whether to wait for the load or assist with a prefill
//! chunk, weighed by the TTFT it saves against what it costs the running requests' time per
//! token over the tokens they have left ([`super::amortize`]).
use thaw_runtime::adapter::LoraAdapter;

use super::amortize::{Stretch, MAX_TPOT_SLOWDOWN};
use crate::perf::PerfModel;

/// The cold-start planner's name for the one performance model.
pub type CostModel = PerfModel;

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

    /// A layer's time with CPU assist next to `dev` seconds of device work (without assist)
    /// and `cpu` seconds of CPU work: the device's work as assist stretches it
    /// ([`PerfModel::assist_device_factor`]), overlapped with the CPU's or not, plus the
    /// assist path's own overhead.
    pub fn assisted_layer_time(&self, dev: f64, cpu: f64) -> f64 {
        let dev = dev * self.assist_device_factor.max(1.0);
        let t = if self.cpu_overlaps {
            dev.max(cpu)
        } else {
            dev + cpu
        };
        t + self.assist_layer_overhead_s
    }

    /// The prefill chunks `auto` weighs for a request (at most `cap`, at least 1): the cap
    /// and its halvings, and the largest chunk whose CPU work per layer the device's work
    /// hides (DESIGN §4's sizing) next to `other_tokens` rows. None of them depends on the
    /// running requests or the assist's overhead, so neither can widen the choice.
    fn assist_chunks(&self, w: AssistWork, other_tokens: usize, cap: usize) -> Vec<usize> {
        let mut chunks = Vec::new();
        let mut c = cap;
        while c > 0 {
            chunks.push(c);
            c /= 2;
        }
        // cpu(c) = k·c ≤ f·(base + a_tok·(other + c)) ⇔ c ≤ f·(base + a_tok·other)/(k − f·a_tok).
        let k = self.cpu_work_time(w, 1);
        let f = self.assist_device_factor.max(1.0);
        let slack = k - f * self.layer_per_token_s;
        if self.cpu_overlaps && slack > 0.0 {
            let hidden = f * self.layer_time(other_tokens) / slack;
            if hidden >= 1.0 && hidden < cap as f64 {
                chunks.push(hidden as usize);
            }
        }
        chunks
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
        self.assist_path(w, prompt, chunk, other_tokens, 0.0).0
    }

    /// The assisted prefill of `prompt` tokens in chunks of `chunk` next to `other_tokens`
    /// rows: its time, and how it stretches each of those steps over the same steps without
    /// assist (what every co-batched request waits longer). `read_s`: what the workers spend
    /// reading the adapter's bytes from its file on their first pass over the layers (a share
    /// per layer of the first step; 0 when they read it from memory).
    fn assist_path(
        &self,
        w: AssistWork,
        prompt: usize,
        chunk: usize,
        other_tokens: usize,
        read_s: f64,
    ) -> (f64, Stretch) {
        let layers = self.num_layers.max(1) as f64;
        let mut stretch = Stretch::default();
        if prompt == 0 {
            return (0.0, stretch);
        }
        let c = chunk.clamp(1, prompt);
        // One step of `rows` rows: its time and its extra time, both for the whole step.
        let step = |rows: usize, read: f64| {
            let dev = self.layer_time(other_tokens + rows);
            let layer = self.assisted_layer_time(dev, self.cpu_work_time(w, rows) + read);
            (layer * layers, (layer - dev).max(0.0) * layers)
        };
        // The first chunk (with the workers' read), the other full chunks, the remainder.
        let (full, rest) = (prompt / c, prompt % c);
        let first = step(c, read_s / layers);
        let mid = step(c, 0.0);
        let last = step(rest, 0.0);
        let mids = (full - 1) as f64;
        stretch.push(1.0, first.1);
        stretch.push(mids, mid.1);
        let mut t = first.0 + mids * mid.0;
        if rest > 0 {
            stretch.push(1.0, last.1);
            t += last.0;
        }
        (t, stretch)
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

    /// The `auto` rule for a request whose load finishes in `load_left_s` and whose CPU
    /// assist could start now, next to `other_tokens` rows of `other_tokens` running
    /// requests, the one nearest its end with `fewest_left` tokens left. The engine's gate
    /// (through [`Self::decide_cold`]) and `thaw-bench simulate` both decide with
    /// [`Self::decide_times`].
    pub fn decide_work(
        &self,
        w: AssistWork,
        prompt_left: usize,
        cap: usize,
        other_tokens: usize,
        fewest_left: usize,
        load_left_s: f64,
    ) -> ColdDecision {
        self.decide_times(&ColdTimes {
            work: w,
            prompt_left,
            cap,
            other_tokens,
            running: other_tokens,
            fewest_left,
            decode_left: usize::MAX,
            load_left_s,
            assist_load_left_s: load_left_s,
            assist_start_s: 0.0,
            assist_read_s: 0.0,
        })
        .decision
    }

    /// The `auto` policy, a pure function of `t` and the model. Waiting costs the request
    /// the load (`load_left_s`: the disk read and host encode when it is still on disk, the
    /// copy) before its prefill; assisting starts its prefill when the workers can
    /// (`assist_start_s`), each step stretched by what the assist costs on this device (its
    /// overhead, the CPU work the device does not hide, the device's slowdown, the workers'
    /// first read of the file), and its decode steps too while its adapter still loads.
    ///
    /// For each chunk it weighs (`assist_chunks`) two tests, both CaraServe's: the
    /// running requests' time per token over the tokens they have left rises by at most
    /// [`MAX_TPOT_SLOWDOWN`] ([`Stretch::worst_rise`]; the SLO), and the wait it hides (the
    /// predicted TTFT saved, less what its own decode loses while its adapter loads) exceeds
    /// what it costs them, every running request waiting for each stretched step (the cost
    /// score). Of the chunks that pass both it takes the one that saves the most net of that
    /// cost; with none it waits.
    pub fn decide_times(&self, t: &ColdTimes) -> ColdPlan {
        let wait = self.ttft_wait(t.prompt_left, t.cap, t.other_tokens, t.load_left_s);
        let mut plan = ColdPlan {
            decision: ColdDecision::Wait,
            wait_s: wait,
            assist_s: None,
            others_s: 0.0,
            tpot_rise: 0.0,
        };
        // What a running request's token takes now: the step it is in, without the cold
        // request, plus the loop's gap between steps.
        let tpot = self.step_time(t.other_tokens.max(1)) + self.step_overhead_s;
        // One assisted decode step of the cold request while its adapter still loads.
        let (dec_dev, dec_assisted) = {
            let dev = self.layer_time(t.other_tokens + 1);
            let layer = self.assisted_layer_time(dev, self.cpu_work_time(t.work, 1));
            let layers = self.num_layers.max(1) as f64;
            (dev * layers, layer * layers)
        };
        let mut best = f64::NEG_INFINITY;
        for chunk in self.assist_chunks(t.work, t.other_tokens, t.cap.min(t.prompt_left)) {
            let (path, mut stretch) = self.assist_path(
                t.work,
                t.prompt_left,
                chunk,
                t.other_tokens,
                t.assist_read_s.max(0.0),
            );
            let assist = t.assist_start_s.max(0.0) + path;
            // Its adapter may still be loading when its prompt is done: its decode steps are
            // assisted (and stretched, for it and for the running requests) until it lands.
            let decode_steps = ((t.assist_load_left_s - assist) / dec_assisted.max(1e-9))
                .max(0.0)
                .min(t.decode_left as f64);
            stretch.push(decode_steps, dec_assisted - dec_dev);
            let decode_extra = decode_steps * (dec_assisted - dec_dev).max(0.0);
            let rise = if t.running == 0 {
                0.0
            } else {
                stretch.worst_rise(t.fewest_left, tpot)
            };
            if rise > MAX_TPOT_SLOWDOWN {
                continue;
            }
            let others = t.running as f64 * stretch.total();
            let net = wait - assist - decode_extra - others;
            // Ties go to the larger chunk (weighed first).
            if net > best {
                best = net;
                plan = ColdPlan {
                    decision: if net > 0.0 {
                        ColdDecision::Assist { max_chunk: chunk }
                    } else {
                        ColdDecision::Wait
                    },
                    assist_s: Some(assist),
                    others_s: others,
                    tpot_rise: rise,
                    ..plan
                };
            }
        }
        plan
    }
}

/// What one `auto` decision weighs besides the model ([`PerfModel::decide_times`]).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ColdTimes {
    /// CPU work of assisting the adapter per prefill row and layer.
    pub work: AssistWork,
    /// Prompt tokens still to prefill.
    pub prompt_left: usize,
    /// Largest prefill chunk a step may give it.
    pub cap: usize,
    /// Rows of other requests in each step.
    pub other_tokens: usize,
    /// Requests already running: each waits for every step this one's prefill is in.
    pub running: usize,
    /// Output tokens left to the running request nearest its end: the one whose time per
    /// token a stretched step raises most ([`Stretch::worst_rise`]). Unused with none running.
    pub fewest_left: usize,
    /// Decode steps it may run after its first token (its assisted decode ends there).
    pub decode_left: usize,
    /// Seconds the copy path waits before its prefill starts: until every layer of the
    /// adapter lands ahead of the forward that reaches it ([`PerfModel::layer_wise_wait`];
    /// the simulator: until every layer is on the device).
    pub load_left_s: f64,
    /// The same when it is assisted: shorter where assisting changes how it loads (a
    /// disk-tier adapter served from its mapped file is copied from that file at once, not
    /// after the loader's queue of reads).
    pub assist_load_left_s: f64,
    /// Seconds until the CPU workers can start on it.
    pub assist_start_s: f64,
    /// Seconds the workers spend reading its bytes from its file on the first pass.
    pub assist_read_s: f64,
}

/// A cold-start decision with the predictions it was made from.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ColdPlan {
    pub decision: ColdDecision,
    /// Predicted TTFT if the request waits for its load.
    pub wait_s: f64,
    /// Predicted TTFT with CPU assist (None: no chunk keeps the running requests' time per
    /// token within [`MAX_TPOT_SLOWDOWN`]).
    pub assist_s: Option<f64>,
    /// Predicted seconds assisting adds to the running requests, summed over them.
    pub others_s: f64,
    /// Predicted rise of the worst-hit running request's time per token over the tokens it
    /// has left ([`Stretch::worst_rise`]); 0 with none running or no chunk weighed.
    pub tpot_rise: f64,
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
        /// chunk is within the prompt and the cap; for a request alone in its step, a longer
        /// wait for the load never turns an assist into a wait (beside running requests it
        /// may: each assisted decode step while the adapter still loads costs them too).
        #[test]
        fn assist_chunks_are_bounded_and_monotone_in_the_load(
            flops_per_row in 1e3f64..1e8,
            prompt in 1usize..3000,
            cap in 1usize..2048,
            other in 0usize..64,
            left in 0usize..4096,
            load in 0.0f64..2.0,
            extra in 0.0f64..2.0,
            overlaps in any::<bool>(),
            factor in 1.0f64..3.0,
        ) {
            let mut m = model(overlaps);
            m.assist_device_factor = factor;
            let w = AssistWork { flops_per_row };
            if let ColdDecision::Assist { max_chunk } = m.decide_work(w, prompt, cap, other, left, load) {
                prop_assert!(max_chunk >= 1 && max_chunk <= prompt.min(cap));
            }
            if let ColdDecision::Assist { max_chunk } = m.decide_work(w, prompt, cap, 0, left, load) {
                let later = m.decide_work(w, prompt, cap, 0, left, load + extra);
                prop_assert_eq!(later, ColdDecision::Assist { max_chunk });
            }
        }

        /// What assist adds to a step is never negative, and grows with the device's
        /// slowdown under assist.
        #[test]
        fn the_assist_stretch_grows_with_the_device_slowdown(
            dev in 1e-6f64..1e-1,
            cpu in 0.0f64..1e-1,
            factor in 1.0f64..4.0,
            more in 0.0f64..2.0,
            overlaps in any::<bool>(),
        ) {
            let mut m = model(overlaps);
            m.assist_device_factor = factor;
            let t = m.assisted_layer_time(dev, cpu);
            prop_assert!(t >= dev);
            m.assist_device_factor = factor + more;
            prop_assert!(m.assisted_layer_time(dev, cpu) >= t);
        }
    }
}
