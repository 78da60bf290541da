use std::collections::BTreeSet;

use safetensors::SafeTensors;

use super::*;
use crate::gen::model::{write_model, GenModelOptions};
use crate::gen::presets::preset;

/// Keys of an `adapter_config.json` written by PEFT 0.21.2 (the HF-written fixture).
const PEFT_0_21_KEYS: &[&str] = &[
    "alora_invocation_tokens",
    "alpha_pattern",
    "arrow_config",
    "auto_mapping",
    "base_model_name_or_path",
    "bias",
    "corda_config",
    "ensure_weight_tying",
    "eva_config",
    "exclude_modules",
    "fan_in_fan_out",
    "inference_mode",
    "init_lora_weights",
    "kasa_config",
    "layer_replication",
    "layers_pattern",
    "layers_to_transform",
    "loftq_config",
    "lora_alpha",
    "lora_bias",
    "lora_dropout",
    "lora_ga_config",
    "megatron_config",
    "megatron_core",
    "modules_to_save",
    "monteclora_config",
    "peft_type",
    "peft_version",
    "qalora_group_size",
    "r",
    "rank_pattern",
    "revision",
    "target_modules",
    "target_parameters",
    "task_type",
    "trainable_token_indices",
    "use_bdlora",
    "use_dora",
    "use_qalora",
    "use_rslora",
    "velora_config",
];

fn tiny_model(dtype: WeightDtype) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let opts = GenModelOptions {
        dtype: Some(dtype),
        ..Default::default()
    };
    write_model(&preset("tiny").unwrap(), dir.path(), &opts).unwrap();
    dir
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn config_has_peft_field_set() {
    let opts = GenAdaptersOptions::default();
    let cfg = adapter_config("m", 16, &opts);
    let keys: BTreeSet<&str> = cfg
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys, PEFT_0_21_KEYS.iter().copied().collect());
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["r"], 16);
    assert_eq!(cfg["lora_alpha"], 32);
    assert_eq!(cfg["task_type"], "CAUSAL_LM");
    assert_eq!(
        cfg["target_modules"],
        json!([
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj"
        ])
    );
    let half = GenAdaptersOptions {
        alpha_ratio: 0.5,
        ..Default::default()
    };
    assert_eq!(adapter_config("m", 3, &half)["lora_alpha"], 1.5);
}

#[test]
fn writes_cycling_ranks_with_peft_tensor_names_and_nonzero_weights() {
    let model = tiny_model(WeightDtype::Bf16);
    let out = tempfile::tempdir().unwrap();
    let opts = GenAdaptersOptions {
        model_dir: model.path().to_path_buf(),
        out_dir: out.path().to_path_buf(),
        count: 5,
        ranks: vec![8, 16, 32],
        targets: vec![Projection::V, Projection::Q, Projection::Down],
        use_rslora: true,
        ..Default::default()
    };
    let dirs = write_adapters(&opts).unwrap();
    let names: Vec<String> = dirs
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "adapter-000-r8",
            "adapter-001-r16",
            "adapter-002-r32",
            "adapter-003-r8",
            "adapter-004-r16"
        ]
    );

    for (dir, r) in dirs.iter().zip([8usize, 16, 32, 8, 16]) {
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["r"], r);
        assert_eq!(cfg["lora_alpha"], 2 * r);
        assert_eq!(cfg["use_rslora"], true);
        assert_eq!(
            cfg["target_modules"],
            json!(["q_proj", "v_proj", "down_proj"])
        );
        assert_eq!(
            cfg["base_model_name_or_path"],
            model.path().to_string_lossy().as_ref()
        );

        let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut expected = BTreeSet::new();
        for l in 0..2 {
            for (module, d_in, d_out) in [
                ("self_attn.q_proj", 64, 64),
                ("self_attn.v_proj", 64, 32),
                ("mlp.down_proj", 172, 64),
            ] {
                let pre = format!("base_model.model.model.layers.{l}.{module}");
                let a = st.tensor(&format!("{pre}.lora_A.weight")).unwrap();
                let b = st.tensor(&format!("{pre}.lora_B.weight")).unwrap();
                assert_eq!(a.shape(), [r, d_in]);
                assert_eq!(b.shape(), [d_out, r]);
                for t in [&a, &b] {
                    // Model is bf16, no --dtype: adapters follow the model.
                    assert_eq!(t.dtype(), safetensors::Dtype::BF16);
                    let nonzero = t.data().chunks_exact(2).filter(|c| c != &[0, 0]).count();
                    assert!(
                        nonzero * 100 >= t.data().len() / 2 * 99,
                        "{pre}: too many zeros"
                    );
                }
                expected.insert(format!("{pre}.lora_A.weight"));
                expected.insert(format!("{pre}.lora_B.weight"));
            }
        }
        assert_eq!(
            st.names()
                .into_iter()
                .map(str::to_string)
                .collect::<BTreeSet<_>>(),
            expected
        );
    }
    // Same rank, different adapter: different weights.
    let read = |i: usize| std::fs::read(dirs[i].join("adapter_model.safetensors")).unwrap();
    assert_ne!(read(0), read(3));
}

#[test]
fn delta_is_a_visible_fraction_of_the_base_output() {
    let model = tiny_model(WeightDtype::F32);
    let out = tempfile::tempdir().unwrap();
    for use_rslora in [false, true] {
        let opts = GenAdaptersOptions {
            model_dir: model.path().to_path_buf(),
            out_dir: out.path().to_path_buf(),
            count: 2,
            ranks: vec![8, 64],
            use_rslora,
            ..Default::default()
        };
        let dirs = write_adapters(&opts).unwrap();
        let base_bytes = std::fs::read(model.path().join("model.safetensors")).unwrap();
        let base = SafeTensors::deserialize(&base_bytes).unwrap();
        for (dir, r) in dirs.iter().zip([8usize, 64]) {
            let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let scale = opts.scale(r) as f32;
            for (module, d_in, d_out) in [
                ("self_attn.q_proj", 64, 64),
                ("self_attn.o_proj", 64, 64),
                ("mlp.down_proj", 172, 64),
            ] {
                let w = f32s(
                    base.tensor(&format!("model.layers.1.{module}.weight"))
                        .unwrap()
                        .data(),
                );
                let pre = format!("base_model.model.model.layers.1.{module}");
                let a = f32s(st.tensor(&format!("{pre}.lora_A.weight")).unwrap().data());
                let b = f32s(st.tensor(&format!("{pre}.lora_B.weight")).unwrap().data());
                // Deterministic, non-constant probe inputs.
                let (mut y2, mut d2) = (0.0f64, 0.0f64);
                for k in 0..16 {
                    let x: Vec<f32> = (0..d_in)
                        .map(|i| ((i * 7 + k * 13) as f32 * 0.37).sin())
                        .collect();
                    let ax: Vec<f32> = (0..r)
                        .map(|j| (0..d_in).map(|i| a[j * d_in + i] * x[i]).sum())
                        .collect();
                    for o in 0..d_out {
                        let y: f32 = (0..d_in).map(|i| w[o * d_in + i] * x[i]).sum();
                        let d: f32 = scale * (0..r).map(|j| b[o * r + j] * ax[j]).sum::<f32>();
                        y2 += f64::from(y * y);
                        d2 += f64::from(d * d);
                    }
                }
                let rel = (d2 / y2).sqrt();
                // Target 0.25; random matrices this small scatter by tens of percent.
                assert!(
                    (0.1..0.5).contains(&rel),
                    "{module} r{r} rslora={use_rslora}: rel {rel}"
                );
            }
        }
    }
}

#[test]
fn missing_model_config_is_a_clear_error() {
    let empty = tempfile::tempdir().unwrap();
    let opts = GenAdaptersOptions {
        model_dir: empty.path().to_path_buf(),
        out_dir: empty.path().join("out"),
        ..Default::default()
    };
    let err = format!("{:#}", write_adapters(&opts).unwrap_err());
    assert!(err.contains("config.json"), "{err}");
}
