//! The cold-start cost model (DESIGN §4): device time per layer for a step's token count,
//! CPU LoRA throughput, link bandwidth and backlog — measured at start-up, refreshed online —
//! and the decision it drives for a cold request: wait for the load, or assist with a prefill
//! chunk sized so the CPU work per layer fits under the device's time per layer.
use std::time::Duration;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::residency::LinkModel;

/// Largest predicted slowdown of co-batched decode that CPU assist may cause.
pub const MAX_DECODE_SLOWDOWN: f64 = 0.05;

/// Measured inputs of the model. Times in seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Device (engine) time of one layer: `base + per_token · tokens`.
    pub layer_base_s: f64,
    pub layer_per_token_s: f64,
    pub num_layers: usize,
    /// CPU LoRA throughput over all workers, FLOP/s.
    pub cpu_flops: f64,
    /// Whether the CPU work overlaps the device's (worker processes) or runs on the engine
    /// thread itself (no workers: it adds to the step).
    pub cpu_overlaps: bool,
    pub link: LinkModel,
    /// Fixed cost CPU assist adds per layer of a step (exports, doorbells, waits, merges),
    /// learned from assisted steps.
    pub assist_layer_overhead_s: f64,
    /// EWMA weight of each new observation.
    pub alpha: f64,
    /// Recent steps, `(tokens, device seconds per layer)`, that the device-time line is
    /// refitted to by least squares.
    pub recent: StepWindow,
}

/// The last [`StepWindow::CAPACITY`] observed steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepWindow(std::collections::VecDeque<(f64, f64)>);

impl StepWindow {
    /// Steps kept: a few seconds of serving.
    pub const CAPACITY: usize = 512;
    /// Fewest steps, and smallest spread of their token counts, a refit needs.
    const MIN_STEPS: usize = 16;
    const MIN_TOKEN_SPREAD: f64 = 16.0;

    fn push(&mut self, tokens: usize, per_layer_s: f64) {
        if self.0.len() == Self::CAPACITY {
            self.0.pop_front();
        }
        self.0.push_back((tokens as f64, per_layer_s));
    }

    /// Least-squares `(base, per_token)` over the window, when its token counts spread
    /// enough to tell a slope from noise.
    fn fit(&self) -> Option<(f64, f64)> {
        let n = self.0.len();
        if n < Self::MIN_STEPS {
            return None;
        }
        let (lo, hi) = self
            .0
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &(x, _)| {
                (lo.min(x), hi.max(x))
            });
        if hi - lo < Self::MIN_TOKEN_SPREAD {
            return None;
        }
        let nf = n as f64;
        let mx = self.0.iter().map(|p| p.0).sum::<f64>() / nf;
        let my = self.0.iter().map(|p| p.1).sum::<f64>() / nf;
        let sxx: f64 = self.0.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        let sxy: f64 = self.0.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let slope = (sxy / sxx).max(1e-9);
        Some(((my - slope * mx).max(0.0), slope))
    }
}

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

impl CostModel {
    /// Device time of one layer for a step of `tokens` rows.
    pub fn layer_time(&self, tokens: usize) -> f64 {
        self.layer_base_s + self.layer_per_token_s * tokens as f64
    }

    /// Device time of a whole step of `tokens` rows.
    pub fn step_time(&self, tokens: usize) -> f64 {
        self.layer_time(tokens) * self.num_layers as f64
    }

    /// CPU time of one layer's LoRA deltas for `rows` rows of `adapter`.
    pub fn cpu_layer_time(&self, adapter: &LoraAdapter, rows: usize) -> f64 {
        let layer = adapter
            .num_layers()
            .saturating_sub(1)
            .min(adapter.num_layers() / 2);
        let flops: f64 = thaw_runtime::adapter::LoraModule::ALL
            .iter()
            .filter_map(|&m| adapter.get(layer, m))
            .map(|w| {
                2.0 * rows as f64 * w.rank as f64 * ((w.a.len() + w.b.len()) / w.rank.max(1)) as f64
            })
            .sum();
        flops / self.cpu_flops.max(1.0)
    }

    /// Time until the last layer of an adapter of `bytes` lands behind `backlog` queued bytes.
    pub fn load_time(&self, bytes: u64, backlog: u64) -> f64 {
        self.link
            .transfer_time((bytes + backlog) as usize)
            .as_secs_f64()
            + self.link.latency_us * 1e-6 * self.num_layers.saturating_sub(1) as f64
    }

    /// Largest chunk whose CPU work per layer fits under the device's time per layer for a
    /// step that also carries `other_tokens` rows of other requests.
    pub fn max_assist_chunk(
        &self,
        adapter: &LoraAdapter,
        other_tokens: usize,
        cap: usize,
    ) -> usize {
        if cap == 0 {
            return 0;
        }
        let fits = |c: usize| {
            let cpu = self.cpu_layer_time(adapter, c);
            let dev = self.layer_time(other_tokens + c);
            // What co-batched requests see: the step's layer time with assist against
            // without it (their decode would run alongside this chunk either way).
            let with = if self.cpu_overlaps {
                dev.max(cpu)
            } else {
                dev + cpu
            } + self.assist_layer_overhead_s;
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
        adapter: &LoraAdapter,
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
            let cpu = self.cpu_layer_time(adapter, c);
            let per_layer = if self.cpu_overlaps {
                dev.max(cpu) + self.assist_layer_overhead_s
            } else {
                dev + cpu + self.assist_layer_overhead_s
            };
            t += per_layer * self.num_layers as f64;
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
    /// co-batched decode within [`MAX_DECODE_SLOWDOWN`]; otherwise wait.
    pub fn decide(
        &self,
        adapter: &LoraAdapter,
        prompt_left: usize,
        cap: usize,
        other_tokens: usize,
        load_left_s: f64,
    ) -> ColdDecision {
        let chunk = self.max_assist_chunk(adapter, other_tokens, cap.min(prompt_left));
        if chunk == 0 {
            return ColdDecision::Wait;
        }
        let assist = self.ttft_assist(adapter, prompt_left, chunk, other_tokens);
        let wait = self.ttft_wait(prompt_left, cap, other_tokens, load_left_s);
        if assist <= wait {
            ColdDecision::Assist { max_chunk: chunk }
        } else {
            ColdDecision::Wait
        }
    }

    /// Folds one CPU-assisted step into the model: `overhead` is what the engine thread
    /// spent on the assist path itself (exports, submits, waits for the workers, merges — as
    /// the engine measured it), the rest of `elapsed` was device work for `tokens` rows.
    pub fn observe_assisted_step(&mut self, tokens: usize, elapsed: Duration, overhead: Duration) {
        if self.num_layers == 0 {
            return;
        }
        let per_layer = overhead.as_secs_f64() / self.num_layers as f64;
        self.assist_layer_overhead_s += self.alpha * (per_layer - self.assist_layer_overhead_s);
        self.observe_step(tokens, elapsed.saturating_sub(overhead));
    }

    /// Folds one measured step (`tokens` rows of device work) into the device time model:
    /// a least-squares line over the recent steps once their sizes spread, an EWMA nudge
    /// of the start-up calibration before that.
    pub fn observe_step(&mut self, tokens: usize, elapsed: Duration) {
        if tokens == 0 || self.num_layers == 0 {
            return;
        }
        let per_layer = elapsed.as_secs_f64() / self.num_layers as f64;
        self.recent.push(tokens, per_layer);
        if let Some((base, per_token)) = self.recent.fit() {
            self.layer_base_s = base;
            self.layer_per_token_s = per_token;
            return;
        }
        let predicted = self.layer_time(tokens);
        // Attribute the error to the per-token slope for big steps, to the base for small.
        let err = per_layer - predicted;
        let w = (tokens as f64 / 64.0).min(1.0);
        self.layer_per_token_s =
            (self.layer_per_token_s + self.alpha * err * w / tokens as f64).max(1e-9);
        self.layer_base_s = (self.layer_base_s + self.alpha * err * (1.0 - w)).max(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(overlaps: bool) -> CostModel {
        CostModel {
            layer_base_s: 1e-4,
            layer_per_token_s: 1e-5,
            num_layers: 8,
            cpu_flops: 1e9,
            cpu_overlaps: overlaps,
            link: LinkModel {
                gbps: 0.05,
                latency_us: 10.0,
            },
            assist_layer_overhead_s: 0.0,
            alpha: 0.2,
            recent: StepWindow::default(),
        }
    }

    #[test]
    fn step_time_is_linear_in_tokens() {
        let m = model(true);
        assert!((m.layer_time(10) - 2e-4).abs() < 1e-12);
        assert!((m.step_time(10) - 1.6e-3).abs() < 1e-12);
    }

    #[test]
    fn assisted_steps_teach_the_overhead_and_the_device_time_apart() {
        let mut m = model(true);
        let device = 8.0 * (2e-4 + 2e-5 * 128.0);
        let overhead = 8.0 * 3e-4;
        for _ in 0..200 {
            m.observe_assisted_step(
                128,
                Duration::from_secs_f64(device + overhead),
                Duration::from_secs_f64(overhead),
            );
            m.observe_step(1, Duration::from_secs_f64(8.0 * (2e-4 + 2e-5)));
        }
        assert!((m.assist_layer_overhead_s - 3e-4).abs() < 3e-6, "{m:?}");
        let want = 2e-4 + 2e-5 * 128.0;
        let got = m.layer_time(128);
        assert!((got - want).abs() / want < 0.05, "{got} vs {want}");
    }

    #[test]
    fn many_small_steps_do_not_flatten_the_slope() {
        // Decode steps whose time also depends on context length (noise the line cannot
        // explain), with a prefill now and then: the fitted slope stays near the truth.
        let mut m = model(true);
        let truth = |t: usize| 2e-4 + 2e-5 * t as f64;
        for i in 0..600 {
            let (t, extra) = if i % 20 == 0 {
                (96 + i % 64, 0.0)
            } else {
                (1 + i % 6, 6e-4 * ((i % 7) as f64 / 7.0))
            };
            m.observe_step(t, Duration::from_secs_f64(8.0 * (truth(t) + extra)));
        }
        let rel = (m.layer_per_token_s - 2e-5).abs() / 2e-5;
        assert!(rel < 0.2, "slope {} vs 2e-5", m.layer_per_token_s);
        let want = truth(128);
        assert!((m.layer_time(128) - want).abs() / want < 0.2);
    }

    #[test]
    fn observing_steps_converges_to_the_measured_rate() {
        let mut m = model(true);
        for _ in 0..200 {
            m.observe_step(128, Duration::from_secs_f64(8.0 * (2e-4 + 2e-5 * 128.0)));
            m.observe_step(1, Duration::from_secs_f64(8.0 * (2e-4 + 2e-5)));
        }
        let big = m.layer_time(128);
        let want = 2e-4 + 2e-5 * 128.0;
        assert!((big - want).abs() / want < 0.05, "{big} vs {want}");
    }
}
