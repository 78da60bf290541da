//! The pool's plain data: its configuration, the engine's job description, tickets and
//! reports.

use std::ffi::OsString;
use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

use thaw_ipc::{
    AdapterHandle, ExchangeConfig, LayerIdx, ModuleMask, StepSeq, WaitStrategy, WorkerId,
    WorkerMask,
};

use crate::calibrate::CalibrationShape;

/// Pool configuration; [`Default`] fits a server: one worker per core but the engine's,
/// started from this executable's `lora-worker` subcommand.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Cores to run workers on, one worker each. `None`: every core of the calling thread's
    /// CPU set except `engine_core` (so create the pool before pinning the engine thread, or
    /// list the cores).
    pub cores: Option<Vec<usize>>,
    /// The engine thread's core, left free by the default core list (default: the first
    /// core of the CPU set).
    pub engine_core: Option<usize>,
    /// Pin each worker to its core.
    pub pin: bool,
    /// Worker executable (default: `std::env::current_exe()`).
    pub program: Option<PathBuf>,
    /// Arguments before the worker's own (default: `["lora-worker"]`, the hidden subcommand).
    pub leading_args: Vec<OsString>,
    /// Extra environment for workers.
    pub env: Vec<(OsString, OsString)>,
    /// Exchange capacities (`max_workers` is set to the number of workers).
    pub exchange: ExchangeConfig,
    /// How the engine and the workers wait.
    pub wait: WaitStrategy,
    /// Worker heartbeat period while idle.
    pub heartbeat_interval: Duration,
    /// A worker owing rows whose heartbeat has not moved for this long is killed.
    pub heartbeat_timeout: Duration,
    /// How often a waiting engine checks the liveness of workers that still owe rows.
    pub liveness_poll: Duration,
    /// Time for a worker to attach after spawn.
    pub startup_timeout: Duration,
    /// Shapes measured at start-up (empty: no calibration; the profile starts from a flop
    /// rate guess and learns online).
    pub calibration: Vec<CalibrationShape>,
    /// EWMA weight of each step's measurement in the profile.
    pub ewma_alpha: f64,
    /// Smallest slice of a job's rows worth giving to a worker.
    pub min_chunk_rows: u32,
    /// Respawns in a row per worker slot, of workers that each died within `stable_after` of
    /// starting, before the slot is left disabled (a crash loop).
    pub max_restarts: u32,
    /// A worker that ran this long before it died was healthy: its slot's crash streak starts
    /// over, so occasional deaths over a long-running server's life never use up
    /// `max_restarts` and shrink its capacity.
    pub stable_after: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            cores: None,
            engine_core: None,
            pin: true,
            program: None,
            leading_args: vec!["lora-worker".into()],
            env: Vec::new(),
            exchange: ExchangeConfig::default(),
            wait: WaitStrategy::spin_then_futex(),
            heartbeat_interval: Duration::from_millis(50),
            heartbeat_timeout: Duration::from_secs(1),
            liveness_poll: Duration::from_millis(5),
            startup_timeout: Duration::from_secs(10),
            calibration: CalibrationShape::defaults(),
            ewma_alpha: 0.2,
            min_chunk_rows: 4,
            max_restarts: 16,
            stable_after: Duration::from_secs(60),
        }
    }
}

/// One unit of CPU LoRA work: rows `rows` of input buffer `input`, through adapter
/// `adapter`'s `layer` weights, for every module in `modules` (each writes its own Δ buffer).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraJob {
    /// The adapter in the host store.
    pub adapter: AdapterHandle,
    /// Layer.
    pub layer: LayerIdx,
    /// Modules sharing this input (e.g. q, k, v).
    pub modules: ModuleMask,
    /// Input buffer index.
    pub input: u32,
    /// Rows of the input (and of each module's Δ buffer).
    pub rows: Range<u32>,
}

/// Proof of a submitted step; redeem with [`super::LoraPool::wait`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a submitted step must be waited for before the next one"]
pub struct Ticket {
    pub(super) seq: StepSeq,
}

impl Ticket {
    /// The step's sequence number.
    pub fn seq(&self) -> StepSeq {
        self.seq
    }
}

/// A step prepared for a device trigger: the device stores `seq` (u32) at byte `seq_offset`
/// of the exchange segment (mapped pinned memory) after copying the input rows.
#[derive(Debug)]
pub struct DeviceStep {
    /// Redeem with [`super::LoraPool::wait`].
    pub ticket: Ticket,
    /// Value the device writes.
    pub seq: StepSeq,
    /// Offset of the sequence word in the exchange segment.
    pub seq_offset: usize,
}

/// Which rows went where in the last step (one entry per exchange job).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// Index of the [`LoraJob`] in the submitted slice.
    pub job: u32,
    /// Worker slot it was posted to.
    pub worker: WorkerId,
    /// Its rows.
    pub rows: Range<u32>,
    /// Whether the engine computed it because the worker died or stalled.
    pub recovered: bool,
}

/// What happened in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepReport {
    /// The step.
    pub seq: StepSeq,
    /// Submit (or device prepare) to the last Δ.
    pub elapsed: Duration,
    /// Longest compute time measured inside a worker.
    pub worker_compute_max: Duration,
    /// Workers that took part.
    pub workers: WorkerMask,
    /// Row·modules computed by workers.
    pub rows_by_workers: u32,
    /// Row·modules the engine computed for dead or stuck workers.
    pub rows_recovered: u32,
    /// Workers found dead or stuck (and killed) during the step.
    pub lost: WorkerMask,
    /// Workers respawned after the step.
    pub respawned: WorkerMask,
}
