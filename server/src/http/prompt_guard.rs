//! Huge prompts: refused by their byte length before any tokenising, and tokenised off the
//! async runtime so a long one never stalls other requests.
//!
//! No token covers more than `max_token_bytes` bytes of prompt text, so a prompt of `b` bytes
//! has at least `b / max_token_bytes` tokens; `b > max_model_len * max_token_bytes` proves it
//! cannot fit the context. The bound holds only for tokenizers that never drop text or fold a
//! run of any length into one token; for the others (`WordPiece`, whitespace-deleting
//! pre-tokenizers, fused `<unk>`, ...) [`max_token_bytes`] is `None` and only the request-body
//! limit and off-thread tokenising apply.
use std::sync::Arc;

use serde_json::Value;
use thaw_runtime::model::Tokenizer;
use tokenizers::models::ModelWrapper;

use crate::error::ServerError;

/// The most UTF-8 bytes one Unicode scalar takes (an unknown character that becomes one `<unk>`).
const MAX_CHAR_BYTES: usize = 4;

/// How much Unicode normalisation or lower-casing can shrink text: composition folds at most
/// three scalars into one (Hangul L+V+T jamo, 9 bytes → 3), and lower-casing at most 3 → 1
/// bytes (KELVIN SIGN → `k`).
const CASE_OR_NF_SHRINK: usize = 3;

/// The tokenizer's model, as far as the bound cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelKind {
    /// BPE where an unknown character becomes one token (or bytes), never a fused run.
    BoundedBpe,
    /// Anything else: WordPiece/WordLevel (a long word → one `[UNK]`), fused unknowns, Unigram.
    Unbounded,
}

/// The factor by which `normalizer` (tokenizer.json's JSON) can shrink text, or `None` when it
/// may delete text outright (strip, accents, BERT cleaning, shrinking replacements).
pub fn normalizer_shrink(normalizer: &Value) -> Option<usize> {
    if normalizer.is_null() {
        return Some(1);
    }
    match normalizer.get("type")?.as_str()? {
        "Prepend" | "ByteLevel" => Some(1),
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" => Some(CASE_OR_NF_SHRINK),
        // Only a literal pattern replaced by something at least as long keeps the length.
        "Replace" => {
            let pat = normalizer.get("pattern")?.get("String")?.as_str()?;
            let content = normalizer.get("content")?.as_str()?;
            (!pat.is_empty() && content.len() >= pat.len()).then_some(1)
        }
        "Sequence" => normalizer
            .get("normalizers")?
            .as_array()?
            .iter()
            .try_fold(1usize, |acc, n| acc.checked_mul(normalizer_shrink(n)?)),
        _ => None,
    }
}

/// Whether `pre` (tokenizer.json's `pre_tokenizer`) keeps every byte of its input.
pub fn pre_tokenizer_keeps_text(pre: &Value) -> bool {
    if pre.is_null() {
        return true;
    }
    let kind = pre.get("type").and_then(Value::as_str).unwrap_or("");
    let removes = pre.get("behavior").and_then(Value::as_str) == Some("Removed");
    match kind {
        "ByteLevel" | "Metaspace" | "Digits" | "UnicodeScripts" | "FixedLength" => true,
        "Split" | "Punctuation" => !removes,
        "Sequence" => pre
            .get("pretokenizers")
            .and_then(Value::as_array)
            .is_some_and(|v| v.iter().all(pre_tokenizer_keeps_text)),
        _ => false,
    }
}

/// The bound from its parts: the longest token (vocabulary and added tokens, in UTF-8 bytes,
/// never below one character) times what the normaliser can shrink, or `None` if unbounded.
pub fn bound_from_parts(
    model: ModelKind,
    normalizer: &Value,
    pre: &Value,
    token_bytes: impl IntoIterator<Item = usize>,
) -> Option<usize> {
    if model != ModelKind::BoundedBpe || !pre_tokenizer_keeps_text(pre) {
        return None;
    }
    let shrink = normalizer_shrink(normalizer)?;
    let longest = token_bytes.into_iter().max()?.max(MAX_CHAR_BYTES);
    longest.checked_mul(shrink)
}

/// The most prompt bytes one token of `tok` can stand for, or `None` if no such bound holds.
pub fn max_token_bytes(tok: &Tokenizer) -> Option<usize> {
    let inner = tok.inner();
    let model = match inner.get_model() {
        ModelWrapper::BPE(b) if b.unk_token.is_none() || b.byte_fallback || !b.fuse_unk => {
            ModelKind::BoundedBpe
        }
        _ => ModelKind::Unbounded,
    };
    let json = |v: Option<Value>| v.unwrap_or(Value::Null);
    let normalizer = json(
        inner
            .get_normalizer()
            .and_then(|n| serde_json::to_value(n).ok()),
    );
    let pre = json(
        inner
            .get_pre_tokenizer()
            .and_then(|p| serde_json::to_value(p).ok()),
    );
    let lens = inner.get_vocab(true).into_keys().map(|t| t.len());
    bound_from_parts(model, &normalizer, &pre, lens)
}

/// 400 when `text` has more bytes than `max_model_len` tokens could cover.
pub fn check_bytes(
    text: &str,
    max_model_len: usize,
    max_token_bytes: Option<usize>,
    param: &'static str,
) -> Result<(), ServerError> {
    let Some(per_token) = max_token_bytes else {
        return Ok(());
    };
    let bytes = text.len();
    if bytes <= max_model_len.saturating_mul(per_token) {
        return Ok(());
    }
    Err(ServerError::invalid(
        param,
        format!(
            "This model's maximum context length is {max_model_len} tokens. However, you \
             requested at least {} tokens (the `{param}` text is {bytes} bytes and no token of \
             this model covers more than {per_token} bytes). Please reduce the length of the \
             `{param}`.",
            bytes.div_ceil(per_token)
        ),
    ))
}

/// Tokenises `text` on the blocking pool (after the byte check), so the async workers keep
/// serving other requests meanwhile.
pub async fn encode(
    tok: &Arc<Tokenizer>,
    text: String,
    add_special_tokens: bool,
    limits: (usize, Option<usize>),
    param: &'static str,
) -> Result<Vec<u32>, ServerError> {
    check_bytes(&text, limits.0, limits.1, param)?;
    let tok = tok.clone();
    tokio::task::spawn_blocking(move || tok.encode(&text, add_special_tokens))
        .await
        .map_err(|e| ServerError::Internal(format!("tokenizer task failed: {e}")))?
        .map_err(|e| ServerError::invalid(param, format!("could not tokenize the {param}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn known_tokenizer_shapes() {
        let bpe = ModelKind::BoundedBpe;
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false});
        // GPT-2 / Qwen style.
        assert_eq!(
            bound_from_parts(bpe, &Value::Null, &byte_level, [3, 10, 7]),
            Some(10)
        );
        // Llama SentencePiece-as-BPE: Prepend + Replace(" " → "▁").
        let llama = json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]});
        assert_eq!(normalizer_shrink(&llama), Some(1));
        assert_eq!(bound_from_parts(bpe, &llama, &Value::Null, [2]), Some(4));
        // NFKC + lowercase may shrink: the bound widens, never narrows.
        let nf =
            json!({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]});
        assert_eq!(bound_from_parts(bpe, &nf, &Value::Null, [8]), Some(72));
        // Text-deleting stages and unbounded models give no bound.
        for n in [
            json!({"type": "BertNormalizer"}),
            json!({"type": "Strip"}),
            json!({"type": "Replace", "pattern": {"String": "  "}, "content": " "}),
            json!({"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}),
        ] {
            assert_eq!(bound_from_parts(bpe, &n, &Value::Null, [8]), None, "{n}");
        }
        for p in [
            json!({"type": "Whitespace"}),
            json!({"type": "BertPreTokenizer"}),
            json!({"type": "Split", "behavior": "Removed"}),
            json!({"type": "Sequence", "pretokenizers": [byte_level, {"type": "WhitespaceSplit"}]}),
        ] {
            assert_eq!(bound_from_parts(bpe, &Value::Null, &p, [8]), None, "{p}");
        }
        assert_eq!(
            bound_from_parts(ModelKind::Unbounded, &Value::Null, &Value::Null, [8]),
            None
        );
    }

    #[test]
    fn byte_check_uses_vllm_wording() {
        assert!(check_bytes("abcd", 2, Some(2), "prompt").is_ok());
        assert!(check_bytes(&"x".repeat(1 << 20), 2, None, "prompt").is_ok());
        let e = check_bytes("abcde", 2, Some(2), "prompt").unwrap_err();
        assert_eq!(e.status(), 400);
        let msg = e.to_string();
        assert!(
            msg.starts_with("This model's maximum context length is 2 tokens. However, you requested at least 3 tokens"),
            "{msg}"
        );
        assert!(msg.contains("reduce the length"), "{msg}");
    }

    fn fixture_tokenizer() -> &'static Tokenizer {
        static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
        TOK.get_or_init(|| {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures/hf-tiny-llama");
            let cfg = thaw_runtime::model::ModelConfig::from_dir(&dir).unwrap();
            Tokenizer::from_dir(&dir, &cfg).unwrap()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The bound is sound on the fixture tokenizer: no encoding has fewer than
        /// `bytes / max_token_bytes` tokens.
        #[test]
        fn bound_is_sound_on_fixture(text in any::<String>(), rep in 1usize..64) {
            let tok = fixture_tokenizer();
            let per = max_token_bytes(tok).expect("the fixture is byte-level BPE");
            let text = text.repeat(rep);
            let ids = tok.encode(&text, false).unwrap();
            prop_assert!(ids.len() * per >= text.len(), "{} tokens for {} bytes", ids.len(), text.len());
        }
    }
}
