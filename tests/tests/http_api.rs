//! The HTTP API in-process (tower `oneshot`, no socket): every endpoint and every error the
//! issue lists, and tokens through HTTP against the engine driven directly.
use std::sync::atomic::Ordering;

use axum::Router;
use serde_json::{json, Value};
use thaw_runtime::engine::{HostModel, SequenceParams};
use thaw_runtime::ids::SeqId;
use thaw_runtime::model::Tokenizer;
use thaw_runtime::sampling::SamplingParams;
use thaw_server::serve::Server;
use thaw_tests::http::{call_router, edit_adapter_config, sse_data, ServeFixture};
use thaw_tests::step_all_pending;

struct Resp {
    status: u16,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// Asserts an OpenAI error body with `status`; returns the error object.
    fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "body: {}", self.body);
        let e = self.json()["error"].clone();
        for k in ["message", "type", "param", "code"] {
            assert!(e.get(k).is_some(), "error body lacks `{k}`: {}", self.body);
        }
        e
    }
}

async fn call(app: &Router, method: &str, path: &str, body: Option<String>) -> Resp {
    let (status, body) = call_router(app, method, path, body).await;
    Resp { status, body }
}

async fn post(app: &Router, path: &str, body: Value) -> Resp {
    call(app, "POST", path, Some(body.to_string())).await
}

/// The engine's own tokens for `prompt` (optionally with an adapter), for comparison.
fn engine_tokens(
    fx: &ServeFixture,
    prompt: &[u32],
    adapter: Option<usize>,
    sampling: SamplingParams,
    max_new: usize,
) -> Vec<(u32, f32)> {
    let params = SequenceParams {
        prompt: prompt.to_vec(),
        sampling,
        max_new_tokens: max_new,
        ignore_eos: true,
        ..Default::default()
    };
    let mut e = fx.engine(adapter, params);
    let mut out = Vec::new();
    loop {
        let o = step_all_pending(&mut e, SeqId(0), false);
        if let Some(o) = o.into_iter().next() {
            out.push((o.token.id, o.token.logprob));
            if o.finish.is_some() {
                return out;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_tokens_equal_engine_tokens() {
    let fx = ServeFixture::new(&[8, 16]);
    let server = Server::start(fx.config()).await.unwrap();
    let app = server.router();
    let model = HostModel::load(&fx.model_dir()).unwrap();
    let tok = Tokenizer::from_dir(&fx.model_dir(), &model.config).unwrap();
    let prompt: Vec<u32> = tok.encode("the quick brown fox", true).unwrap();
    for (adapter, name) in [(None, "base"), (Some(1), fx.adapters[1].0.as_str())] {
        for (temperature, seed) in [(0.0, 1u64), (0.9, 7), (1.3, 12345)] {
            let want = engine_tokens(
                &fx,
                &prompt,
                adapter,
                SamplingParams {
                    temperature,
                    top_k: 40,
                    top_p: 0.95,
                    seed: Some(seed),
                    top_logprobs: 0,
                    logprobs: true,
                },
                12,
            );
            let r = post(
                &app,
                "/v1/completions",
                json!({"model": name, "prompt": prompt, "max_tokens": 12, "temperature": temperature,
                       "top_k": 40, "top_p": 0.95, "seed": seed, "ignore_eos": true, "logprobs": 0}),
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.body);
            let v = r.json();
            let c = &v["choices"][0];
            let ids: Vec<u32> = want.iter().map(|t| t.0).collect();
            let mut dec = thaw_runtime::model::IncrementalDecoder::new(&prompt);
            let mut text = String::new();
            for id in &ids {
                if let Some(p) = dec.push(&tok, *id).unwrap() {
                    text.push_str(&p);
                }
            }
            if let Some(p) = dec.flush(&tok).unwrap() {
                text.push_str(&p);
            }
            assert_eq!(c["text"].as_str().unwrap(), text, "{name} T={temperature}");
            let lps: Vec<f64> = c["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(lps.len(), ids.len());
            for (got, (_, w)) in lps.iter().zip(&want) {
                assert_eq!(*got as f32, *w, "logprobs are the engine's, bit for bit");
            }
            assert_eq!(v["usage"]["completion_tokens"], 12);
            assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_features() {
    let fx = ServeFixture::new(&[8]);
    let server = Server::start(fx.config()).await.unwrap();
    let app = server.router();
    let lora = fx.adapters[0].0.clone();

    // Prompt forms: list of strings and list of token lists, with n = 2 (distinct seeds).
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": "base", "prompt": ["a b", "c d"],
        "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": true}),
    )
    .await;
    let v = r.json();
    assert_eq!(r.status, 200, "{}", r.body);
    let idx: Vec<u64> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(idx, vec![0, 1, 2, 3]);
    assert_eq!(v["usage"]["completion_tokens"], 16);
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": lora, "prompt": [[5, 6, 7], [8, 9]],
        "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"].as_array().unwrap().len(), 2);
    assert_eq!(r.json()["usage"]["prompt_tokens"], 5);

    // Echo and logprobs (top-k alternatives, offsets).
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": "base", "prompt": "hello world",
        "max_tokens": 3, "echo": true, "logprobs": 2, "temperature": 0, "ignore_eos": true}),
    )
    .await;
    let v = r.json();
    let c = &v["choices"][0];
    assert!(c["text"].as_str().unwrap().starts_with("hello world"));
    let lp = &c["logprobs"];
    let n = lp["tokens"].as_array().unwrap().len();
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
    assert_eq!(lp["text_offset"].as_array().unwrap().len(), n);
    let last_top = lp["top_logprobs"].as_array().unwrap().last().unwrap();
    assert!(!last_top.as_object().unwrap().is_empty() && last_top.as_object().unwrap().len() <= 2);

    // Stop strings: cut, excluded, finish_reason stop.
    let full = post(
        &app,
        "/v1/completions",
        json!({"model": "base", "prompt": "the",
        "max_tokens": 24, "temperature": 0, "ignore_eos": true}),
    )
    .await
    .json();
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 6 {
        let stop: String = chars[3..5].iter().collect();
        let cut = text.find(&stop).unwrap();
        let v = post(
            &app,
            "/v1/completions",
            json!({"model": "base", "prompt": "the",
            "max_tokens": 24, "temperature": 0, "ignore_eos": true, "stop": [stop, "zzzzzz"]}),
        )
        .await
        .json();
        assert_eq!(v["choices"][0]["text"].as_str().unwrap(), &text[..cut]);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    assert_eq!(full["choices"][0]["finish_reason"], "length");

    // Streaming completions with usage.
    let r = post(
        &app,
        "/v1/completions",
        json!({"model": lora, "prompt": "abc", "max_tokens": 5,
        "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.status, 200);
    let data = sse_data(&r.body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    let finishes: Vec<Value> = data[..data.len() - 2]
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["finish_reason"].clone())
        .collect();
    assert_eq!(finishes.last().unwrap(), "length");

    // Chat, non-streaming with logprobs, and streaming with deltas.
    let msgs =
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]);
    let r = post(&app, "/v1/chat/completions", json!({"model": lora, "messages": msgs,
        "max_tokens": 4, "logprobs": true, "top_logprobs": 3, "temperature": 0, "ignore_eos": true})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
    let r = post(&app, "/v1/chat/completions", json!({"model": "base", "messages": msgs,
        "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true})).await;
    let data = sse_data(&r.body);
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["object"], "chat.completion.chunk");
    let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 4);

    // Models: base + adapter with rank, targets, tier, landed layers.
    let v = call(&app, "GET", "/v1/models", None).await.json();
    let data = v["data"].as_array().unwrap();
    assert_eq!(data[0]["id"], "base");
    let a = data.iter().find(|m| m["id"] == lora.as_str()).unwrap();
    assert_eq!(a["object"], "model");
    assert_eq!(a["rank"], 8);
    assert_eq!(a["tier"], "device");
    assert_eq!(a["landed_layers"], a["num_layers"]);
    assert_eq!(a["parent"], "base");
    assert_eq!(a["targets"].as_array().unwrap().len(), 7);

    // Health and metrics.
    assert_eq!(call(&app, "GET", "/health", None).await.status, 200);
    let m = call(&app, "GET", "/metrics", None).await.body;
    for name in [
        "thaw_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"}",
        "thaw_time_to_first_token_seconds_bucket",
        "thaw_time_per_output_token_seconds_count",
        "thaw_e2e_request_latency_seconds_sum",
        "thaw_num_requests_waiting 0",
        "thaw_num_requests_running 0",
        "thaw_kv_cache_used_blocks 0",
        "thaw_adapter_leases 0",
        "thaw_adapter_device_memory_bytes",
        &format!("thaw_adapter_tier{{adapter=\"{lora}\"}} 2"),
        &format!("thaw_adapter_cache_hits_total{{adapter=\"{lora}\"}}"),
        &format!("thaw_adapter_cpu_assisted_rows_total{{adapter=\"{lora}\"}} 0"),
        "thaw_adapter_load_seconds_count",
    ] {
        assert!(m.contains(name), "metrics lack {name}:\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_gets_an_openai_body_and_status() {
    let fx = ServeFixture::new(&[8, 64]);
    let mut cfg = fx.config();
    cfg.max_lora_rank = 32;
    cfg.lora_modules.truncate(1);
    cfg.max_request_body_bytes = 4096;
    let server = Server::start(cfg).await.unwrap();
    let app = server.router();
    let c = |body: Value| post(&app, "/v1/completions", body);

    let e = c(json!({"model": "nope", "prompt": "x"})).await.error(404);
    assert_eq!(e["message"], "The model `nope` does not exist.");
    assert_eq!(e["param"], "model");
    for (body, param) in [
        (
            json!({"model": "base", "prompt": "x", "temperature": -1}),
            "temperature",
        ),
        (json!({"model": "base", "prompt": "x", "top_p": 0}), "top_p"),
        (
            json!({"model": "base", "prompt": "x", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            json!({"model": "base", "prompt": "x", "max_tokens": "many"}),
            "max_tokens",
        ),
        (json!({"model": "base", "prompt": "x", "n": 0}), "n"),
        (
            json!({"model": "base", "prompt": "x", "logprobs": 50}),
            "logprobs",
        ),
        (
            json!({"model": "base", "prompt": "x", "presence_penalty": 1}),
            "presence_penalty",
        ),
        (json!({"model": "base", "prompt": [999999]}), "prompt"),
        (json!({"model": "base", "prompt": ""}), "prompt"),
        (json!({"model": "base"}), "prompt"),
        (json!({"prompt": "x"}), "model"),
    ] {
        let e = c(body.clone()).await.error(400);
        assert_eq!(e["param"], param, "{body}: {e}");
    }
    // Context overflow: the test preset has 256 positions.
    let e = c(json!({"model": "base", "prompt": "x y", "max_tokens": 300}))
        .await
        .error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    assert!(e["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length is 256"));
    let e = post(
        &app,
        "/v1/chat/completions",
        json!({"model": "base", "messages": []}),
    )
    .await
    .error(400);
    assert_eq!(e["param"], "messages");
    // Not JSON, too large.
    let r = call(&app, "POST", "/v1/completions", Some("{not json".into())).await;
    r.error(400);
    let big = json!({"model": "base", "prompt": "x".repeat(10_000)});
    c(big).await.error(413);

    // Adapter loads: rank over the limit, DoRA, bias, modules_to_save, missing path,
    // non-JSON config, unknown adapter unload.
    let load = |name: &str, path: &std::path::Path| {
        post(
            &app,
            "/v1/load_lora_adapter",
            json!({"lora_name": name, "lora_path": path}),
        )
    };
    let e = load("big", &fx.adapters[1].1).await.error(400);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("--max-lora-rank 32"),
        "{e}"
    );
    type Case = (&'static str, fn(&mut Value), u16, &'static str);
    let cases: [Case; 4] = [
        ("dora", |v| v["use_dora"] = json!(true), 422, "DoRA"),
        ("bias", |v| v["bias"] = json!("all"), 422, "bias"),
        (
            "mts",
            |v| v["modules_to_save"] = json!(["lm_head"]),
            422,
            "modules_to_save",
        ),
        ("nojson", |_| {}, 400, "not valid JSON"),
    ];
    for (name, edit, status, needle) in cases {
        let dir = fx.copy_adapter(0, name);
        if name == "nojson" {
            std::fs::write(dir.join("adapter_config.json"), "{ r: 8,").unwrap();
        } else {
            edit_adapter_config(&dir, edit);
        }
        let e = load(name, &dir).await.error(status);
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{name}: {e}"
        );
    }
    let e = load("ghost", std::path::Path::new("/definitely/not/here"))
        .await
        .error(404);
    assert_eq!(e["code"], "adapter_not_found");
    post(
        &app,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "ghost"}),
    )
    .await
    .error(404);
    post(&app, "/v1/load_lora_adapter", json!({"lora_name": "x"}))
        .await
        .error(400);
    call(&app, "GET", "/v1/nothing", None).await.error(404);

    // Load, reload (new generation), use, unload, then 404.
    let dir = fx.copy_adapter(0, "fresh");
    let r = load("fresh", &dir).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["generation"], 1);
    let r = load("fresh", &dir).await;
    assert_eq!(r.json()["generation"], 2);
    let ok = c(json!({"model": "fresh", "prompt": "x", "max_tokens": 2})).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let r = post(
        &app,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "fresh"}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    c(json!({"model": "fresh", "prompt": "x"})).await.error(404);

    // Shutting down: 503.
    server.state.shutting_down.store(true, Ordering::SeqCst);
    let e = c(json!({"model": "base", "prompt": "x"})).await.error(503);
    assert_eq!(e["code"], "shutting_down");
    server.state.shutting_down.store(false, Ordering::SeqCst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_429() {
    let fx = ServeFixture::new(&[]);
    let long = json!({"model": "base", "prompt": "x", "max_tokens": 250, "ignore_eos": true});
    // No room in the queue at all: deterministic 429.
    let mut cfg = fx.config();
    cfg.max_queued_requests = 0;
    let server = Server::start(cfg).await.unwrap();
    let e = post(&server.router(), "/v1/completions", long.clone())
        .await
        .error(429);
    assert_eq!(e["code"], "queue_full");
    assert!(e["message"]
        .as_str()
        .unwrap()
        .contains("--max-queued-requests"));
    // A burst against a queue of 1 behind one running request: everyone gets 200 or 429.
    let mut cfg = fx.config();
    cfg.max_queued_requests = 1;
    cfg.max_num_seqs = 1;
    let server = Server::start(cfg).await.unwrap();
    let app = server.router();
    let burst: Vec<_> = (0..8)
        .map(|_| {
            let (app, body) = (app.clone(), long.to_string());
            tokio::spawn(async move { call(&app, "POST", "/v1/completions", Some(body)).await })
        })
        .collect();
    for b in burst {
        let r = b.await.unwrap();
        assert!(matches!(r.status, 200 | 429), "{} {}", r.status, r.body);
    }
}
