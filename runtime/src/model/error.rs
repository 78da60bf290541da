//! Errors from reading a base model directory (config, weights, tokenizer).

use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong reading a HF model directory. Each message says what was wrong
/// and what to do about it.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error("missing file {}: {hint}", path.display())]
    MissingFile { path: PathBuf, hint: String },

    #[error("cannot read {}: {reason}", path.display())]
    Io { path: PathBuf, reason: String },

    #[error("{} is not valid JSON: {reason}; re-save the model with transformers `save_pretrained`", path.display())]
    Json { path: PathBuf, reason: String },

    #[error("{} is not a valid safetensors file ({reason}); it may be truncated or corrupt — download or save it again", path.display())]
    Safetensors { path: PathBuf, reason: String },

    #[error("unsupported model architecture `{found}`; Thaw serves llama, mistral and qwen2 (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)")]
    UnsupportedArchitecture { found: String },

    #[error("unsupported rope scaling `{0}`; Thaw supports rope_type default, linear and llama3")]
    UnsupportedRopeScaling(String),

    #[error("invalid model config: `{field}` {reason}")]
    InvalidConfig { field: String, reason: String },

    #[error("tensor `{tensor}` has dtype {dtype}; Thaw loads F32, F16 and BF16 safetensors weights (and GGUF files with F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors) — re-save the model in one of those")]
    UnsupportedDtype { tensor: String, dtype: String },

    #[error("tensor `{tensor}` is missing from the weights; is this checkpoint for the architecture its config.json declares?")]
    MissingTensor { tensor: String },

    #[error("tensor `{tensor}` appears more than once (again in {}); the shards overlap — re-save the model", path.display())]
    DuplicateTensor { tensor: String, path: PathBuf },

    #[error("tensor `{tensor}` has shape {got:?}, expected {expected:?} from config.json; the weights and config do not belong together")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },

    #[error("tensor `{tensor}` cannot be stored: {reason}")]
    BadTensor { tensor: String, reason: String },

    #[error("{} is not a usable GGUF file: {reason}", path.display())]
    Gguf { path: PathBuf, reason: String },

    #[error("tokenizer error: {reason}")]
    Tokenizer { reason: String },
}
