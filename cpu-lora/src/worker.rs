//! The worker process: `thaw lora-worker …` in deployment (the server's CLI forwards its
//! [`WorkerArgs`] to [`worker_main`]), `thaw-lora-worker …` in this crate's tests.
//!
//! It pins itself to one core, adopts the three segments its parent passed by fd
//! inheritance (exchange, host store, step statistics — each validated: magic, version,
//! kind, size), claims its exchange slot and loops: wait for a step (spin or spin-then-futex),
//! compute its rows from the host store (the `compute` module), record its compute time, bump
//! its result word; heartbeat while idle and between jobs. Single-threaded; after the first
//! steps of the largest shapes, a step allocates nothing.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use thaw_ipc::{
    Exchange, ReaderSlot, Segment, SegmentKind, StoreReader, WaitOutcome, WaitStrategy, WorkerId,
    WorkerPort,
};

use crate::compute::ComputeState;
use crate::stats::StatsSegment;
use crate::CpuLoraError;

/// Default environment variable carrying the exchange segment's fd number.
pub const EXCHANGE_FD_ENV: &str = "THAW_LORA_EXCHANGE_FD";
/// Default environment variable carrying the host store segment's fd number.
pub const STORE_FD_ENV: &str = "THAW_LORA_STORE_FD";
/// Default environment variable carrying the stats segment's fd number.
pub const STATS_FD_ENV: &str = "THAW_LORA_STATS_FD";
/// Fault injection for tests: a directory. While `<dir>/stall-<worker id>` exists, the worker
/// stops after writing the Δ of a (job, module) of each step, before reporting the step complete (after announcing it by creating
/// `<dir>/stalled-<worker id>-<pid>`), without heartbeating — a stuck worker to kill.
pub const FAULT_DIR_ENV: &str = "THAW_LORA_FAULT_DIR";

/// How a worker waits for its doorbell (maps to [`WaitStrategy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WaitMode {
    /// Spin on the sequence word (yielding now and then): lowest latency, burns the core.
    Spin,
    /// Spin briefly, then sleep in a futex (keeps spinning while the doorbell is armed).
    Futex,
}

impl WaitMode {
    /// The strategy this mode stands for.
    pub fn strategy(self) -> WaitStrategy {
        match self {
            WaitMode::Spin => WaitStrategy::spin(),
            WaitMode::Futex => WaitStrategy::spin_then_futex(),
        }
    }

    /// The mode of a strategy.
    pub fn of(s: WaitStrategy) -> Self {
        if s.parks() {
            WaitMode::Futex
        } else {
            WaitMode::Spin
        }
    }

    /// The command-line spelling.
    pub fn as_arg(self) -> &'static str {
        match self {
            WaitMode::Spin => "spin",
            WaitMode::Futex => "futex",
        }
    }
}

/// Arguments of a worker process. Spawned by [`crate::LoraPool`]; not meant to be typed.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// Exchange slot of this worker (0..max_workers).
    #[arg(long)]
    pub worker_id: u32,
    /// Core to pin to; none = do not pin.
    #[arg(long)]
    pub core: Option<usize>,
    /// Host-store reader slot (distinct per process; 0 is the engine's).
    #[arg(long)]
    pub reader_slot: u32,
    /// Environment variable holding the inherited exchange segment fd.
    #[arg(long, default_value = EXCHANGE_FD_ENV)]
    pub exchange_fd_env: String,
    /// Environment variable holding the inherited host store segment fd.
    #[arg(long, default_value = STORE_FD_ENV)]
    pub store_fd_env: String,
    /// Environment variable holding the inherited stats segment fd.
    #[arg(long, default_value = STATS_FD_ENV)]
    pub stats_fd_env: String,
    /// How to wait for steps.
    #[arg(long, value_enum, default_value = "futex")]
    pub wait: WaitMode,
    /// Heartbeat period while idle, in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub heartbeat_ms: u64,
}

/// A worker with its segments open, ready to serve steps.
#[derive(Debug)]
pub struct Worker {
    port: WorkerPort,
    store: StoreReader,
    stats: StatsSegment,
    state: ComputeState,
    strategy: WaitStrategy,
    heartbeat: Duration,
    fault: Option<Fault>,
}

#[derive(Debug)]
struct Fault {
    stall: PathBuf,
    stalled: PathBuf,
}

impl Fault {
    fn from_env(id: WorkerId) -> Option<Self> {
        let dir = PathBuf::from(std::env::var_os(FAULT_DIR_ENV)?);
        Some(Self {
            stall: dir.join(format!("stall-{}", id.0)),
            stalled: dir.join(format!("stalled-{}-{}", id.0, std::process::id())),
        })
    }

    fn maybe_stall(&self) {
        if !self.stall.exists() {
            return;
        }
        let _ = std::fs::write(&self.stalled, b"");
        while self.stall.exists() {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Worker {
    /// Validates the three segments and claims exchange slot `id`.
    pub fn open(
        exchange: Segment,
        store: Segment,
        stats: Segment,
        id: WorkerId,
        reader: ReaderSlot,
        wait: WaitMode,
        heartbeat: Duration,
    ) -> Result<Self, CpuLoraError> {
        let stats = StatsSegment::open(stats)?;
        let store = StoreReader::open(store, reader)?;
        let ex = Exchange::open(exchange)?;
        let max_jobs = ex.config().max_jobs as usize;
        let port = WorkerPort::attach(ex, id)?;
        Ok(Self {
            port,
            store,
            stats,
            state: ComputeState::new(max_jobs),
            strategy: wait.strategy(),
            heartbeat: heartbeat.max(Duration::from_millis(1)),
            fault: Fault::from_env(id),
        })
    }

    /// Serves steps until the engine shuts the exchange down or the parent dies.
    pub fn run(&mut self) {
        let parent = std::os::unix::process::parent_id();
        loop {
            let deadline = Instant::now() + self.heartbeat;
            match self.port.wait_step(self.strategy, Some(deadline)) {
                WaitOutcome::Step(seq) => {
                    let fault = self.fault.as_ref();
                    let mut stall = || fault.iter().for_each(|f| f.maybe_stall());
                    let hook: Option<&mut dyn FnMut()> = match fault {
                        Some(_) => Some(&mut stall),
                        None => None,
                    };
                    let stat = self.state.run_step(&mut self.port, &self.store, seq, hook);
                    self.stats.record(self.port.id(), stat);
                    self.port.complete();
                    self.port.beat();
                }
                WaitOutcome::TimedOut => {
                    self.port.beat();
                    // PR_SET_PDEATHSIG normally kills us with the parent; this catches a
                    // worker started without it (e.g. by hand).
                    if std::os::unix::process::parent_id() != parent {
                        return;
                    }
                }
                WaitOutcome::Shutdown => return,
            }
        }
    }
}

/// Pins the calling thread to `core`. Any core of the cgroup's cpuset is accepted, even
/// outside the affinity mask inherited from a pinned engine thread.
fn pin_to(core: usize) -> Result<(), CpuLoraError> {
    let mut set = nix::sched::CpuSet::new();
    set.set(core).map_err(|_| CpuLoraError::Pin { core })?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .map_err(|_| CpuLoraError::Pin { core })
}

/// Lets the calling thread run on any core again. Threads spawned by a pinned engine thread
/// inherit its single-core mask; background threads (the loader, the copy engine) call this
/// so they do not queue behind the engine on its core. Best effort: a failure leaves the
/// inherited mask, which is only slower.
pub fn float_current_thread() {
    let mut set = nix::sched::CpuSet::new();
    for cpu in 0..nix::sched::CpuSet::count() {
        let _ = set.set(cpu);
    }
    let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
}

/// Entry point of a worker process: pin, open the inherited segments, serve until shutdown.
pub fn worker_main(args: WorkerArgs) -> Result<(), CpuLoraError> {
    if let Some(core) = args.core {
        pin_to(core)?;
    }
    let exchange = Segment::from_inherited_env(&args.exchange_fd_env, SegmentKind::Exchange)?;
    let store = Segment::from_inherited_env(&args.store_fd_env, SegmentKind::HostStore)?;
    let stats = Segment::from_inherited_env(&args.stats_fd_env, SegmentKind::Scratch)?;
    let mut worker = Worker::open(
        exchange,
        store,
        stats,
        WorkerId(args.worker_id),
        ReaderSlot(args.reader_slot),
        args.wait,
        Duration::from_millis(args.heartbeat_ms),
    )?;
    worker.run();
    Ok(())
}
