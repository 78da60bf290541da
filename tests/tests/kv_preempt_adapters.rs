//! Preemption under adapter churn, over a real socket (the is28 Azure-trace failures in
//! miniature): more adapters than `--max-loras`, a KV pool small enough that requests are
//! preempted, and chat-style clients that close their stream early. Every request that reads
//! to the end gets all its tokens and no error (a resumed request's adapter is on the device
//! again), and once the clients are gone nothing is left running or waiting.
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use thaw_server::serve::ServeConfig;
use thaw_tests::http::{get, metric, read_head, send_request, ServeFixture, SocketServer};

const ADAPTERS: usize = 6;

/// The value of a labelled protocol sample (`engine`, `model_name`).
fn vllm(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .or_else(|| metric(metrics, name))
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

/// Streams a completion; reads `stop_after` data chunks and hangs up when given, else to the
/// end. Returns the data chunks read.
fn stream(addr: std::net::SocketAddr, body: &Value, stop_after: Option<usize>) -> Vec<String> {
    let s = send_request(addr, "POST", "/v1/completions", Some(&body.to_string()));
    let mut r = BufReader::new(s);
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 200);
    let mut data = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        match r.read_line(&mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => panic!("reading the stream after {} chunks: {e}", data.len()),
        }
        if let Some(d) = line.trim_end().strip_prefix("data:") {
            data.push(d.trim_start().to_string());
            if stop_after.is_some_and(|n| data.len() >= n) {
                break; // dropping the socket closes the stream, as a client that got its answer
            }
        }
    }
    data
}

#[test]
fn preempted_requests_over_many_adapters_all_finish_and_disconnects_leave_nothing() {
    let fx = ServeFixture::new(&[8; ADAPTERS]);
    let cfg = ServeConfig {
        max_loras: 2,
        max_num_seqs: 16,
        // 16 blocks is one whole context. Each adapter's three full requests (120 tokens, ~9
        // blocks each) outgrow 24 blocks by themselves, so the pool runs out even when the
        // adapters load one after another and their requests never overlap across adapters.
        num_gpu_blocks_override: Some(24),
        enable_prefix_caching: true,
        ..fx.config()
    };
    let server = SocketServer::start(cfg);
    let addr = server.addr;
    let mut handles = Vec::new();
    // All clients send at once, so the running requests outgrow the pool however slowly the
    // threads start on a loaded machine (without it, a busy CI host spread the arrivals out
    // and no request was ever preempted).
    let start = std::sync::Arc::new(std::sync::Barrier::new(18));
    for i in 0..18usize {
        let model = fx.adapters[i % ADAPTERS].0.clone();
        let closer = i % 3 == 0;
        let mut body = json!({"model": model, "prompt": format!("story {i}: once upon a time"),
                              "temperature": 0.0, "ignore_eos": true, "stream": true,
                              "stream_options": {"include_usage": true}});
        if !closer {
            body["max_tokens"] = json!(120);
        }
        let start = start.clone();
        handles.push(std::thread::spawn(move || {
            start.wait();
            (closer, stream(addr, &body, closer.then_some(6)))
        }));
    }
    for h in handles {
        let (closer, data) = h.join().expect("client thread");
        for d in &data {
            assert!(!d.contains("\"error\""), "an error in the stream: {d}");
        }
        if closer {
            continue;
        }
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
        let usage = data
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .find_map(|v| v["usage"]["completion_tokens"].as_u64());
        assert_eq!(usage, Some(120), "every token came");
    }
    // The clients that hung up are forgotten: nothing waits or runs for them.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = get(addr, "/metrics").text();
        let (running, waiting) = (
            vllm(&m, "vllm:num_requests_running"),
            vllm(&m, "vllm:num_requests_waiting"),
        );
        if running == 0.0 && waiting == 0.0 {
            assert!(
                vllm(&m, "vllm:num_preemptions_total") > 0.0,
                "the pool ran out and requests were preempted"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{running} running and {waiting} waiting long after every client left"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
