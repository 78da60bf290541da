//! Helpers for the HTTP tests: a generated model with adapters to serve, servers started
//! in-process (on a real loopback socket, in a background runtime), and a minimal blocking
//! HTTP/1.1 client (Content-Length and chunked bodies, SSE parsing) so tests need no HTTP
//! client crate.
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::engine::{EngineConfig, HostModel, SequenceParams};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, Projection};
use thaw_server::serve::{ServeConfig, Server};

use crate::test_preset;

/// A generated model directory plus adapters (`adapters/` holds one per rank).
pub struct ServeFixture {
    pub dir: tempfile::TempDir,
    pub adapters: Vec<(String, PathBuf)>,
}

impl ServeFixture {
    /// The test preset (small, fast) with adapters of `ranks` on all projections.
    pub fn new(ranks: &[usize]) -> Self {
        Self::with_context(ranks, test_preset().max_position_embeddings)
    }

    /// [`Self::new`] with a context of `max_position_embeddings` tokens.
    pub fn with_context(ranks: &[usize], max_position_embeddings: usize) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = dir.path().join("model");
        let preset = gen::ModelPreset {
            max_position_embeddings,
            ..test_preset()
        };
        gen::write_model(&preset, &model, &GenModelOptions::default()).expect("gen-model");
        let mut adapters = Vec::new();
        for (i, r) in ranks.iter().enumerate() {
            let out = dir.path().join(format!("staging-{i}"));
            let written = gen::write_adapters(&GenAdaptersOptions {
                model_dir: model.clone(),
                out_dir: out,
                count: 1,
                ranks: vec![*r],
                targets: Projection::ALL.to_vec(),
                seed: 50 + i as u64,
                ..Default::default()
            })
            .expect("gen-adapters");
            let name = format!("lora-{i}-r{r}");
            let dst = dir.path().join("adapters").join(&name);
            std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
            std::fs::rename(&written[0], &dst).unwrap();
            adapters.push((name, dst));
        }
        Self { dir, adapters }
    }

    pub fn model_dir(&self) -> PathBuf {
        self.dir.path().join("model")
    }

    /// A CPU engine over this model with adapter `i` (if any) registered as `AdapterId(0)`
    /// and one sequence, `SeqId(0)`: `params` run on that adapter. The reference HTTP results
    /// are compared with.
    pub fn engine(&self, adapter: Option<usize>, params: SequenceParams) -> crate::CpuEngine {
        let model = HostModel::load(&self.model_dir()).expect("fixture model");
        let cfg = model.config.clone();
        let mut e = crate::cpu_engine(model, EngineConfig::default());
        if let Some(i) = adapter {
            let a = LoraAdapter::load(&self.adapters[i].1, &cfg).expect("fixture adapter");
            e.register_adapter(AdapterId(0), Arc::new(a))
                .expect("registering the fixture adapter");
        }
        let params = SequenceParams {
            adapter: adapter.map(|_| AdapterId(0)),
            ..params
        };
        e.add_sequence(SeqId(0), params)
            .expect("adding the reference sequence");
        e
    }

    /// A config serving this model and its adapters, on port 0.
    pub fn config(&self) -> ServeConfig {
        ServeConfig {
            model: Some(self.model_dir()),
            port: 0,
            lora_modules: self.adapters.clone(),
            served_model_name: vec!["base".into()],
            max_num_seqs: 16,
            max_num_batched_tokens: 256,
            shutdown_timeout: Duration::from_secs(5),
            // In-process servers cannot spawn `thaw lora-worker` from the test executable:
            // cold layers are assisted on the engine thread.
            lora_workers: 0,
            // The HTTP tests exercise /v1/load_lora_adapter; servers default to it off.
            allow_runtime_lora_updating: true,
            ..Default::default()
        }
    }

    /// A copy of adapter `i` under a new directory, for tests that damage it.
    pub fn copy_adapter(&self, i: usize, name: &str) -> PathBuf {
        let src = &self.adapters[i].1;
        let dst = self.dir.path().join("copies").join(name);
        std::fs::create_dir_all(&dst).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(src.join(f), dst.join(f)).unwrap();
        }
        dst
    }
}

/// Edits `adapter_config.json` of an adapter directory.
pub fn edit_adapter_config(dir: &std::path::Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("adapter_config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// A server on a real loopback socket, running in its own tokio runtime thread.
pub struct SocketServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SocketServer {
    pub fn start(cfg: ServeConfig) -> Self {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let server = Server::start(cfg).await.expect("server starts");
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                server
                    .serve(listener, async move {
                        let _ = stop_rx.await;
                    })
                    .await
                    .expect("serve");
            });
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("server started");
        Self {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for SocketServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A parsed HTTP response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    /// The `data:` payloads of an SSE body.
    pub fn sse_data(&self) -> Vec<String> {
        sse_data(&self.text())
    }
}

/// The `data:` payloads of SSE text.
pub fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim_start().to_string())
        .collect()
}

/// Opens a connection and writes one request (Connection: close).
pub fn send_request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write request");
    s
}

/// Reads the status line and headers.
pub fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).expect("header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    (status, headers)
}

/// One request, the whole response.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
    let s = send_request(addr, method, path, body);
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r);
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).expect("chunk size");
            let n = usize::from_str_radix(size.trim(), 16).expect("chunk size hex");
            if n == 0 {
                break;
            }
            let mut buf = vec![0; n + 2];
            r.read_exact(&mut buf).expect("chunk");
            body.extend_from_slice(&buf[..n]);
        }
    } else {
        r.read_to_end(&mut body).expect("body");
    }
    HttpResponse {
        status,
        headers,
        body,
    }
}

pub fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    request(addr, "GET", path, None)
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    request(addr, "POST", path, Some(&body.to_string()))
}

/// Sends one request to an in-process router (no socket) and returns its status and body.
pub async fn call_router(
    app: &axum::Router,
    method: &str,
    path: &str,
    body: Option<String>,
) -> (u16, String) {
    use tower::ServiceExt;
    let req = axum::http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(
            body.map(axum::body::Body::from)
                .unwrap_or_else(axum::body::Body::empty),
        )
        .expect("a valid request");
    let resp = app
        .clone()
        .oneshot(req)
        .await
        .expect("the router is infallible");
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("the body is read");
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// Sends every body to `/v1/completions` of an in-process router at once and returns each
/// response's first choice text, in the bodies' order; every response must be a 200.
pub async fn complete_all(app: &axum::Router, bodies: Vec<Value>) -> Vec<String> {
    let handles: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let app = app.clone();
            tokio::spawn(async move {
                call_router(&app, "POST", "/v1/completions", Some(body.to_string())).await
            })
        })
        .collect();
    let mut texts = Vec::with_capacity(handles.len());
    for h in handles {
        let (status, body) = h.await.expect("the request task ran");
        assert_eq!(status, 200, "/v1/completions: {body}");
        let v: Value = serde_json::from_str(&body).expect("a JSON body");
        texts.push(
            v["choices"][0]["text"]
                .as_str()
                .expect("a choice text")
                .to_string(),
        );
    }
    texts
}

/// The value of an unlabelled sample in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The address a spawned `thaw serve --port 0` (stdout piped) prints in its banner. Its stdout
/// keeps being drained on a thread so the server never blocks on a full pipe.
pub fn banner_address(child: &mut std::process::Child) -> SocketAddr {
    let out = child
        .stdout
        .take()
        .expect("thaw serve spawned with stdout piped");
    let mut lines = BufReader::new(out).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("thaw serve exited before its banner")
            .unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    addr
}

/// A `thaw serve` child process, killed and reaped when dropped.
pub struct ServeChild(pub std::process::Child);

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `thaw serve --port 0 --served-model-name base --model MODEL --lora-dir ADAPTERS ARGS`
/// and waits for its banner: the child (killed on drop) and its address.
pub fn spawn_serve(
    model: &std::path::Path,
    adapters: &std::path::Path,
    args: &[&str],
) -> (ServeChild, SocketAddr) {
    let mut child = std::process::Command::new(thaw_binary())
        .args(["serve", "--port", "0", "--served-model-name", "base"])
        .arg("--model")
        .arg(model)
        .arg("--lora-dir")
        .arg(adapters)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn thaw serve");
    let addr = banner_address(&mut child);
    (ServeChild(child), addr)
}

/// The `thaw` binary next to this test executable (`target/<profile>/thaw`), built with
/// `cargo build -p thaw-server --bin thaw` first if it is not there yet. `.ci/run` builds it
/// before the tests, and `cargo test --workspace` builds it as part of thaw-server.
pub fn thaw_binary() -> PathBuf {
    workspace_binary("thaw-server", "thaw")
}

/// The binary `name` of workspace package `package` next to this test executable
/// (`target/<profile>/<name>`), built with `cargo build -p <package> --bin <name>` first if it
/// is not there yet (`cargo test --workspace` builds every package's binaries).
pub fn workspace_binary(package: &str, name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps");
    let bin = profile_dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if !bin.exists() {
        let mut cmd = std::process::Command::new(env!("CARGO"));
        cmd.args(["build", "-p", package, "--bin", name]);
        if profile_dir.ends_with("release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "building the {name} binary failed");
    }
    assert!(
        bin.exists(),
        "{} not found after building it",
        bin.display()
    );
    bin
}
