//! SmolLM2-135M-Instruct in bf16 against transformers' greedy reference
//! (`tests/fixtures/smollm2-reference/greedy.json`, written by its `make_reference.py`): what
//! the 16-bit activation oracles (`act16_oracle.rs`, `attn16_oracle.rs`,
//! `residual16_oracle.rs`) load before comparing their emulation's tokens with it.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::model::Tokenizer;

/// The transformers reference.
#[derive(serde::Deserialize)]
pub struct Reference {
    /// Which transformers and torch wrote it.
    pub generator: String,
    /// New tokens a case asked for (transformers stops earlier at the end-of-turn token).
    pub new_tokens: usize,
    pub cases: Vec<Case>,
}

/// One chat prompt and transformers' greedy continuation.
#[derive(serde::Deserialize)]
pub struct Case {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub tokens: Vec<u32>,
}

/// The model at `THAW_SMOLLM2_BF16`, the reference, and each case's chat prompt encoded by the
/// model's own template (checked equal to the reference's ids); `None` (the test skips, saying
/// so) when the variable is unset.
pub struct SmolLm2 {
    pub dir: PathBuf,
    pub model: HostModel,
    pub tok: Tokenizer,
    pub want: Reference,
    pub prompts: Vec<Vec<u32>>,
}

impl SmolLm2 {
    pub fn load() -> Option<Self> {
        let Some(dir) = std::env::var_os("THAW_SMOLLM2_BF16") else {
            eprintln!("skipping: set THAW_SMOLLM2_BF16 to SmolLM2-135M-Instruct in bf16");
            return None;
        };
        let dir = PathBuf::from(dir);
        let file =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/smollm2-reference/greedy.json");
        let want: Reference = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        let (model, tok) = HostModel::load_with_tokenizer(&dir).expect("the model loads");
        assert_eq!(model.format_mix(), "BF16", "{dir:?} is not a bf16 model");
        let prompts = want
            .cases
            .iter()
            .map(|c| {
                let ids = crate::chat_prompt(&tok, &c.prompt);
                assert_eq!(ids, c.prompt_ids, "{:?}: the chat prompt differs", c.prompt);
                ids
            })
            .collect();
        Some(Self {
            dir,
            model,
            tok,
            want,
            prompts,
        })
    }
}

/// Logits and greedy tokens of each sequence over the steps of [`run_logged`] (a prefill,
/// then decodes).
pub struct Run {
    pub logits: Vec<Vec<Vec<f32>>>,
    pub tokens: Vec<Vec<u32>>,
}

impl Run {
    /// The largest normwise error between `self`'s and `other`'s logits over every step of
    /// every sequence.
    pub fn worst(&self, other: &Run) -> f64 {
        self.logits
            .iter()
            .zip(&other.logits)
            .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| crate::rel_err(p, q)))
            .fold(0.0, f64::max)
    }
}

/// `prompts` (sequence `i` on adapter `prompts[i].1`, an index into `adapters`) greedily on an
/// engine over `backend`, every sequence in every step, EOS ignored, for `steps` steps, each
/// step's logits kept: what the 16-bit activation oracles compare between emulations.
pub fn run_logged(
    backend: CpuBackend,
    model: &HostModel,
    adapters: &[Arc<LoraAdapter>],
    prompts: &[(Vec<u32>, Option<u32>)],
    steps: usize,
) -> Run {
    let cfg = EngineConfig {
        max_batch_tokens: 1024,
        max_batch_seqs: 8,
        num_kv_blocks: 64,
        ..Default::default()
    };
    let mut e = Engine::new(backend, model.clone(), cfg).expect("engine");
    for (i, a) in adapters.iter().enumerate() {
        e.register_adapter(AdapterId(i as u32), a.clone()).unwrap();
    }
    for (i, (p, a)) in prompts.iter().enumerate() {
        let params = SequenceParams {
            prompt: p.clone(),
            adapter: a.map(AdapterId),
            max_new_tokens: steps,
            ignore_eos: true,
            ..Default::default()
        };
        e.add_sequence(SeqId(i as u64), params).unwrap();
    }
    let n = prompts.len();
    let mut out = Run {
        logits: vec![Vec::new(); n],
        tokens: vec![Vec::new(); n],
    };
    for _ in 0..steps {
        let items = (0..n)
            .map(|i| PlanItem {
                seq: SeqId(i as u64),
                num_tokens: e.pending_tokens(SeqId(i as u64)).unwrap(),
            })
            .collect();
        let plan = StepPlan {
            items,
            return_logits: true,
        };
        for o in e.step(&plan).unwrap() {
            let i = o.seq.0 as usize;
            out.tokens[i].push(o.token.id);
            out.logits[i].push(o.logits.expect("asked for logits"));
        }
    }
    out
}
