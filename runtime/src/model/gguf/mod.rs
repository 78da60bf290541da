//! GGUF models (llama.cpp's format) served as they are: the container
//! (`reader`), and a Llama-family model from it — config from `llama.*` metadata, tensors
//! renamed to the HF names the engine uses (quantised matrices kept quantised), and the
//! tokenizer and chat template from `tokenizer.*` (`llama`, `tokenizer`).

mod llama;
mod reader;
mod tokenizer;

pub use llama::{load_gguf, load_gguf_bytes, GgufModel};
pub use reader::{GgufError, GgufFile, GgufTensorInfo, GgufValue};

/// Whether `path` names a GGUF file (by extension).
pub fn is_gguf_path(path: &std::path::Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

#[cfg(test)]
mod tests;
