//! Many adapters, few slots (issue 11): 1,000 adapters (ranks 8/16 on q,v), 48 concurrent
//! clients, Zipf(1.0) popularity. With default memory flags every request completes — none is
//! refused for lack of adapter memory — and each has the same greedy tokens and logprobs as on
//! a server with every adapter cached; the same holds with a device budget so small that
//! adapters are evicted and re-read from disk all the time, and with the `no-cache` baseline.
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use thaw_server::coldstart::ColdStartPolicy;
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};
use thaw_server::serve::ServeConfig;
use thaw_tests::http::{get, metric, post, SocketServer};
use thaw_tests::test_preset;

const ADAPTERS: usize = 1000;
const CLIENTS: usize = 48;
const REQUESTS: usize = 192;

struct Fixture {
    _dir: tempfile::TempDir,
    model: PathBuf,
    adapters: Vec<(String, PathBuf)>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    gen::write_model(&test_preset(), &model, &GenModelOptions::default()).expect("gen-model");
    let out = dir.path().join("adapters");
    let written = gen::write_adapters(&GenAdaptersOptions {
        model_dir: model.clone(),
        out_dir: out,
        count: ADAPTERS,
        ranks: vec![8, 16],
        targets: vec![Projection::Q, Projection::V],
        seed: 11,
        ..Default::default()
    })
    .expect("gen-adapters");
    let adapters = written
        .into_iter()
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    Fixture {
        _dir: dir,
        model,
        adapters,
    }
}

/// Default flags but the model, its adapters, and no worker processes (an in-process server
/// cannot spawn `thaw lora-worker` from the test executable).
fn config(fx: &Fixture) -> ServeConfig {
    ServeConfig {
        model: Some(fx.model.clone()),
        port: 0,
        lora_modules: fx.adapters.clone(),
        served_model_name: vec!["base".into()],
        lora_workers: 0,
        ..Default::default()
    }
}

/// (adapter index, prompt) per request: adapters by Zipf(1.0) over a seeded shuffle.
fn workload() -> Vec<(usize, Vec<u32>)> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let weights: Vec<f64> = (1..=ADAPTERS).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut rank_to_adapter: Vec<usize> = (0..ADAPTERS).collect();
    for i in (1..ADAPTERS).rev() {
        rank_to_adapter.swap(i, rng.random_range(0..=i));
    }
    (0..REQUESTS)
        .map(|_| {
            let mut u = rng.random::<f64>() * total;
            let mut k = 0;
            while k + 1 < ADAPTERS && u >= weights[k] {
                u -= weights[k];
                k += 1;
            }
            let len = rng.random_range(3..24);
            let prompt = (0..len).map(|_| rng.random_range(3..300)).collect();
            (rank_to_adapter[k], prompt)
        })
        .collect()
}

/// Each request's (status, text, token logprobs), from `CLIENTS` clients at once.
fn run(
    server: &SocketServer,
    fx: &Fixture,
    reqs: &[(usize, Vec<u32>)],
) -> Vec<(u16, String, Vec<f64>)> {
    let reqs = Arc::new(reqs.to_vec());
    let names: Arc<Vec<String>> = Arc::new(fx.adapters.iter().map(|a| a.0.clone()).collect());
    let addr = server.addr;
    let threads: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (reqs, names) = (reqs.clone(), names.clone());
            std::thread::spawn(move || {
                let mut out = Vec::new();
                for i in (c..reqs.len()).step_by(CLIENTS) {
                    let (a, prompt) = &reqs[i];
                    let body = json!({"model": names[*a], "prompt": prompt, "max_tokens": 6,
                        "temperature": 0, "ignore_eos": true, "logprobs": 0});
                    let r = post(addr, "/v1/completions", &body);
                    let res = if r.status == 200 {
                        let v: Value = r.json();
                        let c = &v["choices"][0];
                        let lps = c["logprobs"]["token_logprobs"]
                            .as_array()
                            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                            .unwrap_or_default();
                        (200, c["text"].as_str().unwrap_or_default().to_string(), lps)
                    } else {
                        (r.status, r.text(), Vec::new())
                    };
                    out.push((i, res));
                }
                out
            })
        })
        .collect();
    let mut all: HashMap<usize, (u16, String, Vec<f64>)> = HashMap::new();
    for t in threads {
        all.extend(t.join().expect("client thread"));
    }
    (0..reqs.len()).map(|i| all.remove(&i).unwrap()).collect()
}

fn check(got: &[(u16, String, Vec<f64>)], want: &[(u16, String, Vec<f64>)], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(w.0, 200, "reference request {i} failed: {}", w.1);
        assert_eq!(g.0, 200, "{what}: request {i} failed: {}", g.1);
        assert_eq!(g.2.len(), 6, "{what}: request {i} got {} tokens", g.2.len());
        assert_eq!(
            g.1, w.1,
            "{what}: request {i}'s tokens differ from the all-cached server"
        );
        // Layers computed on the CPU while an adapter streams in sum in another order than
        // resident ones (f32): the same tokens, logprobs equal to about 1e-6.
        for (a, b) in g.2.iter().zip(&w.2) {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                "{what}: request {i} logprobs {:?} vs {:?}",
                g.2,
                w.2
            );
        }
    }
}

#[test]
fn thousand_adapters_zipf_every_request_completes_with_cached_tokens() {
    let fx = fixture();
    let reqs = workload();
    let distinct: std::collections::HashSet<usize> = reqs.iter().map(|r| r.0).collect();
    assert!(distinct.len() > 60, "the workload must want many adapters");

    // The reference: every adapter resident from the start, nothing ever evicted.
    let want = {
        let mut cfg = config(&fx);
        cfg.cold_start = ColdStartPolicy::Cached;
        cfg.max_loras = ADAPTERS;
        cfg.max_cpu_loras = ADAPTERS;
        let server = SocketServer::start(cfg);
        let m = get(server.addr, "/metrics").text();
        assert_eq!(
            metric(&m, "thaw_adapters{tier=\"device\"}"),
            Some(ADAPTERS as f64)
        );
        run(&server, &fx, &reqs)
    };

    let server = SocketServer::start(config(&fx));
    let got = run(&server, &fx, &reqs);
    check(&got, &want, "default flags");
    let v = get(server.addr, "/v1/models").json();
    assert_eq!(v["data"].as_array().unwrap().len(), ADAPTERS + 1);
    let mem = &v["memory"];
    assert!(mem["disk_adapters"].as_u64().unwrap() > 0, "{mem}");
    assert!(mem["host_adapters"].as_u64().unwrap() <= 64, "{mem}");
    let m = get(server.addr, "/metrics").text();
    let lookups = metric(&m, "thaw_adapter_cache_lookups_total{result=\"hit\"}").unwrap()
        + metric(&m, "thaw_adapter_cache_lookups_total{result=\"miss\"}").unwrap();
    assert_eq!(lookups, REQUESTS as f64, "{m}");
    assert!(metric(&m, "thaw_adapter_disk_reads_total").unwrap() > 0.0);
    drop(server);

    // A device budget that holds a few adapters beside the KV: constant eviction.
    let mut cfg = config(&fx);
    cfg.device_memory_bytes = 2 << 20;
    cfg.max_cpu_loras = 8;
    let server = SocketServer::start(cfg);
    let got = run(&server, &fx, &reqs);
    check(&got, &want, "a 2 MiB device");
    let m = get(server.addr, "/metrics").text();
    assert!(
        metric(&m, "thaw_adapter_evictions_total{tier=\"device\"}").unwrap() > 0.0,
        "{m}"
    );
    drop(server);

    // The no-cache baseline (S-LoRA's memory): the same tokens; once the clients are answered
    // no adapter is left on the device, and every adapter it loaded was dropped again.
    let mut cfg = config(&fx);
    cfg.adapter_eviction = thaw_server::memory::EvictionPolicy::NoCache;
    let server = SocketServer::start(cfg);
    let got = run(&server, &fx, &reqs);
    check(&got, &want, "no-cache");
    let m = get(server.addr, "/metrics").text();
    let gauge = |name: &str| metric(&m, name).unwrap_or_else(|| panic!("no {name} in {m}"));
    assert_eq!(gauge("thaw_adapters{tier=\"device\"}"), 0.0, "{m}");
    let loads = gauge("thaw_adapter_device_loads_total{cause=\"demand\"}")
        + gauge("thaw_adapter_device_loads_total{cause=\"prefetch\"}");
    assert!(loads > 0.0, "{m}");
    assert_eq!(
        gauge("thaw_adapter_evictions_total{tier=\"device\"}"),
        loads,
        "{m}"
    );
}
