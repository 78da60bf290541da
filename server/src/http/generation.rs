//! From a validated request to per-choice token streams: context checks, submission to the
//! engine (one sequence per prompt × n) and, per choice, detokenization, stop strings
//! (matched on text and cut from the output, as OpenAI and vLLM do) and logprobs.
use std::sync::Arc;
use std::time::Instant;

use thaw_runtime::engine::{FinishReason, SequenceParams};
use thaw_runtime::model::{IncrementalDecoder, Tokenizer};
use thaw_runtime::sampling::SampledToken;
use tokio::sync::mpsc::UnboundedReceiver;

use super::app::AppState;
use super::params::{choice_seed, GenParams};
use crate::engine_loop::{EngineEvent, Submission};
use crate::error::ServerError;
use crate::registry::AdapterLease;

/// Why a choice ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    /// Ended early; the message is for the client.
    Abort(String),
}

impl Finish {
    pub fn as_str(&self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Abort(_) => "abort",
        }
    }
}

/// One generated (or scored prompt) token with its logprobs, decoded for display.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenInfo {
    pub id: u32,
    pub text: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What a choice produced since the last call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Delta {
    pub text: String,
    /// Tokens received in this delta (with logprobs when asked for).
    pub tokens: Vec<TokenInfo>,
    /// With the first token of a choice whose prompt was scored: its prompt tokens after
    /// the first ([`GenParams::prompt_logprobs`]).
    pub prompt: Vec<TokenInfo>,
    pub num_tokens: usize,
    /// Prompt tokens the prefix cache held (with the first token only).
    pub cached_tokens: usize,
    pub finish: Option<Finish>,
}

/// One choice's stream of deltas. Dropping it cancels the engine sequence.
pub struct ChoiceStream {
    pub index: usize,
    pub prompt: Arc<Vec<u32>>,
    rx: Option<UnboundedReceiver<EngineEvent>>,
    tok: Arc<Tokenizer>,
    decoder: IncrementalDecoder,
    stop: Arc<Vec<String>>,
    held: String,
    logprobs: bool,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

/// Longest suffix of `text` that is a proper prefix of some stop string.
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut keep = 0;
    for s in stops {
        for (k, _) in s.char_indices().skip(1) {
            if k > keep && text.ends_with(&s[..k]) {
                keep = k;
            }
        }
    }
    keep
}

/// Earliest match of any stop string in `text`.
fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}

/// A token's display text (special tokens included, as OpenAI's logprobs show them).
pub fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false)
        .unwrap_or_else(|_| tok.id_to_token(id).unwrap_or_default())
}

impl ChoiceStream {
    fn token_info(&self, t: &SampledToken) -> TokenInfo {
        TokenInfo {
            id: t.id,
            text: token_text(&self.tok, t.id),
            logprob: t.logprob,
            top: t
                .top
                .iter()
                .map(|(id, lp)| (token_text(&self.tok, *id), *lp))
                .collect(),
        }
    }

    fn close(&mut self) {
        self.rx = None;
    }

    /// The next delta, or None after the last one.
    pub async fn next(&mut self) -> Option<Delta> {
        let rx = self.rx.as_mut()?;
        let ev = rx.recv().await.unwrap_or_else(|| {
            EngineEvent::Aborted("internal error: the scheduler stopped; see the server log".into())
        });
        let mut d = Delta::default();
        match ev {
            EngineEvent::Token {
                token,
                finish,
                prompt_logprobs,
                cached_tokens,
            } => {
                self.completion_tokens += 1;
                self.cached_tokens += cached_tokens;
                d.num_tokens = 1;
                d.cached_tokens = cached_tokens;
                d.prompt = prompt_logprobs.iter().map(|t| self.token_info(t)).collect();
                if self.logprobs {
                    d.tokens.push(self.token_info(&token));
                }
                // EOS / stop-token text is not part of the completion.
                if !matches!(finish, Some(FinishReason::Stop(_))) {
                    if let Ok(Some(piece)) = self.decoder.push(&self.tok, token.id) {
                        self.held.push_str(&piece);
                    }
                }
                if finish.is_some() {
                    if let Ok(Some(rest)) = self.decoder.flush(&self.tok) {
                        self.held.push_str(&rest);
                    }
                }
                if let Some(pos) = find_stop(&self.held, &self.stop) {
                    self.held.truncate(pos);
                    d.text = std::mem::take(&mut self.held);
                    d.finish = Some(Finish::Stop);
                    self.close();
                } else if let Some(f) = finish {
                    d.text = std::mem::take(&mut self.held);
                    d.finish = Some(match f {
                        FinishReason::Stop(_) => Finish::Stop,
                        FinishReason::Length => Finish::Length,
                    });
                    self.close();
                } else {
                    let keep = held_back(&self.held, &self.stop);
                    let cut = self.held.len() - keep;
                    d.text = self.held[..cut].to_string();
                    self.held.drain(..cut);
                }
            }
            EngineEvent::Aborted(msg) => {
                d.text = std::mem::take(&mut self.held);
                d.finish = Some(Finish::Abort(msg));
                self.close();
            }
        }
        Some(d)
    }

    /// Runs the choice to its end.
    pub async fn collect(mut self) -> Collected {
        let mut c = Collected {
            index: self.index,
            prompt: self.prompt.clone(),
            ..Default::default()
        };
        while let Some(d) = self.next().await {
            c.text.push_str(&d.text);
            c.tokens.extend(d.tokens);
            c.prompt_logprobs.extend(d.prompt);
            if let Some(f) = d.finish {
                c.finish = Some(f);
            }
        }
        c.completion_tokens = self.completion_tokens;
        c.cached_tokens = self.cached_tokens;
        c
    }
}

/// A finished choice.
#[derive(Clone, Debug, Default)]
pub struct Collected {
    pub index: usize,
    pub prompt: Arc<Vec<u32>>,
    pub text: String,
    pub tokens: Vec<TokenInfo>,
    /// Scored prompt tokens after the first, when the request asked for them.
    pub prompt_logprobs: Vec<TokenInfo>,
    pub completion_tokens: usize,
    /// Prompt tokens the prefix cache held when it was admitted.
    pub cached_tokens: usize,
    pub finish: Option<Finish>,
}

/// The model a request names: the base model (None) or a leased adapter.
pub async fn resolve_model(
    state: &AppState,
    model: &str,
) -> Result<Option<AdapterLease>, ServerError> {
    if state.served_names.iter().any(|n| n == model) {
        return Ok(None);
    }
    match state.registry.acquire(model).await? {
        Some(lease) => Ok(Some(lease)),
        None => Err(ServerError::ModelNotFound(model.to_string())),
    }
}

/// Checks prompt + completion against the context and the KV cache; returns max_tokens.
pub fn check_length(
    state: &AppState,
    prompt_len: usize,
    max_tokens: Option<usize>,
    param: &'static str,
) -> Result<usize, ServerError> {
    if prompt_len == 0 {
        return Err(ServerError::invalid(
            param,
            format!("`{param}` is empty; send at least one token"),
        ));
    }
    let max = state.max_model_len;
    let completion = match max_tokens {
        Some(m) => m,
        None if prompt_len < max => max - prompt_len,
        None => 1,
    };
    let total = prompt_len + completion;
    if total > max {
        return Err(ServerError::ContextTooLong {
            max,
            total,
            prompt: prompt_len,
            completion,
            param,
        });
    }
    let blocks = total.div_ceil(state.sched.block_size);
    if blocks > state.sched.total_blocks {
        return Err(ServerError::invalid(
            param,
            format!(
                "the request needs {blocks} KV blocks but the cache has {}; lower max_tokens or \
                 restart with more KV blocks (--num-gpu-blocks-override)",
                state.sched.total_blocks
            ),
        ));
    }
    Ok(completion)
}

/// Submits `n` sequences per prompt (choice index = prompt × n + i, as OpenAI numbers them).
/// If any submission fails, the ones already queued are cancelled when their streams drop.
pub fn submit(
    state: &AppState,
    prompts: Vec<(Vec<u32>, usize)>,
    lease: Option<AdapterLease>,
    p: &GenParams,
) -> Result<Vec<ChoiceStream>, ServerError> {
    let arrived = Instant::now();
    let stop = Arc::new(p.stop.clone());
    let mut out = Vec::with_capacity(prompts.len() * p.n);
    for (pi, (prompt, max_new_tokens)) in prompts.into_iter().enumerate() {
        let prompt = Arc::new(prompt);
        for i in 0..p.n {
            let mut sampling = p.sampling.clone();
            sampling.seed = choice_seed(p.sampling.seed, i);
            let rx = state.engine.submit(Submission {
                params: SequenceParams {
                    prompt: prompt.to_vec(),
                    adapter: lease.as_ref().map(|l| l.id()),
                    adapter_generation: lease
                        .as_ref()
                        .map(|l| l.slot().generation)
                        .unwrap_or_default(),
                    sampling,
                    max_new_tokens,
                    stop_token_ids: p.stop_token_ids.clone(),
                    ignore_eos: p.ignore_eos,
                    prompt_logprobs: p.prompt_logprobs,
                },
                lease: lease.clone(),
                arrived,
                priority: p.priority,
            })?;
            out.push(ChoiceStream {
                index: pi * p.n + i,
                prompt: prompt.clone(),
                rx: Some(rx),
                tok: state.tokenizer.clone(),
                decoder: IncrementalDecoder::new(&prompt),
                stop: stop.clone(),
                held: String::new(),
                logprobs: p.logprobs,
                completion_tokens: 0,
                cached_tokens: 0,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_held_back_and_found() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(held_back("abc EN", &stops), 2);
        assert_eq!(held_back("abc\n", &stops), 1);
        assert_eq!(held_back("abc", &stops), 0);
        assert_eq!(find_stop("xx\n\nyyEND", &stops), Some(2));
        assert_eq!(find_stop("xx", &stops), None);
        let uni = vec!["éé".to_string()];
        assert_eq!(held_back("aé", &uni), "é".len());
    }
}
