//! `/metrics` speaks the Gateway API Inference Extension's model-server protocol (vLLM's
//! names): the exposition parses strictly, the protocol families have vLLM's types and labels,
//! and their values follow the server's state while requests come and go — an adapter is in
//! `running_lora_adapters` while its request runs and in `waiting_lora_adapters` while its
//! request queues behind another (`--max-num-seqs 1`).
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;
use thaw_tests::http::{get, read_head, send_request, ServeFixture, SocketServer};
use thaw_tests::prom::{self, Exposition, Sample};

const GAUGES: [&str; 4] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
];
const INFO: &str = "vllm:lora_requests_info";

fn scrape(addr: SocketAddr) -> Exposition {
    let text = get(addr, "/metrics").text();
    let e = prom::parse(&text).unwrap_or_else(|err| panic!("{err}\n{text}"));
    for name in GAUGES.iter().chain([&INFO]) {
        assert_eq!(e[*name].kind, "gauge", "{name}");
    }
    e
}

/// The one sample of a protocol gauge, after checking vLLM's labels.
fn gauge(e: &Exposition, name: &str) -> f64 {
    let s = &e[name].samples;
    assert_eq!(s.len(), 1, "{name}: {s:?}");
    let labels: Vec<(&str, &str)> = s[0]
        .labels
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(labels, [("engine", "0"), ("model_name", "base")], "{name}");
    s[0].value
}

/// The `vllm:lora_requests_info` series an EPP reads: the one with the largest value.
fn latest(e: &Exposition) -> &Sample {
    e[INFO]
        .samples
        .iter()
        .max_by(|a, b| a.value.total_cmp(&b.value))
        .expect("at least one lora_requests_info series")
}

fn adapters(s: &Sample, key: &str) -> String {
    s.labels[key].clone()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Opens a streaming completion and returns it once its first token arrived (so it runs).
fn stream_until_first_token(addr: SocketAddr, model: &str) -> BufReader<std::net::TcpStream> {
    let body = json!({"model": model, "prompt": "hold the batch", "max_tokens": 200,
                      "ignore_eos": true, "stream": true});
    let mut r = BufReader::new(send_request(
        addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
    ));
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 200);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "stream ended early");
        if line.starts_with("data:") {
            return r;
        }
    }
}

fn drain(mut r: BufReader<std::net::TcpStream>) {
    let mut line = String::new();
    while r.read_line(&mut line).unwrap_or(0) > 0 {
        line.clear();
    }
}

#[test]
fn protocol_metrics_follow_running_and_waiting_adapters() {
    let fx = ServeFixture::new(&[8, 16]);
    let (a, b) = (fx.adapters[0].0.clone(), fx.adapters[1].0.clone());
    let mut cfg = fx.config();
    cfg.max_num_seqs = 1;
    cfg.max_loras = 3;
    let started = unix_now();
    let srv = SocketServer::start(cfg);
    let addr = srv.addr;

    // Idle: nothing running or queued, an empty KV cache, one empty LoRA label set.
    let e = scrape(addr);
    assert_eq!(gauge(&e, "vllm:num_requests_running"), 0.0);
    assert_eq!(gauge(&e, "vllm:num_requests_waiting"), 0.0);
    assert_eq!(gauge(&e, "vllm:kv_cache_usage_perc"), 0.0);
    let l = latest(&e);
    assert_eq!(l.labels["max_lora"], "3");
    assert_eq!(adapters(l, "running_lora_adapters"), "");
    assert_eq!(adapters(l, "waiting_lora_adapters"), "");
    assert!(l.value >= started - 1.0 && l.value <= unix_now() + 1.0);
    // Thaw's own metrics are still there, next to the protocol's.
    assert!(e.contains_key("thaw_num_requests_running"));

    // A runs; B queues behind it (one sequence per step).
    let ra = stream_until_first_token(addr, &a);
    let body = json!({"model": b, "prompt": "wait your turn", "max_tokens": 4, "stream": true});
    let mut rb = BufReader::new(send_request(
        addr,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    let e = loop {
        let e = scrape(addr);
        if adapters(latest(&e), "waiting_lora_adapters") == b {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "B never showed as waiting: {e:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    let l = latest(&e);
    assert_eq!(adapters(l, "running_lora_adapters"), a);
    assert_eq!(gauge(&e, "vllm:num_requests_running"), 1.0);
    assert_eq!(gauge(&e, "vllm:num_requests_waiting"), 1.0);
    let usage = gauge(&e, "vllm:kv_cache_usage_perc");
    assert!(usage > 0.0 && usage <= 1.0, "A holds KV blocks: {usage}");
    assert_eq!(gauge(&e, "vllm:gpu_cache_usage_perc"), usage);

    // A is cancelled (hang-up); B runs to the end.
    drop(ra);
    let (status, _) = read_head(&mut rb);
    assert_eq!(status, 200);
    drain(rb);

    // Idle again: the newest label set is empty, and the label sets B went through are kept
    // with older times (vLLM keeps one series per label set it has seen).
    let deadline = Instant::now() + Duration::from_secs(30);
    let e = loop {
        let e = scrape(addr);
        if gauge(&e, "vllm:num_requests_running") == 0.0
            && gauge(&e, "vllm:num_requests_waiting") == 0.0
        {
            break e;
        }
        assert!(Instant::now() < deadline, "server never went idle");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(gauge(&e, "vllm:kv_cache_usage_perc"), 0.0);
    let l = latest(&e);
    assert_eq!(adapters(l, "running_lora_adapters"), "");
    assert_eq!(adapters(l, "waiting_lora_adapters"), "");
    let seen = |running: &str, waiting: &str| {
        e[INFO].samples.iter().find(|s| {
            s.labels["running_lora_adapters"] == running
                && s.labels["waiting_lora_adapters"] == waiting
        })
    };
    let queued = seen(&a, &b).expect("the A-running, B-waiting series is kept");
    let ran = seen(&b, "").expect("the B-running series is kept");
    assert!(queued.value <= ran.value && ran.value <= l.value);
    assert!(e[INFO].samples.iter().all(|s| s.labels["max_lora"] == "3"));
}
