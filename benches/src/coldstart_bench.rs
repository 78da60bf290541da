//! `thaw-bench cold-start-engine`: the four `--cold-start` policies on the engine alone
//! (CaraServe Fig. 10 on the CPU backend with an emulated link). Prints TTFT / TPOT / E2E per
//! policy with overheads relative to `cached`. CPU-backend figures with an emulated link.
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, Zipf};
use thaw_cpu_lora::{LoraPool, PoolConfig};
use thaw_ipc::HostStore;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel};
use thaw_runtime::residency::LinkModel;
use thaw_runtime::sampling::SamplingParams;
use thaw_server::coldstart::{
    self, calibrate, ColdStartPolicy, CostModel, DriverConfig, Request, RunReport, StartTier,
};
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};

use crate::trace::trace_lengths;

/// Options of `thaw-bench cold-start-engine`.
#[derive(clap::Args, Clone, Debug)]
pub struct ColdStartArgs {
    /// Model preset.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Requests per run.
    #[arg(long, default_value_t = 48)]
    pub requests: usize,
    /// LoRA rank (targets q, k, v, o).
    #[arg(long, default_value_t = 64)]
    pub rank: usize,
    /// Median prompt tokens of the synthetic run (uniform in [median/2, 3·median/2]).
    #[arg(long, default_value_t = 128)]
    pub prompt_median: usize,
    /// Output tokens per request of the synthetic run.
    #[arg(long, default_value_t = 32)]
    pub output_tokens: usize,
    /// Offered load as a fraction of the measured sustainable rate.
    #[arg(long, default_value_t = 0.7)]
    pub load: f64,
    /// Adapters of the Zipf run (popularity Zipf(1.0)).
    #[arg(long, default_value_t = 256)]
    pub zipf_adapters: usize,
    /// Trace for the second run's prompt/output lengths.
    #[arg(
        long,
        default_value = "../shared/traces/AzureLLMInferenceTrace_conv.csv"
    )]
    pub trace: PathBuf,
    /// CPU LoRA worker processes (0 = assist on the engine thread).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Largest prefill chunk per request per step.
    #[arg(long, default_value_t = 256)]
    pub max_chunk: usize,
    /// Skip the trace/Zipf run.
    #[arg(long)]
    pub no_trace_run: bool,
    /// A seconds-long version (tiny model, few requests) for the test suite.
    #[arg(long)]
    pub quick: bool,
    /// Where to generate the model and adapters (reused when present).
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// Where adapters start: `host` (in host memory, so a cold start is the host → device
    /// copy, as in CaraServe) or `disk` (the load from disk is part of the cold start too).
    #[arg(long, value_enum, default_value_t = StartFrom::Host)]
    pub start_tier: StartFrom,
    /// Print each request's timeline (adapter in host tier, first chunk planned, first token).
    #[arg(long)]
    pub timeline: bool,
    /// Policies to run (comma-separated); `cached` always runs, as the reference.
    #[arg(long, value_delimiter = ',', default_values_t = ColdStartPolicy::ALL)]
    pub policies: Vec<ColdStartPolicy>,
    /// Disk → host loader threads (reads taken first in, first out) [default: as `thaw
    /// serve`, the cores beside the engine's, 1 to 4].
    #[arg(long)]
    pub loader_threads: Option<usize>,
    /// Runs of every policy, interleaved (cached, on-demand, …, cached, on-demand, …), so a
    /// drift in the machine's speed hits every policy alike; the table pools all rounds.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
}

impl ColdStartArgs {
    fn loader_threads(&self) -> usize {
        self.loader_threads
            .unwrap_or_else(thaw_server::memory::loader::default_threads)
            .max(1)
    }
}

/// Where the benchmark's adapters start (`--start-tier`).
#[derive(clap::ValueEnum, Copy, Clone, Debug, PartialEq, Eq)]
pub enum StartFrom {
    Host,
    Disk,
}

impl StartFrom {
    fn name(self) -> &'static str {
        match self {
            StartFrom::Host => "the host (cold start = host → device copy)",
            StartFrom::Disk => "disk (cold start = disk load + host → device copy)",
        }
    }

    fn tier(self) -> StartTier {
        match self {
            StartFrom::Host => StartTier::Host,
            StartFrom::Disk => StartTier::Disk,
        }
    }
}

/// Summary of one policy's run.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyRow {
    pub policy: ColdStartPolicy,
    pub ttft_mean: f64,
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub tpot_mean: f64,
    pub e2e_mean: f64,
    pub completed: usize,
    pub failed: usize,
    pub rows_assisted: u64,
    /// Steps the CPU computed rows of (rows whose adapter had not landed, assisted).
    pub assisted_steps: usize,
    /// Adapters registered from their mapped files.
    pub disk_maps: u64,
    /// Requests whose adapter was not on the device when they arrived.
    pub misses: usize,
    /// What a miss waited for before its first token, means in seconds: disk, batch, copy
    /// ([`coldstart::Outcome::waits`]).
    pub miss_waits: [f64; 3],
    /// Misses started before their adapter landed, the step waiting for its layers (the
    /// server's `thaw_cold_start_layer_waits_total`).
    pub layer_waits: usize,
    /// Misses the gate held for their adapter's copy at least one step
    /// (`thaw_cold_start_holds_total`).
    pub held: usize,
}

/// One experiment: its setup line and its four rows.
#[derive(Clone, Debug)]
pub struct Experiment {
    pub title: String,
    /// Interleaved runs of every policy pooled into each row (`--rounds`).
    pub rounds: usize,
    pub rows: Vec<PolicyRow>,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

fn summarize(policy: ColdStartPolicy, r: &RunReport) -> PolicyRow {
    let mut ttft: Vec<f64> = r
        .outcomes
        .iter()
        .filter_map(|o| o.ttft)
        .map(|d| d.as_secs_f64())
        .collect();
    let tpot: Vec<f64> = r
        .outcomes
        .iter()
        .filter_map(|o| o.tpot())
        .map(|d| d.as_secs_f64())
        .collect();
    let e2e: Vec<f64> = r
        .outcomes
        .iter()
        .filter_map(|o| o.e2e)
        .map(|d| d.as_secs_f64())
        .collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    PolicyRow {
        policy,
        ttft_mean: mean(&ttft),
        ttft_p50: percentile(&mut ttft.clone(), 0.5),
        ttft_p99: percentile(&mut ttft, 0.99),
        tpot_mean: mean(&tpot),
        e2e_mean: mean(&e2e),
        completed: r.outcomes.iter().filter(|o| o.error.is_none()).count(),
        failed: r.outcomes.iter().filter(|o| o.error.is_some()).count(),
        rows_assisted: r.rows_assisted,
        assisted_steps: r.steps.iter().filter(|s| s.assisted).count(),
        disk_maps: r.disk_maps,
        misses: r.outcomes.iter().filter(|o| o.missed).count(),
        miss_waits: miss_waits(r.outcomes.iter().filter(|o| o.missed)),
        layer_waits: r.outcomes.iter().filter(|o| o.layer_wait).count(),
        held: r.outcomes.iter().filter(|o| o.held).count(),
    }
}

/// Mean (disk, batch, copy) waits of `misses` that got a first token, seconds.
fn miss_waits<'a>(misses: impl Iterator<Item = &'a coldstart::Outcome>) -> [f64; 3] {
    let (mut sum, mut n) = ([0.0; 3], 0usize);
    for (d, b, c) in misses.filter_map(|o| o.waits()) {
        for (s, w) in sum.iter_mut().zip([d, b, c]) {
            *s += w.as_secs_f64();
        }
        n += 1;
    }
    sum.map(|s| s / n.max(1) as f64)
}

/// The model, adapters and the worker executable for a run.
pub struct Bench {
    pub model: HostModel,
    pub adapter_dirs: Vec<PathBuf>,
    pub worker_program: PathBuf,
}

fn prepare(args: &ColdStartArgs, root: &Path, count: usize) -> anyhow::Result<Bench> {
    let preset =
        gen::preset(&args.preset).with_context(|| format!("unknown preset {}", args.preset))?;
    let model_dir = root.join(format!("model-{}", args.preset));
    if !model_dir.join("config.json").exists() {
        gen::write_model(&preset, &model_dir, &GenModelOptions::default())?;
    }
    let adapters_dir = root.join(format!("adapters-{}-r{}-{count}", args.preset, args.rank));
    let mut adapter_dirs: Vec<PathBuf> = if adapters_dir.exists() {
        std::fs::read_dir(&adapters_dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect()
    } else {
        Vec::new()
    };
    if adapter_dirs.len() != count {
        let _ = std::fs::remove_dir_all(&adapters_dir);
        adapter_dirs = gen::write_adapters(&GenAdaptersOptions {
            model_dir: model_dir.clone(),
            out_dir: adapters_dir,
            count,
            ranks: vec![args.rank],
            targets: vec![Projection::Q, Projection::K, Projection::V, Projection::O],
            ..Default::default()
        })?;
    }
    adapter_dirs.sort();
    Ok(Bench {
        model: HostModel::load(&model_dir)?,
        adapter_dirs,
        worker_program: std::env::current_exe()?,
    })
}

fn engine(b: &Bench, args: &ColdStartArgs, link: LinkModel) -> anyhow::Result<Engine<CpuBackend>> {
    let cfg = EngineConfig {
        max_batch_tokens: args.max_chunk.max(512),
        num_kv_blocks: 4096,
        ..Default::default()
    };
    let backend = CpuBackend::new(&b.model.config).with_link(link);
    let mut e = Engine::new(backend, b.model.clone(), cfg)?;
    if args.workers > 0 {
        let n = b.adapter_dirs.len() as u64;
        let per = b.adapter_dirs.first().map_or(0, |d| dir_size(d));
        let store = HostStore::create((n + 4) * per * 2 + (64 << 20), n as u32 + 8)?;
        // A warm host cache: its pages are committed, as after the first adapters passed
        // through a long-running server.
        store.populate();
        let cores: Vec<usize> = (1..=args.workers).collect();
        // The engine thread keeps core 0 to itself, as `thaw serve` does.
        if let Some(c) = core_affinity::get_core_ids().and_then(|c| c.into_iter().next()) {
            core_affinity::set_for_current(c);
        }
        let c = &b.model.config;
        let widest = c.hidden_size.max(c.intermediate_size).max(c.q_dim()) as u32;
        let pool = LoraPool::new(
            PoolConfig {
                cores: Some(cores),
                program: Some(b.worker_program.clone()),
                leading_args: vec!["lora-worker".into()],
                exchange: thaw_ipc::ExchangeConfig {
                    max_rows: args.max_chunk.max(512) as u32,
                    max_d_in: widest,
                    max_d_out: widest,
                    ..Default::default()
                },
                ..Default::default()
            },
            store,
        )?;
        e.attach_pool(pool)?;
    }
    Ok(e)
}

fn dir_size(d: &Path) -> u64 {
    std::fs::read_dir(d)
        .map(|it| {
            it.filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn run_all(
    b: &Bench,
    args: &ColdStartArgs,
    link: LinkModel,
    reqs: &[Request],
) -> anyhow::Result<Vec<PolicyRow>> {
    let adapters: Vec<(PathBuf, StartTier)> = b
        .adapter_dirs
        .iter()
        .map(|d| (d.clone(), args.start_tier.tier()))
        .collect();
    let policies: Vec<ColdStartPolicy> = ColdStartPolicy::ALL
        .into_iter()
        .filter(|p| *p == ColdStartPolicy::Cached || args.policies.contains(p))
        .collect();
    let rounds = args.rounds.max(1);
    let mut pooled: Vec<RunReport> = vec![RunReport::default(); policies.len()];
    for round in 1..=rounds {
        for (&policy, pool) in policies.iter().zip(&mut pooled) {
            let mut e = engine(b, args, link)?;
            let mut cost = calibrate(&mut e)?;
            let cfg = DriverConfig {
                policy,
                max_chunk: args.max_chunk,
                max_batch_tokens: args.max_chunk.max(512),
                loader_threads: args.loader_threads(),
            };
            let r = coldstart::run(&mut e, &adapters, reqs, &cfg, &mut cost);
            if let Some(mut pool) = e.detach_pool() {
                pool.shutdown();
            }
            report_run(policy, &r, &cost, args);
            if rounds > 1 {
                let row = summarize(policy, &r);
                eprintln!(
                    "  {policy}, round {round}/{rounds}: TTFT mean {:.1} ms, P99 {:.1} ms, TPOT {:.1} ms",
                    row.ttft_mean * 1e3,
                    row.ttft_p99 * 1e3,
                    row.tpot_mean * 1e3
                );
            }
            pool.outcomes.extend(r.outcomes);
            pool.rows_assisted += r.rows_assisted;
            pool.steps.extend(r.steps);
            pool.disk_maps += r.disk_maps;
        }
    }
    Ok(policies
        .iter()
        .zip(&pooled)
        .map(|(&p, r)| summarize(p, r))
        .collect())
}

/// What one policy's run did: the cost model it ended with, its steps, its first failure
/// and `auto`'s prediction error.
fn report_run(policy: ColdStartPolicy, r: &RunReport, cost: &CostModel, args: &ColdStartArgs) {
    eprintln!(
        "  {policy}: {} requests in {:.1?}; device {:.1} µs/layer + {:.2} µs/layer/token, assist overhead {:.0} µs/layer, CPU {:.1} GFLOP/s",
        r.outcomes.len(),
        r.wall,
        cost.layer_base_s * 1e6,
        cost.layer_per_token_s * 1e6,
        cost.assist_layer_overhead_s * 1e6,
        cost.cpu_flops / 1e9
    );
    eprintln!("{}", step_profile(policy, r, args.timeline));
    if let Some(e) = r.outcomes.iter().find_map(|o| o.error.as_ref()) {
        eprintln!("  {policy}: first failure: {e}");
    }
    if policy == ColdStartPolicy::Auto && !r.predictions.is_empty() {
        let err: f64 = r
            .predictions
            .iter()
            .map(|p| (p.predicted_s - p.actual_s).abs() / p.actual_s.max(1e-9))
            .sum::<f64>()
            / r.predictions.len() as f64;
        eprintln!(
            "  auto: {} TTFT predictions, mean relative error {:.0}%",
            r.predictions.len(),
            err * 100.0
        );
    }
}

/// How the run's steps went: decode-only vs with prefill, warm vs cold, and where the
/// assisted steps spent the engine thread's time per (layer, input group).
fn step_profile(policy: ColdStartPolicy, r: &RunReport, timeline: bool) -> String {
    let mut out = String::new();
    type Pick = fn(&coldstart::StepRecord) -> bool;
    let kinds: [(&str, Pick); 4] = [
        ("decode-only, warm", |s| s.tokens == s.decodes && !s.cold),
        ("decode-only, cold", |s| s.tokens == s.decodes && s.cold),
        ("prefill, warm", |s| s.tokens > s.decodes && !s.cold),
        ("prefill, cold", |s| s.tokens > s.decodes && s.cold),
    ];
    for (name, pick) in kinds {
        let v: Vec<_> = r.steps.iter().filter(|s| pick(s)).collect();
        if v.is_empty() {
            continue;
        }
        let ms: f64 = v.iter().map(|s| s.elapsed.as_secs_f64()).sum::<f64>() * 1e3;
        let assist_ms: f64 = v
            .iter()
            .map(|s| s.assist_overhead.as_secs_f64())
            .sum::<f64>()
            * 1e3;
        let tokens: usize = v.iter().map(|s| s.tokens).sum();
        out += &format!(
            "    {policy} {name}: {} steps, {:.2} ms/step ({:.2} of it assist overhead), {:.1} tokens/step, {:.1} µs/token\n",
            v.len(),
            ms / v.len() as f64,
            assist_ms / v.len() as f64,
            tokens as f64 / v.len() as f64,
            ms * 1e3 / tokens.max(1) as f64
        );
    }
    let mean_ms = |f: fn(&coldstart::Outcome) -> Option<Duration>| {
        let v: Vec<f64> = r
            .outcomes
            .iter()
            .filter_map(f)
            .map(|d| d.as_secs_f64())
            .collect();
        v.iter().sum::<f64>() * 1e3 / v.len().max(1) as f64
    };
    out += &format!(
        "    {policy} TTFT parts (means): adapter in host tier {:.1} ms, first chunk planned {:.1} ms, first token {:.1} ms after arrival\n",
        mean_ms(|o| o.host_ready),
        mean_ms(|o| o.started),
        mean_ms(|o| o.ttft)
    );
    if timeline {
        for (i, o) in r.outcomes.iter().enumerate() {
            let ms = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
            out += &format!(
                "      req {i}: host {:.1} planned {:.1} first {:.1}\n",
                ms(o.host_ready),
                ms(o.started),
                ms(o.ttft)
            );
        }
    }
    let p = &r.assist;
    if p.groups > 0 {
        let us = |d: Duration| d.as_secs_f64() * 1e6 / p.groups as f64;
        out += &format!(
            "    {policy} assist per (layer, group), {} groups: export {:.1} µs, submit {:.1}, base {:.1}, wait {:.1}, merge {:.1}\n",
            p.groups,
            us(p.export),
            us(p.submit),
            us(p.base),
            us(p.wait),
            us(p.merge)
        );
    }
    out.trim_end().to_string()
}

/// Requests per second the engine sustains on `reqs` under `cached`: all of them arrive at
/// once and the rate is count / makespan.
fn sustainable_rate(
    b: &Bench,
    args: &ColdStartArgs,
    link: LinkModel,
    reqs: &[Request],
) -> anyhow::Result<f64> {
    let burst: Vec<Request> = reqs
        .iter()
        .map(|r| Request {
            arrival: Duration::ZERO,
            ..r.clone()
        })
        .collect();
    let adapters: Vec<(PathBuf, StartTier)> = b
        .adapter_dirs
        .iter()
        .map(|d| (d.clone(), StartTier::Device))
        .collect();
    let mut e = engine(b, args, link)?;
    let mut cost = calibrate(&mut e)?;
    let cfg = DriverConfig {
        policy: ColdStartPolicy::Cached,
        max_chunk: args.max_chunk,
        max_batch_tokens: args.max_chunk.max(512),
        loader_threads: args.loader_threads(),
    };
    let r = coldstart::run(&mut e, &adapters, &burst, &cfg, &mut cost);
    if let Some(mut pool) = e.detach_pool() {
        pool.shutdown();
    }
    Ok(reqs.len() as f64 / r.wall.as_secs_f64().max(1e-9))
}

/// Measures prefill of `prompt` tokens and the load of one adapter, on the engine alone.
fn measure_prefill_s(b: &Bench, args: &ColdStartArgs, prompt: usize) -> anyhow::Result<(f64, f64)> {
    let mut e = engine(
        b,
        &ColdStartArgs {
            workers: 0,
            ..args.clone()
        },
        LinkModel::default(),
    )?;
    let cost = calibrate(&mut e)?;
    Ok((
        cost.step_time(prompt),
        cost.layer_per_token_s * cost.num_layers as f64,
    ))
}

fn poisson_arrivals(n: usize, rate: f64, rng: &mut ChaCha8Rng) -> Vec<Duration> {
    let exp = Exp::new(rate).expect("positive rate");
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            t += exp.sample(rng);
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// Runs both experiments and returns their tables.
pub fn run(args: &ColdStartArgs) -> anyhow::Result<Vec<Experiment>> {
    let args = if args.quick {
        ColdStartArgs {
            preset: "tiny".into(),
            requests: 8,
            rank: 16,
            prompt_median: 24,
            output_tokens: 4,
            zipf_adapters: 8,
            max_chunk: 32,
            ..args.clone()
        }
    } else {
        args.clone()
    };
    let tmp = tempfile::tempdir()?;
    let root = args
        .workdir
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf());
    let mut rng = ChaCha8Rng::seed_from_u64(2023);
    let mut experiments = Vec::new();

    // Run 1: distinct adapter per request, link time = prefill time of the median prompt.
    let b = prepare(&args, &root, args.requests)?;
    let (prefill_s, per_token_s) = measure_prefill_s(&b, &args, args.prompt_median)?;
    let adapter_bytes =
        thaw_runtime::adapter::LoraAdapter::load(&b.adapter_dirs[0], &b.model.config)?.size_bytes();
    let gbps = adapter_bytes as f64 / prefill_s / 1e9;
    let link = LinkModel {
        gbps,
        latency_us: 10.0,
    };
    let _ = per_token_s;
    let vocab = b.model.config.vocab_size as u32;
    let mut reqs: Vec<Request> = (0..args.requests)
        .map(|i| {
            let arrival = Duration::ZERO;
            let len = rng
                .random_range(args.prompt_median / 2..=args.prompt_median * 3 / 2)
                .max(1);
            Request {
                arrival,
                prompt: (0..len).map(|_| rng.random_range(3..vocab)).collect(),
                max_tokens: args.output_tokens,
                adapter: Some(i),
                sampling: SamplingParams::greedy(),
            }
        })
        .collect();
    let rate = args.load * sustainable_rate(&b, &args, link, &reqs)?;
    for (r, a) in reqs
        .iter_mut()
        .zip(poisson_arrivals(args.requests, rate, &mut rng))
    {
        r.arrival = a;
    }
    eprintln!(
        "run 1: median prompt {} tokens prefills in {:.1} ms; adapter {:.1} MB → emulated link {:.3} GB/s; {:.2} req/s offered",
        args.prompt_median,
        prefill_s * 1e3,
        adapter_bytes as f64 / 1e6,
        gbps,
        rate
    );
    let rows = run_all(&b, &args, link, &reqs)?;
    experiments.push(Experiment {
        title: format!(
            "preset {}, rank {} on q,k,v,o, distinct adapter per request, {} requests, prompt {}±{}, {} output tokens, Poisson {:.2} req/s ({:.0}% of sustainable), link {:.3} GB/s + 10 µs/layer (adapter load = median prefill = {:.1} ms), {} CPU worker(s), adapters start on {}",
            args.preset, args.rank, args.requests, args.prompt_median, args.prompt_median / 2,
            args.output_tokens, rate, args.load * 100.0, gbps, prefill_s * 1e3, args.workers,
            args.start_tier.name()
        ),
        rounds: args.rounds.max(1),
        rows,
    });

    if !args.no_trace_run {
        // Run 2: trace lengths (scaled into the context), Zipf(1.0) over many adapters.
        let b2 = prepare(&args, &root, args.zipf_adapters)?;
        let lengths = trace_lengths(&args.trace)?;
        let ctx = b2.model.config.max_position_embeddings;
        let max_prompt = lengths.iter().map(|l| l.0).max().unwrap_or(1).max(1);
        let scale = ((ctx / 2) as f64 / max_prompt as f64).min(1.0);
        let zipf = Zipf::new(args.zipf_adapters as f64, 1.0).expect("valid zipf");
        let picks: Vec<(usize, usize)> = (0..args.requests)
            .map(|_| {
                let (p, o) = lengths[rng.random_range(0..lengths.len())];
                (((p as f64 * scale) as usize).max(1), o.clamp(1, ctx / 4))
            })
            .collect();
        let mean_prompt = picks.iter().map(|p| p.0).sum::<usize>() / picks.len().max(1);
        let mean_out = picks.iter().map(|p| p.1).sum::<usize>() / picks.len().max(1);
        let mut reqs2: Vec<Request> = picks
            .iter()
            .map(|&(p, o)| Request {
                arrival: Duration::ZERO,
                prompt: (0..p).map(|_| rng.random_range(3..vocab)).collect(),
                max_tokens: o,
                adapter: Some(zipf.sample(&mut rng) as usize - 1),
                sampling: SamplingParams::greedy(),
            })
            .collect();
        let rate2 = args.load * sustainable_rate(&b2, &args, link, &reqs2)?;
        for (r, a) in reqs2
            .iter_mut()
            .zip(poisson_arrivals(args.requests, rate2, &mut rng))
        {
            r.arrival = a;
        }
        eprintln!("run 2: trace lengths ×{scale:.3}, mean prompt {mean_prompt}, mean output {mean_out}, {rate2:.2} req/s");
        let rows = run_all(&b2, &args, link, &reqs2)?;
        experiments.push(Experiment {
            title: format!(
                "preset {}, rank {} on q,k,v,o, Zipf(1.0) over {} adapters, {} requests with Azure conv trace lengths ×{:.3} (mean prompt {}, mean output {}), Poisson {:.2} req/s, same link, adapters start on {}",
                args.preset, args.rank, args.zipf_adapters, args.requests, scale, mean_prompt, mean_out, rate2,
                args.start_tier.name()
            ),
            rounds: args.rounds.max(1),
            rows,
        });
    }
    Ok(experiments)
}

/// The experiments as Markdown tables with overheads relative to `cached`.
pub fn table(experiments: &[Experiment]) -> String {
    let mut s = String::from(
        "CPU backend (no GPU), emulated host→device link; times in ms; overhead vs cached in parentheses\n",
    );
    for e in experiments {
        let _ = writeln!(s, "\n{}\n", e.title);
        if let Some(r) = e.rows.first().filter(|_| e.rounds > 1) {
            let _ = writeln!(
                s,
                "{} interleaved rounds of every policy, pooled: {} requests per policy\n",
                e.rounds,
                r.completed + r.failed
            );
        }
        let _ = writeln!(s, "| policy | TTFT mean | TTFT P50 | TTFT P99 | TPOT mean | E2E mean | done/failed | CPU-assisted rows |");
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
        let base = e
            .rows
            .iter()
            .find(|r| r.policy == ColdStartPolicy::Cached)
            .cloned();
        for r in &e.rows {
            let cell = |v: f64, b: Option<f64>| match b {
                Some(b) if r.policy != ColdStartPolicy::Cached => {
                    format!("{:.1} ({:+.0}%)", v * 1e3, (v / b - 1.0) * 100.0)
                }
                _ => format!("{:.1}", v * 1e3),
            };
            let b = base.as_ref();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {}/{} | {} |",
                r.policy,
                cell(r.ttft_mean, b.map(|b| b.ttft_mean)),
                cell(r.ttft_p50, b.map(|b| b.ttft_p50)),
                cell(r.ttft_p99, b.map(|b| b.ttft_p99)),
                cell(r.tpot_mean, b.map(|b| b.tpot_mean)),
                cell(r.e2e_mean, b.map(|b| b.e2e_mean)),
                r.completed,
                r.failed,
                r.rows_assisted
            );
        }
        let _ = writeln!(
            s,
            "\n| policy | misses | a miss waited for (mean ms): disk / batch / copy | started waiting per layer / held | assisted steps | assisted rows | disk maps |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for r in &e.rows {
            let [d, b, c] = r.miss_waits.map(|w| w * 1e3);
            let _ = writeln!(
                s,
                "| {} | {} | {d:.1} / {b:.1} / {c:.1} | {} / {} | {} | {} | {} |",
                r.policy,
                r.misses,
                r.layer_waits,
                r.held,
                r.assisted_steps,
                r.rows_assisted,
                r.disk_maps
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_lengths_parse_the_shared_trace() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/traces/AzureLLMInferenceTrace_conv.csv");
        if !p.exists() {
            // shared/ sits beside the repository; a checkout without it has no trace to read.
            eprintln!("skipped: {} not found", p.display());
            return;
        }
        let l = trace_lengths(&p).unwrap();
        assert_eq!(l.len(), 19_366);
        assert_eq!(l[0], (374, 44));
    }

    #[test]
    fn quick_cold_start_reports_every_policy_inline() {
        let args = ColdStartArgs {
            preset: "tiny".into(),
            requests: 8,
            rank: 16,
            prompt_median: 24,
            output_tokens: 4,
            load: 0.7,
            zipf_adapters: 8,
            trace: PathBuf::new(),
            workers: 0,
            max_chunk: 32,
            no_trace_run: true,
            quick: true,
            workdir: None,
            policies: ColdStartPolicy::ALL.to_vec(),
            timeline: false,
            start_tier: StartFrom::Disk,
            rounds: 2,
            loader_threads: Some(2),
        };
        let ex = run(&args).unwrap();
        assert_eq!(ex.len(), 1);
        assert_eq!(ex[0].rows.len(), 4);
        for r in &ex[0].rows {
            assert_eq!(
                r.completed, 16,
                "{}: every request of both rounds",
                r.policy
            );
            assert_eq!(r.failed, 0);
        }
        let t = table(&ex);
        assert!(t.contains("| cached |") && t.contains("| auto |"));
        assert!(t.contains("a miss waited for"), "{t}");
        assert!(t.contains("started waiting per layer / held"), "{t}");
        // Every adapter starts on disk: every request of a policy that is not `cached` is a
        // miss, and its waits add up to no more than its TTFT.
        for r in ex[0]
            .rows
            .iter()
            .filter(|r| r.policy != ColdStartPolicy::Cached)
        {
            assert_eq!(r.misses, 16, "{}", r.policy);
            // A miss may be held first and then start waiting for its last layers.
            assert!(r.layer_waits <= r.misses && r.held <= r.misses, "{r:?}");
            assert!(
                r.miss_waits.iter().sum::<f64>() <= r.ttft_mean * 1.0001,
                "{r:?}"
            );
        }
    }
}
