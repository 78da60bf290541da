//! A real byte-level BPE tokenizer, trained at generation time on an embedded corpus, and
//! the `tokenizer_config.json` / `special_tokens_map.json` transformers writes next to it.
//!
//! Training is deterministic (the BPE trainer breaks count ties by pair id) and cached per
//! requested vocabulary size for the life of the process.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::Context;
use serde_json::{json, Value};
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, TokenizerBuilder};

use super::writer::write_json;

/// Training text: English prose and dialogue, code in several languages, and text in a
/// dozen scripts plus symbols and emoji, so every kind of input gets some merges.
pub const CORPUS: &str = include_str!("corpus.txt");

/// Beginning-of-sequence token (id 0).
pub const BOS_TOKEN: &str = "<s>";
/// End-of-sequence token (id 1).
pub const EOS_TOKEN: &str = "</s>";
/// ChatML turn opener (id 2).
pub const IM_START_TOKEN: &str = "<|im_start|>";
/// ChatML turn closer (id 3); generation also stops on it.
pub const IM_END_TOKEN: &str = "<|im_end|>";
/// Special tokens in id order. Byte-level BPE can spell any input, so there is no `<unk>`.
pub const SPECIAL_TOKENS: [&str; 4] = [BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN];
/// Id of [`BOS_TOKEN`].
pub const BOS_TOKEN_ID: u32 = 0;
/// Id of [`EOS_TOKEN`].
pub const EOS_TOKEN_ID: u32 = 1;
/// Id of [`IM_END_TOKEN`].
pub const IM_END_TOKEN_ID: u32 = 3;

/// ChatML chat template (Jinja, as used by HF `apply_chat_template`): every message —
/// system, user or assistant — becomes `<|im_start|>{role}\n{content}<|im_end|>\n`, and
/// `add_generation_prompt` opens an assistant turn.
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// A trained tokenizer, serialised as `tokenizer.json`.
#[derive(Debug, Clone)]
pub struct TrainedTokenizer {
    /// The `tokenizer.json` text.
    pub json: String,
    /// Vocabulary size including special tokens (≤ the size asked for).
    pub vocab_size: usize,
}

/// Returns the tokenizer trained for `vocab_size`, training it on first use.
pub fn trained_tokenizer(vocab_size: usize) -> anyhow::Result<Arc<TrainedTokenizer>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<TrainedTokenizer>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // Holding the lock while training makes concurrent callers wait for one training run
    // instead of each doing their own.
    let mut cache = cache
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(t) = cache.get(&vocab_size) {
        return Ok(Arc::clone(t));
    }
    let trained = Arc::new(train(vocab_size)?);
    cache.insert(vocab_size, Arc::clone(&trained));
    Ok(trained)
}

fn train(vocab_size: usize) -> anyhow::Result<TrainedTokenizer> {
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let post = TemplateProcessing::builder()
        .try_single("$A")
        .and_then(|b| b.try_pair("$A $B:1"))
        .map_err(|e| anyhow::anyhow!("template processing: {e}"))?
        .build()?;
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        ByteLevel,
        PostProcessorWrapper,
        ByteLevel,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
    .with_post_processor(Some(post.into()))
    .with_decoder(Some(ByteLevel::default()))
    .build()
    .map_err(|e| anyhow::anyhow!("building tokenizer: {e}"))?;
    tokenizer
        .train(&mut trainer, CORPUS.lines().filter(|l| !l.is_empty()))
        .map_err(|e| anyhow::anyhow!("training BPE on the embedded corpus: {e}"))?;
    let json = tokenizer
        .to_string(true)
        .map_err(|e| anyhow::anyhow!("serialising tokenizer: {e}"))?;
    Ok(TrainedTokenizer {
        json,
        vocab_size: tokenizer.get_vocab_size(true),
    })
}

/// Writes `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into
/// `dir` and returns the tokenizer's vocabulary size.
pub fn write_tokenizer_files(
    dir: &Path,
    vocab_size: usize,
    model_max_length: usize,
) -> anyhow::Result<usize> {
    let trained = trained_tokenizer(vocab_size)?;
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, &trained.json).with_context(|| format!("writing {}", path.display()))?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &tokenizer_config(model_max_length),
    )?;
    write_json(&dir.join("special_tokens_map.json"), &special_tokens_map())?;
    Ok(trained.vocab_size)
}

fn token_entry(content: &str) -> Value {
    json!({
        "content": content,
        "lstrip": false,
        "normalized": false,
        "rstrip": false,
        "single_word": false,
    })
}

/// `tokenizer_config.json` as transformers 4.x writes it for a `PreTrainedTokenizerFast`.
pub fn tokenizer_config(model_max_length: usize) -> Value {
    let added: serde_json::Map<String, Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(id, tok)| {
            let mut entry = token_entry(tok);
            entry["special"] = Value::Bool(true);
            (id.to_string(), entry)
        })
        .collect();
    json!({
        "add_bos_token": false,
        "add_eos_token": false,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": EOS_TOKEN,
        "extra_special_tokens": {},
        "model_max_length": model_max_length,
        "pad_token": null,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": null,
    })
}

/// `special_tokens_map.json` as transformers 4.x writes it.
pub fn special_tokens_map() -> Value {
    json!({
        "additional_special_tokens": [token_entry(IM_START_TOKEN), token_entry(IM_END_TOKEN)],
        "bos_token": token_entry(BOS_TOKEN),
        "eos_token": token_entry(EOS_TOKEN),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLES: [&str; 6] = [
        "The quick brown fox jumps over the lazy dog, twice.",
        "fn main() {\n    let x: Vec<u8> = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}\n",
        "  leading spaces\tand tabs\r\nand CRLF  ",
        "Größe, élève, Ελληνικά, русский, 中文, 日本語, 한국어 — “quotes” …",
        "emoji 🦀🐍👨‍👩‍👧 and a word never seen: Zyxquorbl",
        "",
    ];

    fn load(vocab: usize) -> tokenizers::Tokenizer {
        let t = trained_tokenizer(vocab).unwrap();
        t.json.parse().unwrap()
    }

    #[test]
    fn trains_to_the_requested_size_with_specials_first() {
        let t = trained_tokenizer(512).unwrap();
        assert_eq!(t.vocab_size, 512);
        let tok = load(512);
        for (id, special) in SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(tok.token_to_id(special), Some(id as u32));
        }
        assert_eq!(tok.token_to_id(EOS_TOKEN), Some(EOS_TOKEN_ID));
        assert_eq!(tok.token_to_id(IM_END_TOKEN), Some(IM_END_TOKEN_ID));
    }

    #[test]
    fn round_trips_english_code_and_non_ascii() {
        let tok = load(512);
        for s in SAMPLES {
            let enc = tok.encode(s, false).unwrap();
            let ids = enc.get_ids();
            assert!(ids.iter().all(|&id| (id as usize) < 512));
            assert_eq!(tok.decode(ids, false).unwrap(), s, "ids {ids:?}");
        }
        // Merges were learned: common English takes well under one token per byte.
        let english = SAMPLES[0];
        let n = tok.encode(english, false).unwrap().len();
        assert!(
            n * 3 < english.len() * 2,
            "{n} tokens for {} bytes",
            english.len()
        );
    }

    #[test]
    fn specials_encode_as_single_tokens() {
        let tok = load(512);
        let enc = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
        assert_eq!(enc.get_ids()[0], 2);
        assert_eq!(*enc.get_ids().last().unwrap(), IM_END_TOKEN_ID);
    }

    #[test]
    fn training_is_deterministic() {
        assert_eq!(train(300).unwrap().json, train(300).unwrap().json);
    }

    #[test]
    fn chat_template_renders_chatml() {
        let mut env = minijinja::Environment::new();
        env.add_template("chat", CHAT_TEMPLATE).unwrap();
        let messages = json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye?"},
        ]);
        let out = env
            .get_template("chat")
            .unwrap()
            .render(minijinja::context! { messages => messages, add_generation_prompt => true })
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }
}
