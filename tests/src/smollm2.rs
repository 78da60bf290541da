//! SmolLM2-135M-Instruct in bf16 against transformers' greedy reference
//! (`tests/fixtures/smollm2-reference/greedy.json`, written by its `make_reference.py`): what
//! the 16-bit activation oracles (`act16_oracle.rs`, `attn16_oracle.rs`,
//! `residual16_oracle.rs`) load before comparing their emulation's tokens with it.
use std::path::{Path, PathBuf};

use thaw_runtime::engine::HostModel;
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
