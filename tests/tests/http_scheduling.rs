//! `--scheduling-policy`: every policy serves every request, and reordering admission never
//! changes what a request generates — greedy tokens per request are the same under `sjf`,
//! `priority` and `mlq` as under `fcfs` (batches differ, rows do not interact). Under `mlq`
//! /metrics shows the queues and the predictor.
use serde_json::{json, Value};
use thaw_server::scheduler::SchedulingPolicy;
use thaw_server::serve::Server;
use thaw_tests::http::{call_router as call, complete_all, metric, ServeFixture};

/// A mixed burst: short and long outputs, base and three ranks, assorted priorities.
fn requests(fx: &ServeFixture) -> Vec<Value> {
    let words = [
        "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog",
    ];
    (0..40usize)
        .map(|i| {
            let model = match i % 4 {
                0 => "base".to_string(),
                k => fx.adapters[k - 1].0.clone(),
            };
            let prompt: Vec<&str> = (0..1 + i % 7)
                .map(|j| words[(i + j) % words.len()])
                .collect();
            let max_tokens = if i % 5 == 0 { 48 } else { 2 + i % 4 };
            json!({"model": model, "prompt": prompt.join(" "), "max_tokens": max_tokens,
                   "temperature": 0.0, "ignore_eos": true, "priority": (i * 7) % 5})
        })
        .collect()
}

async fn run(fx: &ServeFixture, policy: SchedulingPolicy) -> (Vec<String>, String) {
    let mut cfg = fx.config();
    cfg.scheduling_policy = policy;
    cfg.max_num_seqs = 4;
    cfg.max_num_batched_tokens = 32;
    // Room for a few sequences beside the adapters: admission has to choose.
    cfg.num_gpu_blocks_override = Some(160);
    let server = Server::start(cfg).await.unwrap();
    let app = server.router();
    let texts = complete_all(&app, requests(fx)).await;
    let (_, metrics) = call(&app, "GET", "/metrics", None).await;
    (texts, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_policy_generates_what_fcfs_generates() {
    let fx = ServeFixture::new(&[8, 32, 64]);
    let (want, _) = run(&fx, SchedulingPolicy::Fcfs).await;
    for policy in [
        SchedulingPolicy::Sjf,
        SchedulingPolicy::Priority,
        SchedulingPolicy::Mlq,
    ] {
        let (got, metrics) = run(&fx, policy).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{policy}: request {i} differs from fcfs");
        }
        let info = format!("thaw_sched_policy_info{{policy=\"{policy}\"}} 1");
        assert!(metrics.contains(&info), "{policy}: {metrics}");
        if policy == SchedulingPolicy::Mlq {
            assert!(
                metrics.contains("thaw_sched_queue_quota_tokens{queue=\"0\"}"),
                "{metrics}"
            );
            let n = metric(&metrics, "thaw_sched_predictor_samples").unwrap_or(0.0);
            assert!(n > 0.0, "the predictor was scored: {metrics}");
            assert!(metric(&metrics, "thaw_perf_model_samples").unwrap_or(0.0) > 0.0);
        }
    }
}
