//! Errors from reading and validating a PEFT LoRA adapter. Each says what is wrong and what to
//! do; the server maps them all to 422 (unsupported adapter) or 404 (`NotFound`).

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum AdapterError {
    #[error("adapter directory {} does not exist; pass the directory PEFT `save_pretrained` wrote", path.display())]
    NotFound { path: PathBuf },

    #[error("adapter file {} is missing; a PEFT adapter directory holds adapter_config.json and adapter_model.safetensors", path.display())]
    MissingFile { path: PathBuf },

    #[error("{} is a pickled PyTorch checkpoint; Thaw reads safetensors only — re-save with `model.save_pretrained(dir, safe_serialization=True)` or convert it with `safetensors.torch.save_file`", path.display())]
    PickleWeights { path: PathBuf },

    #[error("cannot read {}: {reason}", path.display())]
    Io { path: PathBuf, reason: String },

    #[error("{} is not valid JSON ({reason}); re-save the adapter with PEFT `save_pretrained`", path.display())]
    ConfigNotJson { path: PathBuf, reason: String },

    #[error("invalid adapter config: `{field}` {reason}")]
    InvalidConfig { field: String, reason: String },

    #[error("peft_type is `{0}`; Thaw serves LoRA adapters only (peft_type \"LORA\")")]
    UnsupportedPeftType(String),

    #[error("DoRA adapters are not supported; merge or retrain without use_dora")]
    Dora,

    #[error("adapter trains biases (`{0}`); Thaw supports bias=\"none\" only — retrain with bias=\"none\" and lora_bias=False")]
    Bias(String),

    #[error("adapter saves full copies of modules {0:?} (modules_to_save); Thaw cannot swap base weights per request — retrain without modules_to_save or merge the adapter into the base model")]
    ModulesToSave(Vec<String>),

    #[error("target module `{0}` is not a LoRA-servable projection; Thaw applies LoRA to q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj only")]
    UnknownTargetModule(String),

    #[error("tensor `{tensor}` has shape {got:?}, the base model expects {expected:?}; was this adapter trained for a different base model?")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },

    #[error("tensor `{tensor}` has rank {file_rank} but adapter_config.json says {config_rank} (r / rank_pattern); the config and weights do not belong together — re-save the adapter")]
    RankMismatch {
        tensor: String,
        config_rank: usize,
        file_rank: usize,
    },

    #[error("adapter has weights for layer {layer} (`{tensor}`) but the base model has {num_layers} layers; was this adapter trained for a different base model?")]
    LayerOutOfRange {
        tensor: String,
        layer: usize,
        num_layers: usize,
    },

    #[error("tensor `{tensor}` is missing from the adapter weights although adapter_config.json targets it; the file may be incomplete — re-save the adapter")]
    MissingTensor { tensor: String },

    #[error("unexpected tensor `{tensor}` in the adapter weights: {reason}")]
    UnexpectedTensor { tensor: String, reason: String },

    #[error("{} is not a valid safetensors file ({reason}); it may be truncated or corrupt — copy or save it again", path.display())]
    Corrupt { path: PathBuf, reason: String },

    #[error("tensor `{tensor}` holds NaN or infinite values (element {index}); the file is corrupt or the training diverged — re-save or retrain the adapter")]
    NonFinite { tensor: String, index: usize },

    #[error("tensor `{tensor}` has dtype {dtype}; Thaw loads F32, F16 and BF16 adapter weights")]
    UnsupportedDtype { tensor: String, dtype: String },
}
