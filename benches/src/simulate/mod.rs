//! `thaw-bench simulate`: N Thaw instances behind a router, as a discrete-event simulation in
//! which every instance is the cost model a real `thaw serve --dump-cost-model` wrote (no
//! constants of its own). Workloads: Azure trace arrivals and lengths, scaled to an offered
//! load; 1,000 to 1,000,000 adapters with Zipf or Chameleon rank-power-law popularity.
//! Output: P50/P99 TTFT, SLO attainment and goodput, adapter loads per second, per router and
//! cluster size, as a table, JSON and plots. `--workload multi-turn` runs chat conversations
//! on instances with prefix caches (`--prefix-caching true,false` compares with none), where
//! the prefix-aware routers (prefix-affinity, the EPP with its prefix-cache-scorer) matter.
mod cluster;
mod instance;
mod model;
mod plot;
mod prefix;
mod replay;
mod report;
mod router;
mod workload;

use std::path::PathBuf;

use model::InstanceModel;
use report::Row;
use router::RouterKind;

use crate::load::workload::PopularityKind;
use thaw_server::coldstart::CostSnapshot;

/// What the simulated clients send.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SimWorkload {
    /// Azure trace arrivals and lengths, independent requests.
    Azure,
    /// Conversations of --turns turns: each adapter's --system-prompt-len system prompt, the
    /// earlier turns and a --user-len message per prompt, --answer-len answers.
    MultiTurn,
}

/// `thaw-bench simulate` options.
#[derive(clap::Args, Clone, Debug)]
pub struct SimulateArgs {
    /// What the clients send.
    #[arg(long, value_enum, default_value = "azure")]
    pub workload: SimWorkload,
    /// Turns per conversation (--workload multi-turn).
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Tokens of each adapter's system prompt (--workload multi-turn).
    #[arg(long, default_value_t = 1000)]
    pub system_prompt_len: usize,
    /// Tokens of each new user message (--workload multi-turn).
    #[arg(long, default_value_t = 64)]
    pub user_len: usize,
    /// Tokens of each answer (--workload multi-turn).
    #[arg(long, default_value_t = 64)]
    pub answer_len: usize,
    /// Mean seconds (exponential) between an answer and the next turn (--workload multi-turn).
    #[arg(long, default_value_t = 1.0)]
    pub think_time: f64,
    /// Prefix caching on the instances: true, false, or both to compare [default: true].
    #[arg(long, value_delimiter = ',')]
    pub prefix_caching: Vec<bool>,
    /// Cost model written by `thaw serve --dump-cost-model PATH`; with --replay of a run
    /// against several servers, one per server (comma-separated, in --url order) or one for
    /// all; with --replay, a `PATH.history.jsonl` replays the model as it evolved in the run.
    #[arg(long, value_name = "PATH", value_delimiter = ',', required = true)]
    pub cost_model: Vec<PathBuf>,
    /// Cluster sizes (instances) [default: 8,32,128,512,1024; --quick: 8,16].
    #[arg(long, value_delimiter = ',')]
    pub instances: Vec<usize>,
    /// Routers to compare [default: all].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub routers: Vec<RouterKind>,
    /// Adapter counts [default: 1000,100000,1000000; --quick: 1000].
    #[arg(long, value_delimiter = ',')]
    pub adapters: Vec<usize>,
    /// Adapter popularity models [default: zipf,rank-power-law; --quick: zipf].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub popularity: Vec<PopularityKind>,
    /// Adapter ranks, assigned to adapters uniformly at random.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64,128")]
    pub ranks: Vec<u32>,
    /// Zipf exponent.
    #[arg(long, default_value_t = 1.0)]
    pub zipf_alpha: f64,
    /// Chameleon's power-law exponent over ranks.
    #[arg(long, default_value_t = 1.0)]
    pub rank_alpha: f64,
    /// Requests per instance in each run [default: 50; --quick: 20].
    #[arg(long)]
    pub requests_per_instance: Option<usize>,
    /// Offered load as a fraction of the cluster's capacity (what the cost model predicts for
    /// full decode batches).
    #[arg(long, default_value_t = 0.7)]
    pub load: f64,
    /// TTFT SLO, seconds [default: 5 × the unloaded prefill of the median prompt].
    #[arg(long)]
    pub ttft_slo: Option<f64>,
    /// Decode step-time SLO of the rank-aware router, seconds [default: 1.5 × a full batch's step].
    #[arg(long)]
    pub tpot_slo: Option<f64>,
    /// Azure trace: arrival times and prompt/output lengths.
    #[arg(
        long,
        default_value = "../shared/traces/AzureLLMInferenceTrace_conv.csv"
    )]
    pub trace: PathBuf,
    /// Longest prompt + output; trace lengths are scaled to fit [default: what --max-num-seqs
    /// requests of equal share fill in the instance's KV cache].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// A few seconds: two small clusters, one adapter count, one popularity.
    #[arg(long)]
    pub quick: bool,
    /// Directory for `simulate.json` and the plots [default: none].
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long, default_value_t = 2023)]
    pub seed: u64,
    /// Validate instead: replay the requests of a `thaw-bench load` report (load.json) on as
    /// many simulated instances as it had servers, routed as it routed them (round-robin),
    /// each modelled by its server's --cost-model; print measured vs simulated TTFT.
    #[arg(long, value_name = "LOAD_JSON")]
    pub replay: Option<PathBuf>,
}

impl SimulateArgs {
    /// Fills the defaults that depend on --quick.
    fn resolved(&self) -> SimulateArgs {
        let mut a = self.clone();
        let q = self.quick;
        if a.instances.is_empty() {
            a.instances = if q {
                vec![8, 16]
            } else {
                vec![8, 32, 128, 512, 1024]
            };
        }
        if a.routers.is_empty() {
            a.routers = RouterKind::ALL.to_vec();
        }
        if a.adapters.is_empty() {
            a.adapters = if q {
                vec![1000]
            } else {
                vec![1000, 100_000, 1_000_000]
            };
        }
        if a.popularity.is_empty() {
            a.popularity = if q {
                vec![PopularityKind::Zipf]
            } else {
                vec![PopularityKind::Zipf, PopularityKind::RankPowerLaw]
            };
        }
        a.requests_per_instance
            .get_or_insert(if q { 20 } else { 50 });
        if a.prefix_caching.is_empty() {
            a.prefix_caching = vec![true];
        }
        a
    }
}

/// Runs every combination; returns the rows and the printed report.
pub fn run(args: &SimulateArgs) -> anyhow::Result<(Vec<Row>, String)> {
    let args = args.resolved();
    anyhow::ensure!(
        args.load.is_finite() && args.load > 0.0,
        "--load must be positive, got {}",
        args.load
    );
    anyhow::ensure!(
        args.instances.iter().all(|&n| n > 0) && args.adapters.iter().all(|&n| n > 0),
        "--instances and --adapters must be at least 1"
    );
    anyhow::ensure!(
        !args.ranks.is_empty() && args.ranks.iter().all(|&r| r > 0),
        "--ranks must list positive ranks"
    );
    if let Some(p) = &args.replay {
        let models = args
            .cost_model
            .iter()
            .map(|p| replay::ServerModel::read(p))
            .collect::<anyhow::Result<Vec<_>>>()?;
        return Ok((Vec::new(), replay::compare(&models, p)?));
    }
    let [path] = args.cost_model.as_slice() else {
        anyhow::bail!(
            "a simulated cluster is made of one server's cost model; pass one --cost-model"
        );
    };
    let model = &InstanceModel::new(CostSnapshot::read(path)?)?;
    let trace = match args.workload {
        SimWorkload::Azure => crate::trace::read_trace(&args.trace)
            .map_err(|e| anyhow::anyhow!("{e:#}; pass --trace with an Azure trace CSV"))?,
        SimWorkload::MultiTurn => Vec::new(),
    };
    anyhow::ensure!(
        args.think_time.is_finite() && args.think_time >= 0.0,
        "--think-time must be a non-negative number of seconds"
    );
    let mut rows = Vec::new();
    for &adapters in &args.adapters {
        let ranks = workload::adapter_ranks(adapters, &args.ranks, args.seed);
        let server = workload::server_info(&ranks, workload::max_model_len(&args, model));
        drop(ranks);
        for &pop in &args.popularity {
            for &n in &args.instances {
                let mut w = match args.workload {
                    SimWorkload::Azure => workload::build(&args, model, &trace, &server, pop, n)?,
                    SimWorkload::MultiTurn => workload::build_chat(&args, model, &server, pop, n)?,
                };
                for &caching in &args.prefix_caching {
                    w.ctx.prefix_caching = caching;
                    rows.extend(report::run_routers(&args, model, &w, n, adapters, pop));
                }
            }
        }
    }
    let mut text = report::table(&args, model, &rows);
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir)?;
        let json = dir.join("simulate.json");
        std::fs::write(&json, serde_json::to_string_pretty(&rows)?)?;
        text.push_str(&format!("\nwrote {}\n", json.display()));
        for p in plot::write(dir, &rows)? {
            text.push_str(&format!("wrote {}\n", p.display()));
        }
    }
    Ok((rows, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--quick` on the cost model a real `thaw serve` dumped (benches/fixtures): every router
    /// and size gets a row, percentiles are ordered, and routing by LoRA affinity loads fewer
    /// adapters than routing at random.
    #[test]
    fn quick_mode_compares_every_router() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = tempfile::tempdir().unwrap();
        let args = SimulateArgs {
            workload: SimWorkload::Azure,
            turns: 4,
            system_prompt_len: 1000,
            user_len: 64,
            answer_len: 64,
            think_time: 1.0,
            prefix_caching: vec![],
            cost_model: vec![root.join("fixtures/cost-model-cpu.json")],
            instances: vec![],
            routers: vec![],
            adapters: vec![],
            popularity: vec![],
            ranks: vec![8, 16, 32, 64, 128],
            zipf_alpha: 1.0,
            rank_alpha: 1.0,
            requests_per_instance: None,
            load: 0.7,
            ttft_slo: None,
            tpot_slo: None,
            trace: root.join("../../shared/traces/AzureLLMInferenceTrace_conv.csv"),
            max_model_len: None,
            quick: true,
            out: Some(out.path().to_path_buf()),
            seed: 7,
            replay: None,
        };
        let (rows, text) = run(&args).unwrap();
        assert_eq!(rows.len(), 2 * RouterKind::ALL.len(), "{text}");
        for r in &rows {
            assert_eq!(r.finished, r.requests, "{r:?}");
            assert!(r.p50_ttft_s <= r.p99_ttft_s, "{r:?}");
            assert!((0.0..=1.0).contains(&r.slo_attainment), "{r:?}");
        }
        for n in [8, 16] {
            let loads = |k: RouterKind| {
                rows.iter()
                    .find(|r| r.instances == n && r.router == k)
                    .unwrap()
                    .loads
            };
            assert!(
                loads(RouterKind::EppLora) < loads(RouterKind::Random),
                "{text}"
            );
        }
        assert!(out.path().join("simulate.json").exists());
        assert!(text.contains("P99 TTFT"), "{text}");
    }

    /// `--workload multi-turn --prefix-caching true,false` on the fixture's cost model: every
    /// turn finishes; without caches nothing hits; with them most prompt tokens do (the
    /// system prompts and earlier turns), and the prefix-aware routers hit more than random
    /// and start the turns sooner than any router without caches.
    #[test]
    fn multi_turn_compares_caching_and_prefix_aware_routers() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let args = SimulateArgs {
            workload: SimWorkload::MultiTurn,
            turns: 4,
            system_prompt_len: 1000,
            user_len: 64,
            answer_len: 64,
            think_time: 1.0,
            prefix_caching: vec![true, false],
            cost_model: vec![root.join("fixtures/cost-model-cpu.json")],
            instances: vec![4],
            routers: vec![],
            adapters: vec![100],
            popularity: vec![PopularityKind::Zipf],
            ranks: vec![8, 16, 32, 64, 128],
            zipf_alpha: 1.0,
            rank_alpha: 1.0,
            requests_per_instance: Some(40),
            load: 0.5,
            ttft_slo: None,
            tpot_slo: None,
            trace: root.join("no-trace-needed.csv"),
            max_model_len: None,
            quick: false,
            out: None,
            seed: 11,
            replay: None,
        };
        let (rows, text) = run(&args).unwrap();
        assert_eq!(rows.len(), 2 * RouterKind::ALL.len(), "{text}");
        for r in &rows {
            assert_eq!(r.finished, r.requests, "{r:?}");
            assert_eq!(r.requests, 160);
        }
        let row = |k: RouterKind, caching: bool| {
            rows.iter()
                .find(|r| r.router == k && r.prefix_caching == caching)
                .unwrap()
        };
        for k in RouterKind::ALL {
            assert_eq!(row(k, false).prefix_hit_rate, 0.0);
        }
        for k in [RouterKind::PrefixAffinity, RouterKind::EppPrefix] {
            let on = row(k, true);
            assert!(on.prefix_hit_rate > 0.6, "{text}");
            assert!(
                on.prefix_hit_rate > row(RouterKind::Random, true).prefix_hit_rate,
                "{text}"
            );
            let best_off = RouterKind::ALL
                .iter()
                .map(|&o| row(o, false).p50_ttft_s)
                .fold(f64::INFINITY, f64::min);
            assert!(on.p50_ttft_s < best_off, "{text}");
        }
        assert!(text.contains("hit rate"), "{text}");
    }
}
