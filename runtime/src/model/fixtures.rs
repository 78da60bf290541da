//! Test helpers: the HF-written fixtures in `tests/fixtures/` and scratch copies of them.

use std::path::{Path, PathBuf};

/// The tiny Llama saved by transformers `save_pretrained` (see tests/fixtures/README.md).
pub(crate) fn tiny_llama() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/hf-tiny-llama"
    ))
}

/// A PEFT adapter saved against [`tiny_llama`]: `r4_qv` or `r8_all_rslora`.
pub(crate) fn adapter(name: &str) -> PathBuf {
    tiny_llama().join("adapters").join(name)
}

/// Copies the files of `src` (not recursing) into a fresh temp dir, writable, for mutation.
pub(crate) fn scratch_copy(src: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(src).expect("read fixture dir") {
        let entry = entry.expect("dir entry");
        if entry.file_type().expect("file type").is_file() {
            let bytes = std::fs::read(entry.path()).expect("read fixture");
            std::fs::write(dir.path().join(entry.file_name()), bytes).expect("write copy");
        }
    }
    dir
}
