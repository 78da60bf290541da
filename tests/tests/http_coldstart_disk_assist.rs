//! CPU assist from the disk tier over HTTP (issue 27, item 5): under `--cold-start
//! cpu-assist` with a CPU LoRA worker, an adapter whose request arrives while it is only on
//! disk is registered at once from its memory-mapped file and the worker computes its layers
//! while the loader reads it. Every greedy completion equals a `cached` server's, the metrics
//! show adapters served from their files and CPU-assisted rows; an adapter whose full read
//! fails (a NaN only the read sees) fails its request with the error an `on-demand` server
//! gives, and leaves no adapter pages behind. Without workers, an `on-demand` server reads
//! disk misses from their files layer by layer too, with the same tokens, and so does a
//! `cached` server (whose requests still wait for the whole adapter).
use std::net::SocketAddr;
use std::path::Path;

use serde_json::{json, Value};
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};
use thaw_tests::http::{get, metric, post, spawn_serve, ServeChild};
use thaw_tests::test_preset;

const ADAPTERS: usize = 6;

fn start(dir: &Path, args: &[&str]) -> (ServeChild, SocketAddr) {
    spawn_serve(&dir.join("model"), &dir.join("adapters"), args)
}

/// One greedy completion of adapter `a`: (status, text or error body).
fn complete(addr: SocketAddr, a: usize) -> (u16, String) {
    let body = json!({"model": format!("adapter-{a:03}-r8"),
        "prompt": [3 + a as u32, 17, 42, 5, 9, 11, 2, 8], "max_tokens": 6,
        "temperature": 0, "ignore_eos": true});
    let r = post(addr, "/v1/completions", &body);
    if r.status == 200 {
        let v: Value = r.json();
        (
            r.status,
            v["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    } else {
        (r.status, r.text())
    }
}

/// Every adapter, highest index first (the host tier keeps the last registered; the first
/// ones start on disk), two clients at once.
fn run(addr: SocketAddr, adapters: &[usize]) -> Vec<(u16, String)> {
    let threads: Vec<_> = (0..2)
        .map(|c| {
            let mine: Vec<usize> = adapters.iter().copied().skip(c).step_by(2).collect();
            std::thread::spawn(move || {
                mine.into_iter()
                    .map(|a| (a, complete(addr, a)))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all: Vec<_> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("client thread"))
        .collect();
    all.sort_by_key(|(a, _)| *a);
    all.into_iter().map(|(_, r)| r).collect()
}

/// The lowest-numbered adapter only on disk (per `/v1/models`).
fn on_disk(addr: SocketAddr) -> usize {
    let v: Value = get(addr, "/v1/models").json();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["tier"] == "disk")
        .filter_map(|m| {
            m["id"]
                .as_str()?
                .strip_prefix("adapter-")?
                .get(..3)?
                .parse()
                .ok()
        })
        .min()
        .unwrap_or_else(|| panic!("an adapter on disk: {v}"))
}

/// Makes the first weights of `dir`'s safetensors file NaN (0xFF bytes are NaN in f32, f16
/// and bf16), keeping its header, so mapping it succeeds and only the full read fails.
fn poison(dir: &Path) {
    let path = dir.join("adapter_model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for b in &mut bytes[8 + header..8 + header + 16] {
        *b = 0xFF;
    }
    replace(dir, &bytes);
}

/// Puts `bytes` in place of `dir`'s safetensors file as a new file (adapter files are never
/// rewritten in place while served).
fn replace(dir: &Path, bytes: &[u8]) {
    let tmp = dir.join("adapter_model.safetensors.new");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, dir.join("adapter_model.safetensors")).unwrap();
}

/// A model and [`ADAPTERS`] rank-8 q/v adapters in a new directory, and every adapter's
/// completion, highest index first, from a `cached` server that holds them all.
fn generate() -> (tempfile::TempDir, Vec<usize>, Vec<(u16, String)>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    gen::write_model(&test_preset(), &model, &GenModelOptions::default()).expect("gen-model");
    gen::write_adapters(&GenAdaptersOptions {
        model_dir: model,
        out_dir: dir.path().join("adapters"),
        count: ADAPTERS,
        ranks: vec![8],
        targets: vec![Projection::Q, Projection::V],
        seed: 31,
        ..Default::default()
    })
    .expect("gen-adapters");
    let order: Vec<usize> = (0..ADAPTERS).rev().collect();
    let want = {
        let (_s, addr) = start(dir.path(), &["--cold-start", "cached"]);
        run(addr, &order)
    };
    (dir, order, want)
}

/// A server started with `args` serves every adapter (`order`) with `want`'s tokens, and
/// registered at least one disk miss from its mapped file; returns its metrics.
fn serves_from_files(dir: &Path, args: &[&str], order: &[usize], want: &[(u16, String)]) -> String {
    let (_s, addr) = start(dir, args);
    let got = run(addr, order);
    for (a, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(w.0, 200, "cached adapter {a} failed: {}", w.1);
        assert_eq!(g.0, 200, "{args:?}: adapter {a} failed: {}", g.1);
        assert_eq!(
            g.1, w.1,
            "{args:?}: adapter {a}: tokens differ from the cached server"
        );
    }
    let m = get(addr, "/metrics").text();
    let maps = metric(&m, "thaw_adapter_disk_maps_total").unwrap();
    assert!(
        maps >= 1.0,
        "{args:?}: disk misses were read from their files: {m}"
    );
    m
}

#[test]
fn cpu_assist_serves_disk_adapters_from_their_files() {
    let (dir, order, want) = generate();
    // One adapter in the host tier, the rest on disk; a slow link so layers are still
    // streaming when the first steps run.
    let disk_args = [
        "--cold-start",
        "cpu-assist",
        "--lora-workers",
        "1",
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "1",
        "--emulated-link-gbps",
        "0.05",
    ];
    let m = serves_from_files(dir.path(), &disk_args, &order, &want);
    let assisted = metric(&m, "thaw_cpu_assisted_rows_total").unwrap();
    assert!(assisted > 0.0, "the worker computed rows: {m}");

    // Without workers, on-demand: disk misses are served from their files too, read layer by
    // layer into the arena (each layer lands once read and checked, not after the whole
    // read), with the cached server's tokens.
    {
        let on_demand_from_files = [
            "--cold-start",
            "on-demand",
            "--lora-workers",
            "0",
            "--max-loras",
            "1",
            "--max-cpu-loras",
            "1",
        ];
        serves_from_files(dir.path(), &on_demand_from_files, &order, &want);
    }

    // A NaN only the full read sees: the request fails as an on-demand server fails it, and
    // the adapter's pages go back (the next request runs, and the adapter holds none).
    // (Start-up validates every adapter, so each server starts clean and the file is
    // poisoned under it.)
    let on_demand = [
        "--cold-start",
        "on-demand",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "1",
    ];
    let (p, expected, clean) = {
        let (_s, addr) = start(dir.path(), &on_demand);
        let p = on_disk(addr);
        let poisoned = dir.path().join(format!("adapters/adapter-{p:03}-r8"));
        let clean = std::fs::read(poisoned.join("adapter_model.safetensors")).unwrap();
        poison(&poisoned);
        let r = complete(addr, p);
        replace(&poisoned, &clean);
        (p, r, clean)
    };
    assert_ne!(expected.0, 200, "the poisoned adapter fails on demand");
    let poisoned = dir.path().join(format!("adapters/adapter-{p:03}-r8"));
    // Two device slots, so the poisoned adapter evicts nothing: had it stayed, the device
    // would hold one adapter (and its pages) more than before its request.
    let mut fail_args = disk_args;
    fail_args[5] = "2";
    let (_s, addr) = start(dir.path(), &fail_args);
    let before = get(addr, "/metrics").text();
    let device = |m: &str| metric(m, "thaw_adapters{tier=\"device\"}").unwrap();
    let pages = |m: &str| metric(m, "thaw_device_memory_used_bytes{use=\"adapters\"}").unwrap();
    assert_eq!(on_disk(addr), p, "the same adapter starts on disk");
    poison(&poisoned);
    let got = complete(addr, p);
    replace(&poisoned, &clean);
    assert_eq!(got, expected, "same status and error as on-demand");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let m = loop {
        let m = get(addr, "/metrics").text();
        let settled = device(&m) <= device(&before) && pages(&m) <= pages(&before);
        if settled || std::time::Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(
        metric(&m, "thaw_adapter_disk_maps_total"),
        Some(1.0),
        "the poisoned adapter was served from its file first: {m}"
    );
    assert!(
        device(&m) <= device(&before) && pages(&m) <= pages(&before),
        "the failed adapter left the device and its pages went back: before {before}\nafter {m}"
    );
    let other = (p + 1) % ADAPTERS;
    assert_eq!(
        complete(addr, other),
        want[other],
        "the server still serves other adapters"
    );
}

/// `cached`'s disk misses are served from their mapped files too: the upload pipeline reads
/// each layer, checks it and queues its copy (the read overlapped with the copy, not the
/// loader's whole read first), while each request still starts only once its adapter has
/// landed. The tokens are those of a `cached` server holding every adapter, the metrics count
/// the adapters registered from their files, and an adapter whose file has a NaN fails its
/// request (the unchecked mapping is never computed from); other adapters are served on.
#[test]
fn cached_serves_disk_misses_from_their_files() {
    let (dir, order, want) = generate();
    // One device slot and one host slot: most requests miss to disk. A slow link so that
    // layers are still in flight when requests are planned (held until every one landed).
    let args = [
        "--cold-start",
        "cached",
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "1",
        "--emulated-link-gbps",
        "0.05",
    ];
    serves_from_files(dir.path(), &args, &order, &want);

    // A fresh server (start-up validates every adapter), the file poisoned under it.
    let (_s, addr) = start(dir.path(), &args);
    let p = on_disk(addr);
    let poisoned = dir.path().join(format!("adapters/adapter-{p:03}-r8"));
    let clean = std::fs::read(poisoned.join("adapter_model.safetensors")).unwrap();
    poison(&poisoned);
    let bad = complete(addr, p);
    replace(&poisoned, &clean);
    assert_ne!(bad.0, 200, "adapter {p}'s NaN was computed from: {}", bad.1);
    let m = get(addr, "/metrics").text();
    assert_eq!(
        metric(&m, "thaw_adapter_disk_maps_total"),
        Some(1.0),
        "the poisoned adapter was served from its file first: {m}"
    );
    let other = (p + 1) % ADAPTERS;
    assert_eq!(
        complete(addr, other),
        want[other],
        "the server still serves other adapters"
    );
}
