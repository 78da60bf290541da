//! OpenAI request bodies (what clients send) and the JSON pieces of responses. Fields Thaw does
//! not know are ignored, as vLLM does; fields it knows but does not implement are rejected with
//! a 400 naming them (see `params.rs`).
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `prompt`: a string, a list of strings, a list of token ids or a list of such lists.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: a string or a list of strings.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling fields shared by completions and chat.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// vLLM's extension; -1 or 0 turns it off.
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    /// vLLM's extension: extra token ids that end generation.
    pub stop_token_ids: Option<Vec<u32>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// vLLM's extension used by benchmarks.
    pub ignore_eos: Option<bool>,
    /// vLLM's extension: admission order under `--scheduling-policy priority` (lower first).
    pub priority: Option<i64>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Number of top alternatives per token (0..=20).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
}

/// One content part of a chat message; only `text` parts are served.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<MessageContent>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub add_generation_prompt: Option<bool>,
    pub tools: Option<Value>,
}

/// `POST /v1/load_lora_adapter` (vLLM).
#[derive(Clone, Debug, Deserialize)]
pub struct LoadLoraRequest {
    pub lora_name: String,
    pub lora_path: String,
}

/// `POST /v1/unload_lora_adapter` (vLLM).
#[derive(Clone, Debug, Deserialize)]
pub struct UnloadLoraRequest {
    pub lora_name: String,
}

#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's `usage.prompt_tokens_details`: prompt tokens served from the prefix cache.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails::default(),
        }
    }

    /// With `cached_tokens` of the prompt tokens found in the prefix cache (summed over the
    /// choices, so capped at the prompt tokens counted once).
    pub fn cached(mut self, cached_tokens: usize) -> Self {
        self.prompt_tokens_details.cached_tokens = cached_tokens.min(self.prompt_tokens);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_forms_parse() {
        let p = |s: &str| serde_json::from_str::<Prompt>(s).unwrap();
        assert_eq!(p("\"hi\""), Prompt::Text("hi".into()));
        assert_eq!(
            p("[\"a\",\"b\"]"),
            Prompt::Texts(vec!["a".into(), "b".into()])
        );
        assert_eq!(p("[1,2]"), Prompt::Tokens(vec![1, 2]));
        assert_eq!(
            p("[[1],[2,3]]"),
            Prompt::TokenLists(vec![vec![1], vec![2, 3]])
        );
        assert!(serde_json::from_str::<Prompt>("[1.5]").is_err());
    }
}
