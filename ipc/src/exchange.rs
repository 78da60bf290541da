//! The exchange segment: one step's CPU LoRA work, its inputs and outputs, the doorbell and
//! the workers' result, heartbeat and pid words.
//!
//! Layout (offsets from the segment start, every region 64-byte aligned; see
//! [`ExchangeLayout`], which the CUDA side uses to find the mapped words):
//!
//! ```text
//! 4096        seq        u32  step sequence word: written by the host (post_step) or by the
//!                             GPU's copy-and-signal kernel; workers spin on it when armed
//! +64         bell       u32  futex word, bumped on every host-side ring/arm/shutdown
//!             sleepers   u32  workers parked on `bell`
//! +128        armed      u32  1 while a step with CPU work is in flight: spin, don't park
//!             shutdown   u32  1 = workers exit
//! +192        result_waiters u32  engine threads parked on a result word
//!             n_jobs     u32  jobs in the table for the current step
//! workers     max_workers × 64 B: result u32 (seq completed), pid u32, heartbeat u64
//! jobs        max_jobs × 64 B [`Job`]
//! inputs      max_inputs × [max_rows, max_d_in] f32
//! outputs     7 modules × [max_rows, max_d_out] f32 (Δ, already scaled)
//! ```
//!
//! Step protocol: with no step in flight the engine writes jobs ([`Exchange::set_jobs`]) and
//! input rows ([`Exchange::input_mut`]), then publishes the step's sequence number
//! ([`Exchange::post_step`], a SeqCst store, so Release for the rows). A worker acquires the
//! number ([`crate::WorkerPort::wait_step`]), computes the rows of its jobs, writes Δ and
//! stores the number into its result word. The engine waits for all result words
//! ([`Exchange::wait_results`]), then reads Δ ([`Exchange::output`]).

use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use bytemuck::{Pod, Zeroable};

use crate::doorbell::{self, Park, WaitStrategy};
use crate::error::{IpcError, Result};
use crate::segment::{Segment, SegmentKind, HEADER_LEN};
use crate::types::NUM_MODULES;
use crate::types::{AdapterHandle, LayerIdx, Module, ModuleMask, StepSeq, WorkerId, WorkerMask};

/// Capacities of an exchange segment. Stored in the segment header, so a worker reads them
/// back instead of being told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExchangeConfig {
    /// Worker slots (1..=64).
    pub max_workers: u32,
    /// Jobs per step.
    pub max_jobs: u32,
    /// Distinct input buffers per step (e.g. one per projection input shared by modules).
    pub max_inputs: u32,
    /// Rows (tokens) per input / output buffer.
    pub max_rows: u32,
    /// Row stride of the input buffers, in f32 (the largest `d_in`).
    pub max_d_in: u32,
    /// Row stride of the output buffers, in f32 (the largest `d_out`).
    pub max_d_out: u32,
}

impl Default for ExchangeConfig {
    /// Sized for Llama-3-8B-class models (hidden 4096, intermediate 14336), 128 rows per
    /// step. Pages are only backed when touched.
    fn default() -> Self {
        Self {
            max_workers: 16,
            max_jobs: 256,
            max_inputs: 4,
            max_rows: 128,
            max_d_in: 14336,
            max_d_out: 14336,
        }
    }
}

impl ExchangeConfig {
    fn to_words(self) -> [u64; 6] {
        [
            self.max_workers,
            self.max_jobs,
            self.max_inputs,
            self.max_rows,
            self.max_d_in,
            self.max_d_out,
        ]
        .map(u64::from)
    }

    fn from_words(w: &[u64]) -> Result<Self> {
        let get = |i: usize| {
            u32::try_from(w[i])
                .map_err(|_| IpcError::CorruptHeader(format!("config word {i} = {}", w[i])))
        };
        Ok(Self {
            max_workers: get(0)?,
            max_jobs: get(1)?,
            max_inputs: get(2)?,
            max_rows: get(3)?,
            max_d_in: get(4)?,
            max_d_out: get(5)?,
        })
    }

    fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(IpcError::InvalidConfig(what.to_owned()));
        if !(1..=64).contains(&self.max_workers) {
            return bad("max_workers must be 1..=64");
        }
        if self.max_jobs == 0 || self.max_inputs == 0 || self.max_rows == 0 {
            return bad("max_jobs, max_inputs and max_rows must be at least 1");
        }
        if self.max_d_in == 0 || self.max_d_out == 0 {
            return bad("max_d_in and max_d_out must be at least 1");
        }
        Ok(())
    }
}

/// Byte offsets of everything in an exchange segment (from the segment start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExchangeLayout {
    /// Step sequence word (u32).
    pub seq: usize,
    /// Futex word rung by the host (u32).
    pub bell: usize,
    /// Count of workers parked on `bell` (u32).
    pub sleepers: usize,
    /// Armed word (u32).
    pub armed: usize,
    /// Shutdown word (u32).
    pub shutdown: usize,
    /// Count of engine threads parked on result words (u32).
    pub result_waiters: usize,
    /// Number of jobs in the current step (u32).
    pub n_jobs: usize,
    /// First worker slot; slot `w` is at `workers + w * 64`.
    pub workers: usize,
    /// First job; job `j` is at `jobs + j * 64`.
    pub jobs: usize,
    /// First input buffer; input `i` is at `inputs + i * input_stride`.
    pub inputs: usize,
    /// Bytes per input buffer.
    pub input_stride: usize,
    /// First output buffer; module `m` is at `outputs + m * output_stride`.
    pub outputs: usize,
    /// Bytes per output buffer.
    pub output_stride: usize,
    /// Bytes needed in all.
    pub total: usize,
}

/// Offset of a worker's result word within its slot.
pub const WORKER_RESULT: usize = 0;
/// Offset of a worker's pid word within its slot.
pub const WORKER_PID: usize = 4;
/// Offset of a worker's heartbeat counter (u64) within its slot.
pub const WORKER_HEARTBEAT: usize = 8;
const SLOT: usize = 64;

fn align64(x: usize) -> usize {
    (x + 63) & !63
}

impl ExchangeLayout {
    /// Computes the layout for `cfg` (overflow-checked).
    pub fn new(cfg: &ExchangeConfig) -> Result<Self> {
        let too_big = || IpcError::InvalidConfig(format!("{cfg:?} does not fit in memory"));
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(too_big);
        let c = HEADER_LEN;
        let workers = c + 4 * SLOT;
        let jobs = workers + mul(cfg.max_workers as usize, SLOT)?;
        let inputs = align64(jobs + mul(cfg.max_jobs as usize, std::mem::size_of::<Job>())?);
        let input_stride = align64(mul(mul(cfg.max_rows as usize, cfg.max_d_in as usize)?, 4)?);
        let outputs = inputs + mul(cfg.max_inputs as usize, input_stride)?;
        let output_stride = align64(mul(mul(cfg.max_rows as usize, cfg.max_d_out as usize)?, 4)?);
        let total = outputs + mul(NUM_MODULES, output_stride)?;
        Ok(Self {
            seq: c,
            bell: c + SLOT,
            sleepers: c + SLOT + 4,
            armed: c + 2 * SLOT,
            shutdown: c + 2 * SLOT + 4,
            result_waiters: c + 3 * SLOT,
            n_jobs: c + 3 * SLOT + 4,
            workers,
            jobs,
            inputs,
            input_stride,
            outputs,
            output_stride,
            total,
        })
    }
}

/// One unit of CPU LoRA work: rows `row_start..row_start+row_count` of input buffer
/// `input`, through the adapter's (layer, module) weights, for each module in `modules`,
/// computed by `worker`. 64 bytes, `#[repr(C)]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
pub struct Job {
    /// The adapter in the host store.
    pub adapter: AdapterHandle,
    /// Layer.
    pub layer: LayerIdx,
    /// Modules to compute (all read the same input buffer).
    pub modules: ModuleMask,
    /// Worker that computes this job.
    pub worker: WorkerId,
    /// Input buffer index (< `max_inputs`).
    pub input: u32,
    /// First row.
    pub row_start: u32,
    /// Number of rows.
    pub row_count: u32,
    /// Adapter rank (a hint; the store's view is authoritative).
    pub rank: u32,
    /// LoRA scale (alpha / rank) applied to Δ.
    pub scale: f32,
    /// Stored dtype code ([`crate::DType::code`]).
    pub dtype: u32,
    /// Zero.
    pub _pad: u32,
}

impl Job {
    /// The job's row range.
    pub fn rows(&self) -> Range<u32> {
        self.row_start..self.row_start.saturating_add(self.row_count)
    }

    pub(crate) fn check(&self, cfg: &ExchangeConfig) -> Result<()> {
        let bad = |why: String| Err(IpcError::InvalidConfig(format!("job {self:?}: {why}")));
        if self.worker.0 >= cfg.max_workers {
            return bad(format!("worker beyond max_workers {}", cfg.max_workers));
        }
        if self.input >= cfg.max_inputs {
            return bad(format!("input beyond max_inputs {}", cfg.max_inputs));
        }
        if u64::from(self.row_start) + u64::from(self.row_count) > u64::from(cfg.max_rows) {
            return bad(format!("rows beyond max_rows {}", cfg.max_rows));
        }
        if self.modules.0 >> NUM_MODULES != 0 {
            return bad("module bits above 6".into());
        }
        Ok(())
    }
}

/// A worker slot's words, as the engine sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerStatus {
    /// Last step the worker completed.
    pub result: StepSeq,
    /// Its pid (0 = none attached).
    pub pid: u32,
    /// Heartbeat counter (bumped by the worker while alive).
    pub heartbeat: u64,
}

/// A mapped exchange segment. The engine uses it directly; a worker wraps it in a
/// [`crate::WorkerPort`].
#[derive(Debug)]
pub struct Exchange {
    seg: Segment,
    cfg: ExchangeConfig,
    layout: ExchangeLayout,
    in_flight: Option<StepSeq>,
}

impl Exchange {
    /// Creates a zeroed exchange segment for `cfg`.
    pub fn create(cfg: ExchangeConfig) -> Result<Self> {
        cfg.validate()?;
        let layout = ExchangeLayout::new(&cfg)?;
        let seg = Segment::create_with_config(
            SegmentKind::Exchange,
            "exchange",
            layout.total - HEADER_LEN,
            &cfg.to_words(),
        )?;
        Self::open(seg)
    }

    /// Wraps an opened segment, reading the config back from its header and checking that
    /// the layout fits.
    pub fn open(seg: Segment) -> Result<Self> {
        if seg.kind() != SegmentKind::Exchange {
            return Err(IpcError::KindMismatch {
                found: seg.header().kind,
                expected: SegmentKind::Exchange,
            });
        }
        let cfg = ExchangeConfig::from_words(seg.config_words())?;
        cfg.validate()
            .map_err(|e| IpcError::CorruptHeader(e.to_string()))?;
        let layout = ExchangeLayout::new(&cfg)?;
        if layout.total > seg.len() {
            return Err(IpcError::CorruptHeader(format!(
                "layout needs {} bytes, segment has {}",
                layout.total,
                seg.len()
            )));
        }
        Ok(Self {
            seg,
            cfg,
            layout,
            in_flight: None,
        })
    }

    /// The underlying segment (for `inherit_into`, `base_addr`, cloning the fd).
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Capacities.
    pub fn config(&self) -> &ExchangeConfig {
        &self.cfg
    }

    /// Offsets.
    pub fn layout(&self) -> &ExchangeLayout {
        &self.layout
    }

    pub(crate) fn word(&self, off: usize) -> &AtomicU32 {
        self.seg.atomic_u32(off)
    }

    pub(crate) fn slot_word(&self, w: WorkerId, field: usize) -> &AtomicU32 {
        self.word(self.layout.workers + w.0 as usize * SLOT + field)
    }

    pub(crate) fn heartbeat_word(&self, w: WorkerId) -> &std::sync::atomic::AtomicU64 {
        self.seg
            .atomic_u64(self.layout.workers + w.0 as usize * SLOT + WORKER_HEARTBEAT)
    }

    pub(crate) fn check_worker(&self, w: WorkerId) -> Result<()> {
        if w.0 >= self.cfg.max_workers {
            return Err(IpcError::NoSuchWorker {
                worker: w.0,
                max: self.cfg.max_workers,
            });
        }
        Ok(())
    }

    /// The raw step sequence word: what a device kernel (or a test posing as one) stores to
    /// without waking anyone. Only seen promptly while armed.
    pub fn seq_word(&self) -> &AtomicU32 {
        self.word(self.layout.seq)
    }

    /// The last step number posted.
    pub fn current_step(&self) -> StepSeq {
        StepSeq(self.seq_word().load(Ordering::Acquire))
    }

    /// Arms the doorbell: waiters spin on the sequence word instead of parking (needed
    /// before a device writes it). Wakes parked waiters so they start spinning.
    pub fn arm(&self) {
        self.word(self.layout.armed).store(1, Ordering::SeqCst);
        doorbell::ring(self.word(self.layout.bell), self.word(self.layout.sleepers));
    }

    /// Disarms: waiters park again after their bounded spin.
    pub fn disarm(&self) {
        self.word(self.layout.armed).store(0, Ordering::SeqCst);
    }

    /// Whether the doorbell is armed.
    pub fn is_armed(&self) -> bool {
        self.word(self.layout.armed).load(Ordering::SeqCst) != 0
    }

    /// Tells every worker to exit; parked ones are woken.
    pub fn shutdown(&self) {
        self.word(self.layout.shutdown).store(1, Ordering::SeqCst);
        doorbell::ring(self.word(self.layout.bell), self.word(self.layout.sleepers));
    }

    pub(crate) fn is_shutdown(&self) -> bool {
        self.word(self.layout.shutdown).load(Ordering::SeqCst) != 0
    }

    /// Copies `jobs` into the job table for the next step. Refused while a step is in
    /// flight, for jobs outside the capacities, and for two jobs writing the same
    /// (module, row) — each output row has exactly one writer.
    pub fn set_jobs(&mut self, jobs: &[Job]) -> Result<()> {
        self.idle()?;
        if jobs.len() > self.cfg.max_jobs as usize {
            return Err(IpcError::InvalidConfig(format!(
                "{} jobs, max_jobs is {}",
                jobs.len(),
                self.cfg.max_jobs
            )));
        }
        for (i, j) in jobs.iter().enumerate() {
            j.check(&self.cfg)?;
            for k in &jobs[..i] {
                let overlap = j.row_start < k.rows().end && k.row_start < j.rows().end;
                if overlap && j.modules.0 & k.modules.0 != 0 && j.row_count > 0 && k.row_count > 0 {
                    return Err(IpcError::InvalidConfig(format!(
                        "jobs {k:?} and {j:?} write the same output rows"
                    )));
                }
            }
        }
        // SAFETY: no step is in flight (`idle` checked), so no worker reads the job table
        // until the next `post_step`, whose SeqCst store publishes these bytes.
        let table = unsafe {
            self.seg
                .mapping()
                .slice_mut::<Job>(self.layout.jobs, jobs.len())
        };
        table.copy_from_slice(jobs);
        self.word(self.layout.n_jobs)
            .store(jobs.len() as u32, Ordering::Relaxed);
        Ok(())
    }

    /// Rows `rows` of input buffer `input`, for the engine to fill before posting: a
    /// `[rows.len(), max_d_in]` row-major f32 block. Refused while a step is in flight.
    pub fn input_mut(&mut self, input: u32, rows: Range<u32>) -> Result<&mut [f32]> {
        self.idle()?;
        let (off, n) = self.input_range(input, rows)?;
        // SAFETY: no step is in flight, so no worker reads inputs until the next post_step
        // (which publishes the writes); `&mut self` rules out another slice in this process.
        Ok(unsafe { self.seg.mapping().slice_mut::<f32>(off, n) })
    }

    /// Rows `rows` of module `module`'s Δ buffer (`[rows.len(), max_d_out]` f32), for the
    /// engine to merge after [`Exchange::wait_results`]. Refused while a step is in flight.
    pub fn output(&self, module: Module, rows: Range<u32>) -> Result<&[f32]> {
        self.idle()?;
        let (off, n) = self.output_range(module, rows)?;
        // SAFETY: no step is in flight: every worker stored its result word (Release) after
        // writing Δ and wait_results loaded it (Acquire); workers write outputs again only
        // after the next post_step, which needs `&mut self`, so not while this borrow lives.
        Ok(unsafe { self.seg.mapping().slice::<f32>(off, n) })
    }

    pub(crate) fn input_range(&self, input: u32, rows: Range<u32>) -> Result<(usize, usize)> {
        let d = self.cfg.max_d_in as usize;
        if input >= self.cfg.max_inputs {
            return Err(IpcError::InvalidConfig(format!(
                "input {input} >= max_inputs"
            )));
        }
        let base = self.layout.inputs + input as usize * self.layout.input_stride;
        self.rows_range(base, d, rows)
    }

    pub(crate) fn output_range(&self, module: Module, rows: Range<u32>) -> Result<(usize, usize)> {
        let d = self.cfg.max_d_out as usize;
        let base = self.layout.outputs + module.index() * self.layout.output_stride;
        self.rows_range(base, d, rows)
    }

    fn rows_range(&self, base: usize, d: usize, rows: Range<u32>) -> Result<(usize, usize)> {
        if rows.start > rows.end || rows.end > self.cfg.max_rows {
            return Err(IpcError::InvalidConfig(format!(
                "rows {rows:?} outside 0..{}",
                self.cfg.max_rows
            )));
        }
        Ok((base + rows.start as usize * d * 4, rows.len() * d))
    }

    fn idle(&self) -> Result<()> {
        match self.in_flight {
            None => Ok(()),
            Some(s) => Err(IpcError::InvalidConfig(format!(
                "step {} is in flight: wait for its results (or abandon it) first",
                s.0
            ))),
        }
    }

    /// Publishes step `seq` (after jobs and inputs are written) and wakes parked workers.
    pub fn post_step(&mut self, seq: StepSeq) -> Result<()> {
        self.idle()?;
        self.in_flight = Some(seq);
        self.seq_word().store(seq.0, Ordering::SeqCst);
        doorbell::ring(self.word(self.layout.bell), self.word(self.layout.sleepers));
        Ok(())
    }

    /// Records that a device kernel will store `seq` into the sequence word (the
    /// copy-and-signal path). The doorbell must be armed, since the device cannot wake a
    /// parked worker.
    pub fn device_step_pending(&mut self, seq: StepSeq) -> Result<()> {
        self.idle()?;
        if !self.is_armed() {
            return Err(IpcError::InvalidConfig(
                "arm the doorbell before a device posts a step".into(),
            ));
        }
        self.in_flight = Some(seq);
        Ok(())
    }

    /// Waits until every worker in `workers` has completed step `seq` (result word ≥ seq),
    /// or `deadline` passes. `Err(laggards)` names the workers that missed it; the step then
    /// stays in flight until [`Exchange::abandon_step`].
    pub fn wait_results(
        &mut self,
        seq: StepSeq,
        workers: WorkerMask,
        strategy: WaitStrategy,
        deadline: Instant,
    ) -> Result<(), WorkerMask> {
        let mut pending = workers & WorkerMask::first(self.cfg.max_workers);
        let waiters = self.word(self.layout.result_waiters);
        while let Some(w) = pending.iter().next() {
            let word = self.slot_word(w, WORKER_RESULT);
            // While armed (a step with CPU work in flight) the engine spins too: a futex
            // wake-up per layer would cost more than the workers' compute.
            let park = Park {
                word,
                sleepers: waiters,
                armed: Some(self.word(self.layout.armed)),
            };
            let done = doorbell::wait_until(strategy, &park, Some(deadline), || {
                StepSeq(word.load(Ordering::Acquire))
                    .reached(seq)
                    .then_some(())
            });
            if done.is_none() {
                // Deadline passed: collect every worker still short of `seq`.
                let late = pending
                    .iter()
                    .filter(|&w| {
                        !StepSeq(self.slot_word(w, WORKER_RESULT).load(Ordering::Acquire))
                            .reached(seq)
                    })
                    .fold(WorkerMask::default(), WorkerMask::with);
                if late.is_empty() {
                    break;
                }
                return Err(late);
            }
            pending = pending.without(w);
        }
        if self.in_flight == Some(seq) {
            self.in_flight = None;
        }
        Ok(())
    }

    /// Forgets the in-flight step after a missed deadline. Call only once the laggards can
    /// no longer write (killed and reaped, or their slots reset for respawn): the engine
    /// reuses the rows next.
    pub fn abandon_step(&mut self) {
        self.in_flight = None;
    }

    /// A worker slot's result, pid and heartbeat.
    pub fn worker_status(&self, w: WorkerId) -> Result<WorkerStatus> {
        self.check_worker(w)?;
        Ok(WorkerStatus {
            result: StepSeq(self.slot_word(w, WORKER_RESULT).load(Ordering::Acquire)),
            pid: self.slot_word(w, WORKER_PID).load(Ordering::Acquire),
            heartbeat: self.heartbeat_word(w).load(Ordering::Acquire),
        })
    }

    /// Resets a worker slot before (re)spawning its process: no pid, result = `completed`
    /// (the worker will take the first step after it).
    pub fn reset_worker(&self, w: WorkerId, completed: StepSeq) -> Result<()> {
        self.check_worker(w)?;
        self.slot_word(w, WORKER_PID).store(0, Ordering::Release);
        self.slot_word(w, WORKER_RESULT)
            .store(completed.0, Ordering::Release);
        Ok(())
    }
}

impl std::ops::BitAnd for WorkerMask {
    type Output = WorkerMask;
    fn bitand(self, rhs: Self) -> Self {
        WorkerMask(self.0 & rhs.0)
    }
}
