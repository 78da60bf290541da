use super::*;
use crate::model::fixtures;

fn cfg(extra: &str) -> Result<AdapterConfig, AdapterError> {
    AdapterConfig::from_json(&format!(
        r#"{{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none", "use_dora": false {extra}}}"#
    ))
}

#[test]
fn fixture_configs_parse_with_unknown_fields_ignored() {
    let c =
        AdapterConfig::from_file(&fixtures::adapter("r4_qv").join("adapter_config.json")).unwrap();
    assert_eq!((c.r, c.lora_alpha, c.use_rslora), (4, 8.0, false));
    assert_eq!(c.target_modules, vec![LoraModule::Q, LoraModule::V]);
    assert_eq!(c.base_model_name_or_path.as_deref(), Some("hf-tiny-llama"));
    assert_eq!(c.layers_to_transform, None);
    assert_eq!(c.rank_and_scale(1, LoraModule::Q), (4, 2.0));
    let c =
        AdapterConfig::from_file(&fixtures::adapter("r8_all_rslora").join("adapter_config.json"))
            .unwrap();
    assert_eq!(c.target_modules, LoraModule::ALL.to_vec());
    let (r, s) = c.rank_and_scale(0, LoraModule::Down);
    assert_eq!(r, 8);
    assert!((s - 16.0 / 8f32.sqrt()).abs() < 1e-6);
}

#[test]
fn rank_and_alpha_patterns_apply_per_module() {
    let c = cfg(r#", "target_modules": ["q_proj", "v_proj", "down_proj"],
            "rank_pattern": {"model.layers.1.self_attn.q_proj": 4, "down_proj": 2},
            "alpha_pattern": {"v_proj": 32, "layers\\.[0-9]+\\.mlp\\.down_proj": 4}"#)
    .unwrap();
    assert_eq!(c.rank_and_scale(0, LoraModule::Q), (8, 2.0));
    assert_eq!(c.rank_and_scale(1, LoraModule::Q), (4, 4.0));
    assert_eq!(c.rank_and_scale(1, LoraModule::V), (8, 4.0));
    assert_eq!(c.rank_and_scale(3, LoraModule::Down), (2, 2.0));
    let rs =
        cfg(r#", "target_modules": ["q_proj"], "use_rslora": true, "rank_pattern": {"q_proj": 4}"#)
            .unwrap();
    assert_eq!(rs.rank_and_scale(0, LoraModule::Q), (4, 8.0));
}

#[test]
fn target_module_forms() {
    let all = cfg(r#", "target_modules": "all-linear""#).unwrap();
    assert_eq!(all.target_modules, LoraModule::ALL.to_vec());
    let re = cfg(r#", "target_modules": ".*\\.(q_proj|v_proj)""#).unwrap();
    assert_eq!(re.target_modules, vec![LoraModule::Q, LoraModule::V]);
    let re = cfg(r#", "target_modules": ".*layers\\.[01]\\.mlp\\.(gate|up)_proj""#).unwrap();
    assert_eq!(re.target_modules, vec![LoraModule::Gate, LoraModule::Up]);
    assert!(re.targets(1, LoraModule::Up) && !re.targets(2, LoraModule::Up));
    let dotted = cfg(r#", "target_modules": ["self_attn.o_proj", "mlp.down_proj"]"#).unwrap();
    assert_eq!(dotted.target_modules, vec![LoraModule::O, LoraModule::Down]);
    let layers = cfg(r#", "target_modules": ["q_proj"], "layers_to_transform": 1"#).unwrap();
    assert_eq!(layers.layers_to_transform, Some(vec![1]));
    assert!(layers.targets(1, LoraModule::Q) && !layers.targets(0, LoraModule::Q));
    let excl =
        cfg(r#", "target_modules": "all-linear", "exclude_modules": ["mlp.down_proj"]"#).unwrap();
    assert!(!excl.targets(0, LoraModule::Down) && excl.targets(0, LoraModule::Up));
    let fan = cfg(r#", "target_modules": ["q_proj"], "fan_in_fan_out": true"#).unwrap();
    assert!(!fan.fan_in_fan_out);
}

#[test]
fn target_modules_outside_the_projections_are_rejected() {
    for (targets, bad) in [
        (r#"["q_proj", "lm_head"]"#, "lm_head"),
        (r#"["embed_tokens"]"#, "embed_tokens"),
        (r#"["foo_proj"]"#, "foo_proj"),
        (r#"["mlp.q_proj"]"#, "mlp.q_proj"),
    ] {
        match cfg(&format!(r#", "target_modules": {targets}"#)) {
            Err(AdapterError::UnknownTargetModule(m)) => assert_eq!(m, bad),
            other => panic!("{targets}: expected UnknownTargetModule, got {other:?}"),
        }
    }
    assert!(matches!(
        cfg(r#", "target_modules": ".*(q_proj|lm_head)""#),
        Err(AdapterError::UnknownTargetModule(m)) if m.starts_with("lm_head")
    ));
    assert!(matches!(
        cfg(r#", "target_modules": "nothing""#),
        Err(AdapterError::UnknownTargetModule(_))
    ));
    assert!(matches!(
        cfg(r#", "target_modules": "(?<=x)q_proj""#),
        Err(AdapterError::InvalidConfig { field, .. }) if field == "target_modules"
    ));
    assert!(matches!(
        cfg(r#", "target_modules": []"#),
        Err(AdapterError::InvalidConfig { field, .. }) if field == "target_modules"
    ));
}

#[test]
fn unsupported_features_are_rejected() {
    assert!(matches!(
        cfg(r#", "target_modules": ["q_proj"], "r": 0"#),
        Err(AdapterError::InvalidConfig { .. })
    ));
    for extra in [
        r#", "layer_replication": [[0, 2]]"#,
        r#", "target_parameters": ["experts.gate_up_proj"]"#,
        r#", "trainable_token_indices": [5, 6]"#,
        r#", "use_qalora": true"#,
        r#", "alora_invocation_tokens": [1, 2]"#,
    ] {
        assert!(
            matches!(
                cfg(&format!(r#", "target_modules": ["q_proj"]{extra}"#)),
                Err(AdapterError::InvalidConfig { .. })
            ),
            "{extra}"
        );
    }
    assert!(matches!(
        cfg(r#", "target_modules": ["q_proj"], "lora_bias": true"#),
        Err(AdapterError::Bias(_))
    ));
}

/// Fuzzing found (issue 13): `lora_alpha: 1e308` parsed to an infinite f32 scale, which turns
/// every output of the adapter into NaN. Alphas beyond f32 are refused, in both places.
#[test]
fn alphas_beyond_f32_are_refused() {
    let targets = r#", "target_modules": ["q_proj"]"#;
    for (extra, field) in [
        (r#", "lora_alpha": 1e308"#, "lora_alpha"),
        (r#", "lora_alpha": -1e39"#, "lora_alpha"),
        (
            r#", "alpha_pattern": {"q_proj": 1e300}"#,
            "alpha_pattern.q_proj",
        ),
    ] {
        let text = format!(r#"{{"peft_type": "LORA", "r": 8, "bias": "none" {targets} {extra}}}"#);
        match AdapterConfig::from_json(&text) {
            Err(AdapterError::InvalidConfig { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{extra}: expected InvalidConfig, got {other:?}"),
        }
    }
    let ok = cfg(r#", "target_modules": ["q_proj"], "alpha_pattern": {"q_proj": 3e38}"#).unwrap();
    assert!(ok.rank_and_scale(0, LoraModule::Q).1.is_finite());
}
