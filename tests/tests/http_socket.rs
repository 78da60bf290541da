//! The HTTP API over a real loopback socket: every endpoint, bad adapter loads interleaved
//! with good requests, and 500 streams cancelled mid-way.
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use thaw_tests::http::{
    edit_adapter_config, get, metric, post, read_head, send_request, ServeFixture, SocketServer,
};

/// Polls /metrics until the server is idle: nothing waiting or running, no KV, no leases.
fn wait_idle(addr: std::net::SocketAddr) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = get(addr, "/metrics").text();
        let idle = [
            "thaw_num_requests_waiting",
            "thaw_num_requests_running",
            "thaw_kv_cache_used_blocks",
            "thaw_adapter_leases",
        ]
        .iter()
        .all(|n| metric(&m, n) == Some(0.0));
        if idle {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "server did not return to idle:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_endpoint_over_a_socket() {
    let fx = ServeFixture::new(&[8]);
    let srv = SocketServer::start(fx.config());
    let a = srv.addr;
    let lora = fx.adapters[0].0.clone();
    assert_eq!(get(a, "/health").status, 200);
    let models = get(a, "/v1/models").json();
    assert_eq!(models["data"].as_array().unwrap().len(), 2);
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": lora, "prompt": "hi", "max_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "base", "prompt": "hi", "max_tokens": 3, "stream": true, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200);
    assert!(r
        .headers
        .iter()
        .any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream")));
    let data = r.sse_data();
    assert_eq!(data.len(), 4, "3 token chunks and [DONE]: {data:?}");
    let dir = fx.copy_adapter(0, "again");
    let r = post(
        a,
        "/v1/load_lora_adapter",
        &json!({"lora_name": "again", "lora_path": dir}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(a, "/v1/unload_lora_adapter", &json!({"lora_name": "again"}));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": "again", "prompt": "hi"}),
    );
    assert_eq!(r.status, 404);
    assert_eq!(
        r.json()["error"]["message"],
        "The model `again` does not exist."
    );
    let m = wait_idle(a);
    assert!(
        m.contains("thaw_http_requests_total{endpoint=\"/v1/completions\",status=\"404\"} 1"),
        "{m}"
    );
}

#[test]
fn bad_adapter_loads_do_not_disturb_good_requests() {
    let fx = ServeFixture::new(&[8, 16]);
    let mut bad_dirs = Vec::new();
    for (i, kind) in ["dora", "bias", "mts", "nojson", "trunc"]
        .iter()
        .enumerate()
    {
        let d = fx.copy_adapter(i % 2, kind);
        match *kind {
            "dora" => edit_adapter_config(&d, |v| v["use_dora"] = json!(true)),
            "bias" => edit_adapter_config(&d, |v| v["bias"] = json!("lora_only")),
            "mts" => edit_adapter_config(&d, |v| v["modules_to_save"] = json!(["lm_head"])),
            "nojson" => std::fs::write(d.join("adapter_config.json"), "nope").unwrap(),
            _ => {
                let f = d.join("adapter_model.safetensors");
                let bytes = std::fs::read(&f).unwrap();
                std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
            }
        }
        bad_dirs.push(d);
    }
    bad_dirs.push("/no/such/adapter".into());
    let srv = SocketServer::start(fx.config());
    let a = srv.addr;
    let names: Vec<String> = fx
        .adapters
        .iter()
        .map(|x| x.0.clone())
        .chain(["base".to_string()])
        .collect();
    std::thread::scope(|s| {
        let good = s.spawn(|| {
            let handles: Vec<_> = (0..4)
                .map(|t| {
                    let names = names.clone();
                    s.spawn(move || {
                        for i in 0..50 {
                            let model = &names[(t + i) % names.len()];
                            let stream = i % 3 == 0;
                            let r = post(
                                a,
                                "/v1/completions",
                                &json!({"model": model, "prompt": format!("req {t} {i}"),
                                "max_tokens": 3, "ignore_eos": true, "stream": stream}),
                            );
                            assert_eq!(r.status, 200, "good request failed: {}", r.text());
                            if stream {
                                assert_eq!(r.sse_data().last().map(String::as_str), Some("[DONE]"));
                            } else {
                                assert_eq!(r.json()["usage"]["completion_tokens"], 3);
                            }
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        });
        for i in 0..50 {
            let d = &bad_dirs[i % bad_dirs.len()];
            let r = post(
                a,
                "/v1/load_lora_adapter",
                &json!({"lora_name": format!("bad-{i}"), "lora_path": d}),
            );
            assert!(
                matches!(r.status, 400 | 404 | 422),
                "bad load {d:?} got {}: {}",
                r.status,
                r.text()
            );
            assert!(r.json()["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
        }
        good.join().unwrap();
    });
    let m = wait_idle(a);
    assert!(
        m.contains("thaw_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 200"),
        "{m}"
    );
    let models = get(a, "/v1/models").json();
    assert_eq!(
        models["data"].as_array().unwrap().len(),
        3,
        "no bad adapter was registered"
    );
}

#[test]
fn cancelled_streams_free_kv_and_leases() {
    let fx = ServeFixture::new(&[8, 16]);
    let mut cfg = fx.config();
    cfg.max_num_seqs = 32;
    let srv = SocketServer::start(cfg);
    let a = srv.addr;
    let names: Vec<String> = fx
        .adapters
        .iter()
        .map(|x| x.0.clone())
        .chain(["base".to_string()])
        .collect();
    std::thread::scope(|s| {
        for t in 0..10 {
            let names = names.clone();
            s.spawn(move || {
                for i in 0..50 {
                    let body: Value = json!({"model": names[(t + i) % names.len()], "prompt": "cancel me",
                        "max_tokens": 200, "ignore_eos": true, "stream": true});
                    let sock = send_request(a, "POST", "/v1/completions", Some(&body.to_string()));
                    let mut r = BufReader::new(sock);
                    let (status, _) = read_head(&mut r);
                    assert_eq!(status, 200);
                    // Read until the first token chunk, then hang up mid-stream.
                    let mut line = String::new();
                    let mut seen = 0;
                    while seen < 1 + i % 3 {
                        line.clear();
                        if r.read_line(&mut line).unwrap() == 0 {
                            break;
                        }
                        if line.starts_with("data:") {
                            seen += 1;
                        }
                    }
                    drop(r);
                }
            });
        }
    });
    let m = wait_idle(a);
    let cancelled: f64 = m
        .lines()
        .find_map(|l| {
            l.strip_prefix("thaw_request_finished_total{reason=\"cancelled\"} ")?
                .parse()
                .ok()
        })
        .unwrap_or(0.0);
    assert!(
        cancelled >= 400.0,
        "most of the 500 streams were cancelled, not run to the end ({cancelled}):\n{m}"
    );
}
