//! The engine thread: owns the [`Engine`], the scheduler state and the memory manager, takes
//! commands from the HTTP side over a channel and streams each request's tokens back over its
//! own channel.
//!
//! Each turn it applies commands, drops requests whose receiver is gone (client
//! disconnected: the sequence and its KV are freed and its adapter lease released), asks the
//! adapter-aware admission ([`crate::memory::admit`]) whom to admit and what memory must do,
//! carries that out, plans the step's tokens ([`crate::scheduler::plan_step_admitting`]), runs
//! it and sends tokens.
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{self as cb, Receiver, Sender};
use thaw_runtime::backend::any::AnyBackend;
use thaw_runtime::engine::{Engine, FinishReason, SequenceParams};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SampledToken;
use tokio::sync::mpsc as tmpsc;

use crate::coldstart::{ColdStartPolicy, CostModel};
use crate::error::ServerError;
use crate::memory::apply::{apply, Upload};
use crate::memory::loader::{FetchResult, Loader};
use crate::memory::waits::{classify, Moment, Waits};
use crate::memory::{Board, Device, Limits, MemoryConfig, MemoryManager, Notice, NoticeSink};
use crate::metrics::Metrics;
use crate::perf::{Cause, Stopwatch, Tier};
use crate::registry::AdapterLease;
use crate::scheduler::{
    Arrival, MlqConfig, SchedConfig, SchedState, Scheduler, SchedulingPolicy, SeqState,
};

mod cold_marks;
mod gate;
mod kv;
mod publish;
mod step;
mod step_error;
mod upload_failed;

/// The engine the server runs: the CPU or the CUDA backend, as `--device` chose.
pub type ServeEngine = Engine<AnyBackend>;

/// What a request hears from the engine.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// A generated token; `finish` is set on the last one.
    Token {
        token: SampledToken,
        finish: Option<FinishReason>,
        /// With the first token of a request that asked for prompt logprobs: the scores of
        /// its prompt tokens after the first. Empty otherwise.
        prompt_logprobs: Vec<SampledToken>,
        /// With the first token: prompt tokens the prefix cache held at admission (0 later).
        cached_tokens: usize,
    },
    /// The request ended without finishing (shutdown timeout, engine failure); the message
    /// is safe to show to the client.
    Aborted(String),
}

/// One engine sequence to run.
pub struct Submission {
    pub params: SequenceParams,
    /// Pins the adapter while the request lives; dropped when the engine drops the request.
    pub lease: Option<AdapterLease>,
    pub arrived: Instant,
    /// Admission order under `--scheduling-policy priority` (lower first).
    pub priority: i64,
}

enum Command {
    Submit {
        id: SeqId,
        sub: Box<Submission>,
        events: tmpsc::UnboundedSender<EngineEvent>,
    },
    Memory(Notice),
    /// Stop taking work; abort whatever is left at `deadline`.
    Drain {
        deadline: Instant,
    },
    /// Abort everything and exit the thread.
    Shutdown,
}

pub use crate::engine_stats::LoopStats;

/// How the engine thread treats adapters that are not on the device.
#[derive(Clone, Debug)]
pub struct ColdStart {
    pub policy: ColdStartPolicy,
    /// The cost model `auto` decides with (measured at start-up, refreshed online).
    pub cost: CostModel,
}

/// Everything the loop plans with, made on the engine thread next to the engine.
pub struct LoopConfig {
    pub sched: SchedConfig,
    pub cold: ColdStart,
    pub memory: MemoryConfig,
    pub limits: Limits,
    pub scheduling: Scheduling,
    /// `--emulated-step-time`: the floor each step is padded to (None: off).
    pub emulated_step: Option<crate::emulated_step::StepFloor>,
    /// `--dump-cost-model PATH`: log every step and first token to `PATH.steps.jsonl`.
    pub step_log: Option<std::path::PathBuf>,
}

/// How the loop orders and batches requests.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scheduling {
    pub policy: SchedulingPolicy,
    pub mlq: MlqConfig,
    /// `--tpot-slo-ms` in seconds.
    pub tpot_slo_s: Option<f64>,
    /// `--lora-kernel auto`: the performance model picks SGMV or BGMV per step.
    pub auto_kernel: bool,
}

/// The HTTP side's handle on the engine thread. Cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    pub stats: Arc<LoopStats>,
    next_seq: Arc<AtomicU64>,
    max_queued: usize,
}

impl EngineHandle {
    /// Queues a request; its tokens arrive on the returned receiver. Dropping the receiver
    /// cancels the request.
    pub fn submit(
        &self,
        sub: Submission,
    ) -> Result<tmpsc::UnboundedReceiver<EngineEvent>, ServerError> {
        let prev = self.stats.waiting.fetch_add(1, Ordering::SeqCst);
        if prev >= self.max_queued {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ServerError::QueueFull {
                max: self.max_queued,
            });
        }
        let (events, rx) = tmpsc::unbounded_channel();
        let id = SeqId(self.next_seq.fetch_add(1, Ordering::Relaxed));
        self.tx
            .send(Command::Submit {
                id,
                sub: Box::new(sub),
                events,
            })
            .map_err(|_| {
                self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
                ServerError::SchedulerGone
            })?;
        Ok(rx)
    }

    /// Starts draining: requests still running at `deadline` are aborted.
    pub fn drain(&self, deadline: Instant) {
        let _ = self.tx.send(Command::Drain { deadline });
    }

    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

impl NoticeSink for EngineHandle {
    fn notify(&self, n: Notice) -> Result<(), ServerError> {
        self.tx
            .send(Command::Memory(n))
            .map_err(|_| ServerError::SchedulerGone)
    }
}

/// Starts the engine thread; `build` runs on it (the engine never crosses threads). Also
/// returns the scheduler limits `build` settled on (its KV budget may come from a memory
/// profile on the device).
pub fn start(
    build: impl FnOnce() -> anyhow::Result<(ServeEngine, LoopConfig)> + Send + 'static,
    max_queued: usize,
    metrics: Arc<Metrics>,
    board: Arc<Board>,
) -> anyhow::Result<(EngineHandle, JoinHandle<()>, SchedConfig)> {
    let (tx, rx) = cb::unbounded();
    let stats = Arc::new(LoopStats::default());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let st = stats.clone();
    let thread = std::thread::Builder::new()
        .name("thaw-engine".into())
        .spawn(move || match build() {
            Ok((engine, cfg)) => {
                let (fetch_tx, fetch_rx) = cb::unbounded();
                let threads = crate::memory::loader::default_threads();
                let dtype = thaw_runtime::backend::Backend::lora_dtype(engine.backend());
                let _ = dtype.map(|d| st.lora_dtype.set(d));
                let loader = Loader::start(
                    engine.model_config().clone(),
                    threads,
                    dtype,
                    move |id, r| {
                        let _ = fetch_tx.send((id, r));
                    },
                );
                let loader = match loader {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(anyhow::anyhow!(
                            "starting the adapter loader thread: {e}"
                        )));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(cfg.sched));
                st.alive.store(true, Ordering::SeqCst);
                let mem = MemoryManager::new(cfg.memory.clone(), board);
                Loop::new(engine, cfg, mem, loader, st.clone(), metrics).run(rx, fetch_rx);
                st.alive.store(false, Ordering::SeqCst);
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })?;
    let sched = ready_rx
        .recv()
        .map_err(|_| anyhow::anyhow!("the engine thread died while starting"))??;
    Ok((
        EngineHandle {
            tx,
            stats,
            next_seq: Arc::new(AtomicU64::new(1)),
            max_queued,
        },
        thread,
        sched,
    ))
}

/// A request the loop is serving.
struct Live {
    params: Option<SequenceParams>,
    events: tmpsc::UnboundedSender<EngineEvent>,
    lease: Option<AdapterLease>,
    arrived: Instant,
    last_token: Option<Instant>,
    prompt_len: usize,
    generated: usize,
    running: bool,
    /// Its adapter was not on the device when it arrived.
    missed: bool,
    /// When a step first included it.
    planned: Option<Instant>,
    /// What it waited for so far (until its first token).
    waits: Waits,
    /// Preempted: the engine keeps its tokens, it waits to be resumed.
    preempted: bool,
    /// Prompt tokens found cached at its first admission, until sent with its first token.
    cached_tokens: usize,
    cold: cold_marks::ColdPath,
}

struct Loop {
    engine: ServeEngine,
    cfg: SchedConfig,
    cold: ColdStart,
    limits: Limits,
    mem: MemoryManager,
    loader: Loader,
    state: SchedState,
    live: HashMap<SeqId, Live>,
    stats: Arc<LoopStats>,
    metrics: Arc<Metrics>,
    deadline: Option<Instant>,
    sched: Scheduler,
    auto_kernel: bool,
    /// When the last timed step ended, while steps run back to back (None once the loop
    /// waits): the gap to the next step is the loop's overhead (the cost model's).
    last_step_end: Option<Instant>,
    /// When the last timed step ended, idle or not (None before the first): the time since
    /// it tells the cost model whether the next step is one after idle.
    prev_step_end: Option<Instant>,
    /// Charges the engine thread's time to what it does (see [`crate::perf::enginetime`]).
    clock: Stopwatch,
    /// When the CPU LoRA workers were last supervised ([`WORKER_CHECK`]).
    tended: Instant,
    step_log: Option<crate::perf::StepLog>,
    /// `--emulated-step-time` (None: off).
    emulated_step: Option<crate::emulated_step::StepFloor>,
    /// The sequences the current step computes ([`Self::classify_waits`]' working set, kept
    /// so that a step does not allocate it).
    stepped: HashSet<SeqId>,
}

/// How often the loop reaps dead CPU LoRA workers and starts their replacements, idle or
/// not: a killed worker is replaced within this, not on the next LoRA step (an idle server's
/// capacity must not silently shrink).
const WORKER_CHECK: Duration = Duration::from_millis(250);

/// Entries the per-request maps and queues keep when the server goes idle (see
/// `Loop::shrink_idle`); a burst up to `--max-queued-requests` grows them past it.
const IDLE_CAPACITY: usize = 64;

const SHUTDOWN_MSG: &str =
    "the server shut down before this request finished (--shutdown-timeout elapsed)";

/// What woke the loop up.
enum Wake {
    Command(Command),
    Fetched(AdapterId, FetchResult),
    Timeout,
    Closed,
}

impl Loop {
    fn new(
        mut engine: ServeEngine,
        cfg: LoopConfig,
        mem: MemoryManager,
        loader: Loader,
        stats: Arc<LoopStats>,
        metrics: Arc<Metrics>,
    ) -> Self {
        engine.set_unlanded_layers(crate::coldstart::unlanded_layers(cfg.cold.policy));
        let sched = Scheduler::new(
            cfg.scheduling.policy,
            cfg.scheduling.mlq,
            cfg.scheduling.tpot_slo_s,
            &cfg.sched,
        );
        let step_log = cfg.step_log.as_deref().and_then(|p| {
            crate::perf::StepLog::create(p)
                .map_err(|e| tracing::warn!("no step log at {}: {e}", p.display()))
                .ok()
        });
        Self {
            step_log,
            engine,
            sched,
            auto_kernel: cfg.scheduling.auto_kernel,
            emulated_step: cfg.emulated_step,
            cfg: cfg.sched,
            cold: cfg.cold,
            limits: cfg.limits,
            mem,
            loader,
            state: SchedState::default(),
            live: HashMap::new(),
            stats,
            metrics,
            deadline: None,
            last_step_end: None,
            prev_step_end: None,
            clock: Stopwatch::default(),
            tended: Instant::now(),
            stepped: HashSet::new(),
        }
    }

    /// Supervises the CPU LoRA workers every [`WORKER_CHECK`]: dead ones are reaped and
    /// respawned (the pool does nothing while a step is in flight).
    fn tend_workers(&mut self) {
        if self.tended.elapsed() < WORKER_CHECK {
            return;
        }
        self.tended = Instant::now();
        if let Err(e) = self.engine.tend_pool() {
            tracing::warn!("supervising CPU LoRA workers: {e}");
        }
    }

    /// Waits for a command or a finished disk read, up to `timeout` (None: no limit).
    fn wait(
        rx: &Receiver<Command>,
        fetched: &Receiver<(AdapterId, FetchResult)>,
        timeout: Option<Duration>,
    ) -> Wake {
        let timeout = timeout.unwrap_or(Duration::from_secs(3600));
        cb::select! {
            recv(rx) -> c => c.map_or(Wake::Closed, Wake::Command),
            recv(fetched) -> f => f.map_or(Wake::Timeout, |(id, r)| Wake::Fetched(id, r)),
            default(timeout) => Wake::Timeout,
        }
    }

    /// Handles a wake-up; false means exit.
    fn on_wake(&mut self, w: Wake) -> bool {
        match w {
            Wake::Command(c) => self.handle(c),
            Wake::Fetched(id, r) => {
                self.on_fetched(id, r);
                true
            }
            Wake::Timeout => true,
            Wake::Closed => !self.state.is_idle(),
        }
    }

    fn run(mut self, rx: Receiver<Command>, fetched: Receiver<(AdapterId, FetchResult)>) {
        loop {
            self.tend_workers();
            self.publish();
            if self.state.is_idle() {
                self.last_step_end = None;
                self.shrink_idle();
                // While adapters stream in, wake up now and then to publish their landed
                // layers; otherwise sleep until a command arrives.
                let streaming = !self
                    .stats
                    .landing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_empty();
                // With CPU LoRA workers, wake up to supervise them too.
                let timeout = if streaming {
                    Some(Duration::from_millis(20))
                } else {
                    self.engine.pool().map(|_| WORKER_CHECK)
                };
                self.charge(Cause::Idle);
                let w = Self::wait(&rx, &fetched, timeout);
                self.charge(Cause::Schedule);
                if matches!(w, Wake::Closed) || !self.on_wake(w) {
                    break;
                }
            }
            let mut stop = false;
            while let Ok((id, r)) = fetched.try_recv() {
                self.on_fetched(id, r);
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => {
                        if !self.handle(c) {
                            stop = true;
                            break;
                        }
                    }
                    Err(cb::TryRecvError::Empty) => break,
                    Err(cb::TryRecvError::Disconnected) => {
                        if self.state.is_idle() {
                            stop = true;
                        }
                        break;
                    }
                }
            }
            if stop {
                self.abort_all(SHUTDOWN_MSG);
                break;
            }
            self.drop_cancelled();
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                self.abort_all(SHUTDOWN_MSG);
                continue;
            }
            if !self.step() && !self.state.is_idle() {
                // Nothing could be planned (requests wait for adapters to be read or to land):
                // wait for a command or a read rather than spin.
                self.last_step_end = None;
                self.charge(Cause::Idle);
                let w = Self::wait(&rx, &fetched, Some(Duration::from_millis(2)));
                self.charge(Cause::Schedule);
                if !self.on_wake(w) {
                    self.abort_all(SHUTDOWN_MSG);
                    break;
                }
            }
        }
        self.publish();
    }

    /// Returns the per-request maps' and queues' room to the allocator once nothing runs or
    /// waits, keeping [`IDLE_CAPACITY`] entries; cheap when they are already that small.
    fn shrink_idle(&mut self) {
        if self.live.is_empty() {
            self.live.shrink_to(IDLE_CAPACITY);
        }
        self.state.shrink_idle(IDLE_CAPACITY);
        self.sched.shrink_idle(IDLE_CAPACITY);
    }

    /// Applies one command; false means exit.
    fn handle(&mut self, c: Command) -> bool {
        match c {
            Command::Submit { id, sub, events } => self.submit(id, *sub, events),
            Command::Memory(Notice::Register {
                meta,
                host,
                warm,
                done,
            }) => {
                let id = meta.id;
                self.observe_disk_read(meta.bytes, meta.disk_secs);
                let pages = host.as_deref().and_then(|h| self.engine.adapter_pages(h));
                self.mem.register_placed(meta, host, pages);
                let wanted = self.state.waiting_adapters();
                crate::memory::apply::stage_host(&mut self.mem, &mut self.engine, id, &wanted);
                // The no-cache baseline keeps nothing no request uses, warm adapters included.
                if warm && self.limits.keep_idle {
                    let plan = crate::memory::AdmitPlan {
                        load: vec![id],
                        ..Default::default()
                    };
                    self.apply_memory(&plan, &HashSet::new());
                }
                if let Some(done) = done {
                    let _ = done.send(());
                }
            }
            Command::Memory(Notice::Retire(id)) => {
                if self.mem.forget(id) || self.engine.has_adapter(id) {
                    if let Err(e) = self.engine.unregister_adapter(id) {
                        tracing::warn!("unregistering adapter {id}: {e}");
                    }
                }
            }
            Command::Drain { deadline } => self.deadline = Some(deadline),
            Command::Shutdown => return false,
        }
        true
    }

    fn submit(&mut self, id: SeqId, sub: Submission, events: tmpsc::UnboundedSender<EngineEvent>) {
        let prompt_len = sub.params.prompt.len();
        let mut seq = SeqState::new(id, prompt_len, sub.params.max_new_tokens);
        seq.adapter = sub.params.adapter;
        seq.priority = sub.priority;
        let mut missed = false;
        if let Some(a) = seq.adapter {
            let hit = self.mem.on_arrival(a);
            missed = !hit;
            if let Some(l) = &sub.lease {
                let c = &l.slot().counters;
                let n = if hit { &c.hits } else { &c.misses };
                n.fetch_add(1, Ordering::Relaxed);
            }
            // A request that could never fit beside its adapter is refused, not queued forever.
            let pages = self.mem.state(a).map_or(0, |s| s.pages);
            let pool = self.mem.pool();
            // With the watermark admission leaves free.
            let r = seq.worst_case_blocks(&self.cfg) + self.cfg.watermark();
            let need = r + pages;
            if need > pool.total() || r > pool.kv_capacity_with(0) {
                self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
                self.metrics.count_finished("abort");
                let _ = events.send(EngineEvent::Aborted(format!(
                    "the request's KV and its adapter need {need} pages of device memory but \
                     the budget has {}; lower max_tokens or restart with a larger \
                     --device-memory-bytes",
                    self.mem.pool().total()
                )));
                return;
            }
        }
        let arrival = self.arrival(seq.adapter, &sub);
        let reason = classify(&Moment {
            adapter: seq.adapter.and_then(|a| self.mem.state(a)),
            admitted: false,
            stepped: false,
            head_waits_for_memory: false,
        });
        self.sched
            .enqueue(&mut self.state, &self.cfg, seq, arrival, &self.cold.cost);
        self.live.insert(
            id,
            Live {
                params: Some(sub.params),
                events,
                lease: sub.lease,
                arrived: sub.arrived,
                last_token: None,
                prompt_len,
                generated: 0,
                running: false,
                missed,
                planned: None,
                waits: Waits::new(sub.arrived, reason),
                preempted: false,
                cached_tokens: 0,
                cold: Default::default(),
            },
        );
    }

    /// Folds a disk read of `bytes` that took `secs` into the performance model's disk rate
    /// (the reload cost of a disk-tier adapter for eviction, admission waits and the planner).
    fn observe_disk_read(&mut self, bytes: u64, secs: f64) {
        if secs.is_finite() && secs > 0.0 {
            self.cold
                .cost
                .observe_disk_load(bytes, Duration::from_secs_f64(secs));
        }
    }

    /// A disk read finished: into the host tier, or every waiting request for it fails with
    /// the reason.
    fn on_fetched(&mut self, id: AdapterId, r: FetchResult) {
        let prev = self.charge(Cause::Adapter);
        self.take_fetched(id, r);
        self.charge(prev);
    }

    /// Charges the engine thread's time since the last switch, then runs `c`; returns the
    /// cause that ran.
    fn charge(&mut self, c: Cause) -> Cause {
        self.clock.switch(c, &self.stats.time)
    }

    fn take_fetched(&mut self, id: AdapterId, r: FetchResult) {
        let wanted = self.state.waiting_adapters();
        // Served from its mapped file meanwhile: the read's copy replaces the mapped one.
        let r = r.and_then(|(a, secs)| {
            crate::memory::mapped::adopt(&mut self.engine, id, &a).map(|()| (a, secs))
        });
        match r {
            Ok((adapter, secs)) => {
                self.metrics.adapter_load.observe(secs);
                self.observe_disk_read(adapter.size_bytes() as u64, secs);
                self.mem.on_fetched(id, Some(adapter), &wanted);
                crate::memory::apply::stage_host(&mut self.mem, &mut self.engine, id, &wanted);
            }
            Err(msg) => {
                tracing::warn!("adapter {id}: {msg}");
                // Running requests too: one served from the mapped file fails with the read.
                self.fail_adapter_requests(id, &msg);
                crate::memory::mapped::drop_mapped(&mut self.engine, &mut self.mem, id, &wanted);
                self.mem.on_fetched(id, None, &wanted);
            }
        }
    }

    /// The `no-cache` baseline after a step whose requests finished: their adapters leave the
    /// device now, unless a running request uses them or a waiting one wants them (all waiting
    /// requests here; the next plan trims to admission's view), so none stays cached while the
    /// server sits idle.
    fn drop_idle(&mut self) {
        let in_use = self.state.running_adapters();
        let wanted = self.state.waiting_adapters();
        let on_device = self.mem.pool().adapters().map(|(a, _)| a);
        let evict = crate::memory::nocache::idle_drops(on_device, &in_use, &wanted);
        if !evict.is_empty() {
            let plan = crate::memory::AdmitPlan {
                evict,
                ..Default::default()
            };
            self.apply_memory(&plan, &wanted);
        }
    }

    /// Carries out a memory plan and watches the new adapters land.
    fn apply_memory(&mut self, plan: &crate::memory::AdmitPlan, wanted: &HashSet<AdapterId>) {
        let prev = self.charge(Cause::Adapter);
        let registered = apply(
            &mut self.mem,
            &mut self.engine,
            plan,
            self.state.reserved_blocks,
            Upload::of(self.cold.policy),
            wanted,
            Some(&self.loader),
        );
        if self.cold.policy.serves_disk_miss_from_file() {
            let dtype = thaw_runtime::backend::Backend::lora_dtype(self.engine.backend());
            let model = self.engine.model_config();
            let mem = &mut self.mem;
            crate::memory::mapped::map_fetches(mem, &plan.fetch, model, dtype, wanted, |_, _| true);
        }
        // Whole uploads land asynchronously too on a GPU (the same pipeline): watch both.
        let mut landing = self.stats.landing.lock().unwrap_or_else(|e| e.into_inner());
        for id in registered {
            if let Some(l) = self.engine.adapter_landed(id) {
                landing.insert(id, l);
            }
        }
        drop(landing);
        self.charge(prev);
    }

    /// Forgets a request: out of the scheduler, out of the engine (frees KV), lease dropped.
    fn forget(&mut self, id: SeqId, reason: &'static str) {
        self.state.remove(id, &self.cfg);
        self.sched.remove(id);
        if let Some(l) = self.live.remove(&id) {
            if l.running || l.preempted {
                let _ = self.engine.remove_sequence(id);
            }
            if !l.running {
                self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            }
            self.metrics.count_finished(reason);
        }
    }

    fn drop_cancelled(&mut self) {
        let gone: Vec<SeqId> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.forget(id, "cancelled");
        }
    }

    fn abort_all(&mut self, msg: &str) {
        let ids: Vec<SeqId> = self.live.keys().copied().collect();
        for id in ids {
            let tx = self.live.get(&id).map(|l| l.events.clone());
            self.forget(id, "abort");
            if let Some(tx) = tx {
                let _ = tx.send(EngineEvent::Aborted(msg.to_string()));
            }
        }
        self.publish();
    }

    /// What the scheduler is told of a new request: its priority, its adapter's rank and how
    /// long its adapter needs to reach the device from the tier it is in.
    fn arrival(&self, adapter: Option<AdapterId>, sub: &Submission) -> Arrival {
        let mut a = Arrival {
            priority: sub.priority,
            ..Default::default()
        };
        let Some(id) = adapter else {
            return a;
        };
        a.rank = sub.lease.as_ref().map_or(0, |l| l.slot().rank);
        a.load_s = self.load_s(id);
        a.adapter_pages = self.absent_pages(id);
        a
    }

    /// Device pages adapter `id` must be given, 0 when it is on the device or loading.
    fn absent_pages(&self, id: AdapterId) -> usize {
        match self.mem.state(id) {
            Some(s) if s.device != Device::Absent => 0,
            _ => self.mem.device_pages(id).unwrap_or(0),
        }
    }

    /// Predicted seconds until adapter `id` is on the device from the tier it is in.
    fn load_s(&self, id: AdapterId) -> f64 {
        let bytes = self.mem.bytes(id).unwrap_or(0);
        let backlog = self.engine.backend().link_backlog();
        match self.mem.state(id) {
            Some(s) if s.device == Device::Resident => 0.0,
            Some(s) if s.device == Device::Loading => match self.engine.adapter_landed(id) {
                Some((landed, layers)) if landed < layers => {
                    let left = 1.0 - landed as f64 / layers.max(1) as f64;
                    let b = (bytes as f64 * left) as u64;
                    self.cold.cost.load_time_from(Tier::Host, b, backlog)
                }
                _ => 0.0,
            },
            Some(s) if s.in_host => self.cold.cost.load_time_from(Tier::Host, bytes, backlog),
            _ => self.cold.cost.load_time_from(Tier::Disk, bytes, backlog),
        }
    }
}
