use std::path::PathBuf;

use safetensors::Dtype;
use serde_json::{json, Value};

use super::*;
use crate::model::fixtures;

fn model() -> ModelConfig {
    ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap()
}

fn load(dir: &Path) -> Result<LoraAdapter, AdapterError> {
    LoraAdapter::load(dir, &model())
}

/// A writable copy of a fixture adapter with `edit` applied to its adapter_config.json.
fn with_config(
    name: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> tempfile::TempDir {
    let dir = fixtures::scratch_copy(&fixtures::adapter(name));
    let path = dir.path().join("adapter_config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    dir
}

type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

fn read_tensors(path: &Path) -> Vec<Owned> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<Owned> = st
        .iter()
        .map(|(n, v)| {
            (
                n.to_string(),
                v.dtype(),
                v.shape().to_vec(),
                v.data().to_vec(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn write_tensors(path: &Path, tensors: &[Owned]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn weights_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("adapter_model.safetensors")
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn r4_qv_fixture_loads() {
    let a = load(&fixtures::adapter("r4_qv")).unwrap();
    assert_eq!(a.targets(), &[LoraModule::Q, LoraModule::V]);
    assert_eq!((a.num_layers(), a.max_rank()), (2, 4));
    assert!(a.get(0, LoraModule::K).is_none() && a.get(2, LoraModule::Q).is_none());
    let v1 = a.get(1, LoraModule::V).unwrap();
    assert_eq!((v1.rank, v1.scale), (4, 2.0));
    assert_eq!((v1.a.numel(), v1.b.numel()), (4 * 64, 32 * 4));
    assert_eq!(v1.a.dtype(), WeightDtype::F32);
    // Values are the file's, unchanged.
    let raw = read_tensors(&fixtures::adapter("r4_qv").join("adapter_model.safetensors"));
    let b_raw = raw
        .iter()
        .find(|t| t.0 == "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight")
        .unwrap();
    assert_eq!(v1.b.to_f32(), f32s(&b_raw.3));
    assert_eq!(v1.b.bytes(), &b_raw.3[..]);
    assert!(v1.a.to_f32().iter().any(|&x| x != 0.0) && v1.b.to_f32().iter().any(|&x| x != 0.0));
    assert_eq!(a.size_bytes(), 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4) * 4);
}

#[test]
fn r8_all_rslora_fixture_loads() {
    let a = load(&fixtures::adapter("r8_all_rslora")).unwrap();
    assert_eq!(a.targets(), &LoraModule::ALL);
    assert_eq!(a.max_rank(), 8);
    for (_, m, w) in a.iter() {
        let (d_in, d_out) = model().module_shape(m);
        assert_eq!((w.a.numel(), w.b.numel()), (8 * d_in, d_out * 8));
        assert!((w.scale - 16.0 / 8f32.sqrt()).abs() < 1e-6);
    }
    assert_eq!(a.iter().count(), 14);
}

/// The r4_qv fixture re-saved in `dtype` (each f32 rounded to nearest even), with the
/// `.default` infix PEFT writes for named adapters.
fn resaved(dtype: Dtype) -> tempfile::TempDir {
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    let converted: Vec<Owned> = read_tensors(&weights_path(&dir))
        .into_iter()
        .map(|(n, _, s, b)| {
            let f = f32s(&b);
            let bytes: Vec<u8> = match dtype {
                Dtype::BF16 => f
                    .iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect(),
                Dtype::F16 => f
                    .iter()
                    .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                    .collect(),
                _ => b,
            };
            (n.replace(".weight", ".default.weight"), dtype, s, bytes)
        })
        .collect();
    write_tensors(&weights_path(&dir), &converted);
    dir
}

#[test]
fn bf16_weights_and_default_infix_load() {
    let orig = load(&fixtures::adapter("r4_qv")).unwrap();
    let dir = resaved(Dtype::BF16);
    let a = load(dir.path()).unwrap();
    let (x, y) = (
        orig.get(0, LoraModule::Q).unwrap(),
        a.get(0, LoraModule::Q).unwrap(),
    );
    for (p, q) in x.a.to_f32().iter().zip(&y.a.to_f32()) {
        // bf16 keeps 8 significant bits: relative error at most 2^-8.
        assert!((p - q).abs() <= p.abs() / 256.0 + 1e-12);
    }
}

/// A 2-byte adapter stays 2 bytes a weight (exactly the file's tensor bytes, half the f32
/// copy's size); an f32 adapter converted once to bf16 holds the same bytes as the file saved
/// in bf16; converting to the dtype it has already is a no-op.
#[test]
fn adapters_keep_their_stored_dtype_and_size() {
    let f32a = load(&fixtures::adapter("r4_qv")).unwrap();
    let f32_bytes = f32a.size_bytes();
    assert_eq!(f32a.dtype(), WeightDtype::F32);
    for (dtype, wd) in [
        (Dtype::BF16, WeightDtype::Bf16),
        (Dtype::F16, WeightDtype::F16),
    ] {
        let dir = resaved(dtype);
        let a = load(dir.path()).unwrap();
        assert_eq!(a.dtype(), wd);
        assert_eq!(2 * a.size_bytes(), f32_bytes, "{dtype:?}");
        let file: usize = read_tensors(&weights_path(&dir))
            .iter()
            .map(|t| t.3.len())
            .sum();
        assert_eq!(a.size_bytes(), file, "{dtype:?}: not the file's bytes");
        for (_, _, w) in a.iter() {
            assert_eq!((w.a.dtype(), w.b.dtype()), (wd, wd));
            assert_eq!(w.bytes(), 2 * (w.a.numel() + w.b.numel()));
        }
        let converted = f32a.clone().into_dtype(wd);
        assert_eq!(converted.size_bytes(), a.size_bytes());
        for ((_, _, p), (_, _, q)) in converted.iter().zip(a.iter()) {
            assert_eq!(
                p, q,
                "{dtype:?}: one conversion differs from the saved file"
            );
        }
        let same = a.clone().into_dtype(wd);
        assert!(same.iter().zip(a.iter()).all(|(p, q)| p == q));
    }
}

#[test]
fn rank_pattern_ranks_load() {
    // Layer 0's q_proj saved at rank 2, everything else at 4.
    let dir = with_config("r4_qv", |c| {
        c.insert(
            "rank_pattern".into(),
            json!({"model.layers.0.self_attn.q_proj": 2}),
        );
        c.insert("alpha_pattern".into(), json!({"v_proj": 2}));
    });
    let mut tensors = read_tensors(&weights_path(&dir));
    for (n, _, shape, bytes) in &mut tensors {
        if n.starts_with("base_model.model.model.layers.0.self_attn.q_proj.lora_A") {
            *shape = vec![2, 64];
            bytes.truncate(2 * 64 * 4);
        } else if n.starts_with("base_model.model.model.layers.0.self_attn.q_proj.lora_B") {
            let v = f32s(bytes);
            *bytes = v
                .chunks(4)
                .flat_map(|row| row[..2].to_vec())
                .flat_map(f32::to_le_bytes)
                .collect();
            *shape = vec![64, 2];
        }
    }
    write_tensors(&weights_path(&dir), &tensors);
    let a = load(dir.path()).unwrap();
    let q0 = a.get(0, LoraModule::Q).unwrap();
    assert_eq!((q0.rank, q0.scale), (2, 4.0));
    assert_eq!((q0.a.numel(), q0.b.numel()), (2 * 64, 64 * 2));
    assert_eq!(a.get(1, LoraModule::Q).unwrap().rank, 4);
    assert_eq!(a.get(1, LoraModule::V).unwrap().scale, 0.5);
}

#[test]
fn dora_is_rejected() {
    let dir = with_config("r4_qv", |c| {
        c.insert("use_dora".into(), json!(true));
    });
    assert!(matches!(load(dir.path()), Err(AdapterError::Dora)));
}

#[test]
fn bias_all_is_rejected() {
    let dir = with_config("r4_qv", |c| {
        c.insert("bias".into(), json!("all"));
    });
    assert!(matches!(load(dir.path()), Err(AdapterError::Bias(b)) if b.contains("all")));
}

#[test]
fn bias_lora_only_is_rejected() {
    let dir = with_config("r4_qv", |c| {
        c.insert("bias".into(), json!("lora_only"));
    });
    assert!(matches!(load(dir.path()), Err(AdapterError::Bias(b)) if b.contains("lora_only")));
}

#[test]
fn modules_to_save_is_rejected() {
    let dir = with_config("r4_qv", |c| {
        c.insert("modules_to_save".into(), json!(["lm_head", "embed_tokens"]));
    });
    match load(dir.path()) {
        Err(AdapterError::ModulesToSave(m)) => assert_eq!(m, vec!["lm_head", "embed_tokens"]),
        other => panic!("expected ModulesToSave, got {other:?}"),
    }
    let dir = with_config("r4_qv", |c| {
        c.insert("modules_to_save".into(), json!([]));
    });
    assert!(load(dir.path()).is_ok());
}

#[test]
fn unknown_target_module_is_rejected() {
    let dir = with_config("r4_qv", |c| {
        c.insert(
            "target_modules".into(),
            json!(["q_proj", "v_proj", "lm_head"]),
        );
    });
    assert!(
        matches!(load(dir.path()), Err(AdapterError::UnknownTargetModule(m)) if m == "lm_head")
    );
}

#[test]
fn wrong_base_model_is_a_shape_mismatch() {
    let mut other = model();
    other.hidden_size = 128;
    other.head_dim = 32;
    match LoraAdapter::load(&fixtures::adapter("r4_qv"), &other) {
        Err(AdapterError::ShapeMismatch {
            tensor,
            expected,
            got,
        }) => {
            assert!(tensor.contains("lora_A"), "{tensor}");
            assert_eq!((expected, got), (vec![4, 128], vec![4, 64]));
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
}

#[test]
fn rank_mismatch_is_rejected() {
    let dir = with_config("r4_qv", |c| {
        c.insert("r".into(), json!(8));
    });
    match load(dir.path()) {
        Err(AdapterError::RankMismatch {
            config_rank,
            file_rank,
            ..
        }) => assert_eq!((config_rank, file_rank), (8, 4)),
        other => panic!("expected RankMismatch, got {other:?}"),
    }
}

#[test]
fn missing_weights_file_is_reported() {
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    std::fs::remove_file(weights_path(&dir)).unwrap();
    assert!(
        matches!(load(dir.path()), Err(AdapterError::MissingFile { path }) if path.ends_with("adapter_model.safetensors"))
    );
    std::fs::write(dir.path().join("adapter_model.bin"), b"PK\x03\x04").unwrap();
    assert!(matches!(
        load(dir.path()),
        Err(AdapterError::PickleWeights { .. })
    ));
}

#[test]
fn missing_config_file_is_reported() {
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    std::fs::remove_file(dir.path().join("adapter_config.json")).unwrap();
    assert!(
        matches!(load(dir.path()), Err(AdapterError::MissingFile { path }) if path.ends_with("adapter_config.json"))
    );
}

#[test]
fn missing_dir_is_not_found() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        load(&dir.path().join("nope")),
        Err(AdapterError::NotFound { .. })
    ));
}

#[test]
fn truncated_safetensors_is_corrupt() {
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    let bytes = std::fs::read(weights_path(&dir)).unwrap();
    for cut in [bytes.len() - 100, 200, 5, 0] {
        std::fs::write(weights_path(&dir), &bytes[..cut]).unwrap();
        assert!(
            matches!(load(dir.path()), Err(AdapterError::Corrupt { .. })),
            "cut at {cut}"
        );
    }
}

#[test]
fn non_json_config_is_rejected() {
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    std::fs::write(
        dir.path().join("adapter_config.json"),
        "r: 4\nlora_alpha: 8\n",
    )
    .unwrap();
    assert!(matches!(
        load(dir.path()),
        Err(AdapterError::ConfigNotJson { .. })
    ));
}

#[test]
fn prefix_tuning_is_rejected() {
    let dir = with_config("r4_qv", |c| {
        c.insert("peft_type".into(), json!("PREFIX_TUNING"));
    });
    assert!(
        matches!(load(dir.path()), Err(AdapterError::UnsupportedPeftType(t)) if t == "PREFIX_TUNING")
    );
}

#[test]
fn targeted_but_absent_tensor_is_missing() {
    let dir = with_config("r4_qv", |c| {
        c.insert(
            "target_modules".into(),
            json!(["q_proj", "k_proj", "v_proj"]),
        );
    });
    assert!(matches!(
        load(dir.path()),
        Err(AdapterError::MissingTensor { tensor }) if tensor == "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    ));
}

#[test]
fn untargeted_tensor_is_unexpected() {
    let dir = with_config("r4_qv", |c| {
        c.insert("target_modules".into(), json!(["q_proj"]));
    });
    assert!(
        matches!(load(dir.path()), Err(AdapterError::UnexpectedTensor { tensor, .. }) if tensor.contains("v_proj"))
    );
}

#[test]
fn embedding_lora_tensor_is_unexpected() {
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    let mut tensors = read_tensors(&weights_path(&dir));
    let extra: Vec<u8> = (0..4 * 300)
        .flat_map(|i| (i as f32 * 0.01).to_le_bytes())
        .collect();
    tensors.push((
        "base_model.model.model.embed_tokens.lora_embedding_A".into(),
        Dtype::F32,
        vec![4, 300],
        extra,
    ));
    write_tensors(&weights_path(&dir), &tensors);
    assert!(matches!(
        load(dir.path()),
        Err(AdapterError::UnexpectedTensor { tensor, .. }) if tensor.contains("lora_embedding_A")
    ));
}

#[test]
fn adapter_for_deeper_model_is_layer_out_of_range() {
    let mut shallow = model();
    shallow.num_layers = 1;
    assert!(matches!(
        LoraAdapter::load(&fixtures::adapter("r4_qv"), &shallow),
        Err(AdapterError::LayerOutOfRange {
            layer: 1,
            num_layers: 1,
            ..
        })
    ));
}

#[test]
fn unsupported_dtype_is_rejected() {
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    let tensors: Vec<Owned> = read_tensors(&weights_path(&dir))
        .into_iter()
        .map(|(n, _, s, b)| (n, Dtype::I32, s, b))
        .collect();
    write_tensors(&weights_path(&dir), &tensors);
    assert!(
        matches!(load(dir.path()), Err(AdapterError::UnsupportedDtype { dtype, .. }) if dtype == "I32")
    );
}

#[test]
fn names_parse_with_and_without_prefixes() {
    assert_eq!(
        parse_name("base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"),
        Some((3, LoraModule::Down, Factor::B))
    );
    assert_eq!(
        parse_name("model.layers.0.self_attn.q_proj.lora_A.default.weight"),
        Some((0, LoraModule::Q, Factor::A))
    );
    assert_eq!(
        parse_name("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight"),
        None
    );
    assert_eq!(
        parse_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.bias"),
        None
    );
    assert_eq!(
        parse_name("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"),
        None
    );
    assert_eq!(parse_name("base_model.model.lm_head.lora_A.weight"), None);
}

/// Fuzzing found (issue 13): NaN and infinite weights loaded, and would have made every logit
/// of the adapter's requests NaN. Each non-finite pattern, in each float dtype, is refused.
#[test]
fn non_finite_weights_are_refused() {
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    let original = read_tensors(&weights_path(&dir));
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            let mut tensors = original.clone();
            let (name, d, _, bytes) = &mut tensors[1];
            let mut values = f32s(bytes);
            values[3] = bad;
            *d = dtype;
            *bytes = match dtype {
                Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                Dtype::BF16 => values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
                _ => values
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
            };
            let name = name.clone();
            write_tensors(&weights_path(&dir), &tensors);
            match load(dir.path()) {
                Err(AdapterError::NonFinite { tensor, index }) => {
                    assert_eq!((tensor.as_str(), index), (name.as_str(), 3))
                }
                other => panic!("{bad} as {dtype:?}: expected NonFinite, got {other:?}"),
            }
        }
    }
}
