//! PEFT LoRA adapters on disk: `adapter_config.json` and `adapter_model.safetensors` exactly as
//! PEFT `save_pretrained` writes them, validated against the base model and kept in their stored dtype.
//! Owns parsing and validation; residency (host store, device slots) lives elsewhere.

mod config;
mod error;
mod format;
mod in_place;
mod mapped;
mod module;
mod targets;
mod tensor;

pub use config::AdapterConfig;
pub use error::AdapterError;
pub use format::{LoraAdapter, LoraWeights};
pub use in_place::{file_bytes_copied, in_place_enabled};
pub use mapped::MappedFile;
pub use module::LoraModule;
pub use targets::{FullMatch, TargetSpec};
pub use tensor::{encode_into, exponent_mask, first_non_finite_in, LoraTensor, WeightDtype};
