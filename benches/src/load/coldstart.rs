//! `thaw-bench cold-start`: CaraServe's Fig. 10 / 13 / 14 over HTTP. Starts `thaw serve` once
//! per `--cold-start` policy on the same model, adapters and workload, measures at the client,
//! stops the server with SIGTERM, and prints the policies side by side with overheads
//! relative to `cached`.
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use thaw_server::coldstart::ColdStartPolicy;
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};

use super::cli::{measure, prompt_source, quick_workload, write_json};
use super::client::OpenAiClient;
use super::coldstart_metrics::{self, ServerColdStats};
use super::launch::ServerLaunch;
use super::plot::write_cdfs;
use super::report::{overhead_table, Summary};
use super::runner::{RequestRecord, RunOptions};
use super::workload::{PopularityKind, ServerInfo, WorkloadArgs};

/// Options of `thaw-bench cold-start`.
#[derive(clap::Args, Clone, Debug)]
pub struct ColdStartHttpArgs {
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
    #[arg(long, default_value_t = 40)]
    pub adapters: usize,
    /// Ranks of the generated adapters (round-robin), targeting q,k,v,o.
    #[arg(long, value_delimiter = ',', default_values_t = [8, 16, 32, 64, 128])]
    pub ranks: Vec<usize>,
    /// Policies to compare, in order; `cached` is the baseline of the overheads.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["cached", "on-demand", "cpu-assist", "auto"])]
    pub policies: Vec<ColdStartPolicy>,
    /// Passed to `thaw serve --device` (auto, cpu or cuda); on cuda the link is the real one.
    #[arg(long)]
    pub device: Option<String>,
    /// Passed to `thaw serve --emulated-link-gbps`.
    #[arg(long)]
    pub emulated_link_gbps: Option<f64>,
    /// Passed to `thaw serve --emulated-link-latency-us`.
    #[arg(long)]
    pub emulated_link_latency_us: Option<f64>,
    /// Passed to `thaw serve --lora-workers`.
    #[arg(long)]
    pub lora_workers: Option<usize>,
    /// Passed to `thaw serve --max-loras` (adapters resident on the device at once).
    #[arg(long)]
    pub max_loras: Option<usize>,
    #[command(flatten)]
    pub server: ServerLaunch,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Directory for the JSON report, the CDF plots and the servers' logs.
    #[arg(long, default_value = "thaw-bench-results")]
    pub out: PathBuf,
    /// A seconds-long version for the test suite: tiny model, 8 adapters, 12 requests,
    /// a distinct adapter per request.
    #[arg(long)]
    pub quick: bool,
}

/// One policy's run.
#[derive(Serialize)]
pub struct PolicyRun {
    pub policy: ColdStartPolicy,
    pub summary: Summary,
    /// The server's cold-start counters at the end of the run (None: /metrics unread).
    pub server: Option<ServerColdStats>,
    pub requests: Vec<RequestRecord>,
}

/// The JSON report of `cold-start`.
#[derive(Serialize)]
pub struct ColdStartReport {
    pub bench: &'static str,
    pub setup: String,
    pub serve_args: Vec<String>,
    pub workload: WorkloadArgs,
    pub prompts: String,
    pub server: Option<ServerInfo>,
    pub runs: Vec<PolicyRun>,
}

/// The `thaw` executable next to this one.
pub fn default_thaw_bin() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    Ok(exe.with_file_name(format!("thaw{}", std::env::consts::EXE_SUFFIX)))
}

fn prepare(args: &ColdStartHttpArgs, root: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    prepare_files(
        args.model.as_deref(),
        &args.preset,
        args.lora_dir.as_deref(),
        args.adapters,
        &args.ranks,
        root,
    )
}

/// The model and adapter directories to serve: the given ones, else generated into `root`
/// (reused when already there).
pub(super) fn prepare_files(
    model: Option<&Path>,
    preset: &str,
    lora_dir: Option<&Path>,
    adapters: usize,
    ranks: &[usize],
    root: &Path,
) -> anyhow::Result<(PathBuf, PathBuf)> {
    let model = match model {
        Some(m) => m.to_path_buf(),
        None => {
            let spec = gen::preset(preset).with_context(|| format!("unknown --preset {preset}"))?;
            let dir = root.join(format!("model-{preset}"));
            if !dir.join("config.json").exists() {
                eprintln!("generating the {preset} model into {}", dir.display());
                gen::write_model(&spec, &dir, &GenModelOptions::default())?;
            }
            dir
        }
    };
    let lora_dir = match lora_dir {
        Some(d) => d.to_path_buf(),
        None => {
            let rank_names: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
            let dir = root.join(format!(
                "adapters-{}-{}-r{}",
                model
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("model"),
                adapters,
                rank_names.join("_")
            ));
            let present = std::fs::read_dir(&dir).map_or(0, |it| it.count());
            if present != adapters {
                let _ = std::fs::remove_dir_all(&dir);
                eprintln!("generating {adapters} adapters into {}", dir.display());
                gen::write_adapters(&GenAdaptersOptions {
                    model_dir: model.clone(),
                    out_dir: dir.clone(),
                    count: adapters,
                    ranks: ranks.to_vec(),
                    targets: vec![Projection::Q, Projection::K, Projection::V, Projection::O],
                    ..Default::default()
                })?;
            }
            dir
        }
    };
    Ok((model, lora_dir))
}

/// A running `thaw serve`; SIGTERM on drop if still running.
pub(super) struct ServeProcess {
    child: Child,
    pub(super) url: String,
}

impl ServeProcess {
    /// The server's process id (to read its memory).
    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(super) fn start(
        bin: &Path,
        args: &[String],
        log: &Path,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        Self::start_with_env(bin, args, log, timeout, &[])
    }

    /// [`ServeProcess::start`] with extra environment variables for the server.
    pub(super) fn start_with_env(
        bin: &Path,
        args: &[String],
        log: &Path,
        timeout: Duration,
        env: &[(&str, String)],
    ) -> anyhow::Result<Self> {
        let log_file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut child = Command::new(bin)
            .arg("serve")
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().context("server stdout")?;
        // The banner names the bound address (we ask for port 0); the rest of stdout is drained
        // by a thread so the server never blocks on a full pipe.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if !sent {
                    if let Some(rest) = line.split("http://").nth(1) {
                        let addr = rest.split_whitespace().next().unwrap_or("").to_string();
                        let _ = tx.send(addr);
                        sent = true;
                    }
                }
            }
        });
        let mut p = Self {
            child,
            url: String::new(),
        };
        let deadline = Instant::now() + timeout;
        let addr = loop {
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(a) => break a,
                Err(_) => {
                    if let Some(status) = p.child.try_wait()? {
                        anyhow::bail!(
                            "`thaw serve` exited ({status}) before listening:\n{}",
                            log_tail(log)
                        );
                    }
                    anyhow::ensure!(
                        Instant::now() < deadline,
                        "`thaw serve` printed no address within {timeout:?}:\n{}",
                        log_tail(log)
                    );
                }
            }
        };
        p.url = format!("http://{addr}");
        Ok(p)
    }

    /// SIGTERM, then wait up to `grace` before SIGKILL.
    pub(super) fn stop(&mut self, grace: Duration) -> anyhow::Result<()> {
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("`thaw serve` did not exit {grace:?} after SIGTERM; killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
        Ok(())
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.stop(Duration::from_secs(10));
    }
}

/// Polls the server's `/health` until it answers (an error with the log's tail after
/// `timeout`), then reads its models and adapters.
pub(super) async fn wait_ready(
    client: &OpenAiClient,
    url: &str,
    log: &Path,
    timeout: Duration,
) -> anyhow::Result<ServerInfo> {
    let deadline = Instant::now() + timeout;
    while !client.healthy().await {
        anyhow::ensure!(
            Instant::now() < deadline,
            "{url} never became healthy:\n{}",
            log_tail(log)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    client.server_info().await
}

pub(super) fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Fails clearly when `bin serve` does not know `--cold-start` (a `thaw` older than the flag).
pub fn check_cold_start_flag(bin: &Path) -> anyhow::Result<()> {
    let out = Command::new(bin)
        .args(["serve", "--help"])
        .output()
        .with_context(|| {
            format!(
                "running {} (build it with `cargo build -p thaw-server --bin thaw`, or pass --thaw-bin)",
                bin.display()
            )
        })?;
    let help = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        help.contains("--cold-start"),
        "{} serve has no --cold-start flag; rebuild thaw (`cargo build -p thaw-server --bin thaw`)",
        bin.display()
    );
    Ok(())
}

/// Runs every policy; returns the printed text.
pub fn run(args: &ColdStartHttpArgs) -> anyhow::Result<String> {
    let mut args = args.clone();
    if args.quick {
        args.preset = "tiny".into();
        args.adapters = args.adapters.min(8);
        args.ranks = vec![8, 16];
        args.workload = WorkloadArgs {
            popularity: PopularityKind::Distinct,
            ..quick_workload(&args.workload)
        };
        args.server.startup_timeout = args.server.startup_timeout.min(120.0);
    }
    anyhow::ensure!(!args.policies.is_empty(), "--policies is empty");
    let bin = args.server.bin()?;
    check_cold_start_flag(&bin)?;
    let tmp = tempfile::tempdir()?;
    let root = args.server.root(tmp.path())?;
    let (model, lora_dir) = prepare(&args, &root)?;
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
    let opt = |name: &str, v: Option<String>| v.map(|v| vec![format!("--{name}"), v]);
    for extra in [
        opt(
            "emulated-link-gbps",
            args.emulated_link_gbps.map(|v| v.to_string()),
        ),
        opt(
            "emulated-link-latency-us",
            args.emulated_link_latency_us.map(|v| v.to_string()),
        ),
        opt("device", args.device.clone()),
        opt("lora-workers", args.lora_workers.map(|v| v.to_string())),
        opt("max-loras", args.max_loras.map(|v| v.to_string())),
    ]
    .into_iter()
    .flatten()
    {
        common.extend(extra);
    }
    common.extend(args.server.serve_arg.iter().cloned());

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut runs: Vec<PolicyRun> = Vec::new();
    let mut server_info: Option<ServerInfo> = None;
    let mut prompts_desc = String::new();
    for policy in &args.policies {
        let mut serve_args = common.clone();
        serve_args.extend(["--cold-start".to_string(), policy.to_string()]);
        let log = args.out.join(format!("serve-{policy}.log"));
        let t0 = Instant::now();
        let mut server = ServeProcess::start(
            &bin,
            &serve_args,
            &log,
            Duration::from_secs_f64(args.server.startup_timeout),
        )?;
        let (records, summary, stats) = rt.block_on(async {
            let client = OpenAiClient::new(&server.url, None)?;
            let timeout = Duration::from_secs_f64(args.server.startup_timeout);
            let info = wait_ready(&client, &server.url, &log, timeout).await?;
            eprintln!(
                "{policy}: server up at {} in {:.1?} ({} adapters)",
                server.url,
                t0.elapsed(),
                info.adapters.len()
            );
            // The plan is made once, from the first server; later ones serve the same files.
            let info = server_info.get_or_insert(info).clone();
            let prompts = prompt_source(Some(&model), &info)?;
            prompts_desc = prompts.describe();
            let opts = RunOptions {
                request_timeout: Duration::from_secs_f64(args.server.request_timeout),
                progress: !args.server.no_progress,
                label: format!("{policy:>10}"),
            };
            let (records, summary) =
                measure(&client, &info, &args.workload, &prompts, &opts).await?;
            let stats = match client.get_text("/metrics").await {
                Ok(text) => Some(ServerColdStats::read(&text)),
                Err(e) => {
                    eprintln!("{policy}: /metrics unread: {e}");
                    None
                }
            };
            anyhow::Ok((records, summary, stats))
        })?;
        server.stop(Duration::from_secs(60))?;
        eprintln!(
            "{policy}: {}/{} completed in {:.1} s",
            summary.completed, summary.sent, summary.wall_s
        );
        runs.push(PolicyRun {
            policy: *policy,
            summary,
            server: stats,
            requests: records,
        });
    }

    let w = &args.workload;
    let setup = format!(
        "thaw serve (--device {}; on the CPU an emulated host→device link{}{}), model {}, {} adapters \
         from {}; {} requests, {:?} arrivals at {:.2} req/s, {:?} popularity, {:?} lengths (prompt {}, \
         output {})",
        args.device.as_deref().unwrap_or("auto"),
        args.emulated_link_gbps
            .map(|g| format!(" {g} GB/s"))
            .unwrap_or_default(),
        args.emulated_link_latency_us
            .map(|l| format!(" + {l} µs/layer"))
            .unwrap_or_default(),
        model.display(),
        server_info.as_ref().map_or(0, |s| s.adapters.len()),
        lora_dir.display(),
        w.requests,
        w.arrivals,
        w.rate.unwrap_or(super::workload::DEFAULT_RATE),
        w.popularity,
        w.lengths,
        w.prompt_len,
        w.output_len,
    );
    let json = args.out.join("cold-start.json");
    let plots = write_cdfs(
        &args.out.join("cold-start-cdf"),
        "thaw serve --cold-start policies",
        &runs
            .iter()
            .map(|r| (r.policy.to_string(), r.requests.as_slice()))
            .collect::<Vec<_>>(),
    )?;
    let table_rows: Vec<(String, &Summary)> = runs
        .iter()
        .map(|r| (r.policy.to_string(), &r.summary))
        .collect();
    let mut s =
        format!("{setup}\ntimes in ms at the client; overhead vs cached in parentheses\n\n");
    s.push_str(&overhead_table(&table_rows, "cached"));
    s.push_str("\nfrom each server's /metrics at the end of its run:\n\n");
    s.push_str(&coldstart_metrics::table(
        &runs
            .iter()
            .map(|r| (r.policy.to_string(), r.server.as_ref()))
            .collect::<Vec<_>>(),
    ));
    for r in &runs {
        for e in &r.summary.errors {
            s.push_str(&format!("{}: error: {e}\n", r.policy));
        }
    }
    s.push_str(&format!("\nreport: {}\n", json.display()));
    for p in plots {
        s.push_str(&format!("plot: {}\n", p.display()));
    }
    write_json(
        &json,
        &ColdStartReport {
            bench: "cold-start",
            setup,
            serve_args: common,
            workload: args.workload.clone(),
            prompts: prompts_desc,
            server: server_info,
            runs,
        },
    )?;
    Ok(s)
}
