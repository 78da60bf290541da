//! The device cache with CPU LoRA workers attached (issue 11; Thaw's default `--cold-start
//! auto` attaches them): an adapter holds a slot of the workers' host store only while its
//! layers stream in, so the device keeps far more adapters than `--max-cpu-loras` (before,
//! every adapter on the device kept its slot and the cache held at most `--max-cpu-loras`).
//! Every request completes with the tokens of a server with every adapter cached. (That the
//! workers compute from a slot while an adapter streams, and give it back once it has
//! landed, is `coldstart_workers::landed_adapters_release_their_host_store_slots`.)
use std::net::SocketAddr;
use std::path::Path;

use serde_json::{json, Value};
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};
use thaw_tests::http::{get, metric, post, spawn_serve, ServeChild};
use thaw_tests::test_preset;

const ADAPTERS: usize = 24;
const MAX_CPU_LORAS: usize = 4;
const CLIENTS: usize = 8;

fn start(dir: &Path, args: &[&str]) -> (ServeChild, SocketAddr) {
    spawn_serve(&dir.join("model"), &dir.join("adapters"), args)
}

/// Every adapter once from one client (each lands before the next is loaded), then every
/// adapter again from `CLIENTS` clients at once: (status, text) per request.
fn run(addr: SocketAddr) -> Vec<(u16, String)> {
    let mut all = requests(addr, 0, 1);
    all.extend(requests(addr, ADAPTERS, CLIENTS));
    all
}

/// Requests `first..first + ADAPTERS` (adapter `i % ADAPTERS`) from `clients` clients.
fn requests(addr: SocketAddr, first: usize, clients: usize) -> Vec<(u16, String)> {
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            std::thread::spawn(move || {
                (first + c..first + ADAPTERS)
                    .step_by(clients)
                    .map(|i| {
                        let a = i % ADAPTERS;
                        let body = json!({"model": format!("adapter-{a:03}-r8"),
                            "prompt": [3 + a as u32, 17, 42, 5 + i as u32], "max_tokens": 5,
                            "temperature": 0, "ignore_eos": true});
                        let r = post(addr, "/v1/completions", &body);
                        let text = if r.status == 200 {
                            let v: Value = r.json();
                            v["choices"][0]["text"]
                                .as_str()
                                .unwrap_or_default()
                                .to_string()
                        } else {
                            r.text()
                        };
                        (i, (r.status, text))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all: Vec<(usize, (u16, String))> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("client thread"))
        .collect();
    all.sort_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, r)| r).collect()
}

#[test]
fn with_workers_the_device_keeps_more_adapters_than_the_host_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    gen::write_model(&test_preset(), &model, &GenModelOptions::default()).expect("gen-model");
    let written = gen::write_adapters(&GenAdaptersOptions {
        model_dir: model,
        out_dir: dir.path().join("adapters"),
        count: ADAPTERS,
        ranks: vec![8],
        targets: vec![Projection::Q, Projection::V],
        seed: 23,
        ..Default::default()
    })
    .expect("gen-adapters");
    assert_eq!(
        written[5].file_name().unwrap().to_string_lossy(),
        "adapter-005-r8"
    );
    let max_cpu = MAX_CPU_LORAS.to_string();
    let want = {
        let (_s, addr) = start(dir.path(), &["--cold-start", "cached"]);
        run(addr)
    };
    let (_s, addr) = start(
        dir.path(),
        &[
            "--cold-start",
            "auto",
            "--lora-workers",
            "1",
            "--max-cpu-loras",
            &max_cpu,
        ],
    );
    let got = run(addr);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(w.0, 200, "cached request {i} failed: {}", w.1);
        assert_eq!(g.0, 200, "request {i} failed: {}", g.1);
        assert_eq!(
            g.1, w.1,
            "request {i}: tokens differ from the cached server"
        );
    }
    let m = get(addr, "/metrics").text();
    let device = metric(&m, "thaw_adapters{tier=\"device\"}").unwrap();
    assert_eq!(
        device, ADAPTERS as f64,
        "every adapter stays on the device, not --max-cpu-loras {MAX_CPU_LORAS}: {m}"
    );
    assert_eq!(
        metric(&m, "thaw_adapter_evictions_total{tier=\"device\"}"),
        Some(0.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "thaw_adapter_device_loads_total{cause=\"demand\"}").unwrap()
            + metric(&m, "thaw_adapter_device_loads_total{cause=\"prefetch\"}").unwrap(),
        ADAPTERS as f64,
        "each adapter loaded once: {m}"
    );
}
