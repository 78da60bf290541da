//! The tokenizer: `tokenizer.json` (HF fast tokenizer) plus the special tokens and chat template
//! from `tokenizer_config.json` (and the files newer transformers split them into), and a
//! streaming detokenizer.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::config::{read_json, ModelConfig};
use super::error::ModelError;
use super::json::Obj;

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer {
        reason: e.to_string(),
    }
}

/// A HF fast tokenizer with the serving-relevant bits of its config.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    chat_template: Option<String>,
    chat_templates: BTreeMap<String, String>,
    /// `add_bos_token: true` in tokenizer_config.json: prepend BOS when the post-processor in
    /// tokenizer.json does not already.
    add_bos_token: bool,
}

/// `bos_token` / `eos_token` are a string or an AddedToken dict `{"content": ..}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of `{name, template}` where "default" is the one used.
fn chat_templates(v: Option<&Value>) -> (Option<String>, BTreeMap<String, String>) {
    let mut named = BTreeMap::new();
    match v {
        Some(Value::String(s)) => (Some(s.clone()), named),
        Some(Value::Array(items)) => {
            for item in items {
                if let (Some(name), Some(t)) = (
                    item.get("name").and_then(Value::as_str),
                    item.get("template").and_then(Value::as_str),
                ) {
                    named.insert(name.to_string(), t.to_string());
                }
            }
            let default = named.get("default").cloned();
            if default.is_none() {
                tracing::warn!(
                    "chat_template lists no template named `default`; none will be used by default"
                );
            }
            (default, named)
        }
        _ => (None, named),
    }
}

fn read_object(path: &Path) -> Result<Option<Obj>, ModelError> {
    if !path.is_file() {
        return Ok(None);
    }
    match read_json(path, "")? {
        Value::Object(o) => Ok(Some(o)),
        _ => Err(ModelError::Json {
            path: path.to_path_buf(),
            reason: "expected a JSON object at the top level".into(),
        }),
    }
}

impl Tokenizer {
    /// Reads `tokenizer.json` and, when present, `tokenizer_config.json`,
    /// `special_tokens_map.json` and `chat_template.jinja` / `chat_template.json`.
    /// End-of-sequence ids are the model's (`config.eos_token_ids`) plus the tokenizer's
    /// `eos_token` when it differs.
    pub fn from_dir(dir: &Path, config: &ModelConfig) -> Result<Self, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(ModelError::MissingFile {
                path,
                hint: "Thaw needs a fast tokenizer (tokenizer.json); a sentencepiece tokenizer.model \
                       alone is not enough — re-save with `AutoTokenizer.from_pretrained(..).save_pretrained(dir)`"
                    .into(),
            });
        }
        // The tokenizers crate panics on some malformed files (an `unwrap` in its decoder
        // deserialiser); a bad file is an error, not a crash.
        let loaded = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_file(&path));
        let inner = match loaded {
            Ok(r) => r.map_err(|e| ModelError::Tokenizer {
                reason: format!("{}: {e}", path.display()),
            })?,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("a panic");
                return Err(ModelError::Tokenizer {
                    reason: format!(
                        "{} is malformed (the tokenizers library failed: {what}); re-save it with \
                         `AutoTokenizer.from_pretrained(..).save_pretrained(dir)`",
                        path.display()
                    ),
                });
            }
        };
        let tcfg = read_object(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let special = read_object(&dir.join("special_tokens_map.json"))?.unwrap_or_default();

        let (mut chat_template, chat_templates) = chat_templates(tcfg.get("chat_template"));
        if chat_template.is_none() {
            let jinja = dir.join("chat_template.jinja");
            if jinja.is_file() {
                chat_template =
                    Some(std::fs::read_to_string(&jinja).map_err(|e| ModelError::Io {
                        path: jinja.clone(),
                        reason: e.to_string(),
                    })?);
            } else if let Some(o) = read_object(&dir.join("chat_template.json"))? {
                chat_template = o
                    .get("chat_template")
                    .and_then(Value::as_str)
                    .map(str::to_string);
            }
        }

        let bos_token = token_string(tcfg.get("bos_token"))
            .or_else(|| token_string(special.get("bos_token")))
            .or_else(|| config.bos_token_id.and_then(|id| inner.id_to_token(id)));
        let eos_token = token_string(tcfg.get("eos_token"))
            .or_else(|| token_string(special.get("eos_token")))
            .or_else(|| {
                config
                    .eos_token_ids
                    .first()
                    .and_then(|&id| inner.id_to_token(id))
            });
        let bos_token_id = bos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or(config.bos_token_id);
        let mut eos_token_ids = config.eos_token_ids.clone();
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let add_bos_token = tcfg
            .get("add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(false);

        Ok(Self {
            inner,
            eos_token_ids,
            bos_token_id,
            bos_token,
            eos_token,
            chat_template,
            chat_templates,
            add_bos_token,
        })
    }

    /// A tokenizer assembled by another loader (GGUF metadata).
    pub(crate) fn from_parts(
        inner: tokenizers::Tokenizer,
        eos_token_ids: Vec<u32>,
        bos_token_id: Option<u32>,
        bos_token: Option<String>,
        eos_token: Option<String>,
        chat_template: Option<String>,
        add_bos_token: bool,
    ) -> Self {
        Self {
            inner,
            eos_token_ids,
            bos_token_id,
            bos_token,
            eos_token,
            chat_template,
            chat_templates: BTreeMap::new(),
            add_bos_token,
        }
    }

    /// Token ids of `text`; `add_special_tokens` runs the post-processor (BOS etc.).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(tok_err)?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens && self.add_bos_token {
            if let Some(bos) = self.bos_token_id {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, ModelError> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    /// Ids that end a sequence.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The default chat template (Jinja source), if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// A named template from a list-form `chat_template` (e.g. "tool_use").
    pub fn named_chat_template(&self, name: &str) -> Option<&str> {
        self.chat_templates.get(name).map(String::as_str)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Streaming detokenizer with TGI-style prefix/read offsets: each step decodes the window
/// `ids[prefix..]` and emits only what extends `ids[prefix..read]`, and emits nothing while the
/// text ends in U+FFFD, so a multi-byte UTF-8 character split over byte-level BPE tokens is
/// never sent half-done, and tokenizers that add spaces by context decode correctly.
#[derive(Clone, Debug)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
}

/// Prompt tokens kept as context for the first generated tokens (as TGI does).
const PROMPT_CONTEXT: usize = 5;

impl IncrementalDecoder {
    /// Starts after `prompt_ids` (only the last few are kept as context); special tokens are
    /// skipped in the output.
    pub fn new(prompt_ids: &[u32]) -> Self {
        let tail = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..];
        Self {
            ids: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
            skip_special_tokens: true,
        }
    }

    /// Whether special tokens (e.g. `</s>`) appear in the streamed text; default: skipped.
    pub fn with_skip_special_tokens(mut self, skip: bool) -> Self {
        self.skip_special_tokens = skip;
        self
    }

    /// Adds one generated token; returns the newly completed text, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>, ModelError> {
        self.ids.push(id);
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let new = full
            .strip_prefix(prefix.as_str())
            .or_else(|| full.get(prefix.len()..))
            .unwrap_or_default()
            .to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Only ids from prefix_offset on are ever decoded again.
        self.ids.drain(..self.prefix_offset);
        self.read_offset -= self.prefix_offset;
        self.prefix_offset = 0;
        Ok(if new.is_empty() { None } else { Some(new) })
    }

    /// At the end of a stream: whatever is still held back (e.g. an incomplete character,
    /// rendered as U+FFFD).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<Option<String>, ModelError> {
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        let rest = full.get(prefix.len()..).unwrap_or_default();
        Ok(if rest.is_empty() {
            None
        } else {
            Some(rest.to_string())
        })
    }
}

#[cfg(test)]
#[path = "tokenizer_tests.rs"]
mod tests;
