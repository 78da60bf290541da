//! The base model on disk: HF `config.json` (+ `generation_config.json`), safetensors weights
//! (single file or sharded) and the fast tokenizer, exactly as transformers `save_pretrained`
//! writes them. Owns parsing and validation only; the forward pass lives in the backends.

mod config;
mod error;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod gguf;
pub(crate) mod json;
mod mmap;
mod tokenizer;
mod weights;

pub use config::{Architecture, ModelConfig};
pub use error::ModelError;
pub(crate) use mmap::{map_lazily, FileBytes};
pub use tokenizer::{IncrementalDecoder, Tokenizer};
pub use weights::{TensorF32, Weights};
