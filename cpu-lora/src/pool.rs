//! The engine's handle on its CPU LoRA workers: spawns them pinned one per core, measures
//! them, splits each step's rows across them in proportion to their measured speed, waits
//! for their Δ, and survives their death.
//!
//! **A step.** Write input rows ([`LoraPool::input_mut`] / [`LoraPool::write_input`]), then
//! [`LoraPool::submit`] the step's [`LoraJob`]s: each job's rows are split across the ready
//! workers ([`crate::profile::split_rows`]: equal predicted finish times from the profile),
//! the job table is written and the step is posted (CPU backend). On the CUDA backend,
//! [`LoraPool::arm`] the doorbell, [`LoraPool::submit_device`] the jobs and let the device's
//! copy-and-signal kernel store the returned sequence number. Either way
//! [`LoraPool::wait`] returns a [`StepReport`] once every row has its Δ, readable with
//! [`LoraPool::output`] until the next submit.
//!
//! **Faults.** While waiting the pool checks, every `liveness_poll`, whether a worker that
//! still owes rows has exited (`waitpid`), stopped heartbeating for `heartbeat_timeout`, or
//! missed the step's deadline; such a worker is SIGKILLed and reaped (so it can no longer
//! write), then **the engine computes the dead worker's rows itself**: it attaches a
//! [`thaw_ipc::WorkerPort`] to the dead worker's exchange slot and runs the workers' own
//! `compute` code on that slot's jobs, writing Δ in place and completing the slot.
//! Re-posting the rows to the surviving workers was rejected: the exchange carries one step
//! at a time, so it would cost a second round trip after the survivors finished, add a
//! failure mode (a survivor dying during the re-post) and make the step's outcome depend on
//! other processes; the stand-in is bounded, local and needs no new protocol. The slot is
//! then reset, the dead process's host-store leases released, and a new process spawned
//! (up to `max_restarts` times in a row for workers dying within `stable_after` of their
//! start, after which the slot stays disabled and its share goes to the others; a worker
//! that lived longer starts the count over). Dead workers are found by every submit and by
//! [`LoraPool::health_check`], which the server's engine loop calls on a timer, so a worker
//! killed while the server is idle is replaced promptly too.
//!
//! **Processes.** Children get `PR_SET_PDEATHSIG(SIGKILL)`; [`LoraPool::shutdown`] (and
//! drop) tells them to exit, waits briefly, SIGKILLs stragglers and reaps every one. Create
//! and drive the pool from one long-lived thread: the death signal follows the thread that
//! spawned a worker.

use std::ops::Range;
use std::time::{Duration, Instant};

use thaw_ipc::{
    Exchange, ExchangeConfig, ExchangeLayout, HostStore, Job, Module, StepSeq, WaitStrategy,
    WorkerId, WorkerMask,
};

mod diagnose;
mod plan;
mod recover;
mod types;

pub use types::{Assignment, DeviceStep, LoraJob, PoolConfig, StepReport, Ticket};

use crate::calibrate;
use crate::compute::ComputeState;
use crate::procs::{reap_all, Launch, Slot, SlotState, WorkerInfo};
use crate::profile::{Profile, ShapeKey};
use crate::stats::{StatsSegment, WorkerStepStat};
use crate::worker::WaitMode;
use crate::CpuLoraError;

#[derive(Debug, Clone, Copy)]
struct JobInfo {
    keys: [Option<ShapeKey>; 7],
    n_modules: u32,
}

#[derive(Debug)]
struct InFlight {
    seq: StepSeq,
    posted: Instant,
    workers: WorkerMask,
}

/// The engine-side pool of CPU LoRA worker processes. See the module docs.
#[derive(Debug)]
pub struct LoraPool {
    slots: Vec<Slot>,
    launch: Launch,
    cfg: PoolConfig,
    ex: Exchange,
    stats: StatsSegment,
    store: HostStore,
    profile: Profile,
    seq: StepSeq,
    in_flight: Option<InFlight>,
    // Per-step buffers, sized once.
    jobs: Vec<Job>,
    infos: Vec<JobInfo>,
    assignments: Vec<Assignment>,
    usage: Vec<Vec<(ShapeKey, u32)>>,
    loads: Vec<f64>,
    costs: Vec<f64>,
    cands: Vec<usize>,
    step_stats: Vec<WorkerStepStat>,
    standin: ComputeState,
    shut: bool,
}

/// Cores this process may run on.
fn cpu_set() -> Vec<usize> {
    core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .collect()
}

fn default_cores(engine_core: Option<usize>) -> Vec<usize> {
    let all = cpu_set();
    let engine = engine_core.or_else(|| all.first().copied());
    let rest: Vec<usize> = all.iter().copied().filter(|&c| Some(c) != engine).collect();
    if rest.is_empty() {
        all.into_iter().take(1).collect()
    } else {
        rest
    }
}

impl LoraPool {
    /// Spawns the workers, waits for them to attach and calibrates them. The pool owns the
    /// host store (insert and remove adapters through [`LoraPool::store_mut`]); it needs one
    /// reader slot per worker plus the engine's.
    pub fn new(cfg: PoolConfig, store: HostStore) -> Result<Self, CpuLoraError> {
        let cores = match &cfg.cores {
            Some(c) => c.clone(),
            None => default_cores(cfg.engine_core),
        };
        let n = cores.len();
        if n == 0 || n > 64 {
            return Err(CpuLoraError::Config(format!(
                "{n} worker cores; give 1..=64 (PoolConfig::cores)"
            )));
        }
        if (store.config().max_readers as usize) < n + 1 {
            return Err(CpuLoraError::Config(format!(
                "the host store has {} reader slots, {n} workers need {}; raise \
                 StoreConfig::max_readers",
                store.config().max_readers,
                n + 1
            )));
        }
        let program = match &cfg.program {
            Some(p) => p.clone(),
            None => std::env::current_exe().map_err(CpuLoraError::Process)?,
        };
        let ex_cfg = ExchangeConfig {
            max_workers: n as u32,
            ..cfg.exchange
        };
        let ex = Exchange::create(ex_cfg)?;
        let stats = StatsSegment::create(n as u32)?;
        let max_jobs = ex_cfg.max_jobs as usize;
        let mut pool = Self {
            slots: cores
                .iter()
                .enumerate()
                .map(|(i, &c)| Slot::new(WorkerId(i as u32), cfg.pin.then_some(c)))
                .collect(),
            launch: Launch {
                program,
                leading_args: cfg.leading_args.clone(),
                env: cfg.env.clone(),
                wait: WaitMode::of(cfg.wait),
                heartbeat: cfg.heartbeat_interval,
            },
            profile: Profile::new(n, cfg.ewma_alpha),
            ex,
            stats,
            store,
            seq: StepSeq(0),
            in_flight: None,
            jobs: Vec::with_capacity(max_jobs),
            infos: Vec::with_capacity(max_jobs),
            assignments: Vec::with_capacity(max_jobs),
            usage: (0..n).map(|_| Vec::with_capacity(max_jobs)).collect(),
            loads: vec![0.0; n],
            costs: vec![0.0; n],
            cands: Vec::with_capacity(n),
            step_stats: vec![WorkerStepStat::default(); n],
            standin: ComputeState::new(max_jobs),
            shut: false,
            cfg,
        };
        // From here on, an error drops `pool`, which reaps whatever was spawned.
        for w in 0..n {
            pool.ex.reset_worker(WorkerId(w as u32), pool.seq)?;
            pool.slots[w].spawn(&pool.launch, &pool.ex, &pool.store, &pool.stats)?;
        }
        pool.wait_ready(pool.cfg.startup_timeout)?;
        let shapes = pool.cfg.calibration.clone();
        calibrate::run(&mut pool, &shapes)?;
        Ok(pool)
    }

    /// Waits until every live slot's process has attached. A worker that exits first, or
    /// does not attach in time, is an error.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(), CpuLoraError> {
        let until = Instant::now() + timeout;
        loop {
            let mut starting = false;
            for s in &mut self.slots {
                if let Some(status) = s.exited() {
                    return Err(CpuLoraError::WorkerStartup {
                        worker: s.id,
                        status,
                    });
                }
                s.check_attached(&self.ex);
                starting |= s.state == SlotState::Starting;
            }
            if !starting {
                return Ok(());
            }
            if Instant::now() >= until {
                let s = self.slots.iter().find(|s| s.state == SlotState::Starting);
                return Err(CpuLoraError::WorkerStartup {
                    worker: s.map_or(WorkerId(0), |s| s.id),
                    status: format!("no attach within {timeout:?}"),
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Number of worker slots.
    pub fn n_workers(&self) -> usize {
        self.slots.len()
    }

    /// Each worker slot's state.
    pub fn workers(&self) -> impl Iterator<Item = WorkerInfo> + '_ {
        self.slots.iter().map(Slot::info)
    }

    /// The speed model (rows/ms per worker and shape).
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    pub(crate) fn profile_mut(&mut self) -> &mut Profile {
        &mut self.profile
    }

    /// The host store.
    pub fn store(&self) -> &HostStore {
        &self.store
    }

    /// The host store, to insert or remove adapters (safe while a step runs: readers hold
    /// leases).
    pub fn store_mut(&mut self) -> &mut HostStore {
        &mut self.store
    }

    /// The exchange (capacities, layout and base address for registering it with CUDA; the
    /// sequence word for a test posing as the device).
    pub fn exchange(&self) -> &Exchange {
        &self.ex
    }

    pub(crate) fn exchange_mut(&mut self) -> &mut Exchange {
        &mut self.ex
    }

    pub(crate) fn wait_strategy(&self) -> WaitStrategy {
        self.cfg.wait
    }

    pub(crate) fn stats(&self) -> &StatsSegment {
        &self.stats
    }

    pub(crate) fn next_seq(&mut self) -> StepSeq {
        self.seq = self.seq.next();
        self.seq
    }

    /// The exchange's offsets (for the CUDA side).
    pub fn layout(&self) -> &ExchangeLayout {
        self.ex.layout()
    }

    /// Row stride (f32s) of input buffers.
    pub fn input_stride(&self) -> usize {
        self.ex.config().max_d_in as usize
    }

    /// Row stride (f32s) of Δ buffers.
    pub fn output_stride(&self) -> usize {
        self.ex.config().max_d_out as usize
    }

    /// Rows `rows` of input buffer `input` (`[rows, input_stride]`), to fill before submit.
    pub fn input_mut(&mut self, input: u32, rows: Range<u32>) -> Result<&mut [f32], CpuLoraError> {
        Ok(self.ex.input_mut(input, rows)?)
    }

    /// Copies `x` (`[n, d_in]`, packed) into rows `first_row..first_row + n` of `input`.
    pub fn write_input(
        &mut self,
        input: u32,
        first_row: u32,
        x: &[f32],
        d_in: usize,
    ) -> Result<(), CpuLoraError> {
        let stride = self.input_stride();
        if d_in > stride || x.len().checked_rem(d_in) != Some(0) {
            return Err(CpuLoraError::Config(format!(
                "write_input: {} values are not rows of d_in {d_in} (stride {stride})",
                x.len()
            )));
        }
        let n = (x.len() / d_in) as u32;
        let dst = self.ex.input_mut(input, first_row..first_row + n)?;
        for (d, s) in dst.chunks_exact_mut(stride).zip(x.chunks_exact(d_in)) {
            d[..d_in].copy_from_slice(s);
        }
        Ok(())
    }

    /// Δ rows `rows` of `module` (`[rows, output_stride]`, already scaled), after
    /// [`LoraPool::wait`] and until the next submit.
    pub fn output(&self, module: Module, rows: Range<u32>) -> Result<&[f32], CpuLoraError> {
        Ok(self.ex.output(module, rows)?)
    }

    /// Where each job's rows went in the last step.
    pub fn last_assignments(&self) -> &[Assignment] {
        &self.assignments
    }

    /// What each worker recorded for the last step (indexed by worker slot; stale for
    /// workers that did not take part).
    pub fn worker_step_stats(&self) -> &[WorkerStepStat] {
        &self.step_stats
    }

    /// Arms the doorbell: workers spin on the sequence word instead of sleeping, as a device
    /// cannot wake them. Costs their cores' idle time; disarm when no cold adapter is left.
    pub fn arm(&self) {
        self.ex.arm();
    }

    /// Disarms the doorbell.
    pub fn disarm(&self) {
        self.ex.disarm();
    }

    /// Splits and posts a step (host trigger: the CPU backend).
    pub fn submit(&mut self, jobs: &[LoraJob]) -> Result<Ticket, CpuLoraError> {
        let seq = self.prepare(jobs)?;
        let posted = Instant::now();
        if let Err(e) = self.ex.post_step(seq) {
            self.in_flight = None;
            return Err(e.into());
        }
        if let Some(f) = self.in_flight.as_mut() {
            f.posted = posted;
        }
        Ok(Ticket { seq })
    }

    /// Splits a step whose sequence word the device will write (CUDA backend). Requires
    /// [`LoraPool::arm`].
    pub fn submit_device(&mut self, jobs: &[LoraJob]) -> Result<DeviceStep, CpuLoraError> {
        if !self.ex.is_armed() {
            return Err(CpuLoraError::NotArmed);
        }
        let seq = self.prepare(jobs)?;
        if let Err(e) = self.ex.device_step_pending(seq) {
            self.in_flight = None;
            return Err(e.into());
        }
        Ok(DeviceStep {
            ticket: Ticket { seq },
            seq,
            seq_offset: self.ex.layout().seq,
        })
    }

    /// Resolves shapes, splits rows and writes the job table; returns the new step number.
    fn prepare(&mut self, jobs: &[LoraJob]) -> Result<StepSeq, CpuLoraError> {
        if self.in_flight.is_some() {
            return Err(CpuLoraError::StepInFlight);
        }
        self.health_check()?;
        self.resolve(jobs)?;
        self.split(jobs)?;
        self.ex.set_jobs(&self.jobs)?;
        let mut workers = WorkerMask::default();
        for j in &self.jobs {
            workers = workers.with(j.worker);
        }
        for w in workers.iter() {
            self.slots[w.0 as usize].rebase_heartbeat(&self.ex);
        }
        let seq = self.next_seq();
        self.in_flight = Some(InFlight {
            seq,
            posted: Instant::now(),
            workers,
        });
        Ok(seq)
    }

    /// Waits for the step of `ticket`: every row's Δ is in the exchange when this returns
    /// `Ok`, even if workers died or stalled (their rows are computed by the engine; they are
    /// respawned). Workers still owing rows at `deadline` are treated as stuck.
    pub fn wait(&mut self, ticket: Ticket, deadline: Instant) -> Result<StepReport, CpuLoraError> {
        let Some(flight) = self.in_flight.as_ref() else {
            return Err(CpuLoraError::StaleTicket(ticket.seq.0));
        };
        if flight.seq != ticket.seq {
            return Err(CpuLoraError::StaleTicket(ticket.seq.0));
        }
        let (seq, posted, workers) = (flight.seq, flight.posted, flight.workers);
        let mut pending = workers;
        let mut lost = WorkerMask::default();
        let mut rows_recovered = 0;
        let strategy = self.cfg.wait;
        loop {
            // Workers with no process (dead before the step, or failed respawn) first.
            for w in pending.iter() {
                let slot = &mut self.slots[w.0 as usize];
                slot.exited();
                if slot.child.is_none() {
                    rows_recovered += self.stand_in(w, seq, deadline)?;
                    lost = lost.with(w);
                    pending = pending.without(w);
                }
            }
            if pending.is_empty() {
                break;
            }
            let slice = deadline.min(Instant::now() + self.cfg.liveness_poll);
            let late = match self.ex.wait_results(seq, pending, strategy, slice) {
                Ok(()) => break,
                Err(late) => late,
            };
            pending = late;
            let now = Instant::now();
            for w in late.iter() {
                let slot = &mut self.slots[w.0 as usize];
                let stuck = now >= deadline
                    || slot.heartbeat_age(&self.ex, now) > self.cfg.heartbeat_timeout;
                if slot.exited().is_some() || stuck {
                    slot.kill();
                    tracing::warn!(worker = w.0, stuck, "CPU LoRA worker lost mid-step");
                    rows_recovered += self.stand_in(w, seq, deadline)?;
                    lost = lost.with(w);
                    pending = pending.without(w);
                }
            }
        }
        // Every result word has reached `seq`: this returns at once and ends the step.
        if let Err(late) = self.ex.wait_results(seq, workers, strategy, Instant::now()) {
            self.ex.abandon_step();
            tracing::error!(?late, "result words short after recovery");
        }
        self.in_flight = None;
        let elapsed = posted.elapsed();
        let mut report = StepReport {
            seq,
            elapsed,
            worker_compute_max: Duration::ZERO,
            workers,
            rows_by_workers: 0,
            rows_recovered,
            lost,
            respawned: WorkerMask::default(),
        };
        let mut failed = None;
        for w in workers.iter() {
            if lost.contains(w) {
                continue;
            }
            let st = self.stats.read(w);
            if st.seq != seq {
                continue;
            }
            self.step_stats[w.0 as usize] = st;
            report.rows_by_workers += st.rows;
            report.worker_compute_max = report
                .worker_compute_max
                .max(Duration::from_nanos(st.compute_ns));
            if st.failed > 0 {
                failed = Some(CpuLoraError::JobsFailed {
                    worker: w,
                    failed: st.failed,
                });
            }
            self.profile
                .observe(w.0 as usize, &self.usage[w.0 as usize], st.compute_ns);
        }
        for a in &mut self.assignments {
            a.recovered = lost.contains(a.worker);
        }
        for w in lost.iter() {
            if self.respawn(w)? {
                report.respawned = report.respawned.with(w);
            }
        }
        match failed {
            Some(e) => Err(self.explain(e)),
            None => Ok(report),
        }
    }

    /// Tells every worker to exit, then SIGKILLs and reaps any still running after a short
    /// grace period. Idempotent; drop calls it.
    pub fn shutdown(&mut self) {
        if self.shut {
            return;
        }
        self.shut = true;
        self.ex.shutdown();
        reap_all(&mut self.slots, Duration::from_millis(500));
    }
}

impl Drop for LoraPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}
