//! Shared helpers for Thaw's cross-crate tests (`tests/tests/*.rs`): generated models and
//! adapters written to a temporary directory by the real generators and loaded back through
//! the real loaders, so every test also exercises the on-disk formats.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SeqOutput, StepPlan};
use thaw_runtime::ids::SeqId;
use thaw_server::gen::{self, GenAdaptersOptions, GenModelOptions, ModelPreset, Projection};

/// The engine type the tests drive.
pub type CpuEngine = Engine<CpuBackend>;

/// Path of the HF/PEFT-written fixtures copied from `shared/fixtures`.
pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf-tiny-llama")
}

/// A model small enough for many solo runs, big enough that rank-128 adapters are not
/// larger than the layers they adapt.
pub fn test_preset() -> ModelPreset {
    ModelPreset {
        name: "test",
        hidden_size: 128,
        intermediate_size: 256,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        vocab_size: 384,
        tokenizer_vocab_size: 384,
        max_position_embeddings: 256,
        ..gen::preset("tiny").expect("tiny preset exists")
    }
}

/// A generated model directory, loaded.
pub struct TestModel {
    pub dir: tempfile::TempDir,
    pub model: HostModel,
}

impl TestModel {
    /// A Llama model from [`test_preset`] with weights from `seed`.
    pub fn llama(seed: u64) -> Self {
        Self::from_preset(&test_preset(), seed)
    }

    pub fn from_preset(preset: &ModelPreset, seed: u64) -> Self {
        Self::with_arch(preset, seed, gen::ArchOptions::default())
    }

    /// A model of another architecture (Mistral's window, Qwen2's biases, tied embeddings).
    pub fn with_arch(preset: &ModelPreset, seed: u64, arch: gen::ArchOptions) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = GenModelOptions {
            seed,
            arch,
            ..Default::default()
        };
        gen::write_model(preset, &dir.path().join("model"), &opts).expect("gen-model");
        let model = HostModel::load(&dir.path().join("model")).expect("generated model loads");
        Self { dir, model }
    }

    pub fn model_dir(&self) -> PathBuf {
        self.dir.path().join("model")
    }

    /// Writes one PEFT adapter with `rank` on `targets` (short names: q, k, …) and loads it.
    pub fn adapter(&self, rank: usize, targets: &[&str], seed: u64) -> Arc<LoraAdapter> {
        let dir = self.adapter_dir(rank, targets, seed);
        Arc::new(LoraAdapter::load(&dir, &self.model.config).expect("generated adapter loads"))
    }

    /// Writes one PEFT adapter with `rank` on `targets` and returns its directory.
    pub fn adapter_dir(&self, rank: usize, targets: &[&str], seed: u64) -> PathBuf {
        self.adapter_dir_as(rank, targets, seed, None)
    }

    /// [`TestModel::adapter_dir`] with the weights saved in `dtype` (`None`: the model's).
    pub fn adapter_dir_as(
        &self,
        rank: usize,
        targets: &[&str],
        seed: u64,
        dtype: Option<gen::WeightDtype>,
    ) -> PathBuf {
        let out = self.dir.path().join(format!("adapters-{seed}"));
        let opts = GenAdaptersOptions {
            model_dir: self.model_dir(),
            count: 1,
            ranks: vec![rank],
            targets: targets.iter().map(|s| projection(s)).collect(),
            out_dir: out,
            seed,
            dtype,
            ..Default::default()
        };
        let mut dirs = gen::write_adapters(&opts).expect("gen-adapters");
        dirs.remove(0)
    }
}

/// A CPU engine over `model`.
pub fn cpu_engine(model: HostModel, cfg: EngineConfig) -> CpuEngine {
    let backend = CpuBackend::new(&model.config);
    Engine::new(backend, model, cfg).expect("engine")
}

/// A CPU engine over `model` whose emulated link takes about `secs` seconds to carry
/// `adapter_bytes` (50 µs latency): a step soon after registration finds the adapter still
/// streaming, so the cold-start paths under test run.
pub fn cpu_engine_slow_link(model: HostModel, adapter_bytes: f64, secs: f64) -> CpuEngine {
    let link = thaw_runtime::residency::LinkModel {
        gbps: adapter_bytes / secs / 1e9,
        latency_us: 50.0,
    };
    let backend = CpuBackend::new(&model.config).with_link(link);
    Engine::new(backend, model, EngineConfig::default()).expect("engine")
}

/// Runs one step that computes every pending token of `seq` (its whole remaining prompt, or
/// its one decode token) and returns the step's outputs.
pub fn step_all_pending(e: &mut CpuEngine, seq: SeqId, return_logits: bool) -> Vec<SeqOutput> {
    let num_tokens = e.pending_tokens(seq).expect("a live sequence");
    e.step(&StepPlan {
        items: vec![PlanItem { seq, num_tokens }],
        return_logits,
    })
    .expect("a single-sequence step")
}

/// Greedy tokens of `prompt` under `adapter` for one request alone (6 new tokens): its
/// prefill in chunks of at most `chunk` tokens, then decode, one step each.
pub fn greedy_alone(
    e: &mut CpuEngine,
    seq: SeqId,
    adapter: thaw_runtime::ids::AdapterId,
    prompt: &[u32],
    chunk: usize,
) -> Vec<u32> {
    e.add_sequence(
        seq,
        thaw_runtime::engine::SequenceParams {
            prompt: prompt.to_vec(),
            adapter: Some(adapter),
            sampling: thaw_runtime::sampling::SamplingParams::greedy(),
            max_new_tokens: 6,
            ignore_eos: true,
            ..Default::default()
        },
    )
    .expect("the sequence is admitted");
    let mut tokens = Vec::new();
    loop {
        let num_tokens = e.pending_tokens(seq).expect("a live sequence").min(chunk);
        let plan = StepPlan {
            items: vec![PlanItem { seq, num_tokens }],
            return_logits: false,
        };
        if let Some(o) = e.step(&plan).expect("a single-sequence step").first() {
            tokens.push(o.token.id);
            if o.finish.is_some() {
                return tokens;
            }
        }
    }
}

/// Normwise relative error ‖a − b‖ / ‖b‖ in f64.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared vectors differ in length");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// A projection by its short name (`q`, `gate`, …).
pub fn projection(short: &str) -> Projection {
    Projection::ALL
        .into_iter()
        .find(|p| p.hf_name() == format!("{short}_proj"))
        .unwrap_or_else(|| panic!("no projection named {short}"))
}

pub mod graphs;
pub mod greedy;
pub mod http;
pub mod prom;
pub mod smollm2;

/// Whether the GPU tests can run here: true with a usable NVIDIA GPU; otherwise prints a skip
/// and returns false, unless `THAW_REQUIRE_GPU=1`, which turns a missing GPU into a failure.
pub fn gpu_or_skip() -> bool {
    if thaw_runtime::backend::cuda_available() {
        return true;
    }
    let require = std::env::var("THAW_REQUIRE_GPU").is_ok_and(|v| v == "1");
    assert!(
        !require,
        "THAW_REQUIRE_GPU=1 but no usable NVIDIA GPU / libcuda was found"
    );
    println!("skipped: no NVIDIA GPU (set THAW_REQUIRE_GPU=1 to fail instead)");
    false
}

/// `text` as one user turn of `tok`'s chat template with the generation prompt, encoded (what
/// a chat completion feeds the model).
pub fn chat_prompt(tok: &thaw_runtime::model::Tokenizer, text: &str) -> Vec<u32> {
    let t = thaw_server::chat::ChatTemplate::new(
        tok.chat_template().expect("the model has a chat template"),
        tok.bos_token(),
        tok.eos_token(),
    )
    .unwrap();
    let msgs = [thaw_server::chat::TemplateMessage {
        role: "user".into(),
        content: text.into(),
    }];
    tok.encode(&t.render(&msgs, true).unwrap(), false).unwrap()
}
