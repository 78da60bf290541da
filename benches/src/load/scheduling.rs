//! `thaw-bench scheduling`: Chameleon's Figure 10 on `thaw serve`. One server per variant (a
//! `--scheduling-policy`, or a `--variant` with its own serve arguments) stays up for the whole
//! run; the same seeded workload is replayed at every rate, the variants interleaved per rate
//! (so a drift in the shared machine's speed hits them alike), and the whole sweep repeated
//! `--repeats` times with seeds `--seed`, `--seed`+1, …. Per point it prints the median over
//! the repeats of P50/P99 TTFT, P99 TBT (TPOT) and the TBT SLO attainment, the SLOs ("5× the
//! low-load" TTFT and TBT of the first variant, as Chameleon sets its SLO) and each variant's
//! throughput at SLO — the highest rate up to which every rate meets both.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use thaw_server::scheduler::SchedulingPolicy;

use super::cli::{measure, prompt_source, quick_workload, write_json};
use super::client::OpenAiClient;
use super::coldstart::{prepare_files, wait_ready, ServeProcess};
use super::launch::ServerLaunch;
use super::runner::RunOptions;
use super::scheduling_classes::{class_rows, class_table};
use super::scheduling_report::{points, slos, table, Point, RateRun};
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
    /// The SLOs are this many times the first variant's mean TTFT / TPOT at the lowest rate.
    #[arg(long, default_value_t = 5.0)]
    pub slo_factor: f64,
    /// The TBT SLO in ms, instead of `--slo-factor` × the low-load TPOT (e.g. the
    /// `--tpot-slo-ms` a variant serves with).
    #[arg(long)]
    pub tbt_slo_ms: Option<f64>,
    /// The TTFT SLO in ms, instead of `--slo-factor` × the low-load TTFT (to carry one
    /// run's low-load SLO to a run of higher rates).
    #[arg(long)]
    pub ttft_slo_ms: Option<f64>,
    /// Also print each point's TTFT split by class: requests whose prompt + max_tokens (their
    /// KV reservation) is at least this many tokens against the rest, seeds pooled, with the
    /// count of large requests and the drain after the last send.
    #[arg(long)]
    pub large_tokens: Option<usize>,
    /// More variants after the policies: `LABEL=POLICY [SERVE-ARG...]`, e.g.
    /// `--variant 'mlq+cap=mlq --tpot-slo-ms 60'`.
    #[arg(long)]
    pub variant: Vec<String>,
    /// The variant (a policy name or a `--variant` label) that sets the SLOs and that every
    /// ratio is against [default: the first], e.g. `--baseline slora` for Chameleon's Figure
    /// 10, whose SLO and ratios are S-LoRA's.
    #[arg(long)]
    pub baseline: Option<String>,
    /// Times the whole sweep runs (seed `--seed` + i); every point reports the median.
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// Requests each server serves first, at the lowest rate and not measured (another
    /// seed), so the first measured rate does not pay the adapters' first reads from disk.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    #[command(flatten)]
    pub server: ServerLaunch,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Directory for the JSON report and the servers' logs.
    #[arg(long, default_value = "thaw-bench-results")]
    pub out: PathBuf,
    /// A seconds-long version for the test suite: tiny model, 8 adapters, 12 requests, two
    /// rates.
    #[arg(long)]
    pub quick: bool,
}

/// A server the sweep compares: a policy and its serve arguments.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Variant {
    pub label: String,
    pub policy: SchedulingPolicy,
    pub args: Vec<String>,
}

impl Variant {
    /// `LABEL=POLICY [SERVE-ARG...]`.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        let (label, rest) = s
            .split_once('=')
            .with_context(|| format!("--variant {s:?}: write LABEL=POLICY [SERVE-ARG...]"))?;
        let mut words = rest.split_whitespace();
        let policy = words.next().unwrap_or_default();
        let policy = <SchedulingPolicy as clap::ValueEnum>::from_str(policy, true)
            .map_err(|e| anyhow::anyhow!("--variant {s:?}: bad policy {policy:?}: {e}"))?;
        anyhow::ensure!(!label.trim().is_empty(), "--variant {s:?}: empty label");
        Ok(Self {
            label: label.trim().to_string(),
            policy,
            args: words.map(str::to_string).collect(),
        })
    }

    fn of(policy: SchedulingPolicy) -> Self {
        Self {
            label: policy.name().to_string(),
            policy,
            args: Vec::new(),
        }
    }
}

#[derive(Serialize)]
struct SchedulingReport<'a> {
    bench: &'static str,
    setup: &'a str,
    serve_args: &'a [String],
    variants: &'a [Variant],
    workload: &'a WorkloadArgs,
    ttft_slo_s: f64,
    tpot_slo_s: f64,
    points: &'a [Point],
    runs: &'a [RateRun],
}

/// Runs every variant at every rate, `--repeats` times; returns the printed text.
pub fn run(args: &SchedulingArgs) -> anyhow::Result<String> {
    let mut args = args.clone();
    if args.quick {
        args.preset = "tiny".into();
        args.adapters = args.adapters.min(8);
        args.ranks = vec![8, 16];
        args.rates = vec![10.0, 20.0];
        args.workload = quick_workload(&args.workload);
        args.server.startup_timeout = args.server.startup_timeout.min(120.0);
        args.repeats = args.repeats.min(2);
    }
    let mut variants: Vec<Variant> = args.policies.iter().map(|p| Variant::of(*p)).collect();
    for v in &args.variant {
        variants.push(Variant::parse(v)?);
    }
    anyhow::ensure!(!variants.is_empty(), "--policies and --variant are empty");
    if let Some(b) = &args.baseline {
        put_first(&mut variants, b)?;
    }
    anyhow::ensure!(!args.rates.is_empty(), "--rates is empty");
    anyhow::ensure!(args.repeats >= 1, "--repeats must be at least 1");
    let bin = args.server.bin()?;
    let tmp = tempfile::tempdir()?;
    let root = args.server.root(tmp.path())?;
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
    common.extend(args.server.serve_arg.iter().cloned());
    let mut rates = args.rates.clone();
    rates.sort_by(f64::total_cmp);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // Every variant's server up for the whole sweep (idle ones wait on their queue).
    let mut servers = Vec::new();
    let mut server_info: Option<ServerInfo> = None;
    for (i, v) in variants.iter().enumerate() {
        let mut serve_args = common.clone();
        serve_args.extend(["--scheduling-policy".to_string(), v.policy.to_string()]);
        serve_args.extend(v.args.iter().cloned());
        let log = args.out.join(format!("serve-{i}-{}.log", v.policy));
        let t0 = Instant::now();
        let server = ServeProcess::start(
            &bin,
            &serve_args,
            &log,
            Duration::from_secs_f64(args.server.startup_timeout),
        )?;
        let client = OpenAiClient::new(&server.url, None)?;
        let info = rt.block_on(async {
            let timeout = Duration::from_secs_f64(args.server.startup_timeout);
            wait_ready(&client, &server.url, &log, timeout).await
        })?;
        eprintln!("{}: server up in {:.1?}", v.label, t0.elapsed());
        server_info.get_or_insert(info);
        servers.push((server, client));
    }
    let info = server_info.context("no server started")?;
    let prompts = prompt_source(Some(&model), &info)?;
    if args.warmup > 0 {
        let workload = WorkloadArgs {
            rate: Some(rates[0]),
            requests: args.warmup,
            seed: args.workload.seed.wrapping_add(1_000_003),
            ..args.workload.clone()
        };
        for (v, (_, client)) in variants.iter().zip(&servers) {
            let opts = RunOptions {
                request_timeout: Duration::from_secs_f64(args.server.request_timeout),
                progress: !args.server.no_progress,
                label: format!("{:>8} warm-up", v.label),
            };
            let (_, summary) = rt.block_on(measure(client, &info, &workload, &prompts, &opts))?;
            eprintln!(
                "{}: warm-up {}/{} in {:.1} s (not measured)",
                v.label, summary.completed, summary.sent, summary.wall_s
            );
        }
    }
    let mut runs: Vec<RateRun> = Vec::new();
    for round in 0..args.repeats {
        let seed = args.workload.seed + round as u64;
        for (ri, rate) in rates.iter().enumerate() {
            // Rotate who goes first, so no variant always runs right after another's load.
            let n = variants.len();
            for k in 0..n {
                let vi = (k + ri + round) % n;
                let v = &variants[vi];
                let client = &servers[vi].1;
                let workload = WorkloadArgs {
                    rate: Some(*rate),
                    seed,
                    ..args.workload.clone()
                };
                let opts = RunOptions {
                    request_timeout: Duration::from_secs_f64(args.server.request_timeout),
                    progress: !args.server.no_progress,
                    label: format!("{:>8} {rate:>5.2}/s #{round}", v.label),
                };
                let (records, summary) =
                    rt.block_on(measure(client, &info, &workload, &prompts, &opts))?;
                let metrics = rt
                    .block_on(client.get_text("/metrics"))
                    .unwrap_or_default()
                    .lines()
                    // The per-reason wait sums too (cumulative over the server's life: a
                    // run's share is the difference from the previous run on that server).
                    .filter(|l| {
                        l.starts_with("thaw_sched")
                            || l.starts_with("thaw_perf")
                            || l.starts_with("thaw_request_wait_seconds_sum")
                            || l.starts_with("thaw_request_wait_seconds_count")
                            // With --emulated-step-time: steps run and seconds padded.
                            || l.starts_with("thaw_engine_steps_total")
                            || l.starts_with("thaw_emulated_step_padding_seconds_total")
                    })
                    .map(str::to_string)
                    .collect();
                eprintln!(
                    "{} at {rate} req/s (seed {seed}): {}/{} in {:.1} s, TTFT p99 {:.0} ms",
                    v.label,
                    summary.completed,
                    summary.sent,
                    summary.wall_s,
                    summary.ttft.p99 * 1e3
                );
                runs.push(RateRun {
                    variant: v.label.clone(),
                    rate: *rate,
                    seed,
                    tpot_s: records.iter().filter_map(|r| r.tpot_s).collect(),
                    summary,
                    metrics,
                    records,
                });
            }
        }
    }
    for (server, _) in &mut servers {
        server.stop(Duration::from_secs(60))?;
    }
    let labels: Vec<String> = variants.iter().map(|v| v.label.clone()).collect();
    let (ttft_slo, tpot_slo) = slos(&runs, &labels[0], args.slo_factor);
    let tpot_slo = args.tbt_slo_ms.map_or(tpot_slo, |ms| ms * 1e-3);
    let ttft_slo = args.ttft_slo_ms.map_or(ttft_slo, |ms| ms * 1e-3);
    let points = points(&runs, &labels, &rates, tpot_slo);
    let w = &args.workload;
    let setup = format!(
        "thaw serve (CPU backend), model {}, {} adapters from {}; {} requests per rate, {:?} \
         arrivals, {:?} popularity, {:?} lengths (prompt {}, output {}); serve args {:?}; \
         {} repeat(s), seeds from {}, {} warm-up requests per server",
        model.display(),
        info.adapters.len(),
        lora_dir.display(),
        w.requests,
        w.arrivals,
        w.popularity,
        w.lengths,
        w.prompt_len,
        w.output_len,
        args.server.serve_arg,
        args.repeats,
        w.seed,
        args.warmup,
    );
    let mut s =
        format!("{setup}\ntimes in ms at the client; every figure the median of the repeats\n\n");
    s.push_str(&table(
        &labels,
        &points,
        args.slo_factor,
        ttft_slo,
        tpot_slo,
    ));
    if let Some(n) = args.large_tokens {
        s.push_str(&class_table(&class_rows(&runs, &labels, &rates, n), n));
    }
    for r in &runs {
        for e in &r.summary.errors {
            s.push_str(&format!(
                "{} at {} (seed {}): error: {e}\n",
                r.variant, r.rate, r.seed
            ));
        }
    }
    let json = args.out.join("scheduling.json");
    write_json(
        &json,
        &SchedulingReport {
            bench: "scheduling",
            setup: &setup,
            serve_args: &common,
            variants: &variants,
            workload: &args.workload,
            ttft_slo_s: ttft_slo,
            tpot_slo_s: tpot_slo,
            points: &points,
            runs: &runs,
        },
    )?;
    s.push_str(&format!("\nreport: {}\n", json.display()));
    Ok(s)
}

/// Moves the variant labelled `label` to the front (the SLOs and ratios are the first's),
/// keeping the others' order.
fn put_first(variants: &mut Vec<Variant>, label: &str) -> anyhow::Result<()> {
    let i = variants
        .iter()
        .position(|v| v.label == label)
        .with_context(|| {
            let have: Vec<&str> = variants.iter().map(|v| v.label.as_str()).collect();
            format!("--baseline {label:?} is none of the variants {have:?}; name one of them")
        })?;
    let v = variants.remove(i);
    variants.insert(0, v);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_baseline_goes_first_and_the_rest_keep_their_order() {
        let mut vs: Vec<Variant> = [
            "fcfs=fcfs",
            "mlq=mlq",
            "slora=fcfs --admission-bypass false",
        ]
        .iter()
        .map(|s| Variant::parse(s).unwrap())
        .collect();
        put_first(&mut vs, "slora").unwrap();
        let labels: Vec<&str> = vs.iter().map(|v| v.label.as_str()).collect();
        assert_eq!(labels, ["slora", "fcfs", "mlq"]);
        assert_eq!(vs[0].args, ["--admission-bypass", "false"]);
        let err = put_first(&mut vs, "fifo").unwrap_err().to_string();
        assert!(err.contains("slora"), "{err}");
        assert_eq!(vs.len(), 3);
    }

    #[test]
    fn variants_parse_label_policy_and_args() {
        let v = Variant::parse("mlq+cap=mlq --tpot-slo-ms 60").unwrap();
        assert_eq!(v.label, "mlq+cap");
        assert_eq!(v.policy, SchedulingPolicy::Mlq);
        assert_eq!(v.args, vec!["--tpot-slo-ms", "60"]);
        assert!(Variant::parse("nolabel").is_err());
        assert!(Variant::parse("x=lifo").is_err());
    }
}
