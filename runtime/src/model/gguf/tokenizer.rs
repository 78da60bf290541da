//! The tokenizer of a GGUF file: `tokenizer.ggml.*` (model `gpt2`: byte-level BPE from the
//! token list and merges) rebuilt as a HF fast tokenizer, plus bos/eos, added tokens and
//! `tokenizer.chat_template`.

use serde_json::{json, Map, Value};

use super::reader::{GgufFile, GgufValue};
use crate::model::{ModelConfig, ModelError, Tokenizer};

/// llama.cpp `llama_token_type`: control tokens are special, user-defined ones are added.
const TOKEN_CONTROL: u64 = 3;
const TOKEN_USER_DEFINED: u64 = 4;

fn tok_err(reason: impl Into<String>) -> ModelError {
    ModelError::Tokenizer {
        reason: reason.into(),
    }
}

fn strings<'a>(f: &'a GgufFile, key: &str) -> Result<Vec<&'a str>, ModelError> {
    f.get(key)
        .and_then(GgufValue::as_array)
        .ok_or_else(|| tok_err(format!("`{key}` is missing or not an array")))?
        .iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| tok_err(format!("`{key}` holds a non-string")))
        })
        .collect()
}

/// The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre`.
fn pre_tokenizer(pre: &str) -> Result<Value, ModelError> {
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": true});
    match pre {
        // GPT-2's regex (ByteLevel's own).
        "default" | "gpt2" | "" => Ok(byte_level),
        // SmolLM / StarCoder: every digit on its own, then GPT-2's regex.
        "smollm" | "starcoder" => Ok(json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level]})),
        other => Err(tok_err(format!(
            "pre-tokenizer `{other}` (tokenizer.ggml.pre) is not supported; Thaw reads gpt2, \
             default and smollm GGUF tokenizers — serve the HF directory instead"
        ))),
    }
}

/// Builds the tokenizer (and its serving config) from the file's metadata.
pub(crate) fn tokenizer_from_gguf(
    f: &GgufFile,
    cfg: &ModelConfig,
) -> Result<Tokenizer, ModelError> {
    let model = f
        .get("tokenizer.ggml.model")
        .and_then(GgufValue::as_str)
        .unwrap_or("");
    if model != "gpt2" {
        return Err(tok_err(format!(
            "tokenizer model `{model}` (tokenizer.ggml.model) is not supported; Thaw reads \
             byte-level BPE (`gpt2`) GGUF tokenizers"
        )));
    }
    let tokens = strings(f, "tokenizer.ggml.tokens")?;
    let merges = strings(f, "tokenizer.ggml.merges")?;
    let types: Vec<u64> = match f
        .get("tokenizer.ggml.token_type")
        .and_then(GgufValue::as_array)
    {
        Some(a) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    let pre = f
        .get("tokenizer.ggml.pre")
        .and_then(GgufValue::as_str)
        .unwrap_or("default");

    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, &t) in tokens.iter().enumerate() {
        vocab.insert(t.to_string(), json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == TOKEN_CONTROL || ty == TOKEN_USER_DEFINED {
            added.push(
                json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false,
                              "special": ty == TOKEN_CONTROL}),
            );
        }
    }
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(pre)?,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true,
                           "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    let bytes = serde_json::to_vec(&spec).map_err(|e| tok_err(e.to_string()))?;
    // The tokenizers crate panics on some malformed inputs; a bad file is an error.
    let inner = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(bytes))
        .map_err(|_| tok_err("the tokenizers library failed on the token list and merges"))?
        .map_err(|e| tok_err(format!("the token list and merges do not form a BPE: {e}")))?;
    let name = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|s| s.to_string())
    };
    let add_bos = f
        .get("tokenizer.ggml.add_bos_token")
        .and_then(GgufValue::as_bool)
        .unwrap_or(false);
    let chat_template = f
        .get("tokenizer.chat_template")
        .and_then(GgufValue::as_str)
        .map(str::to_string);
    Ok(Tokenizer::from_parts(
        inner,
        cfg.eos_token_ids.clone(),
        cfg.bos_token_id,
        name(cfg.bos_token_id),
        name(cfg.eos_token_ids.first().copied()),
        chat_template,
        add_bos,
    ))
}
