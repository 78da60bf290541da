//! `thaw-bench load`: the open-loop load generator against any OpenAI-compatible endpoint.
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use super::chat::ChatArgs;
use super::client::OpenAiClient;
use super::plot::write_cdfs;
use super::prompts::PromptSource;
use super::report::{table, Summary};
use super::runner::{self, RequestRecord, RunOptions};
use super::workload::{self, ArrivalKind, LengthKind, ServerInfo, WorkloadArgs};

/// Options of `thaw-bench load`.
#[derive(clap::Args, Clone, Debug)]
pub struct LoadArgs {
    /// Base URL of the server (plain http); several, comma-separated, are served round-robin
    /// (request i to URL i mod n; each record says which), as `thaw-bench simulate --replay`
    /// routes them.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Bearer token, if the server wants one.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub chat: ChatArgs,
    /// Rates to sweep (requests/s), lowest first, on the same server (each run starts on an
    /// idle server): a table per rate and the highest rate within --ttft-slo-ms, with the
    /// prefix-cache hit rate, preemptions and the peak running batch (from /metrics). Chat
    /// workloads (--multi-turn, --no-max-tokens) print this table even for one rate.
    #[arg(long, value_delimiter = ',')]
    pub rates: Vec<f64>,
    /// TTFT SLO of --rates, ms: a rate is within it when its P99 TTFT is [default: 5x the
    /// lowest rate's P50 TTFT].
    #[arg(long)]
    pub ttft_slo_ms: Option<f64>,
    /// tokenizer.json (or its directory) to build prompts from [default: the one in the base
    /// model's `root` directory when the server is local, else random byte-token ids].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The served model's context in tokens, for servers whose `/v1/models` does not report
    /// `max_model_len` (llama.cpp's `llama-server`), or to fit requests into less: trace
    /// lengths are scaled into it and each request's prompt and output clipped to it, with
    /// room for the chat template in the chat workloads [default: the server's
    /// `max_model_len`].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Directory for the JSON report and the CDF plots.
    #[arg(long, default_value = "thaw-bench-results")]
    pub out: PathBuf,
    /// Seconds before a request counts as failed.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// A seconds-long run (12 requests at 20 req/s, 16-token prompts, 4 output tokens; with
    /// --multi-turn a 64-token system prompt) for the test suite.
    #[arg(long)]
    pub quick: bool,
}

/// The quick version of a workload: few short requests at a high rate.
pub fn quick_workload(w: &WorkloadArgs) -> WorkloadArgs {
    WorkloadArgs {
        requests: 12,
        arrivals: if w.arrivals == ArrivalKind::Trace {
            ArrivalKind::Poisson
        } else {
            w.arrivals
        },
        rate: Some(20.0),
        lengths: LengthKind::Fixed,
        prompt_len: 16,
        output_len: 4,
        ..w.clone()
    }
}

/// The JSON report: the setup, the summary and every request.
#[derive(Serialize)]
pub struct LoadReport<'a> {
    pub bench: &'static str,
    pub url: &'a str,
    pub workload: &'a WorkloadArgs,
    pub prompts: String,
    pub server: &'a ServerInfo,
    pub summary: &'a Summary,
    pub requests: &'a [RequestRecord],
}

/// Prompt ids: the given tokenizer, else the server's own when it is a local directory.
pub fn prompt_source(
    tokenizer: Option<&Path>,
    server: &ServerInfo,
) -> anyhow::Result<PromptSource> {
    if let Some(t) = tokenizer {
        return PromptSource::from_tokenizer(t);
    }
    if let Some(root) = &server.base_root {
        let p = Path::new(root).join("tokenizer.json");
        if p.is_file() {
            if let Ok(s) = PromptSource::from_tokenizer(&p) {
                return Ok(s);
            }
        }
    }
    Ok(PromptSource::random())
}

/// Plans and runs `workload` against a server already up.
pub async fn measure(
    client: &OpenAiClient,
    server: &ServerInfo,
    workload: &WorkloadArgs,
    prompts: &PromptSource,
    opts: &RunOptions,
) -> anyhow::Result<(Vec<RequestRecord>, Summary)> {
    measure_routed(
        std::slice::from_ref(client),
        server,
        workload,
        prompts,
        opts,
    )
    .await
}

/// [`measure`] against several servers, round-robin ([`runner::run_routed`]).
pub async fn measure_routed(
    clients: &[OpenAiClient],
    server: &ServerInfo,
    workload: &WorkloadArgs,
    prompts: &PromptSource,
    opts: &RunOptions,
) -> anyhow::Result<(Vec<RequestRecord>, Summary)> {
    let plan = workload::plan(workload, server)?;
    let lengths: Vec<usize> = plan.iter().map(|p| p.prompt_len).collect();
    let ids = prompts.prompts(&lengths, workload.seed);
    let (records, wall) = runner::run_routed(clients, server, &plan, ids, opts).await;
    let summary = Summary::of(&records, wall.as_secs_f64());
    Ok((records, summary))
}

pub fn write_json(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    serde_json::to_writer_pretty(std::io::BufWriter::new(f), value)?;
    Ok(())
}

/// Runs `thaw-bench load` and returns the text to print.
pub fn run(args: &LoadArgs) -> anyhow::Result<String> {
    let workload = if args.quick {
        quick_workload(&args.workload)
    } else {
        args.workload.clone()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let clients = args
            .url
            .split(',')
            .map(|u| OpenAiClient::new(u.trim(), args.api_key.clone()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let client = &clients[0];
        let mut infos = Vec::with_capacity(clients.len());
        for c in &clients {
            infos.push(
                c.server_info()
                    .await
                    .with_context(|| format!("is a server running at {}?", c.base_url()))?,
            );
        }
        let mut server = infos.swap_remove(0);
        if let Some(n) = args.max_model_len {
            anyhow::ensure!(n >= 16, "--max-model-len must be at least 16 tokens");
            server.max_model_len = Some(server.max_model_len.map_or(n, |m| m.min(n)));
        }
        for (c, other) in clients[1..].iter().zip(&infos) {
            anyhow::ensure!(
                other.adapters == server.adapters,
                "{} serves other adapters than {}; round-robin needs the same adapters on every --url",
                c.base_url(),
                client.base_url()
            );
        }
        let prompts = prompt_source(args.tokenizer.as_deref(), &server)?;
        if args.chat.any() || !args.rates.is_empty() {
            anyhow::ensure!(
                clients.len() == 1,
                "--rates and the chat workloads (--multi-turn, --no-max-tokens) run against one --url"
            );
            let mut args = args.clone();
            if args.quick {
                args.chat.system_prompt_len = args.chat.system_prompt_len.min(64);
            }
            return super::sweep::run(&args, &workload, client, &server, &prompts).await;
        }
        let opts = RunOptions {
            request_timeout: Duration::from_secs_f64(args.request_timeout),
            progress: !args.no_progress,
            label: "load".into(),
        };
        let (records, summary) =
            measure_routed(&clients, &server, &workload, &prompts, &opts).await?;
        std::fs::create_dir_all(&args.out)
            .with_context(|| format!("creating {}", args.out.display()))?;
        let json = args.out.join("load.json");
        write_json(
            &json,
            &LoadReport {
                bench: "load",
                url: &args.url,
                workload: &workload,
                prompts: prompts.describe(),
                server: &server,
                summary: &summary,
                requests: &records,
            },
        )?;
        let title = format!("{} at {}", server.base_model, client.base_url());
        let plots = write_cdfs(
            &args.out.join("load-cdf"),
            &title,
            &[("load".to_string(), records.as_slice())],
        )?;
        let mut s = format!(
            "{} requests to {} ({} adapters), {:?} arrivals at {:.2} req/s, {:?} popularity, {:?} lengths; prompts: {}\n\n",
            workload.requests,
            args.url,
            server.adapters.len(),
            workload.arrivals,
            workload.rate.unwrap_or(workload::DEFAULT_RATE),
            workload.popularity,
            workload.lengths,
            prompts.describe()
        );
        s.push_str(&table(&[("load".to_string(), &summary)]));
        for e in &summary.errors {
            s.push_str(&format!("error: {e}\n"));
        }
        s.push_str(&format!("\nreport: {}\n", json.display()));
        for p in plots {
            s.push_str(&format!("plot: {}\n", p.display()));
        }
        Ok(s)
    })
}
