//! `POST /v1/completions`.
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::future::join_all;
use serde_json::{json, Map, Value};

use super::app::AppState;
use super::error::OpenAiJson;
use super::generation::{check_length, resolve_model, submit, Collected, Delta, Finish, TokenInfo};
use super::openai_types::{CompletionRequest, Prompt, Usage};
use super::params::{logprobs_count, validate};
use super::sse::stream_choices;
use crate::error::ServerError;

/// A fresh response id with `prefix`.
pub fn response_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}-{:x}{:06x}",
        (t as u64) & 0xffff_ffff_ffff,
        n & 0xff_ffff
    )
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The keys of a completions-format logprobs object; each holds one entry per token.
const LOGPROBS_KEYS: [&str; 4] = ["tokens", "token_logprobs", "top_logprobs", "text_offset"];

/// A token's alternatives as OpenAI's `{text: logprob}` map (the likelier of two tokens that
/// decode to the same text wins).
fn top_json(t: &TokenInfo) -> Value {
    let mut m = Map::new();
    for (s, lp) in &t.top {
        m.entry(s.clone()).or_insert(json!(lp));
    }
    Value::Object(m)
}

/// OpenAI completions-format logprobs for `tokens`, offsets starting at `offset`.
fn logprobs_json(tokens: &[TokenInfo], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(offset);
        offset += t.text.len();
    }
    json!({
        "tokens": tokens.iter().map(|t| t.text.clone()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(top_json).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

/// Logprobs of the echoed prompt, offsets from 0: `null` for the first token (nothing
/// predicts it), the engine's scores of the others (`scored`, one per prompt token after
/// the first).
fn echo_logprobs(state: &AppState, prompt: &[u32], scored: &[TokenInfo]) -> Value {
    let mut off = 0;
    let (mut toks, mut lps, mut tops, mut offs) = (vec![], vec![], vec![], vec![]);
    for (i, &id) in prompt.iter().enumerate() {
        let s = super::generation::token_text(&state.tokenizer, id);
        offs.push(off);
        off += s.len();
        toks.push(json!(s));
        let score = i.checked_sub(1).and_then(|j| scored.get(j));
        lps.push(score.map_or(Value::Null, |t| json!(t.logprob)));
        tops.push(score.map_or(Value::Null, top_json));
    }
    json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
}

/// `head` followed by `tail`, key by key.
fn concat_logprobs(mut head: Value, tail: Value) -> Value {
    for key in LOGPROBS_KEYS {
        if let (Some(h), Some(t)) = (head[key].as_array_mut(), tail[key].as_array()) {
            h.extend(t.iter().cloned());
        }
    }
    head
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    OpenAiJson(req): OpenAiJson<CompletionRequest>,
) -> Result<Response, ServerError> {
    let logprobs = logprobs_count("logprobs", req.logprobs)?;
    let mut p = validate(&req.sampling, logprobs)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ServerError::invalid(
            "suffix",
            "`suffix` is not supported by this server",
        ));
    }
    if req.best_of.is_some_and(|b| b as usize != p.n) {
        return Err(ServerError::invalid(
            "best_of",
            "`best_of` other than `n` is not supported by this server",
        ));
    }
    let echo = req.echo.unwrap_or(false);
    // Echoed logprobs score the prompt; nothing else pays for it.
    p.prompt_logprobs = if echo { logprobs } else { None };
    let texts: Vec<Option<String>>;
    let prompts: Vec<Vec<u32>> = match &req.prompt {
        Prompt::Text(s) => {
            texts = vec![Some(s.clone())];
            vec![state.encode(s.clone(), true, "prompt").await?]
        }
        Prompt::Texts(v) => {
            texts = v.iter().cloned().map(Some).collect();
            let mut out = Vec::with_capacity(v.len());
            for s in v {
                out.push(state.encode(s.clone(), true, "prompt").await?);
            }
            out
        }
        Prompt::Tokens(t) => {
            texts = vec![None];
            vec![t.clone()]
        }
        Prompt::TokenLists(v) => {
            texts = vec![None; v.len()];
            v.clone()
        }
    };
    if prompts.is_empty() {
        return Err(ServerError::invalid("prompt", "`prompt` is an empty list"));
    }
    let vocab = state.vocab_size;
    for pr in &prompts {
        if let Some(bad) = pr.iter().find(|&&t| t as usize >= vocab) {
            return Err(ServerError::invalid(
                "prompt",
                format!("token id {bad} is outside the model's vocabulary of {vocab}"),
            ));
        }
    }
    let mut sized = Vec::with_capacity(prompts.len());
    for pr in prompts {
        let m = check_length(&state, pr.len(), Some(p.max_tokens.unwrap_or(16)), "prompt")?;
        sized.push((pr, m));
    }
    let prompt_tokens: usize = sized.iter().map(|(p, _)| p.len()).sum();
    let lease = resolve_model(&state, &req.model).await?;
    let choices = submit(&state, sized, lease, &p)?;
    let id = response_id("cmpl");
    let created = unix_now();
    let model = req.model.clone();
    let n = p.n;
    let echo_text = move |state: &AppState, index: usize, prompt: &[u32]| -> String {
        match &texts[index / n] {
            Some(t) => t.clone(),
            None => state.tokenizer.decode(prompt, false).unwrap_or_default(),
        }
    };

    if p.stream {
        let mut first = Vec::new();
        // With logprobs the echo waits for the prompt's scores and rides on the choice's first
        // chunk (as vLLM streams it); without, it goes out at once.
        let mut echoes: Vec<Option<(String, Arc<Vec<u32>>)>> = vec![None; choices.len()];
        if echo && p.logprobs {
            for c in &choices {
                echoes[c.index] = Some((echo_text(&state, c.index, &c.prompt), c.prompt.clone()));
            }
        } else if echo {
            for c in &choices {
                first.push(json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": c.index, "text": echo_text(&state, c.index, &c.prompt),
                                 "logprobs": null, "finish_reason": null}],
                }));
            }
        }
        let (id2, model2, state2) = (id.clone(), model.clone(), state.clone());
        let mut offsets = vec![0usize; choices.len()];
        let chunk = move |index: usize, d: &Delta| {
            let echoed = echoes[index].take();
            if let Some((text, _)) = &echoed {
                offsets[index] = text.len();
            }
            let lp = p.logprobs.then(|| {
                let v = logprobs_json(&d.tokens, offsets[index]);
                offsets[index] += d.tokens.iter().map(|t| t.text.len()).sum::<usize>();
                match &echoed {
                    Some((_, prompt)) => {
                        concat_logprobs(echo_logprobs(&state2, prompt, &d.prompt), v)
                    }
                    None => v,
                }
            });
            let text = match echoed {
                Some((prefix, _)) => format!("{prefix}{}", d.text),
                None => d.text.clone(),
            };
            json!({
                "id": id2, "object": "text_completion", "created": created, "model": model2,
                "choices": [{"index": index, "text": text, "logprobs": lp,
                             "finish_reason": d.finish.as_ref().map(Finish::as_str)}],
            })
        };
        let usage = p
            .include_usage
            .then_some(move |completion: usize, cached: usize| {
                json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [], "usage": Usage::new(prompt_tokens, completion).cached(cached),
                })
            });
        return Ok(stream_choices(choices, first, chunk, usage).into_response());
    }

    let mut done: Vec<Collected> = join_all(choices.into_iter().map(|c| c.collect())).await;
    done.sort_by_key(|c| c.index);
    if let Some(Finish::Abort(msg)) = done.iter().find_map(|c| match &c.finish {
        Some(Finish::Abort(m)) => Some(Finish::Abort(m.clone())),
        _ => None,
    }) {
        return Err(ServerError::Aborted(msg));
    }
    let completion_tokens: usize = done.iter().map(|c| c.completion_tokens).sum();
    let cached_tokens: usize = done.iter().map(|c| c.cached_tokens).sum();
    let out: Vec<Value> = done
        .iter()
        .map(|c| {
            let prefix = if echo {
                echo_text(&state, c.index, &c.prompt)
            } else {
                String::new()
            };
            let lp = p.logprobs.then(|| {
                let v = logprobs_json(&c.tokens, prefix.len());
                if echo {
                    concat_logprobs(echo_logprobs(&state, &c.prompt, &c.prompt_logprobs), v)
                } else {
                    v
                }
            });
            json!({
                "index": c.index,
                "text": format!("{prefix}{}", c.text),
                "logprobs": lp,
                "finish_reason": c.finish.as_ref().map(Finish::as_str),
            })
        })
        .collect();
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": Usage::new(prompt_tokens, completion_tokens).cached(cached_tokens),
    }))
    .into_response())
}
