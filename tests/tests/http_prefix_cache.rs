//! KV as vLLM users expect it (issue 28), over HTTP: blocks on demand, so chat requests that
//! set no `max_tokens` run together; preemption by recompute that a client never notices; and
//! automatic prefix caching keyed by the adapter and its loaded generation, which changes no
//! greedy token.
use std::time::Duration;

use serde_json::{json, Value};
use thaw_server::serve::{ServeConfig, Server};
use thaw_tests::http::{call_router as call, complete_all, sse_data, ServeFixture};
use thaw_tests::prom;

/// Context of the fixture model: room for a 1,000-token prefix and a continuation.
const CONTEXT: usize = 2048;

/// The value of a protocol gauge or counter (one sample, labelled `engine`, `model_name`),
/// from a well-formed exposition.
fn vllm(metrics: &str, name: &str) -> f64 {
    let e = prom::parse(metrics).unwrap_or_else(|err| panic!("{err}\n{metrics}"));
    e.values()
        .flat_map(|f| &f.samples)
        .find(|s| s.name == name)
        .map(|s| s.value)
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{metrics}"))
}

/// Deterministic token ids in the tokenizer's range (never the special ids 0..3).
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            3 + (x % 380) as u32
        })
        .collect()
}

fn config(fx: &ServeFixture, caching: bool) -> ServeConfig {
    ServeConfig {
        enable_prefix_caching: caching,
        max_num_seqs: 64,
        ..fx.config()
    }
}

/// One greedy completion over token ids; returns (text, cached prompt tokens).
async fn complete(
    app: &axum::Router,
    model: &str,
    prompt: &[u32],
    max_tokens: usize,
) -> (String, u64) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                      "temperature": 0.0, "ignore_eos": true});
    let (status, text) = call(app, "POST", "/v1/completions", Some(body.to_string())).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens_details.cached_tokens");
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        cached,
    )
}

async fn served(cfg: ServeConfig) -> (Server, axum::Router) {
    let server = Server::start(cfg).await.unwrap();
    let app = server.router();
    (server, app)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_is_reused_under_its_adapter_generation_only() {
    let fx = ServeFixture::with_context(&[8, 16], CONTEXT);
    let (x, y) = (fx.adapters[0].0.clone(), fx.adapters[1].0.clone());
    let prefix = tokens(1, 1000);
    let prompt = |tail: u64| [prefix.clone(), tokens(tail, 24)].concat();
    let (_s, app) = served(config(&fx, true)).await;
    let (_, first) = complete(&app, &x, &prompt(2), 8).await;
    assert_eq!(first, 0, "nothing is cached before the first request");
    let (second, cached) = complete(&app, &x, &prompt(3), 8).await;
    assert!(
        cached >= 992,
        "the 1,000-token prefix's full blocks: {cached}"
    );
    let (_off, off_app) = served(config(&fx, false)).await;
    let (want, none) = complete(&off_app, &x, &prompt(3), 8).await;
    assert_eq!(none, 0, "caching off reuses nothing");
    assert_eq!(second, want, "a cache hit changes no greedy token");

    // Another adapter over the same prefix: nothing shared, a fresh server's tokens.
    let (other, cached) = complete(&app, &y, &prompt(4), 8).await;
    assert_eq!(cached, 0, "KV computed under {x} is not reused under {y}");
    let (want, _) = complete(&off_app, &y, &prompt(4), 8).await;
    assert_eq!(other, want);
    // The base model shares with base-model requests only.
    let (_, cached) = complete(&app, "base", &prompt(5), 4).await;
    assert_eq!(cached, 0);
    let (_, cached) = complete(&app, "base", &prompt(6), 4).await;
    assert!(
        cached >= 992,
        "base requests share with each other: {cached}"
    );

    // The same name reloaded with other weights: a new generation, nothing reused.
    let new_weights = fx.adapters[1].1.to_str().unwrap().to_string();
    let body = json!({"lora_name": x, "lora_path": new_weights});
    let (status, text) = call(
        &app,
        "POST",
        "/v1/load_lora_adapter",
        Some(body.to_string()),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let (reloaded, cached) = complete(&app, &x, &prompt(3), 8).await;
    assert_eq!(cached, 0, "blocks of the replaced generation are dropped");
    let mut fresh_cfg = config(&fx, true);
    fresh_cfg.lora_modules = vec![(x.clone(), fx.adapters[1].1.clone())];
    let (_fresh, fresh) = served(fresh_cfg).await;
    let (want, _) = complete(&fresh, &x, &prompt(3), 8).await;
    assert_eq!(
        reloaded, want,
        "the reloaded adapter computes with its new weights"
    );

    let (_, metrics) = call(&app, "GET", "/metrics", None).await;
    let (q, h) = (
        vllm(&metrics, "vllm:prefix_cache_queries_total"),
        vllm(&metrics, "vllm:prefix_cache_hits_total"),
    );
    // Six requests of 1,024 prompt tokens looked up; two found 992 each (vLLM's meaning:
    // tokens, not requests).
    assert_eq!((q, h), (6.0 * 1024.0, 2.0 * 992.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_adapter_alternation_over_one_prefix_changes_no_token() {
    let fx = ServeFixture::with_context(&[8, 16], CONTEXT);
    let prefix = tokens(7, 300);
    let bodies: Vec<Value> = (0..64u64)
        .map(|i| {
            let model = &fx.adapters[(i % 2) as usize].0;
            let prompt = [prefix.clone(), tokens(100 + i, 1 + (i % 5) as usize)].concat();
            json!({"model": model, "prompt": prompt, "max_tokens": 4,
                   "temperature": 0.0, "ignore_eos": true})
        })
        .collect();
    let run = |caching: bool| {
        let fx = &fx;
        let bodies = bodies.clone();
        async move {
            let mut cfg = config(fx, caching);
            // Chunked prefill: the 300-token prefix takes several steps, so later requests
            // meet blocks that earlier ones are still writing.
            cfg.max_num_batched_tokens = 64;
            let (_s, app) = served(cfg).await;
            let texts = complete_all(&app, bodies).await;
            let (_, metrics) = call(&app, "GET", "/metrics", None).await;
            (texts, vllm(&metrics, "vllm:prefix_cache_hits_total"))
        }
    };
    let (on, hits) = run(true).await;
    let (off, none) = run(false).await;
    assert_eq!(none, 0.0);
    assert!(
        hits > 0.0,
        "the alternation reused the prefix under each adapter"
    );
    for (i, (a, b)) in on.iter().zip(&off).enumerate() {
        assert_eq!(a, b, "request {i}: caching changed its greedy tokens");
    }
}

/// Streams a chat completion; returns (concatenated content, completion tokens in usage).
async fn stream_chat(
    app: &axum::Router,
    content: &str,
    max_tokens: Option<usize>,
) -> (String, u64) {
    let mut body = json!({"model": "base", "messages": [{"role": "user", "content": content}],
                          "temperature": 0.0, "ignore_eos": true, "stream": true,
                          "stream_options": {"include_usage": true}});
    if let Some(m) = max_tokens {
        body["max_tokens"] = json!(m);
    }
    let (status, text) = call(app, "POST", "/v1/chat/completions", Some(body.to_string())).await;
    assert_eq!(status, 200, "{text}");
    let mut out = String::new();
    let mut usage = 0;
    for d in sse_data(&text) {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap_or_else(|_| panic!("chunk {d}"));
        assert!(v.get("error").is_none(), "{v}");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            out.push_str(c);
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            usage = n;
        }
    }
    (out, usage)
}

/// Eight chat requests that set no `max_tokens` (as chat clients send), each generating to
/// the end of its context, on a pool that holds their actual tokens but not eight whole
/// contexts: all eight run at once, the pool running out preempts some, and every stream
/// equals the one an undisturbed server sends — no token repeated, none dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chats_without_max_tokens_run_together_and_preemption_is_invisible() {
    let fx = ServeFixture::new(&[]);
    let context = thaw_tests::test_preset().max_position_embeddings;
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("tell me story number {i}"))
        .collect();
    // 8 whole contexts are 8 × 16 blocks; the pool holds 48 (the prompts, and room to grow).
    let small = ServeConfig {
        num_gpu_blocks_override: Some(48),
        ..config(&fx, true)
    };
    let (_s, app) = served(small).await;
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (app, p) = (app.clone(), p.clone());
            tokio::spawn(async move { stream_chat(&app, &p, None).await })
        })
        .collect();
    let mut peak = 0.0f64;
    while !handles.iter().all(|h| h.is_finished()) {
        let (_, m) = call(&app, "GET", "/metrics", None).await;
        peak = peak.max(vllm(&m, "vllm:num_requests_running"));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut got = Vec::new();
    for h in handles {
        got.push(h.await.unwrap());
    }
    let (_, metrics) = call(&app, "GET", "/metrics", None).await;
    assert_eq!(
        peak, 8.0,
        "all eight ran at once (the old worst-case reservation ran 3)"
    );
    let preempted = vllm(&metrics, "vllm:num_preemptions_total");
    assert!(
        preempted > 0.0,
        "the pool ran out and sequences were preempted"
    );
    let (_big, reference) = served(config(&fx, false)).await;
    for (i, p) in prompts.iter().enumerate() {
        let (want, n) = stream_chat(&reference, p, None).await;
        assert!(
            n as usize > context / 2,
            "it generated to the end of the context: {n}"
        );
        assert_eq!(
            got[i].1, n,
            "request {i}: as many tokens as an undisturbed run"
        );
        assert_eq!(
            got[i].0, want,
            "request {i}: its stream repeats or drops a token"
        );
    }
}
