//! Generators for Thaw's demo and tests: a HF Llama model directory (`thaw gen-model`) and
//! PEFT LoRA adapters for it (`thaw gen-adapters`), seeded and deterministic, with no
//! downloads. The files match what transformers 4.x and PEFT 0.21 `save_pretrained` write.
//!
//! ```no_run
//! use thaw_server::gen::{preset, write_adapters, write_model, GenAdaptersOptions, GenModelOptions};
//! # fn main() -> anyhow::Result<()> {
//! let tiny = preset("tiny").expect("known preset");
//! write_model(&tiny, "/tmp/tiny".as_ref(), &GenModelOptions::default())?;
//! let adapters = write_adapters(&GenAdaptersOptions {
//!     model_dir: "/tmp/tiny".into(),
//!     out_dir: "/tmp/tiny-adapters".into(),
//!     count: 4,
//!     ..Default::default()
//! })?;
//! # Ok(()) }
//! ```

mod adapters;
mod init;
mod model;
mod presets;
mod tokenizer;
mod writer;

pub use adapters::{
    adapter_config, adapter_name, adapter_tensors, read_model_dims, write_adapters,
    GenAdaptersOptions, DEFAULT_DELTA_REL, PEFT_VERSION,
};
pub use init::{
    linear_std, projection_gain, stream_id, Init, TensorSpec, EMBED_STD, LOGIT_STD, MLP_IN_GAIN,
    NORM_NOISE_STD, QK_GAIN, RESIDUAL_OUT_GAIN, V_GAIN,
};
pub use model::{
    generation_config, model_config, model_config_for, write_model, ArchOptions, GenArch,
    GenModelOptions, ModelPlan, TRANSFORMERS_VERSION,
};
pub use presets::{preset, ModelDims, ModelPreset, Projection, WeightDtype, PRESET_NAMES};
pub use tokenizer::{
    trained_tokenizer, write_tokenizer_files, TrainedTokenizer, BOS_TOKEN, BOS_TOKEN_ID,
    CHAT_TEMPLATE, EOS_TOKEN, EOS_TOKEN_ID, IM_END_TOKEN, IM_END_TOKEN_ID, IM_START_TOKEN,
    SPECIAL_TOKENS,
};
pub use writer::{write_json, LazyTensor, Shard, ShardPlan, DEFAULT_MAX_SHARD_BYTES};
