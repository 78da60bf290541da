//! The engine thread: owns the [`Engine`] and the scheduler state, takes commands from the
//! HTTP side over a channel and streams each request's tokens back over its own channel.
//!
//! Each turn it applies commands, drops requests whose receiver is gone (client
//! disconnected: the sequence and its KV are freed and its adapter lease released), asks the
//! pure policy ([`crate::scheduler::plan_step`]) for the next step, runs it and sends tokens.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, FinishReason, SequenceParams};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SampledToken;
use thaw_runtime::RuntimeError;
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::coldstart::{ColdDecision, ColdStartPolicy, CostModel};
use crate::error::ServerError;
use crate::metrics::Metrics;
use crate::registry::AdapterLease;
use crate::scheduler::{plan_step_gated, Gate, SchedConfig, SchedState, SeqState};

/// The engine the server runs (the CPU backend until the CUDA backend lands).
pub type ServeEngine = Engine<CpuBackend>;

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
}

enum Command {
    Submit {
        id: SeqId,
        sub: Box<Submission>,
        events: tmpsc::UnboundedSender<EngineEvent>,
    },
    Register {
        id: AdapterId,
        adapter: Arc<LoraAdapter>,
        reply: oneshot::Sender<Result<(), RuntimeError>>,
    },
    Unregister {
        id: AdapterId,
        reply: oneshot::Sender<Result<(), RuntimeError>>,
    },
    /// Stop taking work; abort whatever is left at `deadline`.
    Drain { deadline: Instant },
    /// Abort everything and exit the thread.
    Shutdown,
}

/// Numbers the loop publishes for /metrics and tests.
#[derive(Debug, Default)]
pub struct LoopStats {
    /// Requests submitted and not yet admitted (the queue `--max-queued-requests` bounds).
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub kv_used_blocks: AtomicUsize,
    pub kv_total_blocks: AtomicUsize,
    pub steps: AtomicU64,
    pub alive: AtomicBool,
    /// Row·modules whose LoRA delta CPU assist computed.
    pub cpu_assisted_rows: AtomicU64,
    /// Per adapter still streaming: (landed layers, layers). Resident adapters are absent.
    pub landing: std::sync::Mutex<HashMap<AdapterId, (usize, usize)>>,
    /// Adapters of the running and the waiting requests (`vllm:lora_requests_info`).
    pub lora: crate::metrics_protocol::LoraActivity,
    /// The cost model's fitted parameters as of the last step (`--dump-cost-model`).
    pub cost: std::sync::Mutex<Option<crate::coldstart::FittedCost>>,
}

impl LoopStats {
    /// Landed layers of a registered adapter, if it is still streaming.
    pub fn landing(&self, id: AdapterId) -> Option<(usize, usize)> {
        self.landing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .copied()
    }
}

/// How the engine thread treats adapters that are not on the device.
#[derive(Clone, Debug)]
pub struct ColdStart {
    pub policy: ColdStartPolicy,
    /// The cost model `auto` decides with (measured at start-up, refreshed online).
    pub cost: CostModel,
}

/// The HTTP side's handle on the engine thread. Cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
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

    /// Makes an adapter available to the engine (device tier).
    pub async fn register(
        &self,
        id: AdapterId,
        adapter: Arc<LoraAdapter>,
    ) -> Result<(), ServerError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Register { id, adapter, reply })?;
        rx.await
            .map_err(|_| ServerError::SchedulerGone)?
            .map_err(|e| ServerError::Internal(format!("registering adapter {id}: {e}")))
    }

    /// Sends an unregister; the returned receiver says how it went. Sending (not awaiting) keeps
    /// the order of commands, which the registry relies on.
    pub fn unregister(
        &self,
        id: AdapterId,
    ) -> Result<oneshot::Receiver<Result<(), RuntimeError>>, ServerError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Unregister { id, reply })?;
        Ok(rx)
    }

    /// Starts draining: requests still running at `deadline` are aborted.
    pub fn drain(&self, deadline: Instant) {
        let _ = self.tx.send(Command::Drain { deadline });
    }

    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }

    fn send(&self, c: Command) -> Result<(), ServerError> {
        self.tx.send(c).map_err(|_| ServerError::SchedulerGone)
    }
}

/// Starts the engine thread; `build` runs on it (the engine never crosses threads).
pub fn start(
    build: impl FnOnce() -> anyhow::Result<(ServeEngine, SchedConfig, ColdStart)> + Send + 'static,
    max_queued: usize,
    metrics: Arc<Metrics>,
) -> anyhow::Result<(EngineHandle, JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel();
    let stats = Arc::new(LoopStats::default());
    let (ready_tx, ready_rx) = mpsc::channel();
    let st = stats.clone();
    let thread = std::thread::Builder::new()
        .name("thaw-engine".into())
        .spawn(move || match build() {
            Ok((engine, cfg, cold)) => {
                let _ = ready_tx.send(Ok(()));
                st.alive.store(true, Ordering::SeqCst);
                Loop::new(engine, cfg, cold, st.clone(), metrics).run(rx);
                st.alive.store(false, Ordering::SeqCst);
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })?;
    ready_rx
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
    ))
}

/// A request the loop is serving.
struct Live {
    params: Option<SequenceParams>,
    events: tmpsc::UnboundedSender<EngineEvent>,
    _lease: Option<AdapterLease>,
    arrived: Instant,
    last_token: Option<Instant>,
    prompt_len: usize,
    generated: usize,
    running: bool,
}

struct Loop {
    engine: ServeEngine,
    cfg: SchedConfig,
    cold: ColdStart,
    state: SchedState,
    live: HashMap<SeqId, Live>,
    stats: Arc<LoopStats>,
    metrics: Arc<Metrics>,
    deadline: Option<Instant>,
}

const SHUTDOWN_MSG: &str =
    "the server shut down before this request finished (--shutdown-timeout elapsed)";

impl Loop {
    fn new(
        engine: ServeEngine,
        cfg: SchedConfig,
        cold: ColdStart,
        stats: Arc<LoopStats>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            engine,
            cfg,
            cold,
            state: SchedState::default(),
            live: HashMap::new(),
            stats,
            metrics,
            deadline: None,
        }
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            self.publish();
            if self.state.is_idle() {
                // While adapters stream in, wake up now and then to publish their landed
                // layers; otherwise sleep until a command arrives.
                let streaming = !self
                    .stats
                    .landing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_empty();
                let c = if streaming {
                    match rx.recv_timeout(Duration::from_millis(20)) {
                        Ok(c) => Some(c),
                        Err(mpsc::RecvTimeoutError::Timeout) => None,
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                } else {
                    match rx.recv() {
                        Ok(c) => Some(c),
                        Err(_) => break,
                    }
                };
                if let Some(c) = c {
                    if !self.handle(c) {
                        break;
                    }
                }
            }
            let mut stop = false;
            loop {
                match rx.try_recv() {
                    Ok(c) => {
                        if !self.handle(c) {
                            stop = true;
                            break;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
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
                // Nothing could be planned (should not happen while reservations hold):
                // wait for a command rather than spin.
                if let Ok(c) = rx.recv_timeout(Duration::from_millis(5)) {
                    if !self.handle(c) {
                        self.abort_all(SHUTDOWN_MSG);
                        break;
                    }
                }
            }
        }
        self.publish();
    }

    /// Applies one command; false means exit.
    fn handle(&mut self, c: Command) -> bool {
        match c {
            Command::Submit { id, sub, events } => {
                let prompt_len = sub.params.prompt.len();
                let mut seq = SeqState::new(id, prompt_len, sub.params.max_new_tokens);
                seq.adapter = sub.params.adapter;
                self.state.enqueue(seq);
                self.live.insert(
                    id,
                    Live {
                        params: Some(sub.params),
                        events,
                        _lease: sub.lease,
                        arrived: sub.arrived,
                        last_token: None,
                        prompt_len,
                        generated: 0,
                        running: false,
                    },
                );
            }
            Command::Register { id, adapter, reply } => {
                // `cached` makes an adapter resident at once; every other policy streams it
                // layer by layer and serves it in the meantime as the policy says.
                let layers = adapter.num_layers();
                let r = if self.cold.policy == ColdStartPolicy::Cached {
                    self.engine.register_adapter(id, adapter)
                } else {
                    self.engine.register_adapter_streaming(id, adapter)
                };
                if r.is_ok() && self.cold.policy != ColdStartPolicy::Cached {
                    self.stats
                        .landing
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id, (0, layers));
                }
                let _ = reply.send(r);
            }
            Command::Unregister { id, reply } => {
                let _ = reply.send(self.engine.unregister_adapter(id));
            }
            Command::Drain { deadline } => self.deadline = Some(deadline),
            Command::Shutdown => return false,
        }
        true
    }

    /// Forgets a request: out of the scheduler, out of the engine (frees KV), lease dropped.
    fn forget(&mut self, id: SeqId, reason: &'static str) {
        self.state.remove(id, &self.cfg);
        if let Some(l) = self.live.remove(&id) {
            if l.running {
                let _ = self.engine.remove_sequence(id);
            } else {
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

    /// Plans and runs one step; false if there was nothing to run.
    fn step(&mut self) -> bool {
        let free = self.engine.kv_usage().free_blocks();
        let engine = &self.engine;
        let cold = &self.cold;
        let gate = |s: &SeqState, planned: usize| cold_gate(engine, cold, s, planned);
        let mut d = plan_step_gated(&self.state, &self.cfg, free, &gate);
        for id in self.state.admit(d.admit, &self.cfg) {
            self.stats.waiting.fetch_sub(1, Ordering::SeqCst);
            let Some(l) = self.live.get_mut(&id) else {
                continue;
            };
            l.running = true;
            let params = l.params.take().unwrap_or_default();
            if let Err(e) = self.engine.add_sequence(id, params) {
                // Requests are validated before submission; this is a bug or a race with an
                // adapter unload, so the client gets the reason and the log the details.
                tracing::warn!(seq = %id, "engine refused a request: {e}");
                let _ = l.events.send(EngineEvent::Aborted(format!(
                    "the engine refused the request: {e}"
                )));
                l.running = false;
                self.state.remove(id, &self.cfg);
                self.live.remove(&id);
                self.metrics.count_finished("abort");
                d.plan.items.retain(|it| it.seq != id);
            }
        }
        if d.plan.items.is_empty() {
            return false;
        }
        debug_assert!(d.plan.items.iter().all(|it| {
            let s = self.state.running.iter().find(|s| s.id == it.seq);
            s.is_some_and(|s| {
                self.engine.blocks_needed(it.seq, it.num_tokens).ok()
                    == Some(s.blocks_needed(&self.cfg, it.num_tokens))
            })
        }));
        let tokens: usize = d.plan.items.iter().map(|i| i.num_tokens).sum();
        let assisted_before = self.engine.rows_assisted();
        let profile_before = self.engine.assist_profile();
        let started = Instant::now();
        let outputs = match self.engine.step(&d.plan) {
            Ok(o) => o,
            Err(e) => {
                tracing::error!("engine step failed: {e}; aborting the step's requests");
                for it in &d.plan.items {
                    if let Some(l) = self.live.get(&it.seq) {
                        let _ = l.events.send(EngineEvent::Aborted(
                            "internal error while running the model; see the server log".into(),
                        ));
                    }
                    self.forget(it.seq, "abort");
                }
                return true;
            }
        };
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let assisted = self.engine.rows_assisted() - assisted_before;
        if assisted == 0 {
            // Only steps the CPU did not stretch teach the model the device's speed.
            self.cold.cost.observe_step(tokens, started.elapsed());
        } else {
            let overhead = self
                .engine
                .assist_profile()
                .since(&profile_before)
                .overhead();
            self.cold
                .cost
                .observe_assisted_step(tokens, started.elapsed(), overhead);
            self.stats
                .cpu_assisted_rows
                .fetch_add(assisted, Ordering::Relaxed);
        }
        let now = Instant::now();
        let planned: Vec<(SeqId, usize)> =
            d.plan.items.iter().map(|i| (i.seq, i.num_tokens)).collect();
        let mut sampled = Vec::with_capacity(outputs.len());
        let mut finished = Vec::new();
        let mut to_send = Vec::with_capacity(outputs.len());
        for o in outputs {
            sampled.push(o.seq);
            let Some(l) = self.live.get_mut(&o.seq) else {
                continue;
            };
            match l.last_token {
                None => self
                    .metrics
                    .ttft
                    .observe(now.duration_since(l.arrived).as_secs_f64()),
                Some(t) => self
                    .metrics
                    .tpot
                    .observe(now.duration_since(t).as_secs_f64()),
            }
            l.last_token = Some(now);
            l.generated += 1;
            if let Some(f) = o.finish {
                finished.push(o.seq);
                self.metrics
                    .e2e
                    .observe(now.duration_since(l.arrived).as_secs_f64());
                self.metrics.add_tokens(l.prompt_len, l.generated);
                self.metrics.count_finished(match f {
                    FinishReason::Stop(_) => "stop",
                    FinishReason::Length => "length",
                });
            }
            to_send.push((
                l.events.clone(),
                EngineEvent::Token {
                    token: o.token,
                    finish: o.finish,
                    prompt_logprobs: o.prompt_logprobs,
                },
            ));
        }
        self.state.on_step(&planned, &sampled, &finished, &self.cfg);
        for id in finished {
            // The engine already dropped the sequence; dropping `Live` releases the lease.
            self.live.remove(&id);
        }
        // Book-keeping first, then the tokens: a client that saw its last token finds the
        // server's numbers (KV, leases, running) already updated.
        self.publish();
        for (tx, ev) in to_send {
            let _ = tx.send(ev);
        }
        true
    }

    fn publish(&self) {
        {
            let mut landing = self.stats.landing.lock().unwrap_or_else(|e| e.into_inner());
            landing.retain(|id, v| match self.engine.adapter_landed(*id) {
                Some((l, n)) if l < n => {
                    *v = (l, n);
                    true
                }
                _ => false,
            });
        }
        self.stats.lora.publish(
            self.state.running.iter().map(|s| s.adapter),
            self.state.waiting.iter().map(|s| s.adapter),
        );
        *self.stats.cost.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(crate::coldstart::FittedCost::from(&self.cold.cost));
        let kv = self.engine.kv_usage();
        self.stats
            .running
            .store(self.state.running.len(), Ordering::Relaxed);
        self.stats
            .kv_used_blocks
            .store(kv.used_blocks, Ordering::Relaxed);
        self.stats
            .kv_total_blocks
            .store(kv.total_blocks, Ordering::Relaxed);
    }
}

/// The cold-start gate of one prefilling request: go when its adapter is resident (or it has
/// none); otherwise as the policy says.
fn cold_gate(engine: &ServeEngine, cold: &ColdStart, s: &SeqState, planned: usize) -> Gate {
    let Some(id) = s.adapter else {
        return Gate::Go;
    };
    let Some((landed, layers)) = engine.adapter_landed(id) else {
        return Gate::Go; // not registered: admission fails with a clear error
    };
    if landed >= layers {
        return Gate::Go;
    }
    match cold.policy {
        ColdStartPolicy::Cached | ColdStartPolicy::CpuAssist => Gate::Go,
        ColdStartPolicy::OnDemand => Gate::Hold,
        ColdStartPolicy::Auto => {
            let Some(adapter) = engine.adapter_host(id) else {
                return Gate::Go;
            };
            let left = 1.0 - landed as f64 / layers.max(1) as f64;
            let load_left = cold.cost.load_time(
                (adapter.size_bytes_f32() as f64 * left) as u64,
                engine.backend().link_backlog(),
            );
            let pending = s.pending();
            match cold
                .cost
                .decide(adapter, pending, pending, planned, load_left)
            {
                ColdDecision::Wait => Gate::Hold,
                ColdDecision::Assist { max_chunk } => Gate::Cap(max_chunk),
            }
        }
    }
}
