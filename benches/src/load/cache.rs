//! `thaw-bench cache` (Chameleon's cache experiment) and `thaw-bench cache-scale` (S-LoRA's
//! scalability table) over real `thaw serve` processes on the CPU backend.
//!
//! `cache`: for each adapter count and each load (a fraction of the sustainable rate, measured
//! first unless given), one server per `--adapter-eviction` policy (`lru`, `cost`, and the
//! bench-only baselines: `fixed-slots`, the server before the unified pool, and `no-cache`,
//! S-LoRA's memory, Chameleon's baseline); hit rate (from the server's counters), TTFT P50/P99
//! and done/failed at the client, each policy's P99 against the `--baseline` ones.
//!
//! `cache-scale`: throughput and server memory (RSS) with 1, 100, 1,000, 10,000 registered
//! adapters, uniform popularity.
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};
use thaw_server::memory::EvictionPolicy;
use thaw_server::procfs;

use super::cli::{measure, prompt_source, quick_workload, write_json};
use super::client::OpenAiClient;
use super::coldstart::{wait_ready, ServeProcess};
use super::launch::ServerLaunch;
use super::report::Stats;
use super::report::Summary;
use super::runner::{RequestRecord, RunOptions};
use super::workload::{PopularityKind, WorkloadArgs};

/// Options both benchmarks share.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeSetup {
    /// Preset of the generated model.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Ranks of the generated adapters (round-robin; Chameleon's five), targeting q,v.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 16, 32, 64, 128])]
    pub ranks: Vec<usize>,
    #[command(flatten)]
    pub server: ServerLaunch,
    /// Directory for the JSON report and the servers' logs.
    #[arg(long, default_value = "thaw-bench-results")]
    pub out: PathBuf,
    /// A seconds-long version for the test suite: tiny model, few adapters and requests.
    #[arg(long)]
    pub quick: bool,
}

/// Options of `thaw-bench cache`.
#[derive(clap::Args, Clone, Debug)]
pub struct CacheArgs {
    #[command(flatten)]
    pub setup: ServeSetup,
    /// Registered adapter counts to run.
    #[arg(long, value_delimiter = ',', default_values_t = [100, 1000])]
    pub adapter_counts: Vec<usize>,
    /// Policies to compare (`no-cache`, S-LoRA's memory without a cache, is not run unless
    /// named).
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["lru", "cost", "fixed-slots"])]
    pub policies: Vec<EvictionPolicy>,
    /// Policies the "vs" columns compare against: the first in the main table, each other one
    /// in a table of its own below it (e.g. `fixed-slots,no-cache`: the server before the
    /// unified pool, and Chameleon's baseline, S-LoRA without a cache). A baseline missing
    /// from --policies shows "-".
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["fixed-slots"])]
    pub baseline: Vec<EvictionPolicy>,
    /// Loads as fractions of the sustainable rate.
    #[arg(long, value_delimiter = ',', default_values_t = [0.5, 0.75, 1.0])]
    pub load: Vec<f64>,
    /// Sustainable rate in requests/s [default: measured with `cost`, all requests at once].
    /// Give it to compare cells across calls: the probe is one burst and moves between calls.
    #[arg(long)]
    pub sustainable_rate: Option<f64>,
    /// Sustainable load in tokens/s (prompt + output), e.g. from the probe's tokens/s: each
    /// round then offers `--load` × this many tokens/s (`--token-rate`), so rounds whose trace
    /// windows differ in tokens per request offer the same token load. Instead of
    /// --sustainable-rate.
    #[arg(long, conflicts_with = "sustainable_rate")]
    pub sustainable_token_rate: Option<f64>,
    /// Probe bursts per adapter count (same requests each time); the rate used is their
    /// median, and the table's header shows every burst's throughput and the spread.
    #[arg(long, default_value_t = 1)]
    pub probe_repeats: usize,
    /// Only measure the sustainable rate (the probe bursts) and print it; run no loads.
    #[arg(long)]
    pub probe_only: bool,
    /// Unmeasured requests each server serves first, drawn like the measured ones (same
    /// rate, popularity and lengths; another seed), so the measured run starts from the
    /// policy's own steady-state cache, as in Chameleon's long runs, rather than from a cold
    /// server where first uses (compulsory misses, the same for every policy) set the tail.
    #[arg(long, default_value_t = 0)]
    pub warmup_requests: usize,
    /// Rounds, each with its own workload seed (--seed + round); within a round every policy
    /// serves the same requests. The table shows per-round medians.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    #[command(flatten)]
    pub workload: WorkloadArgs,
}

/// Options of `thaw-bench cache-scale`.
#[derive(clap::Args, Clone, Debug)]
pub struct CacheScaleArgs {
    #[command(flatten)]
    pub setup: ServeSetup,
    /// Registered adapter counts to run.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 100, 1000, 10000])]
    pub adapter_counts: Vec<usize>,
    /// `--max-loras` for every server (distinct adapters in one batch). The default, 64, is the
    /// server's --max-num-seqs: like S-LoRA, any mix of adapters may share a batch, so the
    /// table measures the memory layer and not a cap on distinct adapters. Ignored when
    /// --serve-arg sets --max-loras.
    #[arg(long, default_value_t = 64)]
    pub max_loras: usize,
    /// Runs per adapter count, interleaved over the counts (and the servers); the table shows
    /// the run with the median throughput.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// A second `thaw` executable run beside --thaw-bin in every round (e.g. main's build), so
    /// the table compares the two side by side.
    #[arg(long)]
    pub baseline_bin: Option<PathBuf>,
    /// Measure cold loads too: skip S-LoRA's setup, where every registered adapter is in host
    /// memory before the run. By default each server gets `--max-cpu-loras` = the adapter
    /// count and, before the measured run, one 1-token request per adapter (not measured), so
    /// the table measures what grows with the registered count rather than first-use disk
    /// reads (uniform draws over 1,000 adapters make almost every request a first use).
    #[arg(long)]
    pub no_warmup: bool,
    #[command(flatten)]
    pub workload: WorkloadArgs,
}

/// One server run.
#[derive(Clone, Debug, Serialize)]
pub struct Run {
    pub adapters: usize,
    pub label: String,
    pub rate: Option<f64>,
    pub summary: Summary,
    pub hits: f64,
    pub misses: f64,
    pub evictions: f64,
    /// Host-to-device loads (demand and prefetch) during the measured run.
    pub loads: f64,
    /// Adapters on the device once the measured run is over (the server idle).
    pub device_adapters_end: f64,
    pub prefetch_hits: f64,
    /// Adapter lookups (hits + misses) of the unmeasured warm-up, before the counters above.
    pub warmup_lookups: f64,
    /// Server resident memory after start-up and after the run, and its peak (KiB).
    pub rss_start_kib: Option<u64>,
    pub rss_end_kib: Option<u64>,
    pub rss_peak_kib: Option<u64>,
    /// Every request of the measured run (the cache table pools their TTFTs over rounds).
    pub records: Vec<RequestRecord>,
    /// Every measured request's wait reasons as the server logged them.
    pub server_waits: Vec<super::cache_tail::ServerWait>,
}

impl Run {
    fn hit_rate(&self) -> f64 {
        self.hits / (self.hits + self.misses).max(1.0)
    }
}

/// A generated model and `max` adapters; `dir_for(n)` is a directory of the first `n`.
struct Prepared {
    model: PathBuf,
    all: Vec<PathBuf>,
    root: PathBuf,
}

impl Prepared {
    fn new(s: &ServeSetup, root: &Path, max: usize) -> anyhow::Result<Self> {
        let preset =
            gen::preset(&s.preset).with_context(|| format!("unknown --preset {}", s.preset))?;
        let model = root.join(format!("model-{}", s.preset));
        if !model.join("config.json").exists() {
            eprintln!("generating the {} model into {}", s.preset, model.display());
            gen::write_model(&preset, &model, &GenModelOptions::default())?;
        }
        let ranks: Vec<String> = s.ranks.iter().map(|r| r.to_string()).collect();
        let dir = root.join(format!("cache-adapters-{}-r{}", s.preset, ranks.join("_")));
        let present = std::fs::read_dir(&dir).map_or(0, |it| it.count());
        if present < max {
            let _ = std::fs::remove_dir_all(&dir);
            eprintln!("generating {max} adapters into {}", dir.display());
            gen::write_adapters(&GenAdaptersOptions {
                model_dir: model.clone(),
                out_dir: dir.clone(),
                count: max,
                ranks: s.ranks.clone(),
                targets: vec![Projection::Q, Projection::V],
                ..Default::default()
            })?;
        }
        let mut all: Vec<PathBuf> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        all.sort();
        Ok(Self {
            model,
            all,
            root: root.to_path_buf(),
        })
    }

    /// A directory of symlinks to the first `n` adapters.
    fn dir_for(&self, n: usize) -> anyhow::Result<PathBuf> {
        let d = self.root.join(format!("subset-{n}"));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d)?;
        for p in self.all.iter().take(n) {
            let name = p.file_name().context("adapter dir name")?;
            std::os::unix::fs::symlink(p, d.join(name))?;
        }
        Ok(d)
    }
}

/// The value of a Prometheus sample line `name value` (labels included in `name`).
fn metric(text: &str, name: &str) -> f64 {
    super::metrics::metric_sum(text, name).unwrap_or(f64::NAN)
}

/// The text of `path` from byte `from` on (lossy UTF-8).
fn read_from(path: &Path, from: u64) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    f.seek(SeekFrom::Start(from))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Starts `thaw serve`, runs `workload`, reads the counters and memory, stops it.
fn serve_once(
    rt: &tokio::runtime::Runtime,
    s: &ServeSetup,
    serve_args: &[String],
    workload: &WorkloadArgs,
    label: String,
    adapters: usize,
    warmup: Option<&WorkloadArgs>,
) -> anyhow::Result<Run> {
    let bin = s.server.bin()?;
    let log = s
        .out
        .join(format!("serve-{}.log", label.replace([' ', '/'], "_")));
    let timeout = Duration::from_secs_f64(s.server.startup_timeout);
    let t0 = Instant::now();
    // The server logs each request's wait reasons at debug (target thaw::request); the log
    // from the measured run's start on gives the server's side of its tail.
    let rust_log = super::cache_tail::rust_log(std::env::var("RUST_LOG").ok().as_deref());
    let mut server =
        ServeProcess::start_with_env(&bin, serve_args, &log, timeout, &[("RUST_LOG", rust_log)])?;
    let run = rt.block_on(async {
        let client = OpenAiClient::new(&server.url, None)?;
        let info = wait_ready(&client, &server.url, &log, timeout).await?;
        eprintln!(
            "{label}: server up in {:.1?} ({} adapters)",
            t0.elapsed(),
            info.adapters.len()
        );
        let rss_start = procfs::status_kib(server.pid(), "VmRSS:");
        let prompts = prompt_source(None, &info)?;
        let opts = RunOptions {
            request_timeout: Duration::from_secs_f64(s.server.request_timeout),
            progress: !s.server.no_progress,
            label: label.clone(),
        };
        if let Some(w) = warmup {
            let t = Instant::now();
            let (_, sum) = measure(&client, &info, w, &prompts, &opts).await?;
            // The fixed-slots baseline may refuse some (429) under load; a warm-up that served
            // nothing, or a refusal by the unified pool (which never refuses), is an error.
            let fixed = serve_args.iter().any(|a| a.ends_with("=fixed-slots"));
            anyhow::ensure!(
                sum.failed == 0 || (fixed && sum.failed < sum.sent),
                "{label}: {} of {} warm-up requests failed; see {}",
                sum.failed,
                sum.sent,
                log.display()
            );
            eprintln!(
                "{label}: warm-up of {} requests ({} failed) in {:.1?}",
                sum.sent,
                sum.failed,
                t.elapsed()
            );
        }
        // Counters after the warm-up, so the run's hits, misses, evictions and prefetch hits
        // are the measured requests' own.
        let before = match warmup {
            Some(_) => client.get_text("/metrics").await?,
            None => String::new(),
        };
        let log_from = std::fs::metadata(&log).map_or(0, |m| m.len());
        let (records, summary) = measure(&client, &info, workload, &prompts, &opts).await?;
        let m = client.get_text("/metrics").await?;
        let server_waits = read_from(&log, log_from)
            .map(|text| super::cache_tail::parse_waits(&text))
            .unwrap_or_default();
        let counter = |name: &str| {
            let b = metric(&before, name);
            metric(&m, name) - if b.is_finite() { b } else { 0.0 }
        };
        const HIT: &str = "thaw_adapter_cache_lookups_total{result=\"hit\"}";
        const MISS: &str = "thaw_adapter_cache_lookups_total{result=\"miss\"}";
        let warmup_lookups: f64 = [HIT, MISS]
            .iter()
            .map(|n| metric(&before, n))
            .filter(|v| v.is_finite())
            .sum();
        let (rss_end, rss_peak) = (
            procfs::status_kib(server.pid(), "VmRSS:"),
            procfs::status_kib(server.pid(), "VmHWM:"),
        );
        anyhow::Ok(Run {
            adapters,
            label: label.clone(),
            rate: workload.rate,
            hits: counter(HIT),
            misses: counter(MISS),
            evictions: counter("thaw_adapter_evictions_total{tier=\"device\"}"),
            loads: counter("thaw_adapter_device_loads_total{cause=\"demand\"}")
                + counter("thaw_adapter_device_loads_total{cause=\"prefetch\"}"),
            device_adapters_end: metric(&m, "thaw_adapters{tier=\"device\"}"),
            prefetch_hits: counter("thaw_adapter_prefetch_hits_total"),
            warmup_lookups,
            summary,
            rss_start_kib: rss_start,
            rss_end_kib: rss_end,
            rss_peak_kib: rss_peak,
            records,
            server_waits,
        })
    })?;
    server.stop(Duration::from_secs(60))?;
    eprintln!(
        "{label}: {}/{} completed in {:.1} s",
        run.summary.completed, run.summary.sent, run.summary.wall_s
    );
    Ok(run)
}

/// S-LoRA's precondition for its scalability table: every adapter in host memory. One 1-token
/// request per adapter (`Distinct` cycles through them all once), all at once.
fn warmup_workload(w: &WorkloadArgs, adapters: usize) -> WorkloadArgs {
    WorkloadArgs {
        requests: adapters,
        arrivals: super::workload::ArrivalKind::Poisson,
        rate: Some(2000.0),
        popularity: PopularityKind::Distinct,
        lengths: super::workload::LengthKind::Fixed,
        prompt_len: 8,
        output_len: 1,
        ..w.clone()
    }
}

fn serve_arg_set(s: &ServeSetup, flag: &str) -> bool {
    s.server.serve_arg.iter().any(|a| a.starts_with(flag))
}

fn base_args(model: &Path, lora_dir: &Path, s: &ServeSetup) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "--model".into(),
        model.display().to_string(),
        "--lora-dir".into(),
        lora_dir.display().to_string(),
        "--port".into(),
        "0".into(),
        "--max-lora-rank".into(),
        s.ranks.iter().max().copied().unwrap_or(8).to_string(),
    ];
    a.extend(s.server.serve_arg.iter().cloned());
    a
}

fn workdir(s: &ServeSetup) -> anyhow::Result<(Option<tempfile::TempDir>, PathBuf)> {
    std::fs::create_dir_all(&s.out).with_context(|| format!("creating {}", s.out.display()))?;
    Ok(match &s.server.workdir {
        Some(w) => {
            std::fs::create_dir_all(w)?;
            (None, w.clone())
        }
        None => {
            let t = tempfile::tempdir()?;
            let p = t.path().to_path_buf();
            (Some(t), p)
        }
    })
}

/// P99 TTFT (ms) over every completed request of `runs` together: with 150 requests a run's
/// own P99 is its second-slowest request, so the median over rounds of that still swings with
/// one request; pooling the rounds' requests ranks the tail over all of them.
fn pooled_p99_ms(runs: &[Run]) -> f64 {
    pooled_ttft(runs).p99 * 1e3
}

/// TTFT (seconds) over every completed request of `runs` together.
fn pooled_ttft(runs: &[Run]) -> Stats {
    Stats::of(
        runs.iter()
            .flat_map(|r| r.records.iter().filter(|q| q.ok()).filter_map(|q| q.ttft_s)),
    )
}

/// Tokens (prompt + output asked for) a run completed per second of its wall time.
fn token_throughput(r: &Run) -> f64 {
    let tokens: usize = r
        .records
        .iter()
        .filter(|q| q.ok())
        .map(|q| q.prompt_tokens + q.output_tokens)
        .sum();
    tokens as f64 / r.summary.wall_s.max(1e-9)
}

/// The load a run offered: requests/s and tokens/s (prompt + max output) over its planned
/// send times (the first at 0, the last at `span`; n requests over n÷rate seconds).
fn offered_load(r: &Run) -> (f64, f64) {
    let n = r.records.len() as f64;
    let span = r
        .records
        .iter()
        .map(|q| q.scheduled_s)
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let tokens: usize = r
        .records
        .iter()
        .map(|q| q.prompt_tokens + q.max_tokens)
        .sum();
    (n / span, tokens as f64 / span)
}

/// A baseline's runs at one load and what the "vs" columns divide by.
struct Baseline {
    median_p99: f64,
    pooled_p99: f64,
    runs: Vec<Run>,
}

/// Round by round (the same seed), `rs`' P99 against the baseline's: the median difference,
/// or with `each` every round's.
fn paired(rs: &[Run], b: Option<&Baseline>, each: bool) -> String {
    let Some(b) = b else {
        return "-".into();
    };
    let p99 = |r: &Run| r.summary.ttft.p99;
    let mut d: Vec<f64> = rs
        .iter()
        .zip(&b.runs)
        .map(|(a, b)| p99(a) / p99(b) - 1.0)
        .collect();
    let pct = |x: &f64| format!("{:+.1}%", x * 100.0);
    if each {
        return d.iter().map(pct).collect::<Vec<_>>().join("/");
    }
    d.sort_by(f64::total_cmp);
    d.get(d.len() / 2).map_or("-".into(), pct)
}

/// The warm-up's workload seed is the round's plus this (no round's measured seed).
const WARMUP_SEED_OFFSET: u64 = 1_000_000;

/// `thaw-bench cache`; returns the printed text.
pub fn run_cache(args: &CacheArgs) -> anyhow::Result<String> {
    let mut args = args.clone();
    if args.setup.quick {
        args.setup.preset = "tiny".into();
        args.setup.ranks = vec![8, 16];
        args.adapter_counts = vec![12];
        args.load = vec![1.0];
        if !args.probe_only && args.sustainable_token_rate.is_none() {
            args.sustainable_rate.get_or_insert(20.0);
        }
        args.workload = WorkloadArgs {
            popularity: PopularityKind::RankPowerLaw,
            ..quick_workload(&args.workload)
        };
        // Two fixed slots and a device of a few adapters: eviction and refusal both happen.
        args.setup.server.serve_arg.extend([
            "--max-loras=2".to_string(),
            "--device-memory-bytes=3000000".to_string(),
        ]);
    }
    anyhow::ensure!(!args.policies.is_empty(), "--policies is empty");
    anyhow::ensure!(!args.baseline.is_empty(), "--baseline is empty");
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(
        !(args.probe_only
            && (args.sustainable_rate.is_some() || args.sustainable_token_rate.is_some())),
        "--probe-only measures the sustainable rate; drop --sustainable-rate / --sustainable-token-rate"
    );
    let (_tmp, root) = workdir(&args.setup)?;
    let max = args.adapter_counts.iter().copied().max().unwrap_or(1);
    let prep = Prepared::new(&args.setup, &root, max)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut runs = Vec::new();
    let mut text = String::new();
    for &n in &args.adapter_counts {
        let dir = prep.dir_for(n)?;
        let common = base_args(&prep.model, &dir, &args.setup);
        let with_policy = |p: EvictionPolicy| {
            let mut a = common.clone();
            a.push(format!("--adapter-eviction={p}"));
            a
        };
        let given = args.sustainable_rate.or(args.sustainable_token_rate);
        let (sustainable, probe_note) = match given {
            Some(r) => (r, "given".to_string()),
            None => {
                let burst = WorkloadArgs {
                    rate: Some(1e4),
                    ..args.workload.clone()
                };
                let mut got = Vec::new();
                let mut tokens = Vec::new();
                for i in 0..args.probe_repeats.max(1) {
                    let probe = serve_once(
                        &rt,
                        &args.setup,
                        &with_policy(EvictionPolicy::Cost),
                        &burst,
                        format!("{n} adapters probe {}", i + 1),
                        n,
                        None,
                    )?;
                    got.push(probe.summary.throughput_rps);
                    tokens.push(token_throughput(&probe));
                    runs.push(probe);
                }
                let each = got
                    .iter()
                    .map(|r| format!("{r:.1}"))
                    .collect::<Vec<_>>()
                    .join(" / ");
                let (lo, hi) = got
                    .iter()
                    .fold((f64::INFINITY, 0.0f64), |(l, h), r| (l.min(*r), h.max(*r)));
                got.sort_by(f64::total_cmp);
                tokens.sort_by(f64::total_cmp);
                let median = got[got.len() / 2];
                (
                    median,
                    format!(
                        "probe: median of {} bursts of {} requests: {each} req/s (max/min {:.2}); \
                         median {:.0} tokens/s (prompt + output, for --sustainable-token-rate)",
                        got.len(),
                        args.workload.requests,
                        hi / lo,
                        tokens[tokens.len() / 2],
                    ),
                )
            }
        };
        let unit = if args.sustainable_token_rate.is_some() {
            "tokens/s"
        } else {
            "req/s"
        };
        let _ = write!(
            text,
            "\n{n} adapters, sustainable rate {sustainable:.2} {unit} ({probe_note})"
        );
        if args.probe_only {
            text.push('\n');
            continue;
        }
        let b0 = args.baseline[0];
        let _ = writeln!(
            text,
            ", {} round(s), medians over rounds\n\n| load | policy | rate {unit} | hit rate | TTFT P50 ms | TTFT P99 ms | P99 vs {b0} | paired P99 vs {b0} (median of rounds) | pooled P99 ms | pooled vs {b0} | pooled P50 ms | done | failed | evictions | loads | prefetch hits | per-round P99 ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            args.rounds
        );
        // The other baselines' comparisons, a table each.
        let mut others: Vec<String> = args.baseline[1..]
            .iter()
            .map(|b| {
                format!(
                    "\nAgainst {b}:\n\n| load | policy | P99 vs {b} | paired P99 vs {b} (median of rounds) | paired per round | pooled vs {b} |\n|---|---|---|---|---|---|\n"
                )
            })
            .collect();
        let mut offered = String::new();
        let mut tails = String::new();
        for &f in &args.load {
            // Policy → its runs, one per round; the policies interleave within each round.
            let mut per: Vec<Vec<Run>> = vec![Vec::new(); args.policies.len()];
            for round in 0..args.rounds {
                let (rate, token_rate) = match args.sustainable_token_rate {
                    Some(_) => (None, Some(sustainable * f)),
                    None => (Some(sustainable * f), None),
                };
                let w = WorkloadArgs {
                    rate,
                    token_rate,
                    seed: args.workload.seed + round as u64,
                    ..args.workload.clone()
                };
                let warm = (args.warmup_requests > 0).then(|| WorkloadArgs {
                    requests: args.warmup_requests,
                    seed: w.seed + WARMUP_SEED_OFFSET,
                    ..w.clone()
                });
                for (pi, &p) in args.policies.iter().enumerate() {
                    let label = format!("{n} adapters {:.0}% {p} round {}", f * 100.0, round + 1);
                    let r = serve_once(
                        &rt,
                        &args.setup,
                        &with_policy(p),
                        &w,
                        label,
                        n,
                        warm.as_ref(),
                    )?;
                    per[pi].push(r.clone());
                    runs.push(r);
                }
            }
            let med = |rs: &[Run], key: &dyn Fn(&Run) -> f64| {
                let mut v: Vec<f64> = rs.iter().map(key).collect();
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
            };
            let p99 = |r: &Run| r.summary.ttft.p99 * 1e3;
            let cmp: Vec<Option<Baseline>> = args
                .baseline
                .iter()
                .map(|b| {
                    let i = args.policies.iter().position(|p| p == b)?;
                    Some(Baseline {
                        median_p99: med(&per[i], &p99),
                        pooled_p99: pooled_p99_ms(&per[i]),
                        runs: per[i].clone(),
                    })
                })
                .collect();
            let vs = |x: f64, base: Option<f64>| {
                base.map_or("-".into(), |b| format!("{:+.1}%", (x / b - 1.0) * 100.0))
            };
            for (pi, &p) in args.policies.iter().enumerate() {
                let rs = &per[pi];
                let _ = writeln!(
                    tails,
                    "- {:.0}% {p}, TTFT over the rounds: {}",
                    f * 100.0,
                    super::cache_tail::split(rs.iter().map(|r| r.records.as_slice())).line()
                );
                let waits = || rs.iter().map(|r| r.server_waits.as_slice());
                let _ = writeln!(
                    tails,
                    "- {:.0}% {p}, what requests waited for (server log): P99 tail: {}; all: {}",
                    f * 100.0,
                    super::cache_tail::reasons(waits(), 0.99).line(),
                    super::cache_tail::reasons(waits(), 0.0).line()
                );
                let tail = med(rs, &p99);
                let pooled = pooled_p99_ms(rs);
                for (b, t) in cmp[1..].iter().zip(&mut others) {
                    let _ = writeln!(
                        t,
                        "| {:.0}% | {p} | {} | {} | {} | {} |",
                        f * 100.0,
                        vs(tail, b.as_ref().map(|b| b.median_p99)),
                        paired(rs, b.as_ref(), false),
                        paired(rs, b.as_ref(), true),
                        vs(pooled, b.as_ref().map(|b| b.pooled_p99)),
                    );
                }
                let b = cmp[0].as_ref();
                let _ = writeln!(
                    text,
                    "| {:.0}% | {p} | {:.2} | {:.3} | {:.1} | {:.1} | {} | {} | {:.1} | {} | {:.1} | {} | {} | {} | {} | {} | {} |",
                    f * 100.0,
                    sustainable * f,
                    med(rs, &Run::hit_rate),
                    med(rs, &|r| r.summary.ttft.p50 * 1e3),
                    tail,
                    vs(tail, b.map(|b| b.median_p99)),
                    paired(rs, b, false),
                    pooled,
                    vs(pooled, b.map(|b| b.pooled_p99)),
                    pooled_ttft(rs).p50 * 1e3,
                    rs.iter().map(|r| r.summary.completed).sum::<usize>(),
                    rs.iter().map(|r| r.summary.failed).sum::<usize>(),
                    med(rs, &|r| r.evictions),
                    med(rs, &|r| r.loads),
                    med(rs, &|r| r.prefetch_hits),
                    rs.iter()
                        .map(|r| format!("{:.0}", p99(r)))
                        .collect::<Vec<_>>()
                        .join("/"),
                );
            }
            if let Some(first) = per.first() {
                let _ = writeln!(
                    offered,
                    "- {:.0}% load, offered per round (req/s, tokens/s): {}",
                    f * 100.0,
                    first
                        .iter()
                        .map(|r| {
                            let (rps, tps) = offered_load(r);
                            format!("{rps:.1}, {tps:.0}")
                        })
                        .collect::<Vec<_>>()
                        .join(" / ")
                );
            }
        }
        for t in others {
            text.push_str(&t);
        }
        text.push('\n');
        text.push_str(&offered);
        text.push_str(&tails);
    }
    let json = args.setup.out.join("cache.json");
    write_json(&json, &runs)?;
    let w = &args.workload;
    Ok(format!(
        "thaw serve (CPU backend, emulated link), preset {}, ranks {:?} on q,v; {} requests, \
         {:?} arrivals, {:?} popularity, {:?} lengths; {} unmeasured warm-up requests per run; \
         serve args {:?}\n{text}\nreport: {}\n",
        args.setup.preset,
        args.setup.ranks,
        w.requests,
        w.arrivals,
        w.popularity,
        w.lengths,
        args.warmup_requests,
        args.setup.server.serve_arg,
        json.display()
    ))
}

/// `thaw-bench cache-scale`; returns the printed text.
pub fn run_cache_scale(args: &CacheScaleArgs) -> anyhow::Result<String> {
    let mut args = args.clone();
    args.workload.popularity = PopularityKind::Uniform;
    if args.setup.quick {
        args.setup.preset = "tiny".into();
        args.setup.ranks = vec![8];
        args.adapter_counts = vec![1, 20];
        args.workload = quick_workload(&args.workload);
    }
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    if !serve_arg_set(&args.setup, "--max-loras") {
        args.setup
            .server
            .serve_arg
            .push(format!("--max-loras={}", args.max_loras));
    }
    let max = args.adapter_counts.iter().copied().max().unwrap_or(1);
    if !serve_arg_set(&args.setup, "--max-queued-requests") {
        // A backlog of a whole run (or warm-up) is the load being measured, not overload.
        let q = max.max(args.workload.requests) + 1;
        args.setup
            .server
            .serve_arg
            .push(format!("--max-queued-requests={q}"));
    }
    let (_tmp, root) = workdir(&args.setup)?;
    let prep = Prepared::new(&args.setup, &root, max)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // (server label, setup): the build under test, then the baseline if any.
    let mut servers = vec![("this".to_string(), args.setup.clone())];
    if let Some(b) = &args.baseline_bin {
        let mut s = args.setup.clone();
        s.server.thaw_bin = Some(b.clone());
        servers.push(("baseline".to_string(), s));
    }
    let mut runs: Vec<Run> = Vec::new();
    let mut cells: Vec<Vec<Vec<Run>>> =
        vec![vec![Vec::new(); servers.len()]; args.adapter_counts.len()];
    for round in 0..args.rounds {
        for (ci, &n) in args.adapter_counts.iter().enumerate() {
            let dir = prep.dir_for(n)?;
            for (si, (name, setup)) in servers.iter().enumerate() {
                let mut a = base_args(&prep.model, &dir, setup);
                let warm = (!args.no_warmup).then(|| warmup_workload(&args.workload, n));
                if warm.is_some() {
                    a.push(format!("--max-cpu-loras={n}"));
                }
                let label = format!("{n} adapters {name} round {}", round + 1);
                let r = serve_once(&rt, setup, &a, &args.workload, label, n, warm.as_ref())?;
                cells[ci][si].push(r.clone());
                runs.push(r);
            }
        }
    }
    let mut text = String::from(
        "| registered adapters | done/failed | server | req/s | out tok/s | vs 1st count | TTFT P50 ms | server RSS after start MiB | after run MiB | peak MiB |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let median = |rs: &[Run]| -> Option<Run> {
        let mut v = rs.to_vec();
        v.sort_by(|a, b| {
            a.summary
                .output_tokens_per_s
                .total_cmp(&b.summary.output_tokens_per_s)
        });
        v.get(v.len() / 2).cloned()
    };
    let mib = |k: Option<u64>| k.map_or("-".into(), |k| format!("{:.1}", k as f64 / 1024.0));
    for (si, (name, _)) in servers.iter().enumerate() {
        let first = cells
            .first()
            .and_then(|c| median(&c[si]))
            .map_or(f64::NAN, |r| r.summary.output_tokens_per_s);
        for (ci, &n) in args.adapter_counts.iter().enumerate() {
            let Some(r) = median(&cells[ci][si]) else {
                continue;
            };
            let done: usize = cells[ci][si].iter().map(|r| r.summary.completed).sum();
            let failed: usize = cells[ci][si].iter().map(|r| r.summary.failed).sum();
            let _ = writeln!(
                text,
                "| {n} | {done}/{failed} | {name} | {:.2} | {:.1} | {:+.1}% | {:.1} | {} | {} | {} |",
                r.summary.throughput_rps,
                r.summary.output_tokens_per_s,
                (r.summary.output_tokens_per_s / first - 1.0) * 100.0,
                r.summary.ttft.p50 * 1e3,
                mib(r.rss_start_kib),
                mib(r.rss_end_kib),
                mib(r.rss_peak_kib),
            );
        }
    }
    let json = args.setup.out.join("cache-scale.json");
    write_json(&json, &runs)?;
    let w = &args.workload;
    Ok(format!(
        "thaw serve (CPU backend), preset {}, ranks {:?} on q,v, uniform popularity (each request's \
         adapter drawn uniformly from the registered ones; the same seed, so the same requests \
         and lengths for every count); {} requests, {:?} arrivals at {:?} req/s, {:?} lengths; \
         {} round(s), the median run shown (done/failed summed over rounds); {}; serve args {:?}\n\n{text}\nreport: {}\n",
        args.setup.preset,
        args.setup.ranks,
        w.requests,
        w.arrivals,
        w.rate,
        w.lengths,
        args.rounds,
        if args.no_warmup {
            "no warm-up: first uses read the disk inside the measured run"
        } else {
            "S-LoRA's setup: every adapter in host memory before the run \
             (--max-cpu-loras = count, one unmeasured 1-token request per adapter)"
        },
        args.setup.server.serve_arg,
        json.display()
    ))
}
