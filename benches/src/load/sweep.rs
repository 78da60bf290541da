//! `thaw-bench load --rates A,B,…` and the chat workloads (`--multi-turn`, `--no-max-tokens`):
//! the workload at each rate, lowest first, on one server, each run starting on an idle server
//! and sending its own requests (seed `--seed` + the rate's index; the adapters' system prompts
//! stay the same), so a prefix cache cannot serve one rate from another's. Per rate: done/failed, TTFT P50/P99, E2E P99, goodput within the TTFT SLO, the
//! prefix-cache hit rate (from `usage.prompt_tokens_details.cached_tokens`, and from the
//! `vllm:prefix_cache_*` counters' change), preemptions, and the peak running batch and queue
//! (`/metrics` polled every 100 ms). Then the highest rate within the SLO: the largest rate up
//! to which every rate met it with nothing failed.
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use super::chat::{self, ChatArgs};
use super::cli::{measure, write_json, LoadArgs};
use super::client::OpenAiClient;
use super::metrics::{counters, poll_peaks, wait_idle, Counters, Peaks};
use super::prompts::PromptSource;
use super::report::{Stats, Summary};
use super::runner::{RequestRecord, RunOptions};
use super::workload::{ServerInfo, WorkloadArgs, DEFAULT_RATE};

/// One rate's run.
#[derive(Clone, Debug, Serialize)]
pub struct RateRun {
    pub rate: f64,
    pub summary: Summary,
    /// Requests per second whose TTFT met the SLO (over the run's wall time).
    pub goodput_rps: f64,
    /// Σ cached ÷ Σ prompt tokens over the completed requests whose usage reported
    /// cached_tokens; None when none did.
    pub usage_hit_rate: Option<f64>,
    /// Change of the server's counters over the run.
    pub counters: Counters,
    pub peaks: Peaks,
    /// TTFT of each turn index (multi-turn), over the completed requests.
    pub ttft_by_turn: Vec<Stats>,
    /// Requests whose prompt or output was cut to fit the server's context (one-message chat
    /// workloads; see `chat::fit_message`).
    pub clipped: usize,
    pub records: Vec<RequestRecord>,
}

#[derive(Serialize)]
struct SweepReport<'a> {
    bench: &'static str,
    url: &'a str,
    workload: &'a WorkloadArgs,
    chat: &'a ChatArgs,
    prompts: String,
    server: &'a ServerInfo,
    ttft_slo_s: f64,
    highest_rate_within_slo: Option<f64>,
    runs: &'a [RateRun],
}

/// Σ cached ÷ Σ prompt tokens of the completed records that reported cached tokens.
pub fn usage_hit_rate(records: &[RequestRecord]) -> Option<f64> {
    let (mut cached, mut prompt, mut any) = (0usize, 0usize, false);
    for r in records.iter().filter(|r| r.ok()) {
        if let Some(c) = r.cached_tokens {
            any = true;
            cached += c;
            prompt += r.prompt_tokens;
        }
    }
    (any && prompt > 0).then(|| cached as f64 / prompt as f64)
}

/// The highest rate up to which every rate (ascending) kept P99 TTFT within `slo_s` and
/// failed nothing; None if the lowest did not. `points`: (rate, P99 TTFT s, failed).
pub fn highest_within(points: &[(f64, f64, usize)], slo_s: f64) -> Option<f64> {
    let mut sorted = points.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut best = None;
    for (rate, p99, failed) in sorted {
        if failed > 0 || !p99.is_finite() || p99 > slo_s {
            break;
        }
        best = Some(rate);
    }
    best
}

/// TTFT per turn index (request id mod `turns`).
fn ttft_by_turn(records: &[RequestRecord], turns: usize) -> Vec<Stats> {
    if turns <= 1 {
        return Vec::new();
    }
    (0..turns)
        .map(|j| {
            Stats::of(
                records
                    .iter()
                    .filter(|r| r.ok() && r.id % turns == j)
                    .filter_map(|r| r.ttft_s),
            )
        })
        .collect()
}

fn ms(v: f64) -> String {
    if v.is_finite() {
        format!("{:.0}", v * 1e3)
    } else {
        "-".into()
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{:.1}%", v * 100.0))
}

fn num(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0}"))
}

/// The table of a sweep.
pub fn table(runs: &[RateRun], slo_s: f64) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| rate | sent | done | failed | TTFT P50 | TTFT P99 | E2E P99 | done/s | goodput/s | hit rate (usage) | hit rate (metrics) | preemptions | peak running | peak waiting |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in runs {
        let m = &r.summary;
        let _ = writeln!(
            s,
            "| {:.2} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {} | {} | {} | {} | {} |",
            r.rate,
            m.sent,
            m.completed,
            m.failed,
            ms(m.ttft.p50),
            ms(m.ttft.p99),
            ms(m.e2e.p99),
            m.throughput_rps,
            r.goodput_rps,
            pct(r.usage_hit_rate),
            pct(r.counters.hit_rate()),
            num(r.counters.preemptions),
            num(r.peaks.running),
            num(r.peaks.waiting),
        );
    }
    if let Some(turns) = runs
        .first()
        .map(|r| r.ttft_by_turn.len())
        .filter(|&t| t > 1)
    {
        let _ = writeln!(s, "\nTTFT P50 / P99 by turn, ms:\n");
        let head: Vec<String> = (1..=turns).map(|j| format!("turn {j}")).collect();
        let _ = writeln!(s, "| rate | {} |", head.join(" | "));
        let _ = writeln!(s, "|---|{}", "---|".repeat(turns));
        for r in runs {
            let cells: Vec<String> = r
                .ttft_by_turn
                .iter()
                .map(|t| format!("{} / {}", ms(t.p50), ms(t.p99)))
                .collect();
            let _ = writeln!(s, "| {:.2} | {} |", r.rate, cells.join(" | "));
        }
    }
    let points: Vec<(f64, f64, usize)> = runs
        .iter()
        .map(|r| (r.rate, r.summary.ttft.p99, r.summary.failed))
        .collect();
    let _ = writeln!(
        s,
        "\nhighest rate within the SLO (TTFT P99 <= {:.0} ms, nothing failed, at it and every \
         lower rate): {}",
        slo_s * 1e3,
        highest_within(&points, slo_s).map_or("none".into(), |r| format!("{r:.2} req/s"))
    );
    s
}

/// Runs the sweep; returns the printed text.
pub async fn run(
    args: &LoadArgs,
    workload: &WorkloadArgs,
    client: &OpenAiClient,
    server: &ServerInfo,
    prompts: &PromptSource,
) -> anyhow::Result<String> {
    let mut rates = if args.rates.is_empty() {
        vec![workload.rate.unwrap_or(DEFAULT_RATE)]
    } else {
        args.rates.clone()
    };
    anyhow::ensure!(
        rates.iter().all(|r| r.is_finite() && *r > 0.0),
        "--rates must be positive"
    );
    rates.sort_by(f64::total_cmp);
    let client_arc = Arc::new(client.fresh()?);
    let mut runs = Vec::new();
    for (i, &rate) in rates.iter().enumerate() {
        // Each rate sends other requests (seed + i): a server with a prefix cache must not
        // find the previous rate's conversations in it. The adapters' system prompts stay.
        let w = WorkloadArgs {
            rate: Some(rate),
            token_rate: None,
            seed: workload.seed.wrapping_add(i as u64),
            ..workload.clone()
        };
        let opts = RunOptions {
            request_timeout: Duration::from_secs_f64(args.request_timeout),
            progress: !args.no_progress,
            label: format!("{} {rate:.2}/s", args.chat.label()),
        };
        if !wait_idle(client, Duration::from_secs(60)).await {
            eprintln!("the server was still busy 60 s after the previous rate; measuring anyway");
        }
        let before = counters(client).await;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let poller = tokio::spawn(poll_peaks(
            client_arc.clone(),
            Duration::from_millis(100),
            stop_rx,
        ));
        let mut clipped = 0;
        let (records, summary) = if args.chat.any() {
            let convs = chat::plan(&args.chat, &w, server, prompts, workload.seed)?;
            clipped = convs
                .iter()
                .flat_map(|c| &c.turns)
                .filter(|t| t.clipped)
                .count();
            let (records, wall) = chat::run(client, server, &args.chat, &convs, &opts).await;
            let summary = Summary::of(&records, wall.as_secs_f64());
            (records, summary)
        } else {
            measure(client, server, &w, prompts, &opts).await?
        };
        let _ = stop_tx.send(true);
        let peaks = poller.await.context("the /metrics poller failed")?;
        let counters = counters(client).await.since(&before);
        eprintln!(
            "{rate:.2} req/s: {}/{} done, {} failed in {:.1} s, TTFT P99 {:.0} ms",
            summary.completed,
            summary.sent,
            summary.failed,
            summary.wall_s,
            summary.ttft.p99 * 1e3
        );
        runs.push(RateRun {
            rate,
            goodput_rps: 0.0,
            usage_hit_rate: usage_hit_rate(&records),
            counters,
            peaks,
            ttft_by_turn: ttft_by_turn(&records, args.chat.turns()),
            clipped,
            summary,
            records,
        });
    }
    // The SLO: given, else 5× the lowest rate's P50 TTFT (Chameleon's rule).
    let slo_s = match args.ttft_slo_ms {
        Some(ms) => ms * 1e-3,
        None => 5.0 * runs[0].summary.ttft.p50,
    };
    for r in &mut runs {
        let met = r
            .records
            .iter()
            .filter(|q| q.ok() && q.ttft_s.is_some_and(|t| t <= slo_s))
            .count();
        r.goodput_rps = met as f64 / r.summary.wall_s.max(1e-9);
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let json = args.out.join("load-sweep.json");
    let highest = highest_within(
        &runs
            .iter()
            .map(|r| (r.rate, r.summary.ttft.p99, r.summary.failed))
            .collect::<Vec<_>>(),
        slo_s,
    );
    write_json(
        &json,
        &SweepReport {
            bench: "load-sweep",
            url: &args.url,
            workload,
            chat: &args.chat,
            prompts: prompts.describe(),
            server,
            ttft_slo_s: slo_s,
            highest_rate_within_slo: highest,
            runs: &runs,
        },
    )?;
    let c = &args.chat;
    let mut s = format!(
        "{} workload: {} requests per rate to {} ({} adapters), {:?} arrivals, {:?} popularity, \
         {:?} lengths (prompt {}, output {}){}{}; prompts: {}\nTTFT SLO {:.0} ms ({}); times in ms \
         at the client\n\n",
        c.label(),
        workload.requests,
        args.url,
        server.adapters.len(),
        workload.arrivals,
        workload.popularity,
        workload.lengths,
        workload.prompt_len,
        workload.output_len,
        if c.multi_turn {
            format!(
                "; {} turns per conversation, {}-token system prompt per adapter, think time {} s",
                c.turns, c.system_prompt_len, c.think_time
            )
        } else {
            String::new()
        },
        if c.no_max_tokens {
            "; no max_tokens sent (the client ends each stream at its planned output)"
        } else {
            ""
        },
        prompts.describe(),
        slo_s * 1e3,
        if args.ttft_slo_ms.is_some() {
            "--ttft-slo-ms"
        } else {
            "5x the lowest rate's TTFT P50"
        },
    );
    s.push_str(&table(&runs, slo_s));
    for r in runs.iter().filter(|r| r.clipped > 0) {
        let _ = writeln!(
            s,
            "at {:.2} req/s: {} of {} requests clipped to the server's {}-token context \
             (prompt, then output, with room for the chat template)",
            r.rate,
            r.clipped,
            r.summary.sent,
            server.max_model_len.unwrap_or(0)
        );
    }
    for r in &runs {
        for e in &r.summary.errors {
            let _ = writeln!(s, "at {:.2} req/s: error: {e}", r.rate);
        }
    }
    let _ = writeln!(s, "\nreport: {}", json.display());
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_rate_is_the_last_of_an_unbroken_run_within_the_slo() {
        let pts = [(4.0, 0.9, 0), (1.0, 0.2, 0), (2.0, 0.5, 0), (8.0, 0.3, 0)];
        // 4 req/s breaks the SLO, so 8 (within it again) does not count.
        assert_eq!(highest_within(&pts, 0.6), Some(2.0));
        assert_eq!(highest_within(&pts, 1.0), Some(8.0));
        assert_eq!(highest_within(&pts, 0.1), None);
        // A failure breaks the run too.
        assert_eq!(
            highest_within(&[(1.0, 0.1, 0), (2.0, 0.1, 1)], 1.0),
            Some(1.0)
        );
        assert_eq!(highest_within(&[(1.0, f64::NAN, 0)], 1.0), None);
    }

    #[test]
    fn usage_hit_rate_counts_only_completed_requests_that_reported() {
        let rec = |prompt: usize, cached: Option<usize>, ok: bool| RequestRecord {
            id: 0,
            instance: 0,
            model: "a".into(),
            rank: None,
            scheduled_s: 0.0,
            sent_s: 0.0,
            sent_unix_s: 0.0,
            prompt_tokens: prompt,
            cached_tokens: cached,
            max_tokens: 1,
            output_tokens: 1,
            ttft_s: Some(0.1),
            tpot_s: None,
            e2e_s: Some(0.1),
            error: (!ok).then(|| "x".into()),
        };
        assert_eq!(usage_hit_rate(&[rec(100, None, true)]), None);
        let rs = [
            rec(1000, Some(992), true),
            rec(1000, Some(0), true),
            rec(500, None, true),
            rec(1000, Some(1000), false),
        ];
        assert_eq!(usage_hit_rate(&rs), Some(0.496));
        let by_turn = ttft_by_turn(&rs, 2);
        assert_eq!(by_turn.len(), 2);
        assert_eq!(by_turn[0].count, 3, "ids are all 0: turn 1");
        assert_eq!(by_turn[1].count, 0);
    }
}
