use super::*;
use crate::model::fixtures;

fn base(model_type: &str, extra: &str) -> String {
    format!(
        r#"{{"model_type": "{model_type}", "vocab_size": 1000, "hidden_size": 128,
            "intermediate_size": 344, "num_hidden_layers": 3, "num_attention_heads": 8,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "eos_token_id": 2,
            "bos_token_id": 1 {extra}}}"#
    )
}

#[test]
fn fixture_config_loads_unchanged() {
    let cfg = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
    assert_eq!(cfg.architecture, Architecture::Llama);
    assert_eq!(
        (
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_layers
        ),
        (300, 64, 172, 2)
    );
    assert_eq!((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), (4, 2, 16));
    assert_eq!((cfg.q_dim(), cfg.kv_dim()), (64, 32));
    // transformers 5 `rope_parameters`, not a top-level rope_theta.
    assert_eq!(cfg.rope_theta, 10_000.0);
    assert_eq!(cfg.rope_scaling, RopeScaling::None);
    assert_eq!(cfg.rms_norm_eps, 1e-6);
    assert_eq!(cfg.max_position_embeddings, 256);
    assert!(!cfg.tie_word_embeddings && !cfg.attention_bias);
    assert_eq!(cfg.sliding_window, None);
    assert_eq!(cfg.bos_token_id, Some(0));
    assert_eq!(cfg.eos_token_ids, vec![1]);
    assert_eq!(cfg.module_shape(LoraModule::K), (64, 32));
    assert_eq!(cfg.module_shape(LoraModule::Down), (172, 64));
}

#[test]
fn generation_config_eos_wins_and_accepts_lists() {
    let dir = fixtures::scratch_copy(&fixtures::tiny_llama());
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [1, 7], "bos_token_id": 0}"#,
    )
    .unwrap();
    let cfg = ModelConfig::from_dir(dir.path()).unwrap();
    assert_eq!(cfg.eos_token_ids, vec![1, 7]);
}

#[test]
fn llama_with_llama3_rope_scaling() {
    let cfg = ModelConfig::from_json(&base(
        "llama",
        r#", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}, "eos_token_id": [128001, 128009]"#,
    ))
    .unwrap();
    assert_eq!(cfg.rope_theta, 500_000.0);
    assert_eq!(
        cfg.rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    assert_eq!(cfg.eos_token_ids, vec![128001, 128009]);
    assert_eq!(cfg.head_dim, 16);
}

#[test]
fn linear_rope_in_legacy_type_key() {
    let cfg = ModelConfig::from_json(&base(
        "llama",
        r#", "rope_scaling": {"type": "linear", "factor": 2}"#,
    ))
    .unwrap();
    assert_eq!(cfg.rope_scaling, RopeScaling::Linear { factor: 2.0 });
}

#[test]
fn unsupported_rope_scaling_is_named() {
    for kind in ["yarn", "dynamic", "longrope"] {
        let json = base(
            "llama",
            &format!(r#", "rope_scaling": {{"rope_type": "{kind}", "factor": 4.0}}"#),
        );
        match ModelConfig::from_json(&json) {
            Err(ModelError::UnsupportedRopeScaling(k)) => assert_eq!(k, kind),
            other => panic!("expected UnsupportedRopeScaling for {kind}, got {other:?}"),
        }
    }
}

#[test]
fn mistral_sliding_window_and_null_head_dim() {
    let cfg = ModelConfig::from_json(&base(
        "mistral",
        r#", "sliding_window": 4096, "head_dim": null"#,
    ))
    .unwrap();
    assert_eq!(cfg.architecture, Architecture::Mistral);
    assert_eq!(cfg.sliding_window, Some(4096));
    assert_eq!(cfg.head_dim, 16);
    let cfg = ModelConfig::from_json(&base("mistral", r#", "sliding_window": null"#)).unwrap();
    assert_eq!(cfg.sliding_window, None);
}

#[test]
fn qwen2_bias_default_and_sliding_flag() {
    let cfg = ModelConfig::from_json(&base(
        "qwen2",
        r#", "sliding_window": 32768, "use_sliding_window": false, "tie_word_embeddings": true"#,
    ))
    .unwrap();
    assert_eq!(cfg.architecture, Architecture::Qwen2);
    assert!(cfg.attention_bias);
    assert!(cfg.tie_word_embeddings);
    assert_eq!(cfg.sliding_window, None);
    let cfg = ModelConfig::from_json(&base(
        "qwen2",
        r#", "sliding_window": 4096, "use_sliding_window": true"#,
    ))
    .unwrap();
    assert_eq!(cfg.sliding_window, Some(4096));
}

#[test]
fn architecture_from_class_name_and_rejections() {
    let json = base("custom", r#", "architectures": ["MistralForCausalLM"]"#);
    assert_eq!(
        ModelConfig::from_json(&json).unwrap().architecture,
        Architecture::Mistral
    );
    match ModelConfig::from_json(&base("gemma2", "")) {
        Err(ModelError::UnsupportedArchitecture { found }) => assert_eq!(found, "gemma2"),
        other => panic!("expected UnsupportedArchitecture, got {other:?}"),
    }
}

#[test]
fn invalid_shapes_are_rejected() {
    let json =
        base("llama", "").replace(r#""num_key_value_heads": 2"#, r#""num_key_value_heads": 3"#);
    assert!(matches!(
        ModelConfig::from_json(&json),
        Err(ModelError::InvalidConfig { field, .. }) if field == "num_key_value_heads"
    ));
    let json = base("llama", "").replace(r#""hidden_size": 128"#, r#""hidden_size": 130"#);
    assert!(matches!(
        ModelConfig::from_json(&json),
        Err(ModelError::InvalidConfig { field, .. }) if field == "hidden_size"
    ));
    let json = base("llama", "").replace(r#""vocab_size": 1000"#, r#""vocab_size": 0"#);
    assert!(matches!(
        ModelConfig::from_json(&json),
        Err(ModelError::InvalidConfig { .. })
    ));
    assert!(matches!(
        ModelConfig::from_json("{not json"),
        Err(ModelError::Json { .. })
    ));
}

#[test]
fn missing_config_file_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        ModelConfig::from_dir(dir.path()),
        Err(ModelError::MissingFile { .. })
    ));
}

/// Fuzzing found (issue 13): `rms_norm_eps: 1e308` became an infinite f32 (and would have
/// made every norm's output NaN); rope numbers beyond f32 likewise. Both are refused.
#[test]
fn numbers_beyond_f32_are_refused() {
    for (extra, field) in [
        (r#", "rms_norm_eps": 1e308"#, "rms_norm_eps"),
        (r#", "rms_norm_eps": -1e-5"#, "rms_norm_eps"),
        (r#", "rope_theta": 1e39"#, "rope_theta"),
        (
            r#", "rope_scaling": {"rope_type": "linear", "factor": 1e300}"#,
            "factor",
        ),
    ] {
        match ModelConfig::from_json(&base("llama", extra)) {
            Err(ModelError::InvalidConfig { field: f, .. }) => assert_eq!(f, field, "{extra}"),
            other => panic!("{extra}: expected InvalidConfig, got {other:?}"),
        }
    }
}

/// Fuzzing found (issue 13): `num_attention_heads: 18446744073709551615` was accepted and
/// `q_dim()` overflowed (a panic in debug builds, a wrapped size in release).
#[test]
fn sizes_whose_products_overflow_are_refused() {
    let huge = u64::MAX.to_string();
    for (from, field) in [
        (r#""num_attention_heads": 8"#, "num_attention_heads"),
        (r#""hidden_size": 128"#, "hidden_size"),
        (r#""vocab_size": 1000"#, "vocab_size"),
        (r#""intermediate_size": 344"#, "intermediate_size"),
    ] {
        let key = from.split(':').next().unwrap();
        let json = base("llama", r#", "num_key_value_heads": 1, "head_dim": 16"#)
            .replace(r#""num_key_value_heads": 2, "#, "")
            .replace(from, &format!("{key}: {huge}"));
        match ModelConfig::from_json(&json) {
            Err(ModelError::InvalidConfig { .. }) => {}
            Ok(c) => panic!(
                "{field}: accepted with q_dim {:?}",
                c.num_heads.checked_mul(c.head_dim)
            ),
            Err(e) => panic!("{field}: {e}"),
        }
    }
}
