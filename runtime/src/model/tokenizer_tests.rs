use super::*;
use crate::model::fixtures;

fn fixture_tokenizer(dir: &Path) -> Tokenizer {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    Tokenizer::from_dir(dir, &cfg).unwrap()
}

#[test]
fn fixture_tokenizer_round_trips() {
    let tok = fixture_tokenizer(&fixtures::tiny_llama());
    assert_eq!(tok.eos_token_ids(), &[1]);
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.eos_token(), Some("</s>"));
    assert_eq!(tok.bos_token_id(), Some(0));
    assert_eq!(tok.vocab_size(), 300);
    assert_eq!(tok.id_to_token(1).as_deref(), Some("</s>"));
    assert_eq!(tok.chat_template(), None);
    let text = "The quick brown fox, 42 times!";
    let ids = tok.encode(text, true).unwrap();
    assert!(!ids.is_empty() && ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
    assert_eq!(tok.decode(&ids, true).unwrap(), text);
    // Special tokens are recognised in text and skipped on decode when asked.
    let ids = tok.encode("hi</s>", false).unwrap();
    assert_eq!(ids.last(), Some(&1));
    assert_eq!(tok.decode(&ids, true).unwrap(), "hi");
}

#[test]
fn multibyte_utf8_streams_whole_characters() {
    let tok = fixture_tokenizer(&fixtures::tiny_llama());
    let prompt = tok.encode("Say:", true).unwrap();
    let text = " héllo wörld — 世界 🦀!";
    let ids = tok.encode(text, false).unwrap();
    // Byte-level BPE with a ~300 vocab splits these characters over several tokens.
    assert!(ids.len() > text.chars().count());
    let mut dec = IncrementalDecoder::new(&prompt);
    let mut out = String::new();
    let mut held_back = 0;
    for &id in &ids {
        match dec.push(&tok, id).unwrap() {
            Some(piece) => {
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "half a character emitted: {piece:?}"
                );
                out.push_str(&piece);
            }
            None => held_back += 1,
        }
    }
    assert!(held_back > 0, "expected some tokens to end mid-character");
    assert_eq!(dec.flush(&tok).unwrap(), None);
    assert_eq!(out, text);
}

#[test]
fn flush_emits_an_incomplete_tail() {
    let tok = fixture_tokenizer(&fixtures::tiny_llama());
    let ids = tok.encode("🦀", false).unwrap();
    assert!(ids.len() > 1);
    let mut dec = IncrementalDecoder::new(&[]);
    for &id in &ids[..ids.len() - 1] {
        assert_eq!(dec.push(&tok, id).unwrap(), None);
    }
    assert!(dec.flush(&tok).unwrap().unwrap().contains('\u{FFFD}'));
}

#[test]
fn tokenizer_config_variants() {
    let dir = fixtures::scratch_copy(&fixtures::tiny_llama());
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"add_bos_token": true,
            "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
            "eos_token": {"content": "</s>"},
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
    )
    .unwrap();
    let tok = fixture_tokenizer(dir.path());
    assert_eq!(tok.chat_template(), Some("D"));
    assert_eq!(tok.named_chat_template("tool_use"), Some("T"));
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.eos_token(), Some("</s>"));
    let ids = tok.encode("hi", true).unwrap();
    assert_eq!(ids[0], 0);
    assert_ne!(tok.encode("hi", false).unwrap()[0], 0);

    // transformers >= 4.43 may write the template to its own file.
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
    std::fs::write(dir.path().join("chat_template.jinja"), "{{ messages }}").unwrap();
    assert_eq!(
        fixture_tokenizer(dir.path()).chat_template(),
        Some("{{ messages }}")
    );
}

#[test]
fn missing_tokenizer_json_is_reported() {
    let dir = fixtures::scratch_copy(&fixtures::tiny_llama());
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let cfg = ModelConfig::from_dir(dir.path()).unwrap();
    assert!(matches!(
        Tokenizer::from_dir(dir.path(), &cfg),
        Err(ModelError::MissingFile { .. })
    ));
}

/// Fuzzing found (issue 13): one flipped byte (`"decoder"::{`) made the tokenizers library
/// panic inside its deserialiser, taking start-up down with a backtrace. It is an error now.
#[test]
fn malformed_tokenizer_json_is_an_error_not_a_panic() {
    let dir = fixtures::scratch_copy(&fixtures::tiny_llama());
    let path = dir.path().join("tokenizer.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let at = text
        .find("\"decoder\": {")
        .expect("the fixture has a decoder");
    let bad = format!("{}\"decoder\"::{{{}", &text[..at], &text[at + 12..]);
    std::fs::write(&path, bad).unwrap();
    let cfg = ModelConfig::from_dir(dir.path()).unwrap();
    match Tokenizer::from_dir(dir.path(), &cfg) {
        Err(ModelError::Tokenizer { reason }) => {
            assert!(reason.contains("tokenizer.json"), "{reason}")
        }
        other => panic!("expected a tokenizer error, got {:?}", other.map(|_| ())),
    }
}
