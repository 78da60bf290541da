//! Huge prompts (issue 13): a prompt whose byte length proves it cannot fit the context is
//! refused with vLLM's 400 before any tokenising, a body over the limit gets 413, and neither
//! holds up a normal request sent beside it.
use axum::Router;
use serde_json::{json, Value};
use thaw_server::serve::{ServeConfig, Server};
use thaw_tests::http::{call_router, ServeFixture};

async fn post(app: &Router, path: &str, body: String) -> (u16, Value) {
    let (status, text) = call_router(app, "POST", path, Some(body)).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

fn message(v: &Value) -> &str {
    v["error"]["message"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_prompts_get_400_while_a_normal_request_completes() {
    let fx = ServeFixture::new(&[]);
    let server = Server::start(ServeConfig {
        max_request_body_bytes: 8 << 20,
        ..fx.config()
    })
    .await
    .unwrap();
    let app = server.router();
    let normal = json!({"model": "base", "prompt": "hello there", "max_tokens": 4}).to_string();
    // 4 MB without a single space: one "word" for the pre-tokenizer.
    let word = "a".repeat(4 << 20);
    let huge = json!({"model": "base", "prompt": word, "max_tokens": 4}).to_string();
    let huge_list = json!({"model": "base", "prompt": ["hi", word], "max_tokens": 4}).to_string();
    let huge_chat = json!({"model": "base", "max_tokens": 4,
        "messages": [{"role": "user", "content": "x y ".repeat(1 << 20)}]})
    .to_string();
    let (a, b, c, d, e) = tokio::join!(
        post(&app, "/v1/completions", huge),
        post(&app, "/v1/completions", huge_list),
        post(&app, "/v1/chat/completions", huge_chat),
        post(&app, "/v1/completions", normal.clone()),
        post(&app, "/v1/completions", normal),
    );
    for (r, param) in [(&a, "prompt"), (&b, "prompt"), (&c, "messages")] {
        assert_eq!(r.0, 400, "{}", r.1);
        let m = message(&r.1);
        assert!(
            m.starts_with("This model's maximum context length is"),
            "{m}"
        );
        assert!(m.contains("Please reduce the length"), "{m}");
        // Refused by the byte bound, not after tokenising (that message gives exact counts).
        assert!(
            m.contains("requested at least") && m.contains("bytes"),
            "{m}"
        );
        assert_eq!(r.1["error"]["param"], param);
    }
    for r in [&d, &e] {
        assert_eq!(r.0, 200, "{}", r.1);
        assert_eq!(r.1["usage"]["completion_tokens"], 4);
    }

    // A body over --max-request-body-bytes: 413 with an OpenAI error, before parsing.
    let over = json!({"model": "base", "prompt": "b".repeat(9 << 20)}).to_string();
    let (status, v) = post(&app, "/v1/completions", over).await;
    assert_eq!(status, 413, "{v}");
    assert!(message(&v).contains("limit"), "{v}");
}
