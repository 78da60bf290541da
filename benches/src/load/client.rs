//! A small async HTTP/1.1 client for OpenAI-compatible servers (plain `http://`; benchmarks
//! run on loopback or a private network): `GET /v1/models`, `GET /health`, and streaming
//! `POST /v1/completions` and `POST /v1/chat/completions` timed at the client.
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use super::workload::{AdapterInfo, ServerInfo};

/// What the client saw of one streamed completion.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timing {
    /// First chunk carrying generated text or tokens.
    pub ttft: Option<Duration>,
    /// Whole request, until `[DONE]` or the end of the body.
    pub e2e: Option<Duration>,
    /// Completion tokens from the usage chunk (else counted chunks).
    pub output_tokens: usize,
    /// Prompt tokens from the usage chunk.
    pub prompt_tokens: Option<usize>,
    /// `usage.prompt_tokens_details.cached_tokens` (OpenAI's field; servers with prefix
    /// caching report it), None when the server does not.
    pub cached_tokens: Option<usize>,
    /// The generated text (completions' `text`, chat's `delta.content`), concatenated.
    pub text: String,
    pub error: Option<String>,
}

/// Whether `e` is a connection the server closed before it answered (a kept-alive one it had
/// finished with): the request was not served, so sending it again is safe.
fn closed_unanswered(e: &hyper_util::client::legacy::Error) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<hyper::Error>())
        .is_some_and(|h| h.is_incomplete_message() || h.is_canceled())
}

/// Client for one server base URL such as `http://127.0.0.1:8000`.
#[derive(Clone)]
pub struct OpenAiClient {
    base: String,
    http: Client<HttpConnector, Full<Bytes>>,
    api_key: Option<String>,
}

impl OpenAiClient {
    pub fn new(base_url: &str, api_key: Option<String>) -> anyhow::Result<Self> {
        let base = base_url.trim_end_matches('/').to_string();
        let base = base.strip_suffix("/v1").unwrap_or(&base).to_string();
        anyhow::ensure!(
            base.starts_with("http://"),
            "--url {base_url}: only plain http:// endpoints are supported"
        );
        let _: Uri = base.parse().with_context(|| format!("--url {base_url}"))?;
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        // Idle connections go before a server's keep-alive timeout closes them (llama.cpp's
        // llama-server: 5 s), so a request is never sent on a connection the server has closed.
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(2))
            .build(conn);
        Ok(Self {
            base,
            http,
            api_key,
        })
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// The same server over a pool of its own connections (a `/metrics` poller must not use
    /// up the per-connection request count some servers keep, llama-server's 100, on the
    /// connections requests use).
    pub fn fresh(&self) -> anyhow::Result<Self> {
        Self::new(&self.base, self.api_key.clone())
    }

    fn request(&self, method: Method, path: &str, body: Option<&Value>) -> Request<Full<Bytes>> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        if let Some(k) = &self.api_key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        let body = match body {
            Some(v) => {
                b = b.header("content-type", "application/json");
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        b.body(body)
            .expect("a request built from a parsed URI is valid")
    }

    async fn get(&self, path: &str) -> anyhow::Result<(StatusCode, Bytes)> {
        let resp = self
            .http
            .request(self.request(Method::GET, path, None))
            .await
            .with_context(|| format!("GET {}{path}", self.base))?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, body))
    }

    /// The body of `GET path` as text (e.g. `/metrics`).
    pub async fn get_text(&self, path: &str) -> anyhow::Result<String> {
        let (status, body) = self.get(path).await?;
        anyhow::ensure!(status.is_success(), "GET {path} answered {status}");
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// True when `GET /health` answers 200.
    pub async fn healthy(&self) -> bool {
        matches!(self.get("/health").await, Ok((s, _)) if s.is_success())
    }

    /// The base model and adapters from `GET /v1/models`. An entry with a `parent` is an
    /// adapter (vLLM and Thaw); its rank is Thaw's `rank` field when present.
    pub async fn server_info(&self) -> anyhow::Result<ServerInfo> {
        let (status, body) = self.get("/v1/models").await?;
        anyhow::ensure!(
            status.is_success(),
            "GET /v1/models answered {status}: {}",
            String::from_utf8_lossy(&body)
        );
        let v: Value = serde_json::from_slice(&body).context("GET /v1/models: not JSON")?;
        parse_models(&v)
    }

    /// One streamed completion of `prompt` token ids, forced to `max_tokens` (ignore_eos).
    pub async fn stream_completion(
        &self,
        model: &str,
        prompt: &[u32],
        max_tokens: usize,
        timeout: Duration,
    ) -> Timing {
        let body = json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        self.stream_post("/v1/completions", &body, None, timeout)
            .await
    }

    /// One streamed chat completion of `messages` (`{"role", "content"}` objects; the server
    /// applies its chat template). `max_tokens` None sends none, as chat clients do (the server
    /// then allows the rest of the context); `stop_after` Some(n) ends the stream at the
    /// client after n generated tokens (counted from the chunks' logprobs, which it asks for):
    /// an end of generation the server could not foresee, like an EOS.
    pub async fn stream_chat(
        &self,
        model: &str,
        messages: &[Value],
        max_tokens: Option<usize>,
        stop_after: Option<usize>,
        timeout: Duration,
    ) -> Timing {
        let mut body = json!({
            "model": model,
            "messages": messages,
            "ignore_eos": true,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(m) = max_tokens {
            body["max_tokens"] = json!(m);
        }
        if stop_after.is_some() {
            body["logprobs"] = json!(true);
        }
        self.stream_post("/v1/chat/completions", &body, stop_after, timeout)
            .await
    }

    async fn stream_post(
        &self,
        path: &str,
        body: &Value,
        stop_after: Option<usize>,
        timeout: Duration,
    ) -> Timing {
        let start = Instant::now();
        let make = || self.request(Method::POST, path, Some(body));
        match tokio::time::timeout(timeout, self.stream(make, start, stop_after)).await {
            Ok(t) => t,
            Err(_) => Timing {
                error: Some(format!("timed out after {:.0} s", timeout.as_secs_f64())),
                ..Default::default()
            },
        }
    }

    /// Sends `make()`'s request and reads its stream. A request the server never answered
    /// because it closed a kept-alive connection as the request went out (llama-server does
    /// after a streamed answer) is sent once more on a new connection.
    async fn stream(
        &self,
        make: impl Fn() -> Request<Full<Bytes>>,
        start: Instant,
        stop_after: Option<usize>,
    ) -> Timing {
        let mut t = Timing::default();
        let resp = match self.http.request(make()).await {
            Ok(r) => Ok(r),
            Err(e) if closed_unanswered(&e) => self.http.request(make()).await,
            Err(e) => Err(e),
        };
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                t.error = Some(format!("connection: {e}"));
                return t;
            }
        };
        let status = resp.status();
        let mut body = resp.into_body();
        if !status.is_success() {
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            t.error = Some(format!("HTTP {status}: {}", error_message(&bytes)));
            return t;
        }
        let mut sse = SseParser::default();
        let mut chunks = 0usize;
        let mut tokens = 0usize;
        let mut done = false;
        while let Some(frame) = body.frame().await {
            let frame = match frame {
                Ok(f) => f,
                Err(e) => {
                    t.error = Some(format!("stream broke: {e}"));
                    return t;
                }
            };
            let Some(data) = frame.data_ref() else {
                continue;
            };
            for event in sse.push(data) {
                if event == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = match serde_json::from_str(&event) {
                    Ok(v) => v,
                    Err(_) => {
                        t.error = Some(format!("bad SSE data: {event:.200}"));
                        return t;
                    }
                };
                if let Some(e) = v.get("error") {
                    t.error = Some(format!(
                        "error in stream: {}",
                        e.get("message").and_then(Value::as_str).unwrap_or("?")
                    ));
                    return t;
                }
                let choices = v["choices"].as_array().map(Vec::as_slice).unwrap_or(&[]);
                let has_tokens = choices.iter().any(|c| {
                    !chunk_text(c).is_empty()
                        || c["finish_reason"].is_string()
                        || chunk_tokens(c) > 0
                });
                if has_tokens {
                    chunks += 1;
                    if t.ttft.is_none() {
                        t.ttft = Some(start.elapsed());
                    }
                }
                for c in choices {
                    t.text.push_str(chunk_text(c));
                    tokens += chunk_tokens(c);
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    if let Some(c) = u["completion_tokens"].as_u64() {
                        t.output_tokens = c as usize;
                    }
                    t.prompt_tokens = u["prompt_tokens"].as_u64().map(|p| p as usize);
                    t.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .map(|c| c as usize);
                }
                if let Some(n) = stop_after.filter(|&n| tokens >= n) {
                    // The client has its n tokens (a chunk may carry more; it takes the
                    // first n): dropping the body closes the connection, which cancels the
                    // request on the server.
                    t.e2e = Some(start.elapsed());
                    t.output_tokens = n;
                    return t;
                }
            }
        }
        t.e2e = Some(start.elapsed());
        if t.output_tokens == 0 {
            t.output_tokens = chunks;
        }
        if !done {
            t.error = Some("the stream ended without [DONE]".into());
        } else if t.ttft.is_none() {
            t.error = Some("no tokens were streamed".into());
        }
        t
    }
}

/// The text a streamed choice carries: completions' `text` or chat's `delta.content`.
fn chunk_text(choice: &Value) -> &str {
    choice["text"]
        .as_str()
        .or_else(|| choice["delta"]["content"].as_str())
        .unwrap_or("")
}

/// Tokens a streamed choice carries, from its logprobs (completions' `tokens`, chat's
/// `content` entries): 0 without logprobs.
fn chunk_tokens(choice: &Value) -> usize {
    let lp = &choice["logprobs"];
    lp["tokens"]
        .as_array()
        .or_else(|| lp["content"].as_array())
        .map_or(0, Vec::len)
}

/// The OpenAI error body's message, or the body itself.
fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(String::from))
        .unwrap_or_else(|| String::from_utf8_lossy(body).chars().take(200).collect())
}

/// Reads `GET /v1/models`.
pub fn parse_models(v: &Value) -> anyhow::Result<ServerInfo> {
    let data = v["data"]
        .as_array()
        .context("GET /v1/models: no `data` list")?;
    let mut base = None;
    let mut base_root = None;
    let mut max_model_len = None;
    let mut adapters = Vec::new();
    for m in data {
        let id = m["id"]
            .as_str()
            .context("GET /v1/models: an entry has no id")?;
        let len = m["max_model_len"].as_u64().map(|l| l as usize);
        if m["parent"].is_string() {
            adapters.push(AdapterInfo {
                name: id.to_string(),
                rank: m["rank"].as_u64().map(|r| r as usize),
            });
        } else if base.is_none() {
            base = Some(id.to_string());
            base_root = m["root"].as_str().map(String::from);
            max_model_len = len;
        }
        if max_model_len.is_none() {
            max_model_len = len;
        }
    }
    Ok(ServerInfo {
        base_model: base.context("GET /v1/models lists no base model")?,
        base_root,
        max_model_len,
        adapters,
    })
}

/// Splits a byte stream into SSE `data:` payloads (events end with a blank line).
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let text = &self.buf;
            let end = text
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| (i, 2))
                .or_else(|| {
                    text.windows(4)
                        .position(|w| w == b"\r\n\r\n")
                        .map(|i| (i, 4))
                });
            let Some((i, sep)) = end else { break };
            let event: Vec<u8> = self.buf.drain(..i + sep).collect();
            let event = String::from_utf8_lossy(&event[..i]);
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_frames() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        let ev = p.push(b":1}\n\ndata: [DONE]\n\n: comment\n\n");
        assert_eq!(ev, vec!["{\"a\":1}".to_string(), "[DONE]".to_string()]);
        assert_eq!(p.push(b"data: x\r\n\r\n"), vec!["x".to_string()]);
    }

    #[test]
    fn chunks_give_text_and_tokens_of_both_formats() {
        let comp = json!({"text": "ab", "logprobs": {"tokens": ["a", "b"]}});
        assert_eq!((chunk_text(&comp), chunk_tokens(&comp)), ("ab", 2));
        let chat = json!({"delta": {"content": "x"}, "logprobs": {"content": [{"token": "x"}]}});
        assert_eq!((chunk_text(&chat), chunk_tokens(&chat)), ("x", 1));
        let role = json!({"delta": {"role": "assistant", "content": ""}, "logprobs": null});
        assert_eq!((chunk_text(&role), chunk_tokens(&role)), ("", 0));
    }

    #[test]
    fn models_json_gives_base_and_ranked_adapters() {
        let v = json!({"object": "list", "data": [
            {"id": "thaw-demo", "parent": null, "max_model_len": 512},
            {"id": "lora-a", "parent": "thaw-demo", "rank": 8},
            {"id": "lora-b", "parent": "thaw-demo"},
        ]});
        let s = parse_models(&v).unwrap();
        assert_eq!(s.base_model, "thaw-demo");
        assert_eq!(s.max_model_len, Some(512));
        assert_eq!(s.adapters[0].rank, Some(8));
        assert_eq!(s.adapters[1].rank, None);
        assert!(parse_models(&json!({"data": []})).is_err());
    }
}
