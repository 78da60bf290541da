//! The OpenAI-compatible HTTP API (axum): completions, chat, models, vLLM's adapter
//! load/unload, health and Prometheus metrics.

mod app;
mod auth;
mod error;
mod generation;
mod lora_access;
mod openai_types;
mod params;
mod prompt_guard;
mod routes_admin;
mod routes_chat;
mod routes_completions;
mod sse;

pub use app::{router, AppState};
pub use auth::ApiKeys;
pub use error::{error_body, OpenAiJson};
pub use generation::{ChoiceStream, Delta, Finish};
pub use lora_access::LoraAccess;
pub use openai_types::{CompletionRequest, Prompt, Stop, Usage};
pub use params::{GenParams, MAX_LOGPROBS, MAX_N};
pub use prompt_guard::max_token_bytes;
pub use routes_completions::unix_now;
