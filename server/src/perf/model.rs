//! The one performance model: device time of a step from its shape, CPU LoRA throughput,
//! adapter load time per tier — measured at start-up, refitted online — used by the
//! cold-start planner, the scheduler (TPOT cap, kernel choice, request sizes) and the
//! simulator (through [`super::PerfSnapshot`]).
//!
//! Device time of one layer for a step `S` (CaraServe §5, "Performance modeling"):
//!
//! ```text
//! t(S) = β + a_tok · tokens(S) + a_dec · decode_rows(S) + lora(S)
//!        + a_pre · prefills(S) + γ · after_idle(S)
//! lora(S) = α_M · Σ_{i∈S} rank(i)              SGMV (S-LoRA's MBGMV: "linear with the sum
//!                                                    of LoRA ranks in a batch")
//!         = α_B · |S| · max_{i∈S} rank(i)      BGMV ("almost linear to the product of batch
//!                                                    size and the maximum rank")
//! ```
//!
//! CaraServe writes `Perf_BGMV(S) = α_B·|S|·Max rank(i) + β_B` and
//! `Perf_MBGMV(S) = α_M·Sum rank(i) + β_M` for decode batches, one row per request; here a
//! row is a token, so a prefill chunk of `n` rows counts `n` times, and the base model's cost
//! per token (`a_tok`, and `a_dec` for what a decode row's attention over its context adds)
//! sits beside the LoRA term. All terms are per layer, fitted by least squares over every
//! step of the run ([`super::fit::StepStats`]).
//!
//! Two fixed costs per step sit beside them, found in the step logs of the simulator's
//! validation runs (benches/results/simulate.md): `prefills(S)`, the sequences the step
//! prefills (a chunk of their prompt), each costing `a_pre` beyond its rows; and
//! `after_idle(S)`, 1 for a step that starts when the engine has run no step for at least
//! [`PerfModel::after_idle_gap_s`] (or none yet), else 0. At low load nearly every prefill
//! follows idle, so the two are told apart only by prefills that join a running batch (where
//! there were some, the prefill term took most of the cost). Both are fitted like the other
//! slopes, and the simulator charges `γ` to a step planned on an instance idle as long.
//!
//! Beside the device time the engine thread spends time between steps (planning, sending
//! tokens, publishing metrics, and whatever other threads on its core take meanwhile):
//! [`PerfModel::step_overhead_s`] is its mean per step, measured by the engine loop, so a
//! simulated instance runs as many steps per second as the real one.
use std::time::Duration;

use thaw_runtime::backend::LoraKernel;
use thaw_runtime::residency::LinkModel;

use super::fit::{ErrorStat, Sample, StepStats, COLS};

/// What a step computes, as far as its time goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Rows of the step: prefill tokens plus decode tokens.
    pub tokens: usize,
    /// Rows that decode (one token of a sequence past its prompt).
    pub decode: usize,
    /// Rows that carry an adapter.
    pub lora_rows: usize,
    /// Σ over rows of their adapter's rank (SGMV's work).
    pub rank_rows: usize,
    /// Largest rank in the step (BGMV pads every LoRA row to it).
    pub max_rank: usize,
    /// Sequences the step prefills (rows of a prompt, not decode rows).
    pub prefills: usize,
    /// The step starts on an engine that ran no step for at least
    /// [`PerfModel::after_idle_gap_s`] ([`PerfModel::is_after_idle`]).
    pub after_idle: bool,
}

impl StepShape {
    /// Adds `rows` rows of one sequence: decode rows if `decode`, with an adapter of `rank`.
    pub fn add(&mut self, rows: usize, decode: bool, rank: Option<usize>) {
        self.tokens += rows;
        if decode {
            self.decode += rows;
        } else if rows > 0 {
            self.prefills += 1;
        }
        if let Some(r) = rank {
            self.lora_rows += rows;
            self.rank_rows += rows * r;
            self.max_rank = self.max_rank.max(r);
        }
    }

    /// LoRA work under `kernel`: Σ rank for SGMV, rows · max rank for BGMV.
    pub fn lora_work(&self, kernel: LoraKernel) -> usize {
        match kernel {
            LoraKernel::Sgmv => self.rank_rows,
            LoraKernel::Bgmv => self.lora_rows * self.max_rank,
        }
    }

    fn features(&self, kernel: LoraKernel) -> [f64; COLS] {
        let (s, b) = match kernel {
            LoraKernel::Sgmv => (self.lora_work(kernel) as f64, 0.0),
            LoraKernel::Bgmv => (0.0, self.lora_work(kernel) as f64),
        };
        [
            self.tokens as f64,
            self.decode as f64,
            s,
            b,
            self.prefills as f64,
            f64::from(u8::from(self.after_idle)),
        ]
    }
}

/// Where an adapter's bytes are when a request for it arrives.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

/// The disk → host reads an adapter's own read waits behind (the loader threads take reads
/// first in, first out).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct DiskQueue {
    /// Bytes of the reads queued or in flight ahead of it.
    pub ahead_bytes: u64,
    /// Loader threads reading them in parallel (0 counts as 1).
    pub readers: usize,
}

/// Measured inputs of the model. Times in seconds, per layer where the name says so.
#[derive(Clone, Debug, PartialEq)]
pub struct PerfModel {
    /// `β`: device time of one layer of any step.
    pub layer_base_s: f64,
    /// `a_tok`: device time per row per layer.
    pub layer_per_token_s: f64,
    /// `a_dec`: extra device time per decode row per layer (attention over its context).
    pub layer_per_decode_s: f64,
    /// `α_M`: per unit of Σ rank per layer, SGMV.
    pub lora_sgmv_s: f64,
    /// `α_B`: per unit of rows · max rank per layer, BGMV.
    pub lora_bgmv_s: f64,
    /// `a_pre`: extra device time per layer per sequence the step prefills.
    pub layer_per_prefill_s: f64,
    /// `γ`: extra device time per layer of a step that starts after the engine was idle
    /// ([`Self::is_after_idle`]).
    pub layer_after_idle_s: f64,
    /// Time without a step after which the next step counts as one after idle, seconds.
    pub after_idle_gap_s: f64,
    pub num_layers: usize,
    /// CPU LoRA throughput over all workers, FLOP/s.
    pub cpu_flops: f64,
    /// Whether the CPU work overlaps the device's (worker processes) or runs on the engine
    /// thread itself (no workers: it adds to the step).
    pub cpu_overlaps: bool,
    pub link: LinkModel,
    /// Disk → host read rate, bytes per second (learned from the loader's reads).
    pub disk_bytes_per_s: f64,
    /// Host encode rate, bytes per second: the host work that turns an adapter read from its
    /// file into the bytes the copy sends (dtype conversion, packing into pinned memory),
    /// measured at start-up ([`crate::coldstart::calibrate`]) and learned from the loads
    /// ([`Self::observe_host_encode`]); 0 when it costs nothing here. On the H100 this, not
    /// the 55 GB/s link, was most of a cold start (issue 27).
    pub host_encode_bytes_per_s: f64,
    /// Whether the CPU workers can compute an adapter's deltas from its file before the host
    /// tier holds it (the memory-mapped safetensors, layer by layer: a host-store file entry,
    /// `thaw_ipc::HostStore::insert_file`); without, CPU assist of a disk-tier adapter starts
    /// once the read and encode are done. [`crate::coldstart::calibrate`] sets it when the
    /// engine has CPU LoRA workers.
    pub assist_reads_disk: bool,
    /// Fixed cost CPU assist adds per layer of a step (exports, doorbells, waits, merges),
    /// learned from assisted steps.
    pub assist_layer_overhead_s: f64,
    /// Device time of an assisted step over the same step's time without assist: what the
    /// workers take from the device's own work. About 1 on a GPU; on the CPU backend the
    /// workers' cores are the backend's, which then computes on the engine thread alone
    /// (`Backend::set_cpu_assist`), so its steps stretch. Learned from assisted steps
    /// ([`Self::observe_assisted_shape`]); 1 until one is seen.
    pub assist_device_factor: f64,
    /// Assisted steps behind [`Self::assist_device_factor`] and the overhead.
    pub assisted_steps: u64,
    /// Disk reads behind [`Self::disk_bytes_per_s`] (the first replaces the prior).
    pub disk_reads: u64,
    /// Rate at which a process reads an adapter file's pages in place (the page cache, as
    /// the CPU workers read a disk-tier adapter's mapped file), bytes per second, measured at
    /// start-up; 0 when unmeasured (then [`Self::disk_bytes_per_s`]). Unlike the loader's
    /// read it has no parse, validation or conversion in it.
    pub file_read_bytes_per_s: f64,
    /// EWMA weight of each new observation.
    pub alpha: f64,
    /// Moments of every step of the run the device-time model is fitted to by least squares.
    pub recent: StepStats,
    /// Error of each step's prediction, made before the step was measured.
    pub error: ErrorStat,
    /// Mean wall time the engine thread spends between two back-to-back steps (outside the
    /// timed step), seconds.
    pub step_overhead_s: f64,
    /// Gaps between steps behind [`Self::step_overhead_s`].
    pub overhead_steps: u64,
}

impl Default for PerfModel {
    /// An uncalibrated model: plausible CPU-backend magnitudes, corrected by the first steps.
    fn default() -> Self {
        Self {
            layer_base_s: 1e-4,
            layer_per_token_s: 1e-5,
            layer_per_decode_s: 0.0,
            lora_sgmv_s: 1e-8,
            lora_bgmv_s: 1e-8,
            layer_per_prefill_s: 0.0,
            layer_after_idle_s: 0.0,
            after_idle_gap_s: Self::AFTER_IDLE_GAP_S,
            num_layers: 1,
            cpu_flops: 1e9,
            cpu_overlaps: false,
            link: LinkModel::default(),
            disk_bytes_per_s: 1e9,
            host_encode_bytes_per_s: 0.0,
            assist_reads_disk: false,
            assist_layer_overhead_s: 0.0,
            assist_device_factor: 1.0,
            assisted_steps: 0,
            disk_reads: 0,
            file_read_bytes_per_s: 0.0,
            alpha: 0.1,
            recent: StepStats::default(),
            error: ErrorStat::default(),
            step_overhead_s: 0.0,
            overhead_steps: 0,
        }
    }
}

impl PerfModel {
    /// Smallest spread of each column a refit needs (tokens, decode rows, Σ rank, rows·max
    /// rank, prefills, after idle): below it a slope cannot be told from noise (the last two:
    /// both kinds of step seen).
    const MIN_SPREAD: [f64; COLS] = [16.0, 4.0, 64.0, 64.0, 1.0, 1.0];

    /// Default of [`Self::after_idle_gap_s`]. In the step logs of the validation runs the
    /// time from one step's end to the next step's start is under 10 ms while requests run
    /// (the loop's own gap ~0.3 ms, its 2 ms waits for an adapter, preemption by other
    /// threads) and over 50 ms when a request reached an engine with nothing to do; 1 step
    /// in 1,362 fell in between. 20 ms splits the two.
    pub const AFTER_IDLE_GAP_S: f64 = 0.02;

    fn coef(&self) -> [f64; COLS] {
        [
            self.layer_per_token_s,
            self.layer_per_decode_s,
            self.lora_sgmv_s,
            self.lora_bgmv_s,
            self.layer_per_prefill_s,
            self.layer_after_idle_s,
        ]
    }

    /// Whether a step that starts `idle_s` seconds after the previous step ended (None: the
    /// engine has run none) is one after idle: the one definition the engine fits with and
    /// the simulator plans with.
    pub fn is_after_idle(&self, idle_s: Option<f64>) -> bool {
        idle_s.is_none_or(|g| g >= self.after_idle_gap_s)
    }

    /// Device time of one layer for a step of `tokens` rows without adapters.
    pub fn layer_time(&self, tokens: usize) -> f64 {
        self.layer_base_s + self.layer_per_token_s * tokens as f64
    }

    /// Device time of a whole step of `tokens` rows without adapters.
    pub fn step_time(&self, tokens: usize) -> f64 {
        self.layer_time(tokens) * self.num_layers as f64
    }

    /// Device time of one layer of a step of `shape` under `kernel`.
    pub fn layer_time_shape(&self, shape: &StepShape, kernel: LoraKernel) -> f64 {
        let x = shape.features(kernel);
        let c = self.coef();
        self.layer_base_s + (0..COLS).map(|j| c[j] * x[j]).sum::<f64>()
    }

    /// Device time of a whole step of `shape` under the kernel [`Self::choose_kernel`] picks.
    pub fn predict(&self, shape: &StepShape) -> f64 {
        self.layer_time_shape(shape, self.choose_kernel(shape)) * self.num_layers as f64
    }

    /// Wall time from one token of a decoding request to its next when the step is `shape`:
    /// the step's device time plus the engine loop's mean gap between steps
    /// ([`Self::step_overhead_s`]). This, not the device time alone, is what a client
    /// measures as time per output token, so the TPOT cap plans with it.
    pub fn predict_interval(&self, shape: &StepShape) -> f64 {
        self.predict(shape) + self.step_overhead_s
    }

    /// The LoRA kernel predicted faster for `shape` (CaraServe §5: BGMV pads every row to the
    /// step's largest rank, SGMV does not but costs more per unit of work on homogeneous
    /// ranks). Ties go to SGMV.
    pub fn choose_kernel(&self, shape: &StepShape) -> LoraKernel {
        let s = self.lora_sgmv_s * shape.lora_work(LoraKernel::Sgmv) as f64;
        let b = self.lora_bgmv_s * shape.lora_work(LoraKernel::Bgmv) as f64;
        if b < s {
            LoraKernel::Bgmv
        } else {
            LoraKernel::Sgmv
        }
    }

    /// The kernel step number `step` runs: [`Self::choose_kernel`]'s, except that every
    /// [`Self::EXPLORE_EVERY`]th step with adapters runs the other one, so both kernels' terms
    /// keep being measured (a kernel never run would never be fitted, and never chosen).
    pub fn kernel_for_step(&self, shape: &StepShape, step: u64) -> LoraKernel {
        let k = self.choose_kernel(shape);
        if shape.lora_rows == 0 || !step.is_multiple_of(Self::EXPLORE_EVERY) {
            return k;
        }
        match k {
            LoraKernel::Sgmv => LoraKernel::Bgmv,
            LoraKernel::Bgmv => LoraKernel::Sgmv,
        }
    }

    /// See [`Self::kernel_for_step`].
    pub const EXPLORE_EVERY: u64 = 32;

    /// Most rows of a sequence with an adapter of `rank` (prefill rows, unless `decode`)
    /// that can join `shape` while the predicted time between tokens
    /// ([`Self::predict_interval`]) stays within `slo_s`; at most
    /// `cap`. Every co-batched decoding request waits for the whole step, so this is what
    /// keeps their time between tokens under the SLO.
    pub fn max_rows_within(
        &self,
        shape: &StepShape,
        rank: Option<usize>,
        decode: bool,
        slo_s: f64,
        cap: usize,
    ) -> usize {
        let fits = |n: usize| {
            let mut s = *shape;
            s.add(n, decode, rank);
            self.predict_interval(&s) <= slo_s
        };
        if fits(cap) {
            return cap;
        }
        let (mut lo, mut hi) = (0usize, cap);
        if !fits(lo) {
            return 0;
        }
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

    /// Time until the last layer of an adapter of `bytes` lands behind `backlog` queued bytes.
    pub fn load_time(&self, bytes: u64, backlog: u64) -> f64 {
        self.link
            .transfer_time((bytes + backlog) as usize)
            .as_secs_f64()
            + self.link.latency_us * 1e-6 * self.num_layers.saturating_sub(1) as f64
    }

    /// Time until an adapter of `bytes` now in `tier` is on the device: nothing when it is,
    /// the link when it is in host memory (held there as the copy sends it), the disk read and
    /// the host encode before that when it is on disk.
    pub fn load_time_from(&self, tier: Tier, bytes: u64, backlog: u64) -> f64 {
        match tier {
            Tier::Device => 0.0,
            Tier::Host => self.load_time(bytes, backlog),
            Tier::Disk => self.host_ready_time(bytes) + self.load_time(bytes, backlog),
        }
    }

    /// Time from disk to the host tier for an adapter of `bytes`: the read, then the encode.
    pub fn host_ready_time(&self, bytes: u64) -> f64 {
        bytes as f64 / self.disk_bytes_per_s.max(1.0) + self.encode_time(bytes)
    }

    /// Time from disk to the host tier for an adapter of `bytes` whose read is queued behind
    /// `queue` (FIFO): its share of the reads ahead, which the loader threads share, then its
    /// own read and encode. With nothing ahead, [`Self::host_ready_time`].
    pub fn queued_host_ready_time(&self, bytes: u64, queue: DiskQueue) -> f64 {
        self.host_ready_time(queue.ahead_bytes) / queue.readers.max(1) as f64
            + self.host_ready_time(bytes)
    }

    /// Bytes per second the CPU workers read an adapter file in place: the measured page
    /// rate, never slower than the loader's whole read.
    pub fn file_read_rate(&self) -> f64 {
        self.file_read_bytes_per_s
            .max(self.disk_bytes_per_s)
            .max(1.0)
    }

    /// Host encode time of `bytes` (see [`Self::host_encode_bytes_per_s`]).
    pub fn encode_time(&self, bytes: u64) -> f64 {
        if self.host_encode_bytes_per_s > 0.0 {
            bytes as f64 / self.host_encode_bytes_per_s
        } else {
            0.0
        }
    }

    /// Folds one host encode of `bytes` that took `elapsed` into the encode rate.
    pub fn observe_host_encode(&mut self, bytes: u64, elapsed: Duration) {
        let s = elapsed.as_secs_f64();
        if bytes == 0 || s <= 0.0 {
            return;
        }
        let rate = bytes as f64 / s;
        self.host_encode_bytes_per_s = if self.host_encode_bytes_per_s > 0.0 {
            self.host_encode_bytes_per_s + self.alpha * (rate - self.host_encode_bytes_per_s)
        } else {
            rate
        };
    }

    /// Folds one gap between two back-to-back steps (the end of one timed step to the start
    /// of the next) into the mean overhead per step.
    pub fn observe_gap(&mut self, gap: Duration) {
        self.overhead_steps += 1;
        let g = gap.as_secs_f64();
        self.step_overhead_s += (g - self.step_overhead_s) / self.overhead_steps as f64;
    }

    /// Root-mean-square error of the device-time fit over every step it was fitted to,
    /// relative to the mean step (None before any step).
    pub fn fit_rms_rel(&self) -> Option<f64> {
        self.recent.rms_rel(self.layer_base_s, &self.coef())
    }

    /// Folds one disk → host read of `bytes` into the disk rate: the first read replaces
    /// the prior (a guess, not a measurement), later ones move it by [`Self::alpha`].
    pub fn observe_disk_load(&mut self, bytes: u64, elapsed: Duration) {
        let s = elapsed.as_secs_f64();
        if bytes == 0 || s <= 0.0 {
            return;
        }
        let rate = bytes as f64 / s;
        self.disk_reads += 1;
        self.disk_bytes_per_s = if self.disk_reads == 1 {
            rate
        } else {
            self.disk_bytes_per_s + self.alpha * (rate - self.disk_bytes_per_s)
        };
    }

    /// Weight of the next observation of a learned assist cost: the mean of the first
    /// `1/alpha` observations (so the first assisted step replaces the priors), then an EWMA.
    fn assist_weight(&self) -> f64 {
        (1.0 / self.assisted_steps as f64).max(self.alpha)
    }

    /// [`Self::observe_assisted_shape`] for a step of `tokens` prefill rows whose shape is
    /// otherwise unknown.
    pub fn observe_assisted_step(&mut self, tokens: usize, elapsed: Duration, overhead: Duration) {
        let mut s = StepShape::default();
        s.add(tokens, false, None);
        self.observe_assisted_shape(&s, LoraKernel::Sgmv, elapsed, overhead);
    }

    /// Folds one CPU-assisted step of `shape` into the model: `overhead` is what the engine
    /// thread spent on the assist path itself (exports, submits, waits for the workers,
    /// merges — as the engine measured it) and teaches [`Self::assist_layer_overhead_s`]; the
    /// rest of `elapsed`, against the device time the fit predicts for `shape`, teaches
    /// [`Self::assist_device_factor`]. An assisted step does not move the device fit: its time
    /// is the device's under assist, not the device's.
    pub fn observe_assisted_shape(
        &mut self,
        shape: &StepShape,
        kernel: LoraKernel,
        elapsed: Duration,
        overhead: Duration,
    ) {
        if self.num_layers == 0 || shape.tokens == 0 {
            return;
        }
        self.assisted_steps += 1;
        let w = self.assist_weight();
        let layers = self.num_layers as f64;
        let per_layer = overhead.as_secs_f64() / layers;
        self.assist_layer_overhead_s += w * (per_layer - self.assist_layer_overhead_s);
        let plain = self.layer_time_shape(shape, kernel);
        let device = elapsed.saturating_sub(overhead).as_secs_f64() / layers;
        if plain > 0.0 && device > 0.0 {
            // Bounded: one step preempted for a second must not teach a 100× slowdown.
            let f = (device / plain).clamp(0.5, 8.0);
            self.assist_device_factor += w * (f - self.assist_device_factor);
        }
    }

    /// Folds one measured step of `tokens` rows whose shape is otherwise unknown.
    pub fn observe_step(&mut self, tokens: usize, elapsed: Duration) {
        let mut s = StepShape::default();
        s.add(tokens, false, None);
        self.observe_shape(&s, LoraKernel::Sgmv, elapsed);
    }

    /// Folds one measured step into the device-time model: a least-squares fit over all
    /// steps of the run once their shapes spread, an EWMA nudge of the start-up calibration
    /// before that. The prediction made before the fold feeds [`Self::error`].
    pub fn observe_shape(&mut self, shape: &StepShape, kernel: LoraKernel, elapsed: Duration) {
        if shape.tokens == 0 || self.num_layers == 0 {
            return;
        }
        let per_layer = elapsed.as_secs_f64() / self.num_layers as f64;
        let predicted = self.layer_time_shape(shape, kernel);
        self.error.observe(predicted, per_layer);
        self.recent.push(Sample {
            x: shape.features(kernel),
            y: per_layer,
        });
        if let Some((base, c)) = self.recent.fit(
            &self.coef(),
            &Self::MIN_SPREAD,
            &[1e-9, f64::MIN, 0.0, 0.0, 0.0, 0.0],
        ) {
            if c[0] + c[1] > 0.0 {
                self.layer_base_s = base.max(0.0);
                [
                    self.layer_per_token_s,
                    self.layer_per_decode_s,
                    self.lora_sgmv_s,
                    self.lora_bgmv_s,
                    self.layer_per_prefill_s,
                    self.layer_after_idle_s,
                ] = c;
                return;
            }
        }
        // Attribute the error to the per-token slope for big steps, to the base for small.
        let err = per_layer - predicted;
        let tokens = shape.tokens;
        let w = (tokens as f64 / 64.0).min(1.0);
        self.layer_per_token_s =
            (self.layer_per_token_s + self.alpha * err * w / tokens as f64).max(1e-9);
        self.layer_base_s = (self.layer_base_s + self.alpha * err * (1.0 - w)).max(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn model(overlaps: bool) -> PerfModel {
        PerfModel {
            layer_base_s: 1e-4,
            layer_per_token_s: 1e-5,
            num_layers: 8,
            cpu_flops: 1e9,
            cpu_overlaps: overlaps,
            link: LinkModel {
                gbps: 0.05,
                latency_us: 10.0,
            },
            alpha: 0.2,
            ..Default::default()
        }
    }

    #[test]
    fn step_time_is_linear_in_tokens() {
        let m = model(true);
        assert!((m.layer_time(10) - 2e-4).abs() < 1e-12);
        assert!((m.step_time(10) - 1.6e-3).abs() < 1e-12);
    }

    /// Assisted steps teach the assist path's own overhead and how much the assist stretches
    /// the device's work, and leave the device fit to the steps without assist.
    #[test]
    fn assisted_steps_teach_the_overhead_and_the_device_slowdown_apart() {
        for factor in [1.0, 1.8] {
            let mut m = model(true);
            let plain = |t: usize| 8.0 * (2e-4 + 2e-5 * t as f64);
            let overhead = 8.0 * 3e-4;
            for i in 0..200 {
                let t = 64 + i % 64;
                m.observe_assisted_step(
                    t,
                    Duration::from_secs_f64(plain(t) * factor + overhead),
                    Duration::from_secs_f64(overhead),
                );
                m.observe_step(t, Duration::from_secs_f64(plain(t)));
                m.observe_step(1, Duration::from_secs_f64(plain(1)));
            }
            assert!((m.assist_layer_overhead_s - 3e-4).abs() < 3e-6, "{m:?}");
            assert!(
                (m.assist_device_factor - factor).abs() / factor < 0.05,
                "{factor}: {m:?}"
            );
            let want = 2e-4 + 2e-5 * 128.0;
            let got = m.layer_time(128);
            assert!((got - want).abs() / want < 0.05, "{got} vs {want}");
            // What the model predicts an assisted layer costs: the device's stretched time
            // (it outlasts this CPU work), plus the overhead.
            let t = m.assisted_layer_time(want, 0.0);
            assert!((t - (want * factor + 3e-4)).abs() / t < 0.06, "{t}");
        }
    }

    /// The first assisted step and the first disk read replace the priors; later ones move
    /// the estimate without jumping to each new sample.
    #[test]
    fn the_first_measurements_replace_the_priors() {
        let mut m = model(true);
        m.assist_layer_overhead_s = 1e-4;
        m.observe_disk_load(1 << 20, Duration::from_millis(100));
        assert!(
            (m.disk_bytes_per_s - (1 << 20) as f64 / 0.1).abs() < 1.0,
            "{m:?}"
        );
        m.observe_disk_load(1 << 20, Duration::from_millis(10));
        assert!(
            m.disk_bytes_per_s > 1.1e7 && m.disk_bytes_per_s < 1e8,
            "{m:?}"
        );
        let plain = 8.0 * (1e-4 + 1e-5 * 32.0);
        m.observe_assisted_step(
            32,
            Duration::from_secs_f64(2.0 * plain + 8e-3),
            Duration::from_millis(8),
        );
        assert!((m.assist_layer_overhead_s - 1e-3).abs() < 1e-9, "{m:?}");
        assert!((m.assist_device_factor - 2.0).abs() < 1e-6, "{m:?}");
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

    #[test]
    fn learns_both_kernels_and_picks_the_cheaper_per_step() {
        // BGMV is cheaper per unit of work but pays for padding: homogeneous ranks favour
        // it, one big rank among small ones favours SGMV.
        let mut m = model(true);
        let (am, ab) = (4e-8, 2e-8);
        let truth = |s: &StepShape, k: LoraKernel| {
            let lora = match k {
                LoraKernel::Sgmv => am,
                LoraKernel::Bgmv => ab,
            } * s.lora_work(k) as f64;
            8.0 * (1e-4 + 1e-5 * s.tokens as f64 + 2e-6 * s.decode as f64 + lora)
        };
        for i in 0..400usize {
            let mut s = StepShape::default();
            s.add(1 + i % 9, true, Some(8 << (i % 5)));
            s.add((i * 7) % 48, false, Some(8 << ((i / 5) % 5)));
            let k = if i % 2 == 0 {
                LoraKernel::Sgmv
            } else {
                LoraKernel::Bgmv
            };
            m.observe_shape(&s, k, Duration::from_secs_f64(truth(&s, k)));
        }
        assert!((m.lora_sgmv_s - am).abs() / am < 1e-3, "{m:?}");
        assert!((m.lora_bgmv_s - ab).abs() / ab < 1e-3, "{m:?}");
        assert!((m.layer_per_decode_s - 2e-6).abs() / 2e-6 < 1e-3);
        assert!(m.error.mean_rel < 0.5, "{:?}", m.error);
        let mut homo = StepShape::default();
        homo.add(16, true, Some(32));
        assert_eq!(m.choose_kernel(&homo), LoraKernel::Bgmv);
        let mut mixed = StepShape::default();
        mixed.add(15, true, Some(8));
        mixed.add(1, true, Some(128));
        assert_eq!(m.choose_kernel(&mixed), LoraKernel::Sgmv);
        assert_eq!(
            m.kernel_for_step(&mixed, PerfModel::EXPLORE_EVERY),
            LoraKernel::Bgmv
        );
        assert_eq!(m.kernel_for_step(&mixed, 1), LoraKernel::Sgmv);
    }

    /// A run at low load: decode steps, prefills that join them, and prefills that start
    /// on an idle engine, whose steps cost a planted extra. The online fit finds the
    /// after-idle cost apart from the per-prefill one, and predicts both kinds of step.
    #[test]
    fn the_fit_recovers_a_planted_after_idle_cost() {
        let mut m = model(true);
        let (pre, idle) = (3e-4, 7e-4);
        let truth = |s: &StepShape| {
            8.0 * (1e-4
                + 1e-5 * s.tokens as f64
                + 2e-6 * s.decode as f64
                + 4e-8 * s.rank_rows as f64
                + pre * s.prefills as f64
                + if s.after_idle { idle } else { 0.0 })
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for i in 0..1500usize {
            let mut s = StepShape::default();
            let running = rng.random_range(0..6usize);
            for _ in 0..running {
                s.add(1, true, Some([8, 16, 32, 64][rng.random_range(0..4)]));
            }
            if i % 10 == 0 {
                let rank = [8, 16, 32, 64][rng.random_range(0..4)];
                s.add(rng.random_range(10..200), false, Some(rank));
                // Most prefills of a lightly loaded engine start it after idle.
                s.after_idle = running == 0 || rng.random_bool(0.3);
            }
            if s.tokens == 0 {
                continue;
            }
            let noisy = truth(&s) * (1.0 + rng.random_range(-0.05..0.05));
            m.observe_shape(&s, LoraKernel::Sgmv, Duration::from_secs_f64(noisy));
        }
        let rel = |got: f64, want: f64| (got - want).abs() / want;
        assert!(rel(m.layer_after_idle_s, idle) < 0.1, "{m:?}");
        assert!(rel(m.layer_per_prefill_s, pre) < 0.1, "{m:?}");
        let mut cold = StepShape::default();
        cold.add(64, false, Some(16));
        cold.after_idle = true;
        let mut warm = cold;
        warm.after_idle = false;
        assert!(
            rel(m.predict(&cold), truth(&cold)) < 0.03,
            "{} vs {}: {m:?}",
            m.predict(&cold),
            truth(&cold)
        );
        assert!(
            rel(m.predict(&warm), truth(&warm)) < 0.03,
            "{} vs {}: {m:?}",
            m.predict(&warm),
            truth(&warm)
        );
        assert!(m.predict(&cold) - m.predict(&warm) > 8.0 * idle * 0.9);
    }

    #[test]
    fn after_idle_means_no_step_for_the_gap_or_none_yet() {
        let m = PerfModel {
            after_idle_gap_s: 0.02,
            ..Default::default()
        };
        assert!(m.is_after_idle(None));
        assert!(m.is_after_idle(Some(0.02)) && m.is_after_idle(Some(3.0)));
        assert!(!m.is_after_idle(Some(0.0199)) && !m.is_after_idle(Some(3e-4)));
    }

    #[test]
    fn the_tpot_cap_keeps_the_predicted_step_within_the_slo() {
        let m = model(true);
        let mut decoding = StepShape::default();
        decoding.add(8, true, Some(16));
        let slo = m.predict(&decoding) * 3.0;
        let n = m.max_rows_within(&decoding, Some(64), false, slo, 4096);
        assert!(n > 0 && n < 4096);
        let mut with = decoding;
        with.add(n, false, Some(64));
        assert!(m.predict(&with) <= slo);
        with.add(1, false, Some(64));
        assert!(m.predict(&with) > slo, "the cap is the largest that fits");
        assert_eq!(m.max_rows_within(&decoding, None, false, 0.0, 10), 0);
    }

    #[test]
    fn the_tpot_cap_counts_the_gap_between_steps() {
        // The client's time per token is the step plus the loop's gap: a chunk that fits
        // the SLO on device time alone but not with the gap must be cut.
        let mut m = model(true);
        let mut decoding = StepShape::default();
        decoding.add(4, true, Some(16));
        let mut one = decoding;
        one.add(64, false, Some(16));
        let slo = m.predict(&one) * 1.001;
        assert_eq!(m.max_rows_within(&decoding, Some(16), false, slo, 64), 64);
        m.step_overhead_s = m.predict(&one) * 0.05;
        let n = m.max_rows_within(&decoding, Some(16), false, slo, 64);
        assert!(n < 64, "{n}");
        let mut with = decoding;
        with.add(n, false, Some(16));
        assert!(m.predict_interval(&with) <= slo);
        assert_eq!(
            m.predict_interval(&with),
            m.predict(&with) + m.step_overhead_s
        );
    }

    #[test]
    fn the_overhead_is_the_mean_gap_between_steps() {
        let mut m = model(true);
        for g in [1e-4, 3e-4, 2e-4, 6e-4] {
            m.observe_gap(Duration::from_secs_f64(g));
        }
        assert!(
            (m.step_overhead_s - 3e-4).abs() < 1e-12,
            "{}",
            m.step_overhead_s
        );
        assert_eq!(m.overhead_steps, 4);
    }

    #[test]
    fn a_regime_change_moves_the_pooled_fit_to_the_runs_average() {
        // 400 steps at one per-token cost, then 400 at twice it: a window of the last steps
        // would describe only the second regime; the pooled fit describes the run.
        let mut m = model(true);
        for i in 0..800usize {
            let t = 1 + (i * 7) % 128;
            let a = if i < 400 { 1e-5 } else { 2e-5 };
            m.observe_step(t, Duration::from_secs_f64(8.0 * (2e-4 + a * t as f64)));
        }
        assert!(
            (m.layer_per_token_s - 1.5e-5).abs() / 1.5e-5 < 0.02,
            "{m:?}"
        );
        let rms = m.fit_rms_rel().unwrap();
        assert!(
            rms > 0.05 && rms < 0.5,
            "the fit's own error shows the mix: {rms}"
        );
    }

    #[test]
    fn load_time_grows_down_the_tiers() {
        let mut m = model(true);
        let b = 1 << 20;
        let (d, h, k) = (
            m.load_time_from(Tier::Device, b, 0),
            m.load_time_from(Tier::Host, b, 0),
            m.load_time_from(Tier::Disk, b, 0),
        );
        assert!(d == 0.0 && h > 0.0 && k > h, "{d} {h} {k}");
        // The encode is a term of the disk tier's load, not of the host tier's.
        m.observe_host_encode(b, Duration::from_millis(4));
        assert!((m.host_encode_bytes_per_s - b as f64 / 4e-3).abs() < 1.0);
        assert_eq!(m.load_time_from(Tier::Host, b, 0), h);
        let with = m.load_time_from(Tier::Disk, b, 0);
        assert!((with - k - 4e-3).abs() < 1e-9, "{with} vs {k} + 4 ms");
    }
}
