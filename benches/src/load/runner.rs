//! The open-loop driver: every planned request is sent at its offset whether or not earlier
//! ones have finished (so a slow server sees its queue grow, as under real traffic), each on
//! its own task, with a progress bar while the run lasts.
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::client::OpenAiClient;
use super::workload::{PlannedRequest, ServerInfo};

/// One request as measured at the client. Times in seconds.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RequestRecord {
    pub id: usize,
    /// Which server it went to: index into `--url`'s list (round-robin by request index).
    #[serde(default)]
    pub instance: usize,
    /// The `model` sent: an adapter name or the base model.
    pub model: String,
    pub rank: Option<usize>,
    /// Planned send time, seconds after the run started.
    pub scheduled_s: f64,
    /// Actual send time (lags `scheduled_s` only if the client itself falls behind).
    pub sent_s: f64,
    /// The same, as Unix seconds (to line a run up with what the server logged or dumped).
    pub sent_unix_s: f64,
    pub prompt_tokens: usize,
    /// Prompt tokens the server served from its prefix cache
    /// (`usage.prompt_tokens_details.cached_tokens`); None when it did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<usize>,
    pub max_tokens: usize,
    pub output_tokens: usize,
    pub ttft_s: Option<f64>,
    /// (E2E − TTFT) / (output tokens − 1), for requests with at least two output tokens.
    pub tpot_s: Option<f64>,
    pub e2e_s: Option<f64>,
    pub error: Option<String>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// Knobs of a run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub request_timeout: Duration,
    pub progress: bool,
    /// Shown before the progress bar.
    pub label: String,
}

/// Sends every request of `plan` (with `prompts[i]` for request i) at its time and waits for
/// all of them. Returns one record per planned request, in plan order, and the wall time.
/// Several servers stand behind a round-robin router: request `i` of the plan goes to
/// `clients[i % n]` (the simulator's `round-robin` router, so `thaw-bench simulate
/// --replay` can route the same requests the same way).
pub async fn run_routed(
    clients: &[OpenAiClient],
    server: &ServerInfo,
    plan: &[PlannedRequest],
    prompts: Vec<Vec<u32>>,
    opts: &RunOptions,
) -> (Vec<RequestRecord>, Duration) {
    assert!(!clients.is_empty(), "run_routed needs at least one server");
    let bar = if opts.progress {
        let b = ProgressBar::new(plan.len() as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{prefix} [{elapsed_precise}] {bar:30} {pos}/{len} done, {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_prefix(opts.label.clone());
        b
    } else {
        ProgressBar::hidden()
    };
    let failed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = tokio::time::Instant::now();
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(plan.len());
    for (i, (p, prompt)) in plan.iter().zip(prompts).enumerate() {
        let instance = i % clients.len();
        let (client, bar, failed) = (clients[instance].clone(), bar.clone(), failed.clone());
        let (model, rank) = match p.adapter {
            Some(i) => (server.adapters[i].name.clone(), server.adapters[i].rank),
            None => (server.base_model.clone(), None),
        };
        let p = p.clone();
        let timeout = opts.request_timeout;
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + Duration::from_secs_f64(p.at_s)).await;
            let sent_s = t0.elapsed().as_secs_f64();
            let sent_unix_s = unix_now();
            let t = client
                .stream_completion(&model, &prompt, p.output_len, timeout)
                .await;
            let tpot_s = match (t.ttft, t.e2e) {
                (Some(f), Some(e)) if t.output_tokens >= 2 && t.error.is_none() => {
                    Some((e - f).as_secs_f64() / (t.output_tokens - 1) as f64)
                }
                _ => None,
            };
            let ok = t.error.is_none();
            if !ok {
                failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            bar.inc(1);
            bar.set_message(format!(
                "{} failed",
                failed.load(std::sync::atomic::Ordering::Relaxed)
            ));
            RequestRecord {
                id: p.id,
                instance,
                model,
                rank,
                scheduled_s: p.at_s,
                sent_s,
                sent_unix_s,
                prompt_tokens: t.prompt_tokens.unwrap_or(prompt.len()),
                cached_tokens: t.cached_tokens,
                max_tokens: p.output_len,
                output_tokens: t.output_tokens,
                ttft_s: t.ttft.filter(|_| ok).map(|d| d.as_secs_f64()),
                tpot_s,
                e2e_s: t.e2e.filter(|_| ok).map(|d| d.as_secs_f64()),
                error: t.error,
            }
        }));
    }
    let mut records = Vec::with_capacity(tasks.len());
    for (i, (task, p)) in tasks.into_iter().zip(plan).enumerate() {
        records.push(task.await.unwrap_or_else(|e| RequestRecord {
            id: p.id,
            instance: i % clients.len(),
            model: String::new(),
            rank: None,
            scheduled_s: p.at_s,
            sent_s: p.at_s,
            sent_unix_s: 0.0,
            prompt_tokens: p.prompt_len,
            cached_tokens: None,
            max_tokens: p.output_len,
            output_tokens: 0,
            ttft_s: None,
            tpot_s: None,
            e2e_s: None,
            error: Some(format!("client task failed: {e}")),
        }));
    }
    bar.finish_and_clear();
    (records, t0.elapsed())
}

/// Now, as Unix seconds.
pub(super) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
