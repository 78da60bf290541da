//! `thaw-bench scheduling`: Chameleon's Figure 10 on `thaw serve`. For each
//! `--scheduling-policy` it starts one server and replays the same seeded workload at each
//! rate, lowest first; it prints P50/P99 TTFT, P99 TPOT and completed/failed per rate, the
//! SLOs ("5× the low-load" TTFT and TPOT of the first policy, as Chameleon sets its SLO) and
//! each policy's throughput at SLO — the highest rate up to which every rate meets both.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use thaw_server::scheduler::SchedulingPolicy;

use super::cli::{measure, prompt_source, quick_workload, write_json};
use super::client::OpenAiClient;
use super::coldstart::{default_thaw_bin, prepare_files, wait_ready, ServeProcess};
use super::report::Summary;
use super::runner::RunOptions;
use super::workload::{ServerInfo, WorkloadArgs};

/// Options of `thaw-bench scheduling`.
#[derive(clap::Args, Clone, Debug)]
pub struct SchedulingArgs {
    /// Model directory to serve [default: a generated --preset model in --workdir].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Preset of the generated model.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Directory of PEFT adapters to serve [default: --adapters generated adapters].
    #[arg(long)]
    pub lora_dir: Option<PathBuf>,
    /// Number of generated adapters.
    #[arg(long, default_value_t = 100)]
    pub adapters: usize,
    /// Ranks of the generated adapters (round-robin), targeting q,k,v,o.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 16, 32, 64, 128])]
    pub ranks: Vec<usize>,
    /// Policies to compare, in order; the first sets the SLOs.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["fcfs", "sjf", "mlq"])]
    pub policies: Vec<SchedulingPolicy>,
    /// Request rates (req/s), run lowest first on each server.
    #[arg(long, value_delimiter = ',', default_values_t = [0.5, 1.0, 1.5, 2.0, 2.5])]
    pub rates: Vec<f64>,
    /// The SLOs are this many times the first policy's mean TTFT / TPOT at the lowest rate.
    #[arg(long, default_value_t = 5.0)]
    pub slo_factor: f64,
    /// Any other `thaw serve` argument, repeated (e.g. --serve-arg=--max-loras=32).
    #[arg(long, allow_hyphen_values = true)]
    pub serve_arg: Vec<String>,
    /// The `thaw` executable [default: next to thaw-bench].
    #[arg(long)]
    pub thaw_bin: Option<PathBuf>,
    /// Where generated models and adapters go (reused when present) [default: a temp dir].
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// Seconds to wait for each server's /health.
    #[arg(long, default_value_t = 300.0)]
    pub startup_timeout: f64,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Directory for the JSON report and the servers' logs.
    #[arg(long, default_value = "thaw-bench-results")]
    pub out: PathBuf,
    /// Seconds before a request counts as failed.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// A seconds-long version for the test suite: tiny model, 8 adapters, 12 requests, two
    /// rates.
    #[arg(long)]
    pub quick: bool,
}

/// One (policy, rate) run.
#[derive(Clone, Debug, Serialize)]
pub struct RateRun {
    pub policy: SchedulingPolicy,
    pub rate: f64,
    pub summary: Summary,
    /// The server's `thaw_sched_*` and `thaw_perf_*` lines after the run.
    pub metrics: Vec<String>,
}

#[derive(Serialize)]
struct SchedulingReport<'a> {
    bench: &'static str,
    setup: &'a str,
    serve_args: &'a [String],
    workload: &'a WorkloadArgs,
    ttft_slo_s: f64,
    tpot_slo_s: f64,
    runs: &'a [RateRun],
}

/// The SLOs from the first policy's lowest-rate run: `factor` × its mean TTFT and TPOT.
pub fn slos(runs: &[RateRun], factor: f64) -> (f64, f64) {
    let first = runs.iter().min_by(|a, b| a.rate.total_cmp(&b.rate));
    match first {
        Some(r) => (
            factor * r.summary.ttft.mean,
            factor * r.summary.tpot.mean.max(0.0),
        ),
        None => (f64::NAN, f64::NAN),
    }
}

/// Highest rate up to which every rate of `runs` (one policy's) met both SLOs with no
/// failures; 0 when even the lowest did not.
pub fn throughput_at_slo(runs: &[&RateRun], ttft_slo: f64, tpot_slo: f64) -> f64 {
    let mut sorted: Vec<&&RateRun> = runs.iter().collect();
    sorted.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let mut best = 0.0;
    for r in sorted {
        let s = &r.summary;
        let ok = s.failed == 0
            && s.completed > 0
            && s.ttft.p99 <= ttft_slo
            && (s.tpot.count == 0 || s.tpot.p99 <= tpot_slo);
        if !ok {
            break;
        }
        best = r.rate;
    }
    best
}

fn table(args: &SchedulingArgs, runs: &[RateRun], ttft_slo: f64, tpot_slo: f64) -> String {
    let ms = |s: f64| {
        if s.is_finite() {
            format!("{:.0}", s * 1e3)
        } else {
            "-".into()
        }
    };
    let mut out = format!(
        "{:>6} {:>9} {:>9} {:>9} {:>10} {:>9} {:>6}\n",
        "rate", "policy", "TTFT p50", "TTFT p99", "TPOT p99", "done/sent", "failed"
    );
    let mut rates = args.rates.clone();
    rates.sort_by(f64::total_cmp);
    for rate in &rates {
        for p in &args.policies {
            if let Some(r) = runs.iter().find(|r| r.policy == *p && r.rate == *rate) {
                let s = &r.summary;
                out.push_str(&format!(
                    "{:>6.2} {:>9} {:>9} {:>9} {:>10} {:>9} {:>6}\n",
                    rate,
                    p.name(),
                    ms(s.ttft.p50),
                    ms(s.ttft.p99),
                    ms(s.tpot.p99),
                    format!("{}/{}", s.completed, s.sent),
                    s.failed
                ));
            }
        }
    }
    out.push_str(&format!(
        "\nSLO ({}× the low-load mean of {}): TTFT {} ms, TPOT {} ms\n",
        args.slo_factor,
        args.policies.first().map_or("-", |p| p.name()),
        ms(ttft_slo),
        ms(tpot_slo)
    ));
    let base = args.policies.first().map(|p| {
        let mine: Vec<&RateRun> = runs.iter().filter(|r| r.policy == *p).collect();
        throughput_at_slo(&mine, ttft_slo, tpot_slo)
    });
    for p in &args.policies {
        let mine: Vec<&RateRun> = runs.iter().filter(|r| r.policy == *p).collect();
        let t = throughput_at_slo(&mine, ttft_slo, tpot_slo);
        let rel = match base {
            Some(b) if b > 0.0 => format!(" ({:.2}×)", t / b),
            _ => String::new(),
        };
        out.push_str(&format!(
            "throughput at SLO, {:>9}: {t:.2} req/s{rel}\n",
            p.name()
        ));
    }
    let top = rates.last().copied().unwrap_or(0.0);
    let p99 = |p: SchedulingPolicy| {
        runs.iter()
            .find(|r| r.policy == p && r.rate == top)
            .map(|r| r.summary.ttft.p99)
    };
    if let Some(b) = args.policies.first().and_then(|p| p99(*p)) {
        for p in args.policies.iter().skip(1) {
            if let Some(x) = p99(*p) {
                out.push_str(&format!(
                    "P99 TTFT at {top} req/s, {} / {}: {:.2}\n",
                    p.name(),
                    args.policies[0].name(),
                    x / b
                ));
            }
        }
    }
    out
}

/// Runs every policy at every rate; returns the printed text.
pub fn run(args: &SchedulingArgs) -> anyhow::Result<String> {
    let mut args = args.clone();
    if args.quick {
        args.preset = "tiny".into();
        args.adapters = args.adapters.min(8);
        args.ranks = vec![8, 16];
        args.rates = vec![10.0, 20.0];
        args.workload = quick_workload(&args.workload);
        args.startup_timeout = args.startup_timeout.min(120.0);
    }
    anyhow::ensure!(!args.policies.is_empty(), "--policies is empty");
    anyhow::ensure!(!args.rates.is_empty(), "--rates is empty");
    let bin = match &args.thaw_bin {
        Some(b) => b.clone(),
        None => default_thaw_bin()?,
    };
    let tmp = tempfile::tempdir()?;
    let root = args
        .workdir
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&root)?;
    let (model, lora_dir) = prepare_files(
        args.model.as_deref(),
        &args.preset,
        args.lora_dir.as_deref(),
        args.adapters,
        &args.ranks,
        &root,
    )?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut common: Vec<String> = vec![
        "--model".into(),
        model.display().to_string(),
        "--lora-dir".into(),
        lora_dir.display().to_string(),
        "--port".into(),
        "0".into(),
    ];
    common.extend(args.serve_arg.iter().cloned());
    let mut rates = args.rates.clone();
    rates.sort_by(f64::total_cmp);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut runs: Vec<RateRun> = Vec::new();
    let mut server_info: Option<ServerInfo> = None;
    for policy in &args.policies {
        let mut serve_args = common.clone();
        serve_args.extend(["--scheduling-policy".to_string(), policy.to_string()]);
        let log = args.out.join(format!("serve-{policy}.log"));
        let t0 = Instant::now();
        let mut server = ServeProcess::start(
            &bin,
            &serve_args,
            &log,
            Duration::from_secs_f64(args.startup_timeout),
        )?;
        let client = OpenAiClient::new(&server.url, None)?;
        let info = rt.block_on(async {
            let timeout = Duration::from_secs_f64(args.startup_timeout);
            wait_ready(&client, &server.url, &log, timeout).await
        })?;
        eprintln!("{policy}: server up in {:.1?}", t0.elapsed());
        let info = server_info.get_or_insert(info).clone();
        let prompts = prompt_source(Some(&model), &info)?;
        for rate in &rates {
            let workload = WorkloadArgs {
                rate: Some(*rate),
                ..args.workload.clone()
            };
            let opts = RunOptions {
                request_timeout: Duration::from_secs_f64(args.request_timeout),
                progress: !args.no_progress,
                label: format!("{policy:>8} {rate:>5.2}/s"),
            };
            let (_, summary) = rt.block_on(measure(&client, &info, &workload, &prompts, &opts))?;
            let metrics = rt
                .block_on(client.get_text("/metrics"))
                .unwrap_or_default()
                .lines()
                .filter(|l| l.starts_with("thaw_sched") || l.starts_with("thaw_perf"))
                .map(str::to_string)
                .collect();
            eprintln!(
                "{policy} at {rate} req/s: {}/{} in {:.1} s, TTFT p99 {:.0} ms",
                summary.completed,
                summary.sent,
                summary.wall_s,
                summary.ttft.p99 * 1e3
            );
            runs.push(RateRun {
                policy: *policy,
                rate: *rate,
                summary,
                metrics,
            });
        }
        server.stop(Duration::from_secs(60))?;
    }
    let first: Vec<RateRun> = runs
        .iter()
        .filter(|r| Some(&r.policy) == args.policies.first())
        .cloned()
        .collect();
    let (ttft_slo, tpot_slo) = slos(&first, args.slo_factor);
    let w = &args.workload;
    let setup = format!(
        "thaw serve (CPU backend), model {}, {} adapters from {}; {} requests per rate, {:?} \
         arrivals, {:?} popularity, {:?} lengths (prompt {}, output {}); serve args {:?}",
        model.display(),
        server_info.as_ref().map_or(0, |s| s.adapters.len()),
        lora_dir.display(),
        w.requests,
        w.arrivals,
        w.popularity,
        w.lengths,
        w.prompt_len,
        w.output_len,
        args.serve_arg,
    );
    let mut s = format!("{setup}\ntimes in ms at the client\n\n");
    s.push_str(&table(&args, &runs, ttft_slo, tpot_slo));
    for r in &runs {
        for e in &r.summary.errors {
            s.push_str(&format!("{} at {}: error: {e}\n", r.policy, r.rate));
        }
    }
    let json = args.out.join("scheduling.json");
    write_json(
        &json,
        &SchedulingReport {
            bench: "scheduling",
            setup: &setup,
            serve_args: &common,
            workload: &args.workload,
            ttft_slo_s: ttft_slo,
            tpot_slo_s: tpot_slo,
            runs: &runs,
        },
    )?;
    s.push_str(&format!("\nreport: {}\n", json.display()));
    Ok(s)
}
