//! Fuzz targets (proptest, stable toolchain) for the HTTP API: request JSON with every field
//! of completions and chat given wrong types and extreme values, raw and mutated bodies
//! (invalid UTF-8, truncation), and streaming clients that disconnect at every byte of the
//! request and the response. Every answer must be a status the API documents with an OpenAI
//! error body — never a 5xx, a panic or a hang — and after the disconnects the server must be
//! idle again (no request, KV block or lease left) and serve normally. See `fuzz_support`.
mod fuzz_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use thaw_server::serve::{ServeConfig, Server};
use thaw_tests::http::{get, metric, post, ServeFixture, SocketServer};
use tower::ServiceExt;

use fuzz_support::fuzz;

#[global_allocator]
static ALLOC: fuzz_support::CappedAlloc = fuzz_support::CappedAlloc;

/// Short contexts keep every accepted request to a few dozen engine steps.
fn config(fx: &ServeFixture) -> ServeConfig {
    ServeConfig {
        max_model_len: Some(48),
        max_request_body_bytes: 1 << 20,
        ..fx.config()
    }
}

/// An in-process server (router + its runtime), shared by the request targets.
struct InProcess {
    rt: tokio::runtime::Runtime,
    app: axum::Router,
    adapter: String,
    _server: Server,
    _fx: ServeFixture,
}

fn in_process() -> &'static InProcess {
    static S: OnceLock<InProcess> = OnceLock::new();
    S.get_or_init(|| {
        let fx = ServeFixture::new(&[8]);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let server = rt.block_on(Server::start(config(&fx))).unwrap();
        InProcess {
            app: server.router(),
            adapter: fx.adapters[0].0.clone(),
            rt,
            _server: server,
            _fx: fx,
        }
    })
}

/// How often each status was answered, printed after each target (a target whose inputs are
/// all refused early tests little).
static STATUSES: std::sync::Mutex<std::collections::BTreeMap<u16, u64>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

fn print_statuses(target: &str) {
    eprintln!(
        "fuzz {target}: statuses so far {:?}",
        STATUSES.lock().unwrap()
    );
}

/// Statuses the API answers bad or refused input with.
const CLIENT_ERRORS: [u16; 6] = [400, 404, 413, 422, 429, 409];

fn send(path: &str, body: Vec<u8>) -> Result<(), TestCaseError> {
    let s = in_process();
    let req = Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let (status, bytes) = s.rt.block_on(async {
        let resp = s.app.clone().oneshot(req).await.unwrap();
        let status = resp.status().as_u16();
        let bytes = tokio::time::timeout(
            Duration::from_secs(60),
            axum::body::to_bytes(resp.into_body(), usize::MAX),
        )
        .await
        .expect("the response body ended within 60 s")
        .unwrap();
        (status, bytes)
    });
    *STATUSES.lock().unwrap().entry(status).or_default() += 1;
    if std::env::var_os("THAW_FUZZ_VERBOSE").is_some() {
        eprintln!("{status} {}", String::from_utf8_lossy(&bytes));
    }
    let text = String::from_utf8_lossy(&bytes);
    if status == 200 {
        // A stream ends with [DONE] or an error event; a plain answer is JSON with choices.
        if text.starts_with("data:") {
            prop_assert!(
                text.trim_end().ends_with("data: [DONE]") || text.contains("\"error\""),
                "{text}"
            );
        } else {
            let v: Value = serde_json::from_slice(&bytes)
                .map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
            prop_assert!(v["choices"].is_array(), "{text}");
        }
    } else {
        prop_assert!(CLIENT_ERRORS.contains(&status), "status {status}: {text}");
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
        prop_assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{text}"
        );
    }
    Ok(())
}

// ---- values --------------------------------------------------------------------------------

fn edge_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(2)),
        Just(json!(20)),
        Just(json!(21)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(i64::MAX)),
        Just(json!(u32::MAX)),
        Just(json!(1e308)),
        Just(json!(-1e308)),
        Just(json!(1e-320)),
        Just(json!(0.5)),
        Just(json!(-0.0)),
        any::<i32>().prop_map(|v| json!(v)),
        (-5.0..5.0f64).prop_map(|v| json!(v)),
        Just(json!("")),
        Just(json!("base")),
        Just(json!("\u{0}\u{FFFD}<s></s>")),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(2, 10, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map("[a-z_]{0,12}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A value meant for `field`: usually of the right kind (small, so accepted requests stay
/// cheap), sometimes any edge value.
fn field_value(field: &'static str) -> BoxedStrategy<Value> {
    let typed: BoxedStrategy<Value> = match field {
        "max_tokens" | "max_completion_tokens" => {
            prop_oneof![0..12i64, Just(47), Just(48), Just(100_000)]
                .prop_map(|v| json!(v))
                .boxed()
        }
        "n" | "best_of" => (0..5i64).prop_map(|v| json!(v)).boxed(),
        "logprobs" | "top_logprobs" => prop_oneof![
            (0..22i64).prop_map(|v| json!(v)),
            any::<bool>().prop_map(|v| json!(v))
        ]
        .boxed(),
        "temperature" | "top_p" | "presence_penalty" | "frequency_penalty"
        | "repetition_penalty" => (-3.0..3.0f64).prop_map(|v| json!(v)).boxed(),
        "top_k" => (-2..500i64).prop_map(|v| json!(v)).boxed(),
        "seed" => any::<i64>().prop_map(|v| json!(v)).boxed(),
        "stop" => prop_oneof![
            "[a-z ]{0,3}".prop_map(|s| json!(s)),
            proptest::collection::vec("[a-z ]{0,3}", 0..6).prop_map(|v| json!(v)),
        ]
        .boxed(),
        "stop_token_ids" => proptest::collection::vec(any::<u32>(), 0..4)
            .prop_map(|v| json!(v))
            .boxed(),
        "stream" | "echo" | "ignore_eos" | "add_generation_prompt" => {
            any::<bool>().prop_map(|v| json!(v)).boxed()
        }
        "stream_options" => any::<Option<bool>>()
            .prop_map(|v| json!({"include_usage": v}))
            .boxed(),
        "logit_bias" => proptest::collection::btree_map("[0-9]{1,4}", -100..100i32, 0..3)
            .prop_map(|m| json!(m))
            .boxed(),
        "prompt" => prop_oneof![
            any::<String>().prop_map(|s| json!(s)),
            proptest::collection::vec("[a-z ]{0,12}", 0..4).prop_map(|v| json!(v)),
            proptest::collection::vec(prop_oneof![0..400u32, any::<u32>()], 0..12)
                .prop_map(|v| json!(v)),
            proptest::collection::vec(proptest::collection::vec(0..400u32, 0..6), 0..3)
                .prop_map(|v| json!(v)),
            (1..200_000usize).prop_map(|n| json!("ab ".repeat(n))),
        ]
        .boxed(),
        "messages" => proptest::collection::vec(
            (
                prop_oneof![
                    Just("user"),
                    Just("system"),
                    Just("assistant"),
                    Just("tool"),
                    Just("")
                ],
                prop_oneof![
                    any::<String>().prop_map(|s| json!(s)),
                    Just(Value::Null),
                    proptest::collection::vec(
                        (
                            prop_oneof![Just("text"), Just("image_url")],
                            any::<Option<String>>()
                        ),
                        0..3
                    )
                    .prop_map(|parts| json!(parts
                        .into_iter()
                        .map(|(k, t)| json!({"type": k, "text": t}))
                        .collect::<Vec<_>>())),
                ],
            )
                .prop_map(|(role, content)| json!({"role": role, "content": content})),
            0..4,
        )
        .prop_map(Value::Array)
        .boxed(),
        _ => edge_value().boxed(),
    };
    prop_oneof![4 => typed, 1 => edge_value()].boxed()
}

const COMPLETION_FIELDS: &[&str] = &[
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "ignore_eos",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "echo",
    "best_of",
    "suffix",
    "user",
];
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "ignore_eos",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
    "tools",
    "user",
];

/// A valid request for `chat` or completions with 0–4 fields set to mostly valid, sometimes
/// wrong-typed or extreme values (or removed), so that a good share reaches the engine.
fn request(chat: bool) -> impl Strategy<Value = Value> {
    let fields = if chat { CHAT_FIELDS } else { COMPLETION_FIELDS };
    let edit = prop_oneof![
        8 => proptest::sample::select(fields).prop_flat_map(|f| (Just(f), field_value(f).prop_map(Some))),
        1 => proptest::sample::select(fields).prop_map(|f| (f, None)),
        1 => Just("model").prop_flat_map(|f| (Just(f), edge_value().prop_map(Some))),
    ];
    (proptest::collection::vec(edit, 0..5), any::<bool>()).prop_map(move |(edits, adapter)| {
        let model = if adapter {
            json!(in_process().adapter)
        } else {
            json!("base")
        };
        let mut obj = Map::new();
        obj.insert("model".into(), model);
        if chat {
            obj.insert(
                "messages".into(),
                json!([{"role": "user", "content": "hi"}]),
            );
        } else {
            obj.insert("prompt".into(), json!("the quick brown"));
        }
        obj.insert("max_tokens".into(), json!(4));
        for (k, v) in edits {
            match v {
                Some(v) => obj.insert(k.to_string(), v),
                None => obj.remove(k),
            };
        }
        Value::Object(obj)
    })
}

#[test]
fn request_json_structured() {
    in_process();
    let strat = prop_oneof![
        request(false).prop_map(|v| ("/v1/completions", v)),
        request(true).prop_map(|v| ("/v1/chat/completions", v)),
    ];
    fuzz("request_json_structured", 150, strat, |(path, v)| {
        send(path, v.to_string().into_bytes())
    });
    print_statuses("request_json_structured");
}

#[test]
fn request_body_raw() {
    in_process();
    let valid = || {
        json!({"model": "base", "prompt": "hi there", "max_tokens": 3, "stream": true,
               "logprobs": 2, "stop": ["x"]})
        .to_string()
        .into_bytes()
    };
    let bytes = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..300),
        (
            proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
            proptest::option::of(any::<prop::sample::Index>()),
        )
            .prop_map(move |(flips, cut)| {
                let mut b = valid();
                for (i, v) in flips {
                    let i = i.index(b.len());
                    b[i] = v;
                }
                if let Some(c) = cut {
                    b.truncate(c.index(b.len()));
                }
                b
            }),
    ];
    let path = prop_oneof![
        Just("/v1/completions"),
        Just("/v1/chat/completions"),
        Just("/v1/load_lora_adapter"),
        Just("/v1/unload_lora_adapter"),
    ];
    fuzz("request_body_raw", 300, (path, bytes), |(path, b)| {
        send(path, b)
    });
}

// ---- streaming clients that go away -------------------------------------------------------------

/// Polls /metrics until nothing is waiting or running and no KV block or lease is held.
fn wait_idle(addr: std::net::SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = get(addr, "/metrics").text();
        let busy: Vec<&str> = [
            "thaw_num_requests_waiting",
            "thaw_num_requests_running",
            "thaw_kv_cache_used_blocks",
            "thaw_adapter_leases",
        ]
        .into_iter()
        .filter(|n| metric(&m, n) != Some(0.0))
        .collect();
        if busy.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still busy after disconnects: {busy:?}\n{m}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sse_disconnect_anywhere() {
    let fx = ServeFixture::new(&[8]);
    let srv = SocketServer::start(config(&fx));
    let a = srv.addr;
    let adapter = fx.adapters[0].0.clone();
    let request_bytes = |model: &str, chat: bool| {
        let (path, body) = if chat {
            (
                "/v1/chat/completions",
                json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 24, "stream": true, "ignore_eos": true,
                       "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 2}),
            )
        } else {
            (
                "/v1/completions",
                json!({"model": model, "prompt": "the quick", "max_tokens": 24, "stream": true,
                       "ignore_eos": true, "n": 2, "logprobs": 1}),
            )
        };
        let body = body.to_string();
        format!(
            "POST {path} HTTP/1.1\r\nHost: {a}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    // Full response length of each form, to pick cut points inside it.
    let full_len = |req: &[u8]| {
        let mut s = TcpStream::connect(a).unwrap();
        s.write_all(req).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        out.len()
    };
    let forms: Vec<(Vec<u8>, usize)> = [
        ("base", false),
        ("base", true),
        (adapter.as_str(), false),
        (adapter.as_str(), true),
    ]
    .into_iter()
    .map(|(m, chat)| {
        let r = request_bytes(m, chat);
        let n = full_len(&r);
        (r, n)
    })
    .collect();
    let strat = (
        proptest::sample::select((0..forms.len()).collect::<Vec<_>>()),
        any::<prop::sample::Index>(),
        any::<bool>(),
        any::<prop::sample::Index>(),
    );
    fuzz(
        "sse_disconnect",
        60,
        strat,
        |(form, cut, in_request, sent)| {
            let (req, resp_len) = &forms[form];
            let mut s = TcpStream::connect(a).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            if in_request {
                // Gone while sending the request.
                let _ = s.write_all(&req[..sent.index(req.len())]);
            } else {
                s.write_all(req).unwrap();
                let want = cut.index(*resp_len);
                let mut got = 0;
                let mut buf = [0u8; 256];
                while got < want {
                    match s.read(&mut buf[..(want - got).min(256)]) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got += n,
                    }
                }
            }
            drop(s);
            Ok(())
        },
    );
    wait_idle(a);
    // Still serving, in full.
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": adapter, "prompt": "hi", "max_tokens": 4, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 4);
}
