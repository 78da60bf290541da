//! `POST /v1/chat/completions`.
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::future::join_all;
use serde_json::{json, Value};

use super::app::AppState;
use super::error::OpenAiJson;
use super::generation::{check_length, resolve_model, submit, Collected, Delta, Finish, TokenInfo};
use super::openai_types::{ChatRequest, MessageContent, Usage};
use super::params::{logprobs_count, validate};
use super::routes_completions::{response_id, unix_now};
use super::sse::stream_choices;
use crate::chat::TemplateMessage;
use crate::error::ServerError;

fn chat_logprobs(tokens: &[TokenInfo]) -> Value {
    let entry = |s: &str, lp: f32| json!({"token": s, "logprob": lp, "bytes": s.as_bytes()});
    json!({
        "content": tokens.iter().map(|t| {
            let mut e = entry(&t.text, t.logprob);
            e["top_logprobs"] = Value::Array(t.top.iter().map(|(s, lp)| entry(s, *lp)).collect());
            e
        }).collect::<Vec<_>>()
    })
}

fn messages(req: &ChatRequest) -> Result<Vec<TemplateMessage>, ServerError> {
    if req.messages.is_empty() {
        return Err(ServerError::invalid("messages", "`messages` is empty"));
    }
    req.messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(s)) => s.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            (kind, _) => {
                                return Err(ServerError::invalid(
                                    &format!("messages[{i}].content"),
                                    format!(
                                    "content parts of type `{kind}` are not supported; send text"
                                ),
                                ))
                            }
                        }
                    }
                    s
                }
            };
            Ok(TemplateMessage {
                role: m.role.clone(),
                content,
            })
        })
        .collect()
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<ChatRequest>,
) -> Result<Response, ServerError> {
    let top = logprobs_count("top_logprobs", req.top_logprobs)?;
    let want_logprobs = req.logprobs.unwrap_or(false);
    if top.is_some_and(|n| n > 0) && !want_logprobs {
        return Err(ServerError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs` set to true",
        ));
    }
    let mut fields = req.sampling.clone();
    if req.max_completion_tokens.is_some() {
        fields.max_tokens = req.max_completion_tokens;
    }
    let p = validate(&fields, want_logprobs.then_some(top.unwrap_or(0)))?;
    if req.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ServerError::invalid(
            "tools",
            "tool calling is not supported by this server",
        ));
    }
    let template = state.chat.as_ref().ok_or_else(|| {
        ServerError::BadRequest(
            "the model has no chat template (tokenizer_config.json `chat_template`); use /v1/completions"
                .into(),
        )
    })?;
    let text = template.render(&messages(&req)?, req.add_generation_prompt.unwrap_or(true))?;
    let prompt = state.encode(text, false, "messages").await?;
    let max_new = check_length(&state, prompt.len(), p.max_tokens, "messages")?;
    let prompt_tokens = prompt.len();
    let lease = resolve_model(&state, &req.model).await?;
    let choices = submit(&state, vec![(prompt, max_new)], lease, &p)?;
    let id = response_id("chatcmpl");
    let created = unix_now();
    let model = req.model.clone();

    if p.stream {
        let first = choices
            .iter()
            .map(|c| {
                json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": null, "finish_reason": null}],
                })
            })
            .collect();
        let (id2, model2) = (id.clone(), model.clone());
        let chunk = move |index: usize, d: &Delta| {
            let delta = if d.text.is_empty() && d.finish.is_some() {
                json!({})
            } else {
                json!({"content": d.text})
            };
            json!({
                "id": id2, "object": "chat.completion.chunk", "created": created, "model": model2,
                "choices": [{"index": index, "delta": delta,
                             "logprobs": p.logprobs.then(|| chat_logprobs(&d.tokens)),
                             "finish_reason": d.finish.as_ref().map(Finish::as_str)}],
            })
        };
        let usage = p
            .include_usage
            .then_some(move |completion: usize, cached: usize| {
                json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": Usage::new(prompt_tokens, completion).cached(cached),
                })
            });
        return Ok(stream_choices(choices, first, chunk, usage).into_response());
    }

    let mut done: Vec<Collected> = join_all(choices.into_iter().map(|c| c.collect())).await;
    done.sort_by_key(|c| c.index);
    if let Some(msg) = done.iter().find_map(|c| match &c.finish {
        Some(Finish::Abort(m)) => Some(m.clone()),
        _ => None,
    }) {
        return Err(ServerError::Aborted(msg));
    }
    let completion_tokens: usize = done.iter().map(|c| c.completion_tokens).sum();
    let cached_tokens: usize = done.iter().map(|c| c.cached_tokens).sum();
    let out: Vec<Value> = done
        .iter()
        .map(|c| {
            json!({
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": p.logprobs.then(|| chat_logprobs(&c.tokens)),
                "finish_reason": c.finish.as_ref().map(Finish::as_str),
            })
        })
        .collect();
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": Usage::new(prompt_tokens, completion_tokens).cached(cached_tokens),
    }))
    .into_response())
}
