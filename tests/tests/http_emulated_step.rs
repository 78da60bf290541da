//! `--emulated-step-time` (bench-only): a step never returns before its floor, and padding
//! changes no token — greedy outputs per request are the same with and without it.
use std::time::{Duration, Instant};

use axum::Router;
use serde_json::json;
use thaw_server::emulated_step::StepFloor;
use thaw_server::serve::Server;
use thaw_tests::http::{call_router, complete_all, metric, ServeFixture};

async fn call(app: &Router, method: &str, path: &str, body: Option<String>) -> String {
    let (status, text) = call_router(app, method, path, body).await;
    assert_eq!(status, 200, "{path}: {text}");
    text
}

/// (texts, engine steps run for the burst, wall time of the burst, the /metrics text after).
async fn run(fx: &ServeFixture, floor: Option<StepFloor>) -> (Vec<String>, f64, Duration, String) {
    let mut cfg = fx.config();
    cfg.max_num_seqs = 4;
    cfg.emulated_step_time = floor;
    let server = Server::start(cfg).await.unwrap();
    let app = server.router();
    let before = call(&app, "GET", "/metrics", None).await;
    let steps_before = metric(&before, "thaw_engine_steps_total").unwrap();
    let started = Instant::now();
    let bodies = (0..12usize)
        .map(|i| {
            let model = match i % 3 {
                0 => "base".to_string(),
                k => fx.adapters[k - 1].0.clone(),
            };
            json!({"model": model, "prompt": format!("the quick fox {i}"),
                "max_tokens": 3 + i % 5, "temperature": 0.0, "ignore_eos": true})
        })
        .collect();
    let texts = complete_all(&app, bodies).await;
    let wall = started.elapsed();
    let metrics = call(&app, "GET", "/metrics", None).await;
    let steps = metric(&metrics, "thaw_engine_steps_total").unwrap() - steps_before;
    (texts, steps, wall, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn padded_steps_take_the_floor_and_generate_the_same_tokens() {
    let fx = ServeFixture::new(&[8, 64]);
    let (want, _, _, plain) = run(&fx, None).await;
    assert_eq!(
        metric(&plain, "thaw_emulated_step_padding_seconds_total"),
        Some(0.0),
        "off by default: {plain}"
    );
    let floor: StepFloor = "base_ms=20,per_seq_ms=1,per_prefill_token_ms=0.5"
        .parse()
        .unwrap();
    let (got, steps, wall, metrics) = run(&fx, Some(floor)).await;
    assert_eq!(got, want, "padding changed a greedy output");
    assert!(steps > 0.0);
    // Every step took at least base_ms (the floor's least value), so the burst took at least
    // steps × 20 ms: a lower bound on the server's own step count, not a timed upper bound.
    assert!(
        wall.as_secs_f64() >= steps * 0.020,
        "{steps} steps in {wall:?}: some step returned before its 20 ms floor"
    );
    let padded = metric(&metrics, "thaw_emulated_step_padding_seconds_total").unwrap();
    assert!(padded > 0.0, "{metrics}");
    assert!(
        padded <= wall.as_secs_f64() + 1e-3,
        "{padded} s padded in {wall:?}"
    );
    // The engine thread's time by cause: the padding is part of the forward step, and every
    // cause is exported.
    let cause = |c: &str| {
        metric(
            &metrics,
            &format!("thaw_engine_time_seconds_total{{cause=\"{c}\"}}"),
        )
    };
    let forward = cause("forward").unwrap();
    assert!(
        forward >= padded,
        "forward {forward} s < padding {padded} s"
    );
    for c in ["adapter", "schedule", "idle"] {
        assert!(cause(c).is_some_and(|s| s >= 0.0), "{c}: {metrics}");
    }
}
