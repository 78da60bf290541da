//! `thaw-bench upload-stall`: does loading cold adapters slow the requests already running?
//!
//! A batch of decoding requests runs step after step on the CPU backend (emulated link). In
//! *quiet* rounds nothing else happens; in *loading* rounds a distinct cold adapter is
//! registered every `--every` steps, from the host tier (already in memory) or from disk (a
//! loader thread reads it, as the server's does). A step counts as "loading" when an adapter
//! is being read or is still landing as it starts, "quiet" otherwise. The engine thread's time is charged by
//! cause with the server's own stopwatch ([`thaw_server::perf::Stopwatch`]): "adapter" is
//! what registering costs the engine thread, which with the upload pipeline is O(layers),
//! not O(bytes). Rounds go quiet, loading, loading, quiet, … so that drift (and the context,
//! which grows every step) hits both kinds alike; a quiet round first waits, with no step
//! running, for the loads still in flight (on a loaded host they lag by seconds, and before
//! this only the first round stayed quiet), and the table says how long it waited.
//!
//! The "disk, layer by layer" row maps each file instead (header only) and registers it at
//! once: the upload pipeline's loader threads read each layer from the file, check it (file
//! unchanged, weights finite) and encode it into the arena, and its copy is queued as soon as
//! that layer is in, so the first layers land while later ones are still read. It is the
//! server's path for a disk miss under every cold-start policy, `cached` included
//! (`ColdStartPolicy::serves_disk_miss_from_file`). The "disk, whole file first" row is what a
//! miss costs whose file cannot be served as stored (the backend converts its dtype, so the
//! loader reads it whole first); until the change above, every `cached` miss.
//!
//! Next to the TPOT change it reports each load's latency (from its start — registering, or
//! asking the loader to read it — to its first and its last layer landed, polled once a step),
//! so pacing that starves loads shows: the CPU backend paces the pipeline's byte work against its steps
//! (`thaw_runtime::upload::pace`, `THAW_UPLOAD_BUSY_SHARE`). `--loads-per-s` registers loads
//! at a wall-clock rate instead of every `--every` steps (2: the GPU acceptance's distinct
//! adapter per request at 2 req/s).
//!
//! The upload arena is sized to hold every host-tier adapter (`--max-cpu-lora-bytes` as a server
//! sizes it for its host tier), and the host-tier adapters are staged into it before the run, as
//! the server does when an adapter enters the host tier: a host-tier load then only copies.
//!
//! Attribution switches (environment, read once): `THAW_ARENA_KEEP=0` (no image kept or staged:
//! every load encodes its adapter into the arena, as before the arena was the host tier's
//! memory), `THAW_UPLOAD_ENCODE=0` (the loader writes no image into the arena),
//! `THAW_STORE_FILL=0` (the host store is never filled), `THAW_UPLOAD_BUSY_SHARE=1` (no pacing),
//! `THAW_UPLOAD_STREAMING=0` (the loader and the store fill copy through the caches instead of
//! with non-temporal stores), `THAW_BACKGROUND_SCHED=idle` (the byte-moving threads at
//! `SCHED_IDLE` instead of nice 10); the disk read is a "disk" row against the "host tier"
//! row, the store fill the "CPU workers attached" row against it.
//!
//! `--pack-on-engine` adds the old CUDA path for contrast: the engine thread itself copies
//! every byte of the adapter into a staging buffer before queueing it (what `try_stream_lora`
//! did), so its stall shows on the CPU too. Figures are CPU-backend figures with an emulated
//! link; the table says so.
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cpu_par::CpuThreads;
use thaw_runtime::backend::Backend as _;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::residency::LinkModel;
use thaw_runtime::sampling::SamplingParams;
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};
use thaw_server::perf::{Cause, EngineTime, Stopwatch};

/// Options of `thaw-bench upload-stall`.
#[derive(clap::Args, Clone, Debug)]
pub struct UploadStallArgs {
    /// Model preset.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// LoRA rank of the cold adapters (all seven projections).
    #[arg(long, default_value_t = 512)]
    pub rank: usize,
    /// Ranks to compare (comma-separated); overrides --rank. The adapter work per adapter
    /// stays flat across ranks when it is O(layers).
    #[arg(long, value_delimiter = ',')]
    pub ranks: Vec<usize>,
    /// Stored dtype of the generated adapters: f32, f16 or bf16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Requests decoding in the background (one row each per step).
    #[arg(long, default_value_t = 4)]
    pub running: usize,
    /// Steps per round.
    #[arg(long, default_value_t = 48)]
    pub steps: usize,
    /// Rounds of each kind (quiet, loading, loading, quiet, …).
    #[arg(long, default_value_t = 4)]
    pub rounds: usize,
    /// A cold adapter is registered every this many steps of a loading round.
    #[arg(long, default_value_t = 4)]
    pub every: usize,
    /// Register cold adapters at this many a second (wall clock) in loading rounds instead of
    /// every --every steps; 2 is the GPU acceptance's distinct adapter per request at 2 req/s.
    #[arg(long)]
    pub loads_per_s: Option<f64>,
    /// Emulated host → device link, GB/s.
    #[arg(long, default_value_t = 25.0)]
    pub emulated_link_gbps: f64,
    /// Threads the CPU backend computes the forward on. One leaves the other cores to the
    /// pipeline's loader and copy threads, as a GPU server's engine thread leaves the host's.
    #[arg(long, default_value_t = 1)]
    pub compute_threads: usize,
    /// Also run the old path: the engine thread copies every byte before queueing.
    #[arg(long)]
    pub pack_on_engine: bool,
    /// Also run with a CPU LoRA worker attached (what `cpu-assist` and `auto` run with):
    /// registering a streaming adapter then also copies it into the workers' host store.
    #[arg(long)]
    pub with_workers: bool,
    /// Where to generate the model and adapters (reused when present).
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// A seconds-long version (tiny model, rank 16) for the test suite.
    #[arg(long)]
    pub quick: bool,
}

/// Where a loading round's adapters come from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Source {
    /// In host memory already: registering is the whole cold start.
    Host,
    /// Read whole from disk by a loader thread, then registered: a miss whose file the backend
    /// cannot serve as stored (a dtype conversion).
    Disk,
    /// On disk, mapped by a loader thread (header only) and registered at once: the upload
    /// pipeline's loader threads read each layer from the file, check it and encode it, and
    /// its copy is queued as soon as it is in the arena.
    DiskByLayer,
    /// Host tier, the engine thread copying every byte first (the old CUDA path).
    PackOnEngine,
    /// Host tier, with a CPU LoRA worker pool attached (its host store takes a copy).
    Workers,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Host => "host tier",
            Source::Disk => "disk, whole file first",
            Source::DiskByLayer => "disk, layer by layer",
            Source::PackOnEngine => "host, pack on engine thread",
            Source::Workers => "host, CPU workers attached",
        }
    }
}

/// Step times of the steps that ran while adapters loaded (or not), and the adapter work.
#[derive(Default, Debug, Clone)]
struct Phase {
    step_s: Vec<f64>,
    /// The engine thread's CPU time in each step: what a step costs while it runs, without
    /// the time it waited for a core (other processes on a shared machine).
    step_cpu_s: Vec<f64>,
    adapter_s: f64,
    adapter_cpu_s: f64,
    loads: usize,
    /// Seconds from each finished load's start to its last layer landed.
    load_s: Vec<f64>,
    /// Seconds from each load's start to its first layer landed (polled once a step).
    first_s: Vec<f64>,
    /// Loads still reading or landing when the run ended.
    unfinished: usize,
    /// CPU seconds the loads cost off the engine thread: the pipeline's loader threads
    /// (reading, checking and writing into the arena) and, for the disk source, the disk
    /// loader's read.
    loader_cpu_s: f64,
    /// Seconds quiet rounds waited, with no step running, for loads still in flight.
    drain_s: f64,
}

impl Phase {
    fn mean(&self) -> f64 {
        self.step_s.iter().sum::<f64>() / self.step_s.len().max(1) as f64
    }

    fn p50(&self) -> f64 {
        median(&self.step_s)
    }

    fn mean_cpu(&self) -> f64 {
        self.step_cpu_s.iter().sum::<f64>() / self.step_cpu_s.len().max(1) as f64
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// One table row.
#[derive(Debug, Clone)]
pub struct StallRow {
    pub rank: usize,
    pub source: &'static str,
    pub adapter_mb: f64,
    pub layers: usize,
    pub loads: usize,
    pub adapter_us_per_load: f64,
    pub adapter_us_per_layer: f64,
    /// The engine thread's CPU time in adapter work, per load.
    pub adapter_cpu_us_per_load: f64,
    pub quiet_tpot_ms: f64,
    pub loading_tpot_ms: f64,
    pub quiet_p50_ms: f64,
    pub loading_p50_ms: f64,
    /// Steps that ran quiet, and while adapters loaded.
    pub steps: (usize, usize),
    /// Mean engine-thread CPU time of a step, quiet and while adapters load, ms.
    pub quiet_cpu_ms: f64,
    pub loading_cpu_ms: f64,
    /// Load latency (start to last layer landed) of the finished loads: mean, p50, max, ms.
    pub load_ms: (f64, f64, f64),
    /// Start to first layer landed, p50 ms (polled once a step, so within a step of it).
    pub first_layer_ms: f64,
    /// Loads not finished when the run ended (pacing that starves loads shows here).
    pub unfinished: usize,
    /// CPU ms a load costs off the engine thread (loader threads: read, check, arena write).
    pub loader_cpu_ms_per_load: f64,
    /// Seconds the quiet rounds waited for loads still in flight (no step ran meanwhile).
    pub drain_s: f64,
}

impl StallRow {
    /// Relative change of the mean TPOT while adapters load.
    pub fn tpot_change(&self) -> f64 {
        self.loading_tpot_ms / self.quiet_tpot_ms - 1.0
    }

    /// Relative change of the engine thread's mean CPU time a step while adapters load.
    pub fn cpu_change(&self) -> f64 {
        self.loading_cpu_ms / self.quiet_cpu_ms - 1.0
    }
}

fn dtype(name: &str) -> anyhow::Result<gen::WeightDtype> {
    Ok(match name {
        "f32" => gen::WeightDtype::F32,
        "f16" => gen::WeightDtype::F16,
        "bf16" => gen::WeightDtype::Bf16,
        _ => anyhow::bail!("unknown --dtype {name}; use f32, f16 or bf16"),
    })
}

fn prepare(
    args: &UploadStallArgs,
    root: &Path,
    rank: usize,
    count: usize,
) -> anyhow::Result<(HostModel, Vec<PathBuf>)> {
    let preset =
        gen::preset(&args.preset).with_context(|| format!("unknown --preset {}", args.preset))?;
    let model_dir = root.join(format!("model-{}", args.preset));
    if !model_dir.join("config.json").exists() {
        gen::write_model(&preset, &model_dir, &GenModelOptions::default())?;
    }
    let dir = root.join(format!(
        "adapters-{}-r{rank}-{}-all-{count}",
        args.preset, args.dtype
    ));
    let mut dirs: Vec<PathBuf> = if dir.exists() {
        std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect()
    } else {
        Vec::new()
    };
    if dirs.len() != count {
        let _ = std::fs::remove_dir_all(&dir);
        eprintln!(
            "generating {count} rank-{rank} adapters into {}",
            dir.display()
        );
        dirs = gen::write_adapters(&GenAdaptersOptions {
            model_dir: model_dir.clone(),
            out_dir: dir,
            count,
            ranks: vec![rank],
            targets: Projection::ALL.to_vec(),
            dtype: Some(dtype(&args.dtype)?),
            ..Default::default()
        })?;
    }
    dirs.sort();
    Ok((HostModel::load(&model_dir)?, dirs))
}

/// Runs the background batch through quiet and loading rounds for one source.
fn run_source(
    args: &UploadStallArgs,
    model: &HostModel,
    dirs: &[PathBuf],
    host: &[Arc<LoraAdapter>],
    source: Source,
) -> anyhow::Result<(Phase, Phase)> {
    let link = LinkModel {
        gbps: args.emulated_link_gbps,
        latency_us: LinkModel::default().latency_us,
    };
    // Room for every host-tier adapter's image (256-byte alignment a factor), and
    // the disk source's copies.
    let images: usize = host
        .iter()
        .map(|a| a.size_bytes() + 512 * a.iter().count())
        .sum();
    let backend =
        CpuBackend::with_threads(&model.config, CpuThreads::unpinned(args.compute_threads))?
            .with_link(link)
            .with_upload_arena(2 * images + (64 << 20))?;
    let cfg = EngineConfig {
        num_kv_blocks: 2048,
        ..Default::default()
    };
    let mut e = Engine::new(backend, model.clone(), cfg)?;
    let from_disk = matches!(source, Source::Disk | Source::DiskByLayer);
    if !from_disk {
        // In the host tier: their images are written into the arena before the run.
        for a in host {
            e.stage_adapter(a);
        }
        let t0 = Instant::now();
        while e.backend().upload_arena().is_some_and(|u| !u.idle) {
            anyhow::ensure!(t0.elapsed().as_secs() < 300, "staging the host tier hung");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    if source == Source::Workers {
        e.attach_pool(worker_pool(model, host)?)?;
    }
    let total_steps = 2 * args.rounds * args.steps + 1;
    let mut plan = StepPlan::default();
    for i in 0..args.running {
        let id = SeqId(i as u64 + 1);
        e.add_sequence(
            id,
            SequenceParams {
                prompt: (0..16).map(|t| (t * 7 + i as u32) % 100 + 3).collect(),
                sampling: SamplingParams::default(),
                max_new_tokens: total_steps + 32,
                ignore_eos: true,
                ..Default::default()
            },
        )?;
        plan.items.push(PlanItem {
            seq: id,
            num_tokens: 16,
        });
    }
    e.step(&plan)?; // prefill
    for it in &mut plan.items {
        it.num_tokens = 1;
    }
    // Disk reads on a loader thread, handed over as the server's loader does.
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Arc<LoraAdapter>)>();
    let (job_tx, job_rx) = std::sync::mpsc::channel::<(usize, Instant)>();
    let loader = {
        let (dirs, config) = (dirs.to_vec(), model.config.clone());
        let by_layer = source == Source::DiskByLayer;
        std::thread::spawn(move || {
            thaw_runtime::upload::lower_current_thread_priority();
            for (i, asked) in job_rx {
                let a = if by_layer {
                    LoraAdapter::map(&dirs[i], &config)
                } else {
                    LoraAdapter::load_host(&dirs[i], &config, None)
                };
                if let Ok(a) = a {
                    let _ = tx.send((asked, Arc::new(a)));
                }
            }
            thaw_ipc::thread_cpu_time()
        })
    };
    let mut clock = Clock::new();
    let encode_cpu =
        |e: &Engine<CpuBackend>| e.backend().upload_arena().map_or(0, |u| u.encode_cpu_ns);
    let encode_cpu0 = encode_cpu(&e);
    let (mut quiet, mut loading) = (Phase::default(), Phase::default());
    let mut next = 0usize;

    let mut loads = Loads {
        rx,
        pending: 0,
        live: Vec::new(),
        ids: 1000u32..,
    };
    let mut staging: Vec<u8> = Vec::new();
    for round in 0..2 * args.rounds {
        // Quiet, loading, loading, quiet, …: both kinds have the same mean position in the run.
        // The context grows every step (attention and KV reads grow with it, ~1-3% a round
        // here), so plain alternation would charge the loading rounds one round more of it.
        let is_loading = matches!(round % 4, 1 | 2);
        if !is_loading {
            // Loads still in flight finish before a quiet round starts, with no step running
            // (on a loaded host they can be seconds behind): quiet rounds stay quiet and keep
            // their place in the run, instead of only the first round counting as quiet.
            let t0 = Instant::now();
            while loads.in_flight() && t0.elapsed() < DRAIN_LIMIT {
                loads.poll(&mut e, &mut loading, &mut clock)?;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            loading.drain_s += t0.elapsed().as_secs_f64();
        }
        let (round_start, mut issued) = (Instant::now(), 0usize);
        for s in 0..args.steps {
            // Loads due now: every --every steps, or at --loads-per-s from the round's start.
            let due = match args.loads_per_s {
                Some(rate) => (round_start.elapsed().as_secs_f64() * rate) as usize + 1,
                None => s / args.every.max(1) + 1,
            };
            while is_loading && issued < due {
                issued += 1;
                match source {
                    Source::Disk | Source::DiskByLayer => {
                        job_tx.send((next % dirs.len(), Instant::now()))?;
                        loads.pending += 1;
                    }
                    Source::Host | Source::PackOnEngine | Source::Workers => {
                        clock.switch(Cause::Adapter);
                        let started = Instant::now();
                        let a = host[next % host.len()].clone();
                        if source == Source::PackOnEngine {
                            pack(&a, &mut staging);
                        }
                        let id = AdapterId(loads.ids.next().expect("unbounded"));
                        e.register_adapter_streaming(id, a)?;
                        loads.live.push((id, started, false));
                        clock.switch(Cause::Schedule);
                    }
                }
                next += 1;
                loading.loads += 1;
            }
            loads.poll(&mut e, &mut loading, &mut clock)?;
            // A step runs "while adapters load" if one is being read or is still landing.
            let busy = loads.in_flight();
            clock.switch(Cause::Forward);
            let (t, cpu) = (Instant::now(), thaw_ipc::thread_cpu_time());
            e.step(&plan)?;
            let dt = t.elapsed().as_secs_f64();
            let dcpu = thaw_ipc::thread_cpu_time()
                .saturating_sub(cpu)
                .as_secs_f64();
            clock.switch(Cause::Schedule);
            let phase = if busy { &mut loading } else { &mut quiet };
            phase.step_s.push(dt);
            phase.step_cpu_s.push(dcpu);
        }
    }
    // Reads still in flight: registered now (a quick run can outpace the disk); they and the
    // adapters still landing are the loads the run did not finish.
    loading.unfinished = loads.pending + loads.live.len();
    while loads.pending > 0 {
        let (_, a) = loads.rx.recv()?;
        loads.pending -= 1;
        clock.switch(Cause::Adapter);
        e.register_adapter_streaming(AdapterId(loads.ids.next().expect("unbounded")), a)?;
        clock.switch(Cause::Schedule);
    }
    drop(job_tx);
    let read_cpu = loader.join().unwrap_or_default();
    // The last copies' encode: wait for the pipeline to be idle before reading its CPU time.
    let t0 = Instant::now();
    while e.backend().upload_arena().is_some_and(|u| !u.idle) && t0.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    loading.loader_cpu_s = read_cpu.as_secs_f64() + (encode_cpu(&e) - encode_cpu0) as f64 * 1e-9;
    if let Some(mut pool) = e.detach_pool() {
        pool.shutdown();
    }
    // Every registration and eviction is charged to the loads that caused it.
    clock.switch(Cause::Schedule);
    loading.adapter_s = clock.totals.seconds(Cause::Adapter);
    loading.adapter_cpu_s = clock.adapter_cpu.as_secs_f64();
    Ok((quiet, loading))
}

/// The longest a quiet round waits for the loads still in flight before it starts anyway.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The loads in flight: reads not back yet, and registered adapters still landing (with when
/// their load started and whether their first layer was seen landed).
struct Loads {
    rx: std::sync::mpsc::Receiver<(Instant, Arc<LoraAdapter>)>,
    pending: usize,
    live: Vec<(AdapterId, Instant, bool)>,
    ids: std::ops::RangeFrom<u32>,
}

impl Loads {
    /// Whether a load is being read or is still landing.
    fn in_flight(&self) -> bool {
        self.pending > 0 || !self.live.is_empty()
    }

    /// Registers the reads that came back and retires the adapters fully landed, charging it
    /// to adapter work and the loads' latencies to `loading`.
    fn poll(
        &mut self,
        e: &mut Engine<CpuBackend>,
        loading: &mut Phase,
        clock: &mut Clock,
    ) -> anyhow::Result<()> {
        while let Ok((asked, a)) = self.rx.try_recv() {
            self.pending -= 1;
            clock.switch(Cause::Adapter);
            let id = AdapterId(self.ids.next().expect("unbounded"));
            e.register_adapter_streaming(id, a)?;
            self.live.push((id, asked, false));
            clock.switch(Cause::Schedule);
        }
        // Adapters fully landed leave again (the cache would evict them later): keeps memory
        // flat over a long run. Evicting is adapter work too.
        clock.switch(Cause::Adapter);
        self.live.retain_mut(|(id, started, first)| {
            let (id, started) = (*id, *started);
            let now = e.adapter_landed(id);
            if !*first && now.is_none_or(|(l, _)| l > 0) {
                *first = true;
                loading.first_s.push(started.elapsed().as_secs_f64());
            }
            let landed = now.is_none_or(|(l, n)| l == n);
            if landed {
                loading.load_s.push(started.elapsed().as_secs_f64());
                let _ = e.unregister_adapter(id);
            }
            !landed
        });
        clock.switch(Cause::Schedule);
        Ok(())
    }
}

/// The server's stopwatch, plus the engine thread's CPU time in adapter work: wall time also
/// counts the engine thread being preempted (a 2-core machine shares its cores with the
/// pipeline's threads), CPU time only what the engine thread itself did.
struct Clock {
    totals: EngineTime,
    watch: Stopwatch,
    adapter_cpu: std::time::Duration,
    mark: std::time::Duration,
}

impl Clock {
    fn new() -> Self {
        Self {
            totals: EngineTime::default(),
            watch: Stopwatch::new(Instant::now()),
            adapter_cpu: std::time::Duration::ZERO,
            mark: thaw_ipc::thread_cpu_time(),
        }
    }

    fn switch(&mut self, to: Cause) {
        let now = thaw_ipc::thread_cpu_time();
        if self.watch.switch(to, &self.totals) == Cause::Adapter {
            self.adapter_cpu += now.saturating_sub(self.mark);
        }
        self.mark = now;
    }
}

/// One CPU LoRA worker (this executable's `lora-worker`) over a host store with room for a
/// few adapters, as `thaw serve` starts for `cpu-assist`.
fn worker_pool(
    model: &HostModel,
    host: &[Arc<LoraAdapter>],
) -> anyhow::Result<thaw_cpu_lora::LoraPool> {
    let per = host.iter().map(|a| a.size_bytes()).max().unwrap_or(0) as u64;
    let store = thaw_ipc::HostStore::create(8 * per + (64 << 20), 64)?;
    let c = &model.config;
    let widest = c.hidden_size.max(c.intermediate_size).max(c.q_dim()) as u32;
    Ok(thaw_cpu_lora::LoraPool::new(
        thaw_cpu_lora::PoolConfig {
            cores: Some(vec![1]),
            pin: false,
            program: Some(std::env::current_exe()?),
            leading_args: vec!["lora-worker".into()],
            exchange: thaw_ipc::ExchangeConfig {
                max_rows: 512,
                max_d_in: widest,
                max_d_out: widest,
                ..Default::default()
            },
            ..Default::default()
        },
        store,
    )?)
}

/// The old CUDA path's host work, on the engine thread: every byte into a staging buffer.
fn pack(a: &LoraAdapter, staging: &mut Vec<u8>) {
    staging.clear();
    for (_, _, w) in a.iter() {
        staging.extend_from_slice(w.a.bytes());
        staging.extend_from_slice(w.b.bytes());
    }
    std::hint::black_box(&staging);
}

/// Runs the benchmark; returns the rows and the printed report.
pub fn run(args: &UploadStallArgs) -> anyhow::Result<(Vec<StallRow>, String)> {
    let mut args = args.clone();
    if args.quick {
        args.preset = "tiny".into();
        args.ranks = vec![16];
        args.steps = 8;
        args.rounds = 1;
        args.every = 2;
        args.running = 2;
    }
    if args.ranks.is_empty() {
        args.ranks = vec![args.rank];
    }
    let root = match &args.workdir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join("thaw-bench-upload-stall"),
    };
    std::fs::create_dir_all(&root)?;
    let loads = match args.loads_per_s {
        Some(_) => 16,
        None => args.rounds * args.steps.div_ceil(args.every.max(1)),
    };
    let count = loads.clamp(1, 16);
    let mut rows = Vec::new();
    for &rank in &args.ranks {
        let (model, dirs) = prepare(&args, &root, rank, count)?;
        let host: Vec<Arc<LoraAdapter>> = dirs
            .iter()
            // The host tier as the server's loader reads it: in place, verified (no heap
            // copy; `THAW_LOAD_IN_PLACE=0` reads into memory as before).
            .map(|d| LoraAdapter::load_host(d, &model.config, None).map(Arc::new))
            .collect::<Result<_, _>>()?;
        let mut sources = vec![Source::Host, Source::Disk, Source::DiskByLayer];
        if args.pack_on_engine {
            sources.push(Source::PackOnEngine);
        }
        if args.with_workers {
            sources.push(Source::Workers);
        }
        for source in sources {
            let (quiet, loading) = run_source(&args, &model, &dirs, &host, source)?;
            let layers = model.config.num_layers;
            let per_load = loading.adapter_s / loading.loads.max(1) as f64;
            rows.push(StallRow {
                rank,
                source: source.name(),
                adapter_mb: host[0].size_bytes() as f64 / 1e6,
                layers,
                loads: loading.loads,
                adapter_us_per_load: per_load * 1e6,
                adapter_us_per_layer: per_load * 1e6 / layers as f64,
                adapter_cpu_us_per_load: loading.adapter_cpu_s / loading.loads.max(1) as f64 * 1e6,
                quiet_tpot_ms: quiet.mean() * 1e3,
                loading_tpot_ms: loading.mean() * 1e3,
                quiet_p50_ms: quiet.p50() * 1e3,
                loading_p50_ms: loading.p50() * 1e3,
                steps: (quiet.step_s.len(), loading.step_s.len()),
                quiet_cpu_ms: quiet.mean_cpu() * 1e3,
                loading_cpu_ms: loading.mean_cpu() * 1e3,
                load_ms: (
                    loading.load_s.iter().sum::<f64>() / loading.load_s.len().max(1) as f64 * 1e3,
                    median(&loading.load_s) * 1e3,
                    loading.load_s.iter().copied().fold(0.0, f64::max) * 1e3,
                ),
                first_layer_ms: median(&loading.first_s) * 1e3,
                unfinished: loading.unfinished,
                loader_cpu_ms_per_load: loading.loader_cpu_s * 1e3 / loading.loads.max(1) as f64,
                drain_s: loading.drain_s,
            });
        }
    }
    let mut out = String::new();
    let schedule = match args.loads_per_s {
        Some(r) => format!("a load {r}/s"),
        None => format!("a load every {} steps", args.every),
    };
    let switches: Vec<String> = [
        "THAW_ARENA_KEEP",
        "THAW_LOAD_IN_PLACE",
        "THAW_UPLOAD_ENCODE",
        "THAW_STORE_FILL",
        "THAW_UPLOAD_BUSY_SHARE",
        "THAW_UPLOAD_STREAMING",
        "THAW_BACKGROUND_SCHED",
    ]
    .iter()
    .filter_map(|k| std::env::var(k).ok().map(|v| format!("{k}={v}")))
    .collect();
    writeln!(
        out,
        "\n## upload-stall: TPOT of {} running requests while distinct cold adapters load \
         ({} preset, {} adapters on all 7 projections, {schedule}, link {} GB/s emulated, {} \
         compute thread(s), byte work paced to {:.0}% of a step{}; CPU backend)\n",
        args.running,
        args.preset,
        args.dtype,
        args.emulated_link_gbps,
        args.compute_threads,
        thaw_runtime::upload::busy_pace().share() * 1e2,
        if switches.is_empty() {
            String::new()
        } else {
            format!(", {}", switches.join(" "))
        }
    )?;
    writeln!(
        out,
        "| rank | adapters from | MB each | layers | loads | adapter work / load µs (CPU µs) | / layer µs | steps quiet / loading | TPOT quiet ms (p50) | TPOT loading ms (p50) | TPOT change | step CPU ms quiet → loading (change) | load ms mean / p50 / max | first layer landed ms p50 | unfinished | loader CPU ms / load | quiet rounds waited s |"
    )?;
    writeln!(
        out,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )?;
    for r in &rows {
        writeln!(
            out,
            "| {} | {} | {:.1} | {} | {} | {:.0} ({:.0}) | {:.1} | {} / {} | {:.3} ({:.3}) | {:.3} ({:.3}) | {:+.1}% | {:.3} → {:.3} ({:+.1}%) | {:.0} / {:.0} / {:.0} | {:.0} | {} | {:.1} | {:.1} |",
            r.rank,
            r.source,
            r.adapter_mb,
            r.layers,
            r.loads,
            r.adapter_us_per_load,
            r.adapter_cpu_us_per_load,
            r.adapter_us_per_layer,
            r.steps.0,
            r.steps.1,
            r.quiet_tpot_ms,
            r.quiet_p50_ms,
            r.loading_tpot_ms,
            r.loading_p50_ms,
            r.tpot_change() * 1e2,
            r.quiet_cpu_ms,
            r.loading_cpu_ms,
            r.cpu_change() * 1e2,
            r.load_ms.0,
            r.load_ms.1,
            r.load_ms.2,
            r.first_layer_ms,
            r.unfinished,
            r.loader_cpu_ms_per_load,
            r.drain_s
        )?;
    }
    Ok((rows, out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: UploadStallArgs,
    }

    /// The quick run completes, registers adapters from both tiers and reports positive step
    /// times (a smoke run so the benchmark does not rot; no time is asserted).
    #[test]
    fn quick_run_reports_both_tiers() {
        let dir = tempfile::tempdir().unwrap();
        let cli = Cli::parse_from([
            "x",
            "--quick",
            "--pack-on-engine",
            "--workdir",
            dir.path().to_str().unwrap(),
        ]);
        let (rows, text) = run(&cli.args).unwrap();
        assert_eq!(rows.len(), 4);
        for r in &rows {
            assert!(r.loads > 0 && r.steps.0 > 0 && r.steps.1 > 0, "{r:?}");
            assert!(r.quiet_tpot_ms > 0.0 && r.loading_tpot_ms > 0.0, "{r:?}");
            assert!(r.adapter_us_per_load > 0.0, "{r:?}");
            assert!(r.adapter_mb > 0.0);
            assert!(r.unfinished <= r.loads, "{r:?}");
            assert!(r.unfinished == r.loads || r.load_ms.0 > 0.0, "{r:?}");
            assert!(r.load_ms.1 <= r.load_ms.2, "{r:?}");
            // A first layer lands before (or with) the last.
            assert!(
                r.unfinished == r.loads || r.first_layer_ms <= r.load_ms.2,
                "{r:?}"
            );
        }
        assert!(text.contains("| 16 | disk, whole file first |"), "{text}");
        assert!(text.contains("| 16 | disk, layer by layer |"), "{text}");
    }
}
