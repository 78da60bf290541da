use std::collections::BTreeMap;

use safetensors::SafeTensors;

use super::*;
use crate::gen::presets::preset;

fn tiny() -> ModelPreset {
    preset("tiny").unwrap()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// name → (dtype, shape) of the tensors in a safetensors file.
type Header = BTreeMap<String, (safetensors::Dtype, Vec<usize>)>;

/// The tensors of a safetensors file, plus its `__metadata__.format`.
fn read_header(path: &Path) -> (Header, Option<String>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, (view.dtype(), view.shape().to_vec())))
        .collect();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let format = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("format").cloned());
    (tensors, format)
}

fn expected_tensors(p: &ModelPreset) -> BTreeMap<String, Vec<usize>> {
    let (h, i, q, kv, v) = (
        p.hidden_size,
        p.intermediate_size,
        p.q_dim(),
        p.kv_dim(),
        p.vocab_size,
    );
    let mut out = BTreeMap::from([
        ("model.embed_tokens.weight".to_string(), vec![v, h]),
        ("lm_head.weight".to_string(), vec![v, h]),
        ("model.norm.weight".to_string(), vec![h]),
    ]);
    for l in 0..p.num_hidden_layers {
        let pre = format!("model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj", vec![q, h]),
            ("self_attn.k_proj", vec![kv, h]),
            ("self_attn.v_proj", vec![kv, h]),
            ("self_attn.o_proj", vec![h, q]),
            ("mlp.gate_proj", vec![i, h]),
            ("mlp.up_proj", vec![i, h]),
            ("mlp.down_proj", vec![h, i]),
            ("input_layernorm", vec![h]),
            ("post_attention_layernorm", vec![h]),
        ] {
            out.insert(format!("{pre}.{name}.weight"), shape);
        }
    }
    out
}

fn check_tiny_dir(dtype: WeightDtype) {
    let dir = tempfile::tempdir().unwrap();
    let p = tiny();
    let opts = GenModelOptions {
        dtype: Some(dtype),
        ..Default::default()
    };
    let t0 = std::time::Instant::now();
    write_model(&p, dir.path(), &opts).unwrap();
    eprintln!("tiny {dtype}: {:?}", t0.elapsed());

    let cfg = read_json(&dir.path().join("config.json"));
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["architectures"], json!(["LlamaForCausalLM"]));
    assert_eq!(cfg["hidden_size"], 64);
    assert_eq!(cfg["intermediate_size"], 172);
    assert_eq!(cfg["num_hidden_layers"], 2);
    assert_eq!(cfg["num_attention_heads"], 4);
    assert_eq!(cfg["num_key_value_heads"], 2);
    assert_eq!(cfg["head_dim"], 16);
    assert_eq!(cfg["vocab_size"], 512);
    assert_eq!(cfg["max_position_embeddings"], 512);
    assert_eq!(cfg["rope_theta"], 10000.0);
    assert_eq!(cfg["rms_norm_eps"], 1e-6);
    assert_eq!(cfg["tie_word_embeddings"], false);
    assert_eq!(cfg["bos_token_id"], 0);
    assert_eq!(cfg["eos_token_id"], 1);
    assert_eq!(cfg["torch_dtype"], dtype.torch_name());

    let gen = read_json(&dir.path().join("generation_config.json"));
    assert_eq!(gen["eos_token_id"], json!([1, 3]));

    let (tensors, format) = read_header(&dir.path().join("model.safetensors"));
    assert_eq!(format.as_deref(), Some("pt"));
    assert!(!dir.path().join("model.safetensors.index.json").exists());
    let expected = expected_tensors(&p);
    assert_eq!(
        tensors.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    for (name, (dt, shape)) in &tensors {
        assert_eq!(*dt, dtype.safetensors(), "{name}");
        assert_eq!(shape, &expected[name], "{name}");
    }

    let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    assert!(tok.get_vocab_size(true) <= 512);
    for s in [
        "Hello, world! This is a test.",
        "def f(x):\n    return {'a': x ** 2}\n",
        "Ça va? Привет, 世界 🦀",
    ] {
        let ids = tok.encode(s, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, false).unwrap(), s);
    }
    let tok_cfg = read_json(&dir.path().join("tokenizer_config.json"));
    assert!(tok_cfg["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    assert_eq!(tok_cfg["bos_token"], "<s>");
    assert_eq!(tok_cfg["eos_token"], "</s>");
    assert_eq!(tok_cfg["model_max_length"], 512);
    assert!(dir.path().join("special_tokens_map.json").exists());
}

#[test]
fn tiny_f32_dir_is_complete() {
    check_tiny_dir(WeightDtype::F32);
}

#[test]
fn tiny_bf16_dir_is_complete() {
    check_tiny_dir(WeightDtype::Bf16);
}

#[test]
fn same_seed_same_bytes_other_seed_other_weights() {
    let write = |seed| {
        let dir = tempfile::tempdir().unwrap();
        let opts = GenModelOptions {
            seed,
            ..Default::default()
        };
        write_model(&tiny(), dir.path(), &opts).unwrap();
        dir
    };
    let (a, b, c) = (write(5), write(5), write(6));
    for file in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        let read = |d: &tempfile::TempDir| std::fs::read(d.path().join(file)).unwrap();
        assert_eq!(read(&a), read(&b), "{file} differs for the same seed");
    }
    let weights =
        |d: &tempfile::TempDir| std::fs::read(d.path().join("model.safetensors")).unwrap();
    assert_ne!(weights(&a), weights(&c));
}

#[test]
fn rewriting_with_smaller_shards_removes_the_old_single_file() {
    let dir = tempfile::tempdir().unwrap();
    write_model(&tiny(), dir.path(), &GenModelOptions::default()).unwrap();
    let opts = GenModelOptions {
        max_shard_bytes: 200_000,
        ..Default::default()
    };
    write_model(&tiny(), dir.path(), &opts).unwrap();
    assert!(!dir.path().join("model.safetensors").exists());
    let index = read_json(&dir.path().join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), expected_tensors(&tiny()).len());
    for (name, file) in map {
        let (tensors, _) = read_header(&dir.path().join(file.as_str().unwrap()));
        assert!(tensors.contains_key(name), "{name} not in {file}");
    }
}

#[test]
fn llama_7b_shape_plan() {
    let p = preset("llama-7b-shape").unwrap();
    assert_eq!(p.default_dtype, WeightDtype::Bf16);
    let cfg = model_config(&p, p.default_dtype);
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    assert_eq!(cfg["vocab_size"], 32000);
    assert_eq!(cfg["num_key_value_heads"], 32);

    let plan = ModelPlan::new(&p, p.default_dtype, 2048, DEFAULT_MAX_SHARD_BYTES);
    assert_eq!(plan.tensors.len(), 2 + 32 * 9 + 1);
    let names: BTreeMap<String, Vec<usize>> = plan
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect();
    assert_eq!(names, expected_tensors(&p));
    // Llama-2-7B: 6,738,415,616 parameters, 13.48 GB in bf16.
    assert_eq!(plan.num_params(), 6_738_415_616);
    assert_eq!(plan.shards.total_bytes, 2 * 6_738_415_616);

    let shards = &plan.shards.shards;
    assert_eq!(shards.len(), 3);
    let mut seen = vec![0usize; plan.tensors.len()];
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(
            s.file_name,
            format!("model-{:05}-of-00003.safetensors", i + 1)
        );
        assert!(
            s.bytes <= DEFAULT_MAX_SHARD_BYTES,
            "{} is {} bytes",
            s.file_name,
            s.bytes
        );
        let sum: u64 = s
            .tensors
            .iter()
            .map(|&t| plan.tensors[t].size_bytes() as u64)
            .sum();
        assert_eq!(sum, s.bytes);
        for &t in &s.tensors {
            seen[t] += 1;
        }
    }
    assert!(
        seen.iter().all(|&n| n == 1),
        "every tensor in exactly one shard"
    );

    let index = plan.shards.index(&plan.tensors).unwrap();
    assert_eq!(index["metadata"]["total_size"], 13_476_831_232u64);
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), plan.tensors.len());
    assert_eq!(
        map["model.embed_tokens.weight"],
        "model-00001-of-00003.safetensors"
    );
    assert_eq!(map["lm_head.weight"], "model-00003-of-00003.safetensors");
    // Padding rows past the tokenizer's vocabulary are zero in both vocab matrices.
    assert_eq!(plan.tensors[0].init.live_rows, Some(2048));
    assert_eq!(plan.tensors.last().unwrap().init.live_rows, Some(2048));
}

#[test]
fn small_preset_is_about_26m_params() {
    let p = preset("small").unwrap();
    let plan = ModelPlan::new(&p, WeightDtype::F32, 2048, DEFAULT_MAX_SHARD_BYTES);
    let n = plan.num_params();
    assert!((25_000_000..27_000_000).contains(&n), "{n}");
    assert_eq!(plan.shards.shards.len(), 1);
}
