//! CPU LoRA worker benchmarks, after CaraServe Fig. 17 and 18, next to the physical limits.
//!
//! * `thaw-bench lora-ipc`: invocation round trip of one LoRA call (16 tokens, hidden 4096,
//!   rank 64, q + v) on 1…N worker processes: shared memory with spinning and with futex
//!   waits vs a UNIX-domain-socket baseline that serialises the same data. The worker
//!   measures its own compute time; IPC = round trip − compute. Floors: the memcpy time of
//!   the bytes moved and a 1-row, 16-wide step (doorbell + bookkeeping).
//! * `thaw-bench lora-scaling`: 128 tokens (hidden 4096, rank 64, q, k, v, o) on 1…N worker
//!   processes vs one process with N threads running the same kernel; plus one worker's
//!   time against the token count (Fig. 18 left).
//!
//! Tables only; nothing is asserted about times. Worker processes are this executable's
//! hidden `lora-worker` / `lora-socket-worker` subcommands.

use std::os::unix::net::UnixListener;
use std::process::{Child, Command, Stdio};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::Context;
use thaw_cpu_lora::kernel::{flops, lora_delta, LoraMat, LoraProblem, Scratch};
use thaw_cpu_lora::{CalibrationShape, LoraJob, LoraPool, PoolConfig};
use thaw_ipc::{
    AdapterHandle, AdapterId, DType, ExchangeConfig, Generation, HostStore, LayerIdx,
    LayerModuleWeights, Module, ModuleMask, StoreConfig, WaitStrategy,
};

use crate::lora_socket::{adapter_weights, SCALE};

/// Options of `thaw-bench lora-ipc`.
#[derive(clap::Args, Clone, Debug)]
pub struct LoraIpcArgs {
    /// Largest number of worker processes (1..=N are measured).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Tokens per call.
    #[arg(long, default_value_t = 16)]
    pub tokens: u32,
    /// Hidden size.
    #[arg(long, default_value_t = 4096)]
    pub hidden: u32,
    /// LoRA rank.
    #[arg(long, default_value_t = 64)]
    pub rank: u32,
    /// Measured round trips per configuration (10% more are run first as warm-up).
    #[arg(long, default_value_t = 2000)]
    pub iters: usize,
    /// A seconds-long smoke run (hidden 256, rank 16, 30 iterations, ≤ 2 workers).
    #[arg(long)]
    pub quick: bool,
}

/// Options of `thaw-bench lora-scaling`.
#[derive(clap::Args, Clone, Debug)]
pub struct LoraScalingArgs {
    /// Largest number of workers / threads (1..=N are measured).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Tokens per step.
    #[arg(long, default_value_t = 128)]
    pub tokens: u32,
    /// Hidden size.
    #[arg(long, default_value_t = 4096)]
    pub hidden: u32,
    /// LoRA rank.
    #[arg(long, default_value_t = 64)]
    pub rank: u32,
    /// Measured steps per configuration.
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// A seconds-long smoke run (hidden 256, rank 16, 5 iterations, ≤ 2 workers).
    #[arg(long)]
    pub quick: bool,
}

const SEED: u64 = 17;

impl LoraIpcArgs {
    fn effective(&self) -> Self {
        if !self.quick {
            return self.clone();
        }
        Self {
            workers: self.workers.min(2),
            hidden: 256,
            rank: 16,
            iters: 30,
            ..self.clone()
        }
    }
}

impl LoraScalingArgs {
    fn effective(&self) -> Self {
        if !self.quick {
            return self.clone();
        }
        Self {
            workers: self.workers.min(2),
            hidden: 256,
            rank: 16,
            iters: 5,
            ..self.clone()
        }
    }
}

/// Machine line for the report: CPUs and load averages.
pub fn machine() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let l: Vec<&str> = load.split_whitespace().take(3).collect();
    format!(
        "{} CPUs, load average {} (1/5/15 min)",
        cpu_set().len(),
        l.join(" ")
    )
}

/// This process's cores, read once before the engine thread pins itself (workers and bench
/// threads are pinned explicitly, so they need not inherit a wide mask).
fn cpu_set() -> &'static [usize] {
    static SET: std::sync::OnceLock<Vec<usize>> = std::sync::OnceLock::new();
    SET.get_or_init(|| {
        let ids = core_affinity::get_core_ids().unwrap_or_default();
        let ids: Vec<usize> = ids.into_iter().map(|c| c.id).collect();
        if ids.is_empty() {
            vec![0]
        } else {
            ids
        }
    })
}

/// Pins the calling (engine) thread to the first core, so the scheduler does not put it
/// on a worker's core.
fn pin_engine() {
    core_affinity::set_for_current(core_affinity::CoreId { id: cpu_set()[0] });
}

/// Cores for `n` workers: every core but the first (the engine's) first, then the engine's
/// own if `n` exceeds them.
fn worker_cores(n: usize) -> Vec<usize> {
    let set = cpu_set();
    (0..n).map(|i| set[(1 + i) % set.len()]).collect()
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
}

/// A host store holding one adapter (layer 0, the given square modules) and a tiny one
/// (module O, 16 × 16, rank 1) for the doorbell floor.
fn store_for(
    hidden: usize,
    rank: usize,
    modules: &[Module],
) -> anyhow::Result<(HostStore, AdapterHandle, AdapterHandle)> {
    let w = adapter_weights(hidden, rank, SEED, modules.len());
    let bytes = (w.len() * 2 * rank * hidden * 4) as u64;
    let mut store = HostStore::create_with(StoreConfig {
        capacity_bytes: bytes + (64 << 20),
        max_adapters: 8,
        max_readers: 66,
    })?;
    let lm: Vec<LayerModuleWeights<'_>> = modules
        .iter()
        .zip(&w)
        .map(|(&module, (a, b))| LayerModuleWeights {
            layer: LayerIdx(0),
            module,
            rank: rank as u32,
            scale: SCALE,
            dtype: DType::F32,
            a_bytes: bytemuck::cast_slice(a),
            b_bytes: bytemuck::cast_slice(b),
        })
        .collect();
    let main = store.insert(AdapterId(1), Generation(1), &lm)?;
    let t = vec![0.25f32; 16];
    let tiny = LayerModuleWeights {
        layer: LayerIdx(0),
        module: Module::O,
        rank: 1,
        scale: 1.0,
        dtype: DType::F32,
        a_bytes: bytemuck::cast_slice(&t),
        b_bytes: bytemuck::cast_slice(&t),
    };
    let tiny = store.insert(AdapterId(2), Generation(1), &[tiny])?;
    Ok((store, main, tiny))
}

fn pool_for(
    n: usize,
    wait: WaitStrategy,
    rows: u32,
    hidden: u32,
    store: HostStore,
) -> anyhow::Result<LoraPool> {
    let cfg = PoolConfig {
        cores: Some(worker_cores(n)),
        exchange: ExchangeConfig {
            max_workers: n as u32,
            max_jobs: 64,
            max_inputs: 2,
            max_rows: rows.max(n as u32),
            max_d_in: hidden,
            max_d_out: hidden,
        },
        wait,
        min_chunk_rows: 1,
        calibration: vec![CalibrationShape {
            rank: 64,
            hidden,
            rows: 16,
        }],
        ..PoolConfig::default()
    };
    LoraPool::new(cfg, store).context("starting CPU LoRA workers")
}

/// One row of the lora-ipc table.
#[derive(Debug, Clone)]
pub struct IpcRow {
    /// Transport and wait mode.
    pub mode: String,
    /// Worker processes.
    pub workers: usize,
    /// Round trip p50 / p99, µs.
    pub rt: (f64, f64),
    /// Compute inside the worker (slowest worker) p50, µs.
    pub compute: f64,
    /// Round trip − compute, p50 / p99, µs.
    pub ipc: (f64, f64),
}

fn row(mode: &str, workers: usize, rt: &mut [f64], comp: &mut [f64], ipc: &mut [f64]) -> IpcRow {
    IpcRow {
        mode: mode.into(),
        workers,
        rt: (pct(rt, 0.5), pct(rt, 0.99)),
        compute: pct(comp, 0.5),
        ipc: (pct(ipc, 0.5), pct(ipc, 0.99)),
    }
}

fn shm_round_trips(
    a: &LoraIpcArgs,
    n: usize,
    wait: WaitStrategy,
    label: &str,
) -> anyhow::Result<Vec<IpcRow>> {
    let (h, rows) = (a.hidden as usize, a.tokens);
    let (store, main, tiny) = store_for(h, a.rank as usize, &[Module::Q, Module::V])?;
    let mut pool = pool_for(n, wait, rows, a.hidden, store)?;
    let x: Vec<f32> = (0..rows as usize * h)
        .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
        .collect();
    let mut dq = vec![0.0f32; rows as usize * h];
    let mut dv = dq.clone();
    let job = LoraJob {
        adapter: main,
        layer: LayerIdx(0),
        modules: [Module::Q, Module::V].into_iter().collect(),
        input: 0,
        rows: 0..rows,
    };
    let total = a.iters + a.iters / 10;
    let (mut rt, mut comp, mut ipc) = (vec![], vec![], vec![]);
    for i in 0..total {
        let t = Instant::now();
        pool.write_input(0, 0, &x, h)?;
        let ticket = pool.submit(std::slice::from_ref(&job))?;
        let rep = pool.wait(ticket, Instant::now() + Duration::from_secs(10))?;
        dq.copy_from_slice(pool.output(Module::Q, 0..rows)?);
        dv.copy_from_slice(pool.output(Module::V, 0..rows)?);
        let el = t.elapsed().as_secs_f64() * 1e6;
        if i >= a.iters / 10 {
            let c = rep.worker_compute_max.as_secs_f64() * 1e6;
            rt.push(el);
            comp.push(c);
            ipc.push(el - c);
        }
    }
    let mut out = vec![row(label, n, &mut rt, &mut comp, &mut ipc)];
    // Floor: one 16-wide row per worker through the same path.
    let tiny_job = LoraJob {
        adapter: tiny,
        layer: LayerIdx(0),
        modules: ModuleMask::EMPTY.with(Module::O),
        input: 1,
        rows: 0..n as u32,
    };
    let (mut rt, mut comp, mut ipc) = (vec![], vec![], vec![]);
    for i in 0..total {
        let t = Instant::now();
        let ticket = pool.submit(std::slice::from_ref(&tiny_job))?;
        let rep = pool.wait(ticket, Instant::now() + Duration::from_secs(10))?;
        let el = t.elapsed().as_secs_f64() * 1e6;
        if i >= a.iters / 10 {
            let c = rep.worker_compute_max.as_secs_f64() * 1e6;
            rt.push(el);
            comp.push(c);
            ipc.push(el - c);
        }
    }
    out.push(row(
        &format!("{label} 1-row floor"),
        n,
        &mut rt,
        &mut comp,
        &mut ipc,
    ));
    Ok(out)
}

/// Socket workers of the baseline; told to stop and reaped on drop.
struct SocketWorkers {
    children: Vec<Child>,
    socks: Vec<std::os::unix::net::UnixStream>,
    _dir: tempfile::TempDir,
}

impl SocketWorkers {
    fn start(n: usize, a: &LoraIpcArgs) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("lora.sock");
        let listener = UnixListener::bind(&path)?;
        let exe = std::env::current_exe()?;
        let mut me = Self {
            children: vec![],
            socks: vec![],
            _dir: dir,
        };
        for core in worker_cores(n) {
            let child = Command::new(&exe)
                .args(["lora-socket-worker", "--socket"])
                .arg(&path)
                .args([
                    "--hidden",
                    &a.hidden.to_string(),
                    "--rank",
                    &a.rank.to_string(),
                ])
                .args(["--seed", &SEED.to_string(), "--core", &core.to_string()])
                .stdin(Stdio::null())
                .spawn()?;
            me.children.push(child);
        }
        for _ in 0..n {
            me.socks.push(listener.accept()?.0);
        }
        Ok(me)
    }
}

impl Drop for SocketWorkers {
    fn drop(&mut self) {
        use std::io::Write;
        for s in &mut self.socks {
            let _ = s.write_all(&0u32.to_le_bytes());
        }
        for c in &mut self.children {
            let _ = c.wait();
        }
    }
}

fn socket_round_trips(a: &LoraIpcArgs, n: usize) -> anyhow::Result<IpcRow> {
    use std::io::{Read, Write};
    let (h, rows) = (a.hidden as usize, a.tokens as usize);
    let mut w = SocketWorkers::start(n, a)?;
    let x: Vec<f32> = (0..rows * h)
        .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
        .collect();
    let mut delta = vec![0.0f32; 2 * rows * h];
    let (mut sendbuf, mut recvbuf) = (Vec::<u8>::new(), Vec::<u8>::new());
    let total = a.iters + a.iters / 10;
    let (mut rt, mut comp, mut ipc) = (vec![], vec![], vec![]);
    let split = |k: usize| (k * rows / n)..((k + 1) * rows / n);
    for i in 0..total {
        let t = Instant::now();
        for (k, s) in w.socks.iter_mut().enumerate() {
            let r = split(k);
            sendbuf.clear();
            sendbuf.extend_from_slice(&(r.len() as u32).to_le_bytes());
            for v in &x[r.start * h..r.end * h] {
                sendbuf.extend_from_slice(&v.to_le_bytes());
            }
            s.write_all(&sendbuf)?;
        }
        let mut cmax = 0u64;
        for (k, s) in w.socks.iter_mut().enumerate() {
            let r = split(k);
            recvbuf.resize(8 + 2 * r.len() * h * 4, 0);
            s.read_exact(&mut recvbuf)?;
            cmax = cmax.max(u64::from_le_bytes(recvbuf[..8].try_into()?));
            let vals = recvbuf[8..]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let (q, v) = delta.split_at_mut(rows * h);
            let (qs, vs) = (
                &mut q[r.start * h..r.end * h],
                &mut v[r.start * h..r.end * h],
            );
            for (d, s) in qs.iter_mut().chain(vs.iter_mut()).zip(vals) {
                *d = s;
            }
        }
        let el = t.elapsed().as_secs_f64() * 1e6;
        if i >= a.iters / 10 {
            let c = cmax as f64 / 1e3;
            rt.push(el);
            comp.push(c);
            ipc.push(el - c);
        }
    }
    std::hint::black_box(&delta);
    Ok(row("socket", n, &mut rt, &mut comp, &mut ipc))
}

/// Memcpy bandwidth (GB/s) over a 64 MiB buffer: the floor of moving x in and Δ out.
fn memcpy_gbs() -> f64 {
    let n = 16 << 20;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    dst.copy_from_slice(&src);
    let t = Instant::now();
    for _ in 0..4 {
        dst.copy_from_slice(std::hint::black_box(&src));
    }
    std::hint::black_box(&dst);
    (4 * 2 * n * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// Runs `lora-ipc` and returns the rows of its table.
pub fn run_ipc(args: &LoraIpcArgs) -> anyhow::Result<Vec<IpcRow>> {
    let a = args.effective();
    pin_engine();
    let mut rows = vec![];
    for n in 1..=a.workers.max(1) {
        rows.extend(shm_round_trips(&a, n, WaitStrategy::spin(), "shm spin")?);
        rows.extend(shm_round_trips(
            &a,
            n,
            WaitStrategy::spin_then_futex(),
            "shm futex",
        )?);
        rows.push(socket_round_trips(&a, n)?);
    }
    Ok(rows)
}

/// The lora-ipc table.
pub fn ipc_table(args: &LoraIpcArgs, rows: &[IpcRow]) -> String {
    let a = args.effective();
    let bytes = 3.0 * f64::from(a.tokens) * f64::from(a.hidden) * 4.0;
    let gbs = memcpy_gbs();
    let mut s = format!(
        "LoRA invocation round trip: {} tokens, hidden {}, rank {}, q+v, f32 ({})\n\
         copy floor: {:.0} KB moved (x in, Δq Δv out) at {gbs:.1} GB/s memcpy = {:.1} µs\n\n",
        a.tokens,
        a.hidden,
        a.rank,
        machine(),
        bytes / 1e3,
        bytes / gbs / 1e3
    );
    s += &format!(
        "{:<22} {:>7} {:>10} {:>10} {:>12} {:>10} {:>10}\n",
        "mode", "workers", "RT p50 µs", "RT p99 µs", "compute p50", "IPC p50", "IPC p99"
    );
    for r in rows {
        s += &format!(
            "{:<22} {:>7} {:>10.1} {:>10.1} {:>12.1} {:>10.1} {:>10.1}\n",
            r.mode, r.workers, r.rt.0, r.rt.1, r.compute, r.ipc.0, r.ipc.1
        );
    }
    s
}

/// One row of the lora-scaling table.
#[derive(Debug, Clone)]
pub struct ScalingRow {
    /// Workers or threads.
    pub n: usize,
    /// Worker processes: step p50, ms.
    pub procs_ms: f64,
    /// One process, n threads: p50, ms.
    pub threads_ms: f64,
}

const QKVO: [Module; 4] = [Module::Q, Module::K, Module::V, Module::O];

fn procs_step_ms(a: &LoraScalingArgs, n: usize, tokens: u32) -> anyhow::Result<f64> {
    let h = a.hidden as usize;
    let (store, main, _) = store_for(h, a.rank as usize, &QKVO)?;
    // The engine parks while the workers compute (ms), leaving its core to a worker there.
    let mut pool = pool_for(n, WaitStrategy::spin_then_futex(), tokens, a.hidden, store)?;
    let x: Vec<f32> = (0..tokens as usize * h)
        .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
        .collect();
    pool.write_input(0, 0, &x, h)?;
    pool.write_input(1, 0, &x, h)?;
    let jobs = [
        LoraJob {
            adapter: main,
            layer: LayerIdx(0),
            modules: QKVO[..3].iter().copied().collect(),
            input: 0,
            rows: 0..tokens,
        },
        LoraJob {
            adapter: main,
            layer: LayerIdx(0),
            modules: ModuleMask::EMPTY.with(Module::O),
            input: 1,
            rows: 0..tokens,
        },
    ];
    let mut t = vec![];
    for i in 0..a.iters + 2 {
        let ticket = pool.submit(&jobs)?;
        let rep = pool.wait(ticket, Instant::now() + Duration::from_secs(60))?;
        if i >= 2 {
            t.push(rep.elapsed.as_secs_f64() * 1e3);
        }
    }
    Ok(pct(&mut t, 0.5))
}

fn threads_step_ms(a: &LoraScalingArgs, n: usize) -> f64 {
    let (h, r, tokens) = (a.hidden as usize, a.rank as usize, a.tokens as usize);
    let w = adapter_weights(h, r, SEED, 4);
    let x: Vec<f32> = (0..tokens * h)
        .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
        .collect();
    let mut outs: Vec<Vec<f32>> = (0..n).map(|_| vec![0.0; 4 * tokens * h]).collect();
    let start = Barrier::new(n + 1);
    let done = Barrier::new(n + 1);
    let iters = a.iters + 2;
    let mut t = vec![];
    let cores = worker_cores(n);
    std::thread::scope(|s| {
        for (k, out) in outs.iter_mut().enumerate() {
            let (w, x, start, done, core) = (&w, &x, &start, &done, cores[k]);
            s.spawn(move || {
                // Same placement as the worker processes.
                core_affinity::set_for_current(core_affinity::CoreId { id: core });
                let rows = (k * tokens / n)..((k + 1) * tokens / n);
                let p = LoraProblem {
                    rows: rows.len(),
                    d_in: h,
                    d_out: h,
                    rank: r,
                    scale: SCALE,
                };
                let xs = &x[rows.start * h..rows.end * h];
                let mut scratch = Scratch::for_problem(&p);
                for _ in 0..iters {
                    start.wait();
                    for (m, (wa, wb)) in w.iter().enumerate() {
                        let o = &mut out[m * tokens * h..m * tokens * h + rows.len() * h];
                        lora_delta(
                            &p,
                            xs,
                            LoraMat::from_f32(wa),
                            LoraMat::from_f32(wb),
                            o,
                            false,
                            &mut scratch,
                        )
                        .expect("shapes are consistent");
                    }
                    done.wait();
                }
            });
        }
        for i in 0..iters {
            let t0 = Instant::now();
            start.wait();
            done.wait();
            if i >= 2 {
                t.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
    });
    pct(&mut t, 0.5)
}

/// Results of `lora-scaling`.
#[derive(Debug, Clone)]
pub struct ScalingReport {
    /// One row per N.
    pub rows: Vec<ScalingRow>,
    /// One worker against the token count: (tokens, p50 ms) (Fig. 18 left).
    pub by_tokens: Vec<(u32, f64)>,
}

/// Runs `lora-scaling`.
pub fn run_scaling(args: &LoraScalingArgs) -> anyhow::Result<ScalingReport> {
    let a = args.effective();
    pin_engine();
    let mut rows = vec![];
    for n in 1..=a.workers.max(1) {
        rows.push(ScalingRow {
            n,
            procs_ms: procs_step_ms(&a, n, a.tokens)?,
            threads_ms: threads_step_ms(&a, n),
        });
    }
    let mut left = vec![];
    for tokens in [16, 32, 64, 128].into_iter().filter(|&t| t <= a.tokens) {
        left.push((tokens, procs_step_ms(&a, 1, tokens)?));
    }
    Ok(ScalingReport {
        rows,
        by_tokens: left,
    })
}

/// The lora-scaling tables.
pub fn scaling_table(args: &LoraScalingArgs, report: &ScalingReport) -> String {
    let (rows, left) = (&report.rows, &report.by_tokens);
    let a = args.effective();
    let p = |tokens: u32| LoraProblem {
        rows: tokens as usize,
        d_in: a.hidden as usize,
        d_out: a.hidden as usize,
        rank: a.rank as usize,
        scale: 1.0,
    };
    let gflop = 4.0 * flops(&p(a.tokens)) / 1e9;
    let wbytes = 4.0 * 2.0 * f64::from(a.rank) * f64::from(a.hidden) * 4.0;
    let mut s = format!(
        "LoRA prefill scaling: {} tokens, hidden {}, rank {}, q k v o, f32 ({})\n\
         work: {:.2} GFLOP and {:.1} MB of weights per step; ideal N-way time = (1-way time) / N\n\n",
        a.tokens,
        a.hidden,
        a.rank,
        machine(),
        gflop,
        wbytes / 1e6
    );
    s += &format!(
        "{:>3} {:>14} {:>14} {:>10} {:>10} {:>12} {:>12}\n",
        "N", "procs p50 ms", "threads p50 ms", "procs ×", "threads ×", "procs GF/s", "threads GF/s"
    );
    let (p1, t1) = rows
        .first()
        .map_or((1.0, 1.0), |r| (r.procs_ms, r.threads_ms));
    for r in rows {
        s += &format!(
            "{:>3} {:>14.3} {:>14.3} {:>10.2} {:>10.2} {:>12.1} {:>12.1}\n",
            r.n,
            r.procs_ms,
            r.threads_ms,
            p1 / r.procs_ms,
            t1 / r.threads_ms,
            gflop / r.procs_ms * 1e3,
            gflop / r.threads_ms * 1e3
        );
    }
    s += "\none worker process vs tokens (Fig. 18 left)\n";
    s += &format!("{:>7} {:>10} {:>8}\n", "tokens", "p50 ms", "GF/s");
    for &(tokens, ms) in left.iter() {
        s += &format!(
            "{:>7} {:>10.3} {:>8.1}\n",
            tokens,
            ms,
            4.0 * flops(&p(tokens)) / 1e9 / ms * 1e3
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_quick_runs() {
        let a = LoraScalingArgs {
            workers: 2,
            tokens: 16,
            hidden: 64,
            rank: 4,
            iters: 2,
            quick: false,
        };
        assert!(threads_step_ms(&a, 2) > 0.0);
        let report = ScalingReport {
            rows: vec![ScalingRow {
                n: 1,
                procs_ms: 1.0,
                threads_ms: 1.0,
            }],
            by_tokens: vec![(16, 1.0)],
        };
        let t = scaling_table(&a, &report);
        assert!(t.contains("threads p50 ms"));
    }
}
