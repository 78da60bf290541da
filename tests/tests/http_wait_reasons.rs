//! Per-request wait reasons (issue 11): a request whose adapter is not on the device when it
//! arrives records time waiting for the adapter's copy over the link; a request whose adapter
//! is resident records none. Every request's reasons add up to its time to first token.
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use thaw_server::coldstart::ColdStartPolicy;
use thaw_tests::http::{get, metric, post, ServeFixture, SocketServer};

fn waits(m: &str, part: &str, reason: &str, use_: &str) -> f64 {
    let name = format!("thaw_request_wait_seconds_{part}{{reason=\"{reason}\",use=\"{use_}\"}}");
    metric(m, &name).unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

#[test]
fn a_cold_adapter_waits_for_the_link_and_a_warm_one_does_not() {
    let fx = ServeFixture::new(&[8, 8]);
    let cfg = thaw_server::serve::ServeConfig {
        // Adapter 0 is registered at start and warmed onto the device (one --max-loras place);
        // adapter 1 is loaded at run time, when the place is taken, so it stays in host memory.
        lora_modules: vec![fx.adapters[0].clone()],
        max_loras: 1,
        // A request waits for its adapter's layers (no CPU compute in their place), over a
        // link slow enough that the copy spans steps.
        cold_start: ColdStartPolicy::OnDemand,
        emulated_link_gbps: 0.001,
        ..fx.config()
    };
    let server = SocketServer::start(cfg);
    let r = post(
        server.addr,
        "/v1/load_lora_adapter",
        &json!({"lora_name": "cold", "lora_path": fx.adapters[1].1}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // Wait until the start-up adapter has landed (its warm-up crosses the same slow link), so
    // its request is a hit with nothing left to copy.
    let warm = fx.adapters[0].0.clone();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let v: Value = get(server.addr, "/v1/models").json();
        let entry = |id: &str| {
            v["data"]
                .as_array()
                .and_then(|d| d.iter().find(|m| m["id"] == id))
                .cloned()
                .unwrap_or_else(|| panic!("{id} missing from /v1/models: {v}"))
        };
        let (w, c) = (entry(&warm), entry("cold"));
        assert_ne!(c["tier"], "device", "the run-time adapter was warmed: {c}");
        if w["tier"] == "device" && w["landed_layers"] == w["num_layers"] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the start-up adapter never landed: {w}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let complete = |model: &str| {
        let body = json!({"model": model, "prompt": [5, 6, 7], "max_tokens": 2,
            "temperature": 0, "ignore_eos": true});
        let r = post(server.addr, "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
    };
    complete(&warm); // resident since start: a hit
    complete("cold"); // in host memory only: a miss, copied over the link
    complete("cold"); // resident now: a hit
    let m = get(server.addr, "/metrics").text();

    assert_eq!(waits(&m, "count", "link", "miss"), 1.0);
    assert_eq!(waits(&m, "count", "link", "hit"), 2.0);
    assert!(
        waits(&m, "sum", "link", "miss") > 0.0,
        "the cold adapter's request recorded no link wait:\n{m}"
    );
    assert_eq!(
        waits(&m, "sum", "link", "hit"),
        0.0,
        "a warm adapter's request recorded a link wait"
    );
    // Over this link waiting for its layers in the step would stall the step for seconds: the
    // gate held the cold request (once counted), and started none waiting for layers.
    assert_eq!(metric(&m, "thaw_cold_start_holds_total"), Some(1.0), "{m}");
    assert_eq!(
        metric(&m, "thaw_cold_start_layer_waits_total"),
        Some(0.0),
        "{m}"
    );
    for reason in ["disk", "kv"] {
        assert_eq!(waits(&m, "sum", reason, "hit"), 0.0, "{reason}");
    }
    // The reasons of every request add up to its TTFT.
    let total: f64 = ["batch", "kv", "disk", "link"]
        .iter()
        .flat_map(|r| ["hit", "miss"].map(|u| waits(&m, "sum", r, u)))
        .sum();
    let ttft = metric(&m, "thaw_time_to_first_token_seconds_sum").unwrap();
    assert!(
        (total - ttft).abs() <= 1e-6 * ttft.max(1.0),
        "waits {total} s vs TTFT {ttft} s"
    );
}
