//! An adapter whose file goes bad after it was registered (issue 27): a NaN in one of its
//! layers. Served from its mapped file, the upload pipeline reads that layer, finds it
//! non-finite and fails the upload, saying which layer and why.
//!
//! - Engine: [`Engine::failed_uploads`] reports it with the layer; once the adapter is
//!   unregistered its arena bytes are back, and a sequence on another adapter stepping beside
//!   the failure gives the tokens it gives alone.
//! - Server: a NaN written into layer 0 while the adapter sits on disk. The engine loop acts on
//!   the pipeline's failure at once (the loader's full read of the same 128 MB file is still
//!   running): the request fails with an OpenAI error body naming the adapter, the layer and
//!   what to do, while a request on another adapter decoding beside it completes with the
//!   tokens it gets alone, the adapter's device pages and arena bytes go back, and once the
//!   file is fixed the adapter serves again.
use std::path::Path;
use std::time::{Duration, Instant};

use std::sync::Arc;

use serde_json::{json, Value};
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::Backend as _;
use thaw_runtime::engine::{Engine, EngineConfig, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SamplingParams;
use thaw_server::coldstart::ColdStartPolicy;
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};
use thaw_server::serve::ServeConfig;
use thaw_tests::http::{get, metric, post, SocketServer};
use thaw_tests::{test_preset, TestModel};

const FILE: &str = "adapter_model.safetensors";

/// One greedy completion: (status, text or error message, when it returned).
fn complete(addr: std::net::SocketAddr, model: &str, max_tokens: usize) -> (u16, String, Instant) {
    let body = json!({"model": model, "prompt": [5, 17, 42, 9, 11, 2, 8, 30],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    let r = post(addr, "/v1/completions", &body);
    let v: Value = r.json();
    let text = if r.status == 200 {
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    } else {
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    (r.status, text, Instant::now())
}

/// Writes 0xFF (NaN in f32, f16 and bf16) over elements of layer `layer`'s `q_proj` A factor
/// of the safetensors file in `dir`, as a new file renamed over the old (adapter files are
/// never rewritten in place while served); returns the clean bytes.
fn poison_layer(dir: &Path, layer: usize) -> Vec<u8> {
    let path = dir.join(FILE);
    let clean = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(clean[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&clean[8..8 + n]).unwrap();
    let layer = format!("layers.{layer}.");
    let (_, t) = header
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| k.contains(&layer) && k.contains("q_proj.lora_A"))
        .expect("the layer's q_proj A factor");
    let start = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize;
    let mut bad = clean.clone();
    bad[start + 4..start + 8].fill(0xFF);
    replace(dir, &bad);
    clean
}

fn replace(dir: &Path, bytes: &[u8]) {
    let tmp = dir.join("adapter_model.safetensors.new");
    std::fs::write(&tmp, bytes).unwrap();
    std::fs::rename(&tmp, dir.join(FILE)).unwrap();
}

/// `name`'s tier per `/v1/models`.
fn tier(addr: std::net::SocketAddr, name: &str) -> String {
    let v: Value = get(addr, "/v1/models").json();
    let m = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == name);
    m.and_then(|m| m["tier"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn params(prompt: &[u32], adapter: AdapterId) -> SequenceParams {
    SequenceParams {
        prompt: prompt.to_vec(),
        adapter: Some(adapter),
        sampling: SamplingParams::greedy(),
        max_new_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    }
}

/// One step of `seq`'s pending tokens; its token, if the step gave one.
fn step(e: &mut thaw_tests::CpuEngine, seq: SeqId) -> Option<(u32, bool)> {
    let num_tokens = e.pending_tokens(seq).unwrap();
    let plan = StepPlan {
        items: vec![PlanItem { seq, num_tokens }],
        return_logits: false,
    };
    let out = e.step(&plan).expect("the good sequence's step");
    out.first().map(|o| (o.token.id, o.finish.is_some()))
}

#[test]
fn the_engine_reports_a_failed_upload_with_its_layer() {
    let tm = TestModel::llama(91);
    let cfg = tm.model.config.clone();
    let targets = ["q", "k", "v", "o"];
    let good = Arc::new(LoraAdapter::load(&tm.adapter_dir(16, &targets, 910), &cfg).unwrap());
    let bad_dir = tm.adapter_dir(16, &targets, 911);
    let vocab = cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..20u32).map(|t| 3 + (t * 37) % (vocab - 3)).collect();
    let mut oracle = Engine::new(
        thaw_runtime::backend::cpu::CpuBackend::new(&cfg),
        tm.model.clone(),
        EngineConfig::default(),
    )
    .unwrap();
    oracle.register_adapter(AdapterId(0), good.clone()).unwrap();
    oracle
        .add_sequence(SeqId(0), params(&prompt, AdapterId(0)))
        .unwrap();
    let mut want = Vec::new();
    while let Some((t, last)) = step(&mut oracle, SeqId(0)) {
        want.push(t);
        if last {
            break;
        }
    }

    // The last layer poisoned: the layers before it land, then the upload fails.
    let last = cfg.num_layers - 1;
    poison_layer(&bad_dir, last);
    let bytes = good.size_bytes() as f64;
    let mut e = thaw_tests::cpu_engine_slow_link(tm.model.clone(), bytes, 0.05);
    let (ok, bad) = (AdapterId(0), AdapterId(1));
    e.register_adapter(ok, good.clone()).unwrap();
    let arena_before = e.backend().upload_arena().map_or(0, |u| u.used);
    let mapped = Arc::new(LoraAdapter::map(&bad_dir, &cfg).unwrap());
    e.register_adapter_streaming(bad, mapped).unwrap();
    e.add_sequence(SeqId(1), params(&prompt, ok)).unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let failure = loop {
        // The good sequence steps while the bad adapter's layers are read and copied.
        if got.len() < want.len() {
            if let Some((t, _)) = step(&mut e, SeqId(1)) {
                got.push(t);
            }
        }
        if let Some((id, why)) = e.failed_uploads().into_iter().next() {
            break (id, why);
        }
        assert!(Instant::now() < deadline, "the upload never failed");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(failure.0, bad);
    assert!(
        failure
            .1
            .contains(&format!("layer {last} of its file failed its check"))
            && failure.1.contains("NaN"),
        "{}",
        failure.1
    );
    let (landed, layers) = e.adapter_landed(bad).unwrap();
    assert!(landed < layers, "the bad layer never lands");
    e.unregister_adapter(bad).unwrap();
    assert!(e.failed_uploads().is_empty());
    let deadline = Instant::now() + Duration::from_secs(5);
    while e
        .backend()
        .upload_arena()
        .is_some_and(|u| u.used > arena_before)
    {
        assert!(
            Instant::now() < deadline,
            "the failed image's arena bytes never came back"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    while got.len() < want.len() {
        let (t, _) = step(&mut e, SeqId(1)).expect("a token a step");
        got.push(t);
    }
    assert_eq!(got, want, "the good sequence's tokens beside the failure");
}

#[test]
fn a_layer_that_fails_its_check_fails_its_adapters_requests_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("model");
    gen::write_model(&test_preset(), &model, &GenModelOptions::default()).expect("gen-model");
    let mut adapters = Vec::new();
    // The poisoned adapter is large (rank 8192 on every projection, 128 MB): the loader's
    // whole read of it takes far longer than the pipeline's read of layer 0's first factor.
    // The first two are warmed onto the device at start-up (`--max-loras 2`), the big one
    // stays on disk (no host tier); its request takes the idle one's slot.
    for (name, rank, seed) in [("small", 8, 72), ("idle", 8, 73), ("big", 8192, 71)] {
        let written = gen::write_adapters(&GenAdaptersOptions {
            model_dir: model.clone(),
            out_dir: dir.path().join(format!("staging-{name}")),
            count: 1,
            ranks: vec![rank],
            targets: Projection::ALL.to_vec(),
            seed,
            ..Default::default()
        })
        .expect("gen-adapters");
        let dst = dir.path().join("adapters").join(name);
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::rename(&written[0], &dst).unwrap();
        adapters.push((name.to_string(), dst));
    }
    let big = adapters[2].1.clone();
    let server = SocketServer::start(ServeConfig {
        model: Some(model),
        port: 0,
        lora_modules: adapters,
        served_model_name: vec!["base".into()],
        max_lora_rank: 8192,
        max_loras: 2,
        max_cpu_loras: 0,
        max_cpu_lora_bytes: 512 << 20,
        max_num_batched_tokens: 256,
        cold_start: ColdStartPolicy::OnDemand,
        lora_workers: 0,
        shutdown_timeout: Duration::from_secs(5),
        ..Default::default()
    });
    let addr = server.addr;
    // The small adapter alone: the tokens it must give beside the failure.
    let want = complete(addr, "small", 240);
    assert_eq!(want.0, 200, "{}", want.1);
    assert_eq!(tier(addr, "big"), "disk", "the big adapter starts on disk");
    let before = get(addr, "/metrics").text();
    let pages = |m: &str| metric(m, "thaw_device_memory_used_bytes{use=\"adapters\"}").unwrap();
    let arena = |m: &str| metric(m, "thaw_host_arena_bytes{use=\"used\"}").unwrap();
    let device = |m: &str| metric(m, "thaw_adapters{tier=\"device\"}").unwrap();

    let clean = poison_layer(&big, 0);
    let beside = std::thread::spawn(move || complete(addr, "small", 240));
    std::thread::sleep(Duration::from_millis(5));
    let (status, message, failed_at) = complete(addr, "big", 8);
    let (ok, text, done_at) = beside.join().expect("the other client");
    assert_eq!(status, 503, "status {status}: {message}");
    // Two readers check the file, and whichever finds the NaN first reports it: the upload
    // pipeline's per-layer check ("adapter `big` failed to load: layer 0 of its file failed its
    // check … re-upload …") or the loader verifying the file it reads in place ("reading adapter
    // files at …/big failed: tensor `…layers.0…` holds NaN … load the adapter again"). Either
    // names the adapter, the layer and the NaN, and says what to do.
    let pipeline = message
        .starts_with("adapter `big` failed to load: layer 0 of its file failed its check")
        && message.contains("re-upload");
    let loader = message.starts_with("reading adapter files at")
        && message.contains("/big failed: tensor")
        && message.contains(".layers.0.")
        && message.contains("load the adapter again");
    assert!((pipeline || loader) && message.contains("NaN"), "{message}");
    assert_eq!((ok, &text), (200, &want.1), "the other adapter's request");
    assert!(
        failed_at < done_at,
        "the failure came while the other request decoded"
    );

    // Its pages and arena bytes went back: the budget is split as before its request.
    let deadline = Instant::now() + Duration::from_secs(5);
    let m = loop {
        let m = get(addr, "/metrics").text();
        let settled = pages(&m) <= pages(&before)
            && arena(&m) <= arena(&before)
            && device(&m) <= device(&before);
        if settled || Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        pages(&m) <= pages(&before) && arena(&m) <= arena(&before) && device(&m) <= device(&before),
        "the failed adapter's pages and arena bytes went back: before {before}\nafter {m}"
    );
    assert_eq!(tier(addr, "big"), "disk");

    // Fixed, it serves again (its loader read of the bad file may still report first).
    replace(&big, &clean);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (s, t, _) = complete(addr, "big", 8);
        if s == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the fixed adapter never served: {t}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
