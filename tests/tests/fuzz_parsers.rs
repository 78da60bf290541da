//! Fuzz targets (proptest, stable toolchain) for every parser that reads bytes from outside:
//! PEFT `adapter_config.json`, adapter safetensors, HF `config.json`, the tokenizer files and
//! tokenizer inputs. Structure-aware targets build nearly valid inputs and break one thing at
//! a time (lying offsets, oversize headers, huge shapes, NaN/Inf, wrong types, extremes), so
//! they reach the checks deep inside; raw targets feed random and mutated bytes. Every target
//! must end in `Ok` or a clear error — no panic, hang or oversized allocation. See
//! `fuzz_support` for case counts and long campaigns.
mod fuzz_support;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use thaw_runtime::adapter::{AdapterConfig, LoraAdapter, LoraModule};
use thaw_runtime::model::{IncrementalDecoder, ModelConfig, Tokenizer};
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions};

use fuzz_support::fuzz;

#[global_allocator]
static ALLOC: fuzz_support::CappedAlloc = fuzz_support::CappedAlloc;

/// One generated model and rank-8 adapter, shared by every case.
struct Fixture {
    _dir: tempfile::TempDir,
    model_dir: PathBuf,
    config: ModelConfig,
    tokenizer: Tokenizer,
    adapter_config: String,
    safetensors: Vec<u8>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("model");
        gen::write_model(
            &thaw_tests::test_preset(),
            &model_dir,
            &GenModelOptions::default(),
        )
        .unwrap();
        let adapters = gen::write_adapters(&GenAdaptersOptions {
            model_dir: model_dir.clone(),
            out_dir: dir.path().join("adapters"),
            count: 1,
            ranks: vec![8],
            ..Default::default()
        })
        .unwrap();
        let config = ModelConfig::from_dir(&model_dir).unwrap();
        let tokenizer = Tokenizer::from_dir(&model_dir, &config).unwrap();
        Fixture {
            adapter_config: std::fs::read_to_string(adapters[0].join("adapter_config.json"))
                .unwrap(),
            safetensors: std::fs::read(adapters[0].join("adapter_model.safetensors")).unwrap(),
            _dir: dir,
            model_dir,
            config,
            tokenizer,
        }
    })
}

/// A scratch adapter directory per test thread.
fn scratch() -> PathBuf {
    thread_local! {
        static DIR: tempfile::TempDir = tempfile::tempdir().unwrap();
    }
    DIR.with(|d| d.path().to_path_buf())
}

/// Loads an adapter from these two files; the result, after checking that a success is sane.
fn load_adapter(config: &[u8], weights: &[u8]) -> Result<(), TestCaseError> {
    let dir = scratch();
    std::fs::write(dir.join("adapter_config.json"), config).unwrap();
    std::fs::write(dir.join("adapter_model.safetensors"), weights).unwrap();
    let model = &fixture().config;
    if let Ok(a) = LoraAdapter::load(&dir, model) {
        for (layer, m, w) in a.iter() {
            let (d_in, d_out) = model.module_shape(m);
            prop_assert!(layer < model.num_layers);
            prop_assert_eq!(w.a.numel(), w.rank * d_in);
            prop_assert_eq!(w.b.numel(), d_out * w.rank);
            prop_assert!(w.scale.is_finite(), "scale {} accepted", w.scale);
            prop_assert!(
                w.a.to_f32()
                    .iter()
                    .chain(&w.b.to_f32())
                    .all(|x| x.is_finite()),
                "non-finite weights accepted"
            );
        }
    }
    Ok(())
}

// ---- JSON values at the edges ---------------------------------------------------------------

fn edge_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(8)),
        Just(json!(16)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!(1u64 << 32)),
        Just(json!(1u64 << 40)),
        Just(json!(1e308)),
        Just(json!(-1e308)),
        Just(json!(1e-308)),
        Just(json!(0.5)),
        Just(json!(-0.0)),
        any::<i64>().prop_map(|v| json!(v)),
        any::<f64>()
            .prop_filter("JSON has no NaN/Inf", |f| f.is_finite())
            .prop_map(|v| json!(v)),
    ]
}

fn edge_string() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("q_proj".to_string()),
        Just("v_proj".to_string()),
        Just("all-linear".to_string()),
        Just(".*".to_string()),
        Just(".*\\.(q|v)_proj".to_string()),
        Just("(a+)+$".to_string()),
        Just("[".to_string()),
        Just("a{1000}{1000}{1000}".to_string()),
        Just("lm_head".to_string()),
        Just("LORA".to_string()),
        Just("none".to_string()),
        Just("\u{0}\u{FFFD}".to_string()),
        "[a-z_.]{0,24}",
        any::<String>(),
    ]
}

fn edge_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        edge_number(),
        edge_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(2, 12, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(edge_string(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A JSON object: `base` with some fields replaced by edge values or removed, plus extra keys.
fn mutated_object(base: Value, fields: &'static [&'static str]) -> impl Strategy<Value = Value> {
    let edits = proptest::collection::vec(
        (
            proptest::sample::select(fields),
            proptest::option::weighted(0.85, edge_value()),
        ),
        0..5,
    );
    let extra = proptest::collection::vec((edge_string(), edge_value()), 0..2);
    (edits, extra).prop_map(move |(edits, extra)| {
        let mut obj: Map<String, Value> = base.as_object().cloned().unwrap_or_default();
        for (k, v) in edits {
            match v {
                Some(v) => obj.insert(k.to_string(), v),
                None => obj.remove(k),
            };
        }
        for (k, v) in extra {
            obj.entry(k).or_insert(v);
        }
        Value::Object(obj)
    })
}

/// Random bytes, or `seed` with bytes flipped, cut short, or spliced.
fn mutated_bytes(seed: fn() -> Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let flips = proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8);
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..512),
        (flips, any::<prop::sample::Index>(), any::<bool>()).prop_map(
            move |(flips, cut, trunc)| {
                let mut b = seed();
                for (i, v) in flips {
                    if !b.is_empty() {
                        let i = i.index(b.len());
                        b[i] = v;
                    }
                }
                if trunc && !b.is_empty() {
                    b.truncate(cut.index(b.len()));
                }
                b
            }
        ),
    ]
}

// ---- adapter_config.json --------------------------------------------------------------------

const ADAPTER_FIELDS: &[&str] = &[
    "r",
    "lora_alpha",
    "target_modules",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "layers_to_transform",
    "layers_pattern",
    "base_model_name_or_path",
    "exclude_modules",
    "peft_type",
    "use_dora",
    "bias",
    "lora_bias",
    "modules_to_save",
    "task_type",
    "init_lora_weights",
];

fn adapter_config_value() -> Value {
    serde_json::from_str(&fixture().adapter_config).unwrap()
}

fn check_adapter_config(text: &str) -> Result<(), TestCaseError> {
    if let Ok(c) = AdapterConfig::from_json(text) {
        for layer in 0..fixture().config.num_layers + 2 {
            for m in LoraModule::ALL {
                if c.targets(layer, m) {
                    let (rank, scale) = c.rank_and_scale(layer, m);
                    prop_assert!(rank > 0, "a targeted module with rank 0 was accepted");
                    prop_assert!(scale.is_finite(), "scale {scale} accepted");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn adapter_config_structured() {
    fixture();
    fuzz(
        "adapter_config_structured",
        300,
        mutated_object(adapter_config_value(), ADAPTER_FIELDS),
        |v| {
            let text = v.to_string();
            check_adapter_config(&text)?;
            load_adapter(text.as_bytes(), &fixture().safetensors)
        },
    );
}

#[test]
fn adapter_config_raw() {
    fuzz(
        "adapter_config_raw",
        300,
        mutated_bytes(|| fixture().adapter_config.clone().into_bytes()),
        |bytes| check_adapter_config(&String::from_utf8_lossy(&bytes)),
    );
}

// ---- adapter_model.safetensors --------------------------------------------------------------

/// One tensor entry of a safetensors header.
#[derive(Clone, Debug)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    offsets: (u64, u64),
}

/// The fixture adapter's header entries and data.
fn parse_fixture_safetensors() -> (Vec<Entry>, Vec<u8>) {
    let b = &fixture().safetensors;
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: Map<String, Value> = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let mut entries: Vec<Entry> = header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(name, v)| Entry {
            name,
            dtype: v["dtype"].as_str().unwrap().to_string(),
            shape: v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect(),
            offsets: (
                v["data_offsets"][0].as_u64().unwrap(),
                v["data_offsets"][1].as_u64().unwrap(),
            ),
        })
        .collect();
    entries.sort_by_key(|e| e.offsets.0);
    (entries, b[8 + n..].to_vec())
}

#[derive(Clone, Debug)]
enum Mutation {
    Dtype(prop::sample::Index, String),
    Shape(prop::sample::Index, Vec<u64>),
    Offsets(prop::sample::Index, u64, u64),
    Rename(prop::sample::Index, String),
    Drop(prop::sample::Index),
    /// Writes f32 NaN/Inf/denormal/huge bit patterns over part of the data.
    Poison(prop::sample::Index, u32),
    HeaderLen(u64),
    Truncate(prop::sample::Index),
    Metadata(Value),
    HeaderGarbage(Vec<u8>),
}

fn edge_dim() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0),
        Just(1),
        Just(7),
        Just(8),
        Just(9),
        Just(32),
        Just(64),
        Just(128),
        Just(256),
        Just(1 << 31),
        Just(1 << 40),
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        0..300u64,
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let idx = any::<prop::sample::Index>;
    let offset = || prop_oneof![edge_dim(), 0..20_000u64];
    prop_oneof![
        (
            idx(),
            proptest::sample::select(vec!["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "I64", "XX", ""])
                .prop_map(String::from)
        )
            .prop_map(|(i, d)| Mutation::Dtype(i, d)),
        (idx(), proptest::collection::vec(edge_dim(), 0..4)).prop_map(|(i, s)| Mutation::Shape(i, s)),
        (idx(), offset(), offset()).prop_map(|(i, a, b)| Mutation::Offsets(i, a, b)),
        (
            idx(),
            prop_oneof![
                Just("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight".to_string()),
                Just("base_model.model.model.layers.99999999999999999999.self_attn.q_proj.lora_A.weight".to_string()),
                Just("base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight".to_string()),
                Just("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight".to_string()),
                Just("base_model.model.model.layers.0.mlp.q_proj.lora_B.weight".to_string()),
                Just("base_model.model.lm_head.lora_A.weight".to_string()),
                Just("__metadata__".to_string()),
                edge_string(),
            ]
        )
            .prop_map(|(i, n)| Mutation::Rename(i, n)),
        idx().prop_map(Mutation::Drop),
        (
            idx(),
            prop_oneof![
                Just(f32::NAN.to_bits()),
                Just(f32::INFINITY.to_bits()),
                Just(f32::NEG_INFINITY.to_bits()),
                Just(0x7f80_0001),
                Just(0xffff_ffff),
                Just(1),
                Just(f32::MAX.to_bits()),
                Just(0x7c00_7c00),
                Just(0x7fc0_7fc0),
            ]
        )
            .prop_map(|(i, bits)| Mutation::Poison(i, bits)),
        prop_oneof![Just(0u64), Just(1), Just(7), Just(u64::MAX), Just(1 << 40), Just(100_000_001), 0..5000u64]
            .prop_map(Mutation::HeaderLen),
        idx().prop_map(Mutation::Truncate),
        edge_value().prop_map(Mutation::Metadata),
        proptest::collection::vec(any::<u8>(), 1..16).prop_map(Mutation::HeaderGarbage),
    ]
}

/// Serialises entries and data, applying the mutations.
fn build_safetensors(mut entries: Vec<Entry>, mut data: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    let mut header_len = None;
    let mut truncate = None;
    let mut metadata = None;
    let mut garbage = Vec::new();
    for m in muts {
        let pick = |i: &prop::sample::Index, n: usize| (n > 0).then(|| i.index(n));
        match m {
            Mutation::Dtype(i, d) => {
                if let Some(i) = pick(i, entries.len()) {
                    entries[i].dtype = d.clone();
                }
            }
            Mutation::Shape(i, s) => {
                if let Some(i) = pick(i, entries.len()) {
                    entries[i].shape = s.clone();
                }
            }
            Mutation::Offsets(i, a, b) => {
                if let Some(i) = pick(i, entries.len()) {
                    entries[i].offsets = (*a, *b);
                }
            }
            Mutation::Rename(i, n) => {
                if let Some(i) = pick(i, entries.len()) {
                    entries[i].name = n.clone();
                }
            }
            Mutation::Drop(i) => {
                if let Some(i) = pick(i, entries.len()) {
                    entries.remove(i);
                }
            }
            Mutation::Poison(i, bits) => {
                if let Some(i) = pick(i, data.len() / 4) {
                    let end = (i + 8).min(data.len() / 4);
                    for w in i..end {
                        data[w * 4..w * 4 + 4].copy_from_slice(&bits.to_le_bytes());
                    }
                }
            }
            Mutation::HeaderLen(n) => header_len = Some(*n),
            Mutation::Truncate(i) => truncate = Some(*i),
            Mutation::Metadata(v) => metadata = Some(v.clone()),
            Mutation::HeaderGarbage(g) => garbage = g.clone(),
        }
    }
    let mut header = Map::new();
    if let Some(m) = metadata {
        header.insert("__metadata__".into(), m);
    }
    for e in &entries {
        header.insert(
            e.name.clone(),
            json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [e.offsets.0, e.offsets.1]}),
        );
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
    if !garbage.is_empty() {
        let at = garbage[0] as usize % (h.len() + 1);
        h.splice(at..at, garbage[1..].iter().copied());
    }
    let mut out = header_len.unwrap_or(h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.append(&mut data);
    if let Some(i) = truncate {
        out.truncate(i.index(out.len() + 1));
    }
    out
}

#[test]
fn adapter_safetensors_structured() {
    let (entries, data) = parse_fixture_safetensors();
    let config = fixture().adapter_config.clone();
    // The unmutated file loads: the generator reaches the deep checks.
    load_adapter(
        config.as_bytes(),
        &build_safetensors(entries.clone(), data.clone(), &[]),
    )
    .unwrap();
    fuzz(
        "adapter_safetensors_structured",
        300,
        proptest::collection::vec(mutation(), 1..4),
        |muts| {
            let bytes = build_safetensors(entries.clone(), data.clone(), &muts);
            load_adapter(config.as_bytes(), &bytes)
        },
    );
}

#[test]
fn adapter_safetensors_raw() {
    let config = fixture().adapter_config.clone();
    fuzz(
        "adapter_safetensors_raw",
        300,
        mutated_bytes(|| fixture().safetensors.clone()),
        |bytes| load_adapter(config.as_bytes(), &bytes),
    );
}

// ---- HF config.json -------------------------------------------------------------------------

const HF_FIELDS: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "mlp_bias",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "sliding_window",
    "use_sliding_window",
    "bos_token_id",
    "eos_token_id",
    "quantization_config",
    "torch_dtype",
];

fn hf_config_text() -> String {
    std::fs::read_to_string(fixture().model_dir.join("config.json")).unwrap()
}

/// Parses a config.json and uses every derived size the server computes from it.
fn check_hf_config(text: &str) -> Result<(), TestCaseError> {
    if let Ok(c) = ModelConfig::from_json(text) {
        let _ = (c.q_dim(), c.kv_dim());
        for m in LoraModule::ALL {
            let (d_in, d_out) = c.module_shape(m);
            prop_assert!(d_in > 0 && d_out > 0);
        }
        prop_assert!(c.rope_theta.is_finite() && c.rms_norm_eps.is_finite());
    }
    Ok(())
}

#[test]
fn hf_config_structured() {
    let base: Value = serde_json::from_str(&hf_config_text()).unwrap();
    fuzz(
        "hf_config_structured",
        500,
        mutated_object(base, HF_FIELDS),
        |v| check_hf_config(&v.to_string()),
    );
}

#[test]
fn hf_config_raw() {
    fixture();
    fuzz(
        "hf_config_raw",
        500,
        mutated_bytes(|| hf_config_text().into_bytes()),
        |bytes| check_hf_config(&String::from_utf8_lossy(&bytes)),
    );
}

// ---- tokenizer ------------------------------------------------------------------------------

fn prompt_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        proptest::collection::vec(any::<u8>(), 0..256)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        ("[ -~]{1,8}", 1..200_000usize).prop_map(|(s, n)| s.repeat(n).chars().take(n).collect()),
        Just("<s></s><unk>\u{0}\u{200b}\u{FEFF}🦀".repeat(100)),
    ]
}

#[test]
fn tokenizer_inputs() {
    let f = fixture();
    let vocab = f.tokenizer.vocab_size() as u32;
    let ids = proptest::collection::vec(
        prop_oneof![0..vocab, Just(vocab), Just(u32::MAX), any::<u32>()],
        0..64,
    );
    fuzz(
        "tokenizer_inputs",
        48,
        (prompt_text(), any::<bool>(), ids),
        |(text, special, ids)| {
            if let Ok(enc) = f.tokenizer.encode(&text, special) {
                prop_assert!(enc.iter().all(|&id| id < vocab), "id out of the vocabulary");
                let _ = f.tokenizer.decode(&enc, true);
            }
            let _ = f.tokenizer.decode(&ids, special);
            let mut dec = IncrementalDecoder::new(&ids[..ids.len().min(3)]);
            for &id in &ids {
                let _ = dec.push(&f.tokenizer, id);
            }
            let _ = dec.flush(&f.tokenizer);
            Ok(())
        },
    );
}

/// Mutated tokenizer.json and tokenizer_config.json load or fail, never panic.
#[test]
fn tokenizer_files_raw() {
    let f = fixture();
    let files = ["tokenizer.json", "tokenizer_config.json"];
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&f.model_dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    fn original(name: &str) -> Vec<u8> {
        std::fs::read(fixture().model_dir.join(name)).unwrap()
    }
    let which = proptest::sample::select(vec![0usize, 1]);
    let strat = which.prop_flat_map(|w| {
        let seed: fn() -> Vec<u8> = if w == 0 {
            || original("tokenizer.json")
        } else {
            || original("tokenizer_config.json")
        };
        (Just(w), mutated_bytes(seed))
    });
    fuzz("tokenizer_files_raw", 100, strat, |(w, bytes)| {
        let target = dir.path().join(files[w]);
        std::fs::write(&target, &bytes).unwrap();
        let r = Tokenizer::from_dir(dir.path(), &f.config);
        std::fs::write(&target, original(files[w])).unwrap();
        if let Ok(t) = r {
            let _ = t.encode("the quick brown fox", true);
        }
        Ok(())
    });
}

/// Replays the inputs that once broke a parser (the fixes' regression tests), so they run in
/// every `cargo test` whatever the random cases are.
#[test]
fn corpus_replay() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz-corpus");
    let Ok(dirs) = std::fs::read_dir(&corpus) else {
        return;
    };
    let config = fixture().adapter_config.clone();
    for d in dirs {
        let d = d.unwrap().path();
        let target = d.file_name().unwrap().to_string_lossy().into_owned();
        for f in std::fs::read_dir(&d).unwrap() {
            let bytes = std::fs::read(f.unwrap().path()).unwrap();
            let r = match target.as_str() {
                "adapter_config" => check_adapter_config(&String::from_utf8_lossy(&bytes)),
                "adapter_safetensors" => load_adapter(config.as_bytes(), &bytes),
                "hf_config" => check_hf_config(&String::from_utf8_lossy(&bytes)),
                _ => Ok(()),
            };
            r.unwrap_or_else(|e| panic!("corpus {target}: {e}"));
        }
    }
}
