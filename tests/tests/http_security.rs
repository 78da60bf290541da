//! Issue 13's security model, in-process: API keys on every /v1 route, runtime adapter
//! loading off by default and confined to --lora-root, and a hostile chat template that ends
//! in an error while the server keeps serving.
use axum::body::Body;
use axum::http::Request;
use axum::Router;
use serde_json::{json, Value};
use thaw_server::serve::{ServeConfig, Server};
use thaw_tests::http::ServeFixture;
use tower::ServiceExt;

struct Resp {
    status: u16,
    headers: axum::http::HeaderMap,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The OpenAI error object, after checking the status.
    fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "body: {}", self.body);
        let e = self.json()["error"].clone();
        for k in ["message", "type", "param", "code"] {
            assert!(e.get(k).is_some(), "error body lacks `{k}`: {}", self.body);
        }
        e
    }

    fn message(&self) -> String {
        self.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

async fn call(
    app: &Router,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> Resp {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let req = req
        .body(
            body.map(|b| Body::from(b.to_string()))
                .unwrap_or_else(Body::empty),
        )
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    Resp {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_every_v1_route() {
    let fx = ServeFixture::new(&[8]);
    let server = Server::start(ServeConfig {
        api_keys: vec!["sk-first".into(), "sk-second".into()],
        ..fx.config()
    })
    .await
    .unwrap();
    let app = server.router();
    let completion = json!({"model": "base", "prompt": "hi", "max_tokens": 2});
    let chat =
        json!({"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let load = json!({"lora_name": "x", "lora_path": fx.adapters[0].1});
    let routes: [(&str, &str, Option<Value>); 6] = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", Some(completion.clone())),
        ("POST", "/v1/chat/completions", Some(chat)),
        ("POST", "/v1/load_lora_adapter", Some(load)),
        (
            "POST",
            "/v1/unload_lora_adapter",
            Some(json!({"lora_name": "x"})),
        ),
        ("GET", "/v1/no-such-route", None),
    ];
    for (method, path, body) in &routes {
        for key in [
            None,
            Some("sk-firs"),
            Some("sk-first "),
            Some("SK-FIRST"),
            Some(""),
        ] {
            let r = call(&app, method, path, key, body.clone()).await;
            let e = r.error(401);
            assert_eq!(e["code"], "invalid_api_key", "{path} {key:?}");
            assert!(r.message().contains("--api-key"), "{}", r.body);
            assert_eq!(r.headers["www-authenticate"], "Bearer");
        }
    }
    for key in ["sk-first", "sk-second"] {
        let r = call(&app, "GET", "/v1/models", Some(key), None).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let r = call(
            &app,
            "POST",
            "/v1/completions",
            Some(key),
            Some(completion.clone()),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // Probes and Prometheus need no key.
    assert_eq!(call(&app, "GET", "/health", None, None).await.status, 200);
    let m = call(&app, "GET", "/metrics", None, None).await;
    assert_eq!(m.status, 200);
    assert!(
        m.body.contains("status=\"401\""),
        "401s are counted: {}",
        m.body
    );
    // The InferencePool's endpoint picker scrapes the vLLM series without a key.
    for series in ["vllm:num_requests_waiting", "vllm:lora_requests_info"] {
        assert!(m.body.contains(series), "{series} on /metrics: {}", m.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_adapter_updates_are_off_by_default() {
    let fx = ServeFixture::new(&[8]);
    let server = Server::start(ServeConfig {
        allow_runtime_lora_updating: false,
        ..fx.config()
    })
    .await
    .unwrap();
    let app = server.router();
    let copy = fx.copy_adapter(0, "fresh");
    for (path, body) in [
        (
            "/v1/load_lora_adapter",
            json!({"lora_name": "fresh", "lora_path": copy}),
        ),
        (
            "/v1/unload_lora_adapter",
            json!({"lora_name": fx.adapters[0].0}),
        ),
        ("/v1/load_lora_adapter", json!({"lora_path": "/etc/passwd"})),
    ] {
        let r = call(&app, "POST", path, None, Some(body)).await;
        r.error(404);
        assert!(
            r.message().contains("--allow-runtime-lora-updating"),
            "{}",
            r.body
        );
    }
    // The start-up adapter is served, and still there.
    let r = call(
        &app,
        "POST",
        "/v1/completions",
        None,
        Some(json!({"model": fx.adapters[0].0, "prompt": "hi", "max_tokens": 2})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_root_confines_runtime_loads() {
    let fx = ServeFixture::new(&[8]);
    let root = fx.dir.path().join("copies");
    let inside = fx.copy_adapter(0, "inside");
    std::os::unix::fs::symlink(&fx.adapters[0].1, root.join("link-out")).unwrap();
    std::os::unix::fs::symlink("/nonexistent/thaw", root.join("dangling")).unwrap();
    // An adapter directory inside the root whose weights file links outside it.
    let file_link = fx.copy_adapter(0, "file-link");
    std::fs::remove_file(file_link.join("adapter_model.safetensors")).unwrap();
    std::os::unix::fs::symlink(
        fx.adapters[0].1.join("adapter_model.safetensors"),
        file_link.join("adapter_model.safetensors"),
    )
    .unwrap();
    let server = Server::start(ServeConfig {
        allow_runtime_lora_updating: true,
        lora_root: Some(root.clone()),
        ..fx.config()
    })
    .await
    .unwrap();
    let app = server.router();
    let load = |name: &str, path: &str| {
        call(
            &app,
            "POST",
            "/v1/load_lora_adapter",
            None,
            Some(json!({"lora_name": name, "lora_path": path})),
        )
    };
    let outside_adapter = fx.adapters[0].1.display().to_string();
    let dotdot = format!("{}/../../{}", inside.display(), "model");
    let mut messages = std::collections::BTreeSet::new();
    for p in [
        "/etc/passwd",
        "/etc",
        "/root",
        "/proc/self",
        "/definitely/not/here",
        "/etc/definitely-not-here",
        outside_adapter.as_str(),
        dotdot.as_str(),
        "../model",
        "link-out",
        "dangling",
        "dangling/deeper",
        "file-link",
    ] {
        let r = load("x", p).await;
        let e = r.error(403);
        assert_eq!(e["code"], "forbidden", "{p}");
        messages.insert(r.message());
    }
    assert_eq!(
        messages.len(),
        1,
        "one message for every path: {messages:?}"
    );
    let msg = messages.into_iter().next().unwrap();
    assert!(msg.contains("--lora-root"), "{msg}");

    // Inside the root: loads by absolute or relative path; a missing one is 404 without the
    // root's absolute location.
    let r = load("in", inside.to_str().unwrap()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = load("in2", "inside").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = load("gone", "not-here").await;
    r.error(404);
    assert!(r.message().contains("<lora-root>/not-here"), "{}", r.body);
    assert!(
        !r.message().contains(&*fx.dir.path().to_string_lossy()),
        "{}",
        r.body
    );
    // A broken adapter inside the root: the error names it relative to the root.
    std::fs::write(inside.join("adapter_config.json"), "{ r: 8,").unwrap();
    let r = load("broken", "inside").await;
    r.error(400);
    assert!(r.message().contains("<lora-root>/inside"), "{}", r.body);
    assert!(
        !r.message().contains(&*fx.dir.path().to_string_lossy()),
        "{}",
        r.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_chat_template_fails_and_the_server_keeps_serving() {
    let fx = ServeFixture::new(&[]);
    let cfg_path = fx.model_dir().join("tokenizer_config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["chat_template"] = json!(
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    );
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let server = Server::start(fx.config()).await.unwrap();
    let app = server.router();
    let chat =
        json!({"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let completion = json!({"model": "base", "prompt": "hi", "max_tokens": 2});
    for _ in 0..3 {
        let r = call(
            &app,
            "POST",
            "/v1/chat/completions",
            None,
            Some(chat.clone()),
        )
        .await;
        let e = r.error(400);
        assert_eq!(e["param"], "messages");
        assert!(r.message().contains("instruction budget"), "{}", r.body);
        let r = call(
            &app,
            "POST",
            "/v1/completions",
            None,
            Some(completion.clone()),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(call(&app, "GET", "/health", None, None).await.status, 200);
}
