//! The HTTP application: shared state, the router and the request-counting / shutdown
//! middleware.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use thaw_runtime::model::Tokenizer;

use super::auth::{require_api_key, ApiKeys};
use super::error::BodyLimit;
use super::lora_access::LoraAccess;
use super::{routes_admin, routes_chat, routes_completions};
use crate::chat::ChatTemplate;
use crate::engine_loop::EngineHandle;
use crate::error::ServerError;
use crate::metrics::Metrics;
use crate::registry::Registry;
use crate::scheduler::SchedConfig;

/// Everything a handler needs.
pub struct AppState {
    pub engine: EngineHandle,
    pub registry: Arc<Registry>,
    pub tokenizer: Arc<Tokenizer>,
    /// The most prompt bytes one token covers (`prompt_guard`); `None` when unbounded.
    pub max_token_bytes: Option<usize>,
    pub chat: Option<ChatTemplate>,
    pub metrics: Arc<Metrics>,
    /// Set on SIGTERM/SIGINT: new requests get 503.
    pub shutting_down: AtomicBool,
    /// Names the base model answers to (`--served-model-name`, else the model path).
    pub served_names: Vec<String>,
    /// The model directory, shown as `root` in /v1/models.
    pub model_root: String,
    pub max_model_len: usize,
    /// The model's vocabulary (token ids must be below it).
    pub vocab_size: usize,
    pub sched: SchedConfig,
    pub max_body_bytes: usize,
    /// Unix seconds of start-up.
    pub created: u64,
    /// `--api-key`: keys every /v1 request must bear.
    pub api_keys: ApiKeys,
    /// `--allow-runtime-lora-updating`, `--lora-root`.
    pub lora_access: LoraAccess,
}

impl AppState {
    pub fn base_name(&self) -> &str {
        &self.served_names[0]
    }

    /// Tokenises prompt text off the async runtime, refusing by byte length first text that
    /// cannot fit the context.
    pub async fn encode(
        &self,
        text: String,
        add_special_tokens: bool,
        param: &'static str,
    ) -> Result<Vec<u32>, ServerError> {
        let limits = (self.max_model_len, self.max_token_bytes);
        super::prompt_guard::encode(&self.tokenizer, text, add_special_tokens, limits, param).await
    }
}

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.max_body_bytes;
    let (load, unload) = if state.lora_access.enabled() {
        (
            post(routes_admin::load_lora),
            post(routes_admin::unload_lora),
        )
    } else {
        (post(lora_updates_off), post(lora_updates_off))
    };
    Router::new()
        .route("/v1/completions", post(routes_completions::completions))
        .route("/v1/chat/completions", post(routes_chat::chat_completions))
        .route("/v1/models", get(routes_admin::models))
        .route("/v1/load_lora_adapter", load)
        .route("/v1/unload_lora_adapter", unload)
        .route("/health", get(routes_admin::health))
        .route("/metrics", get(routes_admin::metrics))
        .fallback(fallback)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), track))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn lora_updates_off() -> ServerError {
    LoraAccess::disabled_error()
}

async fn fallback(req: Request) -> ServerError {
    ServerError::NotFound(format!(
        "no route for {} {}; see /v1/models, /v1/completions, /v1/chat/completions",
        req.method(),
        req.uri().path()
    ))
}

/// Counts requests by endpoint and status, and turns new work away while shutting down.
async fn track(State(state): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    req.extensions_mut().insert(BodyLimit(state.max_body_bytes));
    let resp = if state.shutting_down.load(Ordering::SeqCst) && endpoint != "/metrics" {
        ServerError::ShuttingDown.into_response()
    } else {
        next.run(req).await
    };
    state
        .metrics
        .count_request(&endpoint, resp.status().as_u16());
    resp
}
