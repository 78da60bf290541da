use super::*;
use crate::model::{fixtures, ModelConfig};

/// A host copy read in place goes into the workers' store as a file entry (no copy) at every
/// load while its file is the one mapped; once a new file is renamed over it, the workers
/// (which open it by path) would read other bytes, so the entry is a copy of the mapped ones.
#[test]
fn a_file_entry_only_while_the_file_is_the_one_mapped() {
    let model = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    let a = LoraAdapter::load_in_place(dir.path(), &model).unwrap();
    let (src, tensors) = file_entry(&a).expect("read in place: a file entry");
    assert_eq!(tensors.len(), a.iter().count());
    assert_eq!(
        src.len,
        std::fs::metadata(dir.path().join("adapter_model.safetensors"))
            .unwrap()
            .len()
    );
    let path = dir.path().join("adapter_model.safetensors");
    let tmp = dir.path().join("new.tmp");
    std::fs::write(&tmp, std::fs::read(&path).unwrap()).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    assert!(file_entry(&a).is_none(), "replaced: the entry copies");
    assert!(a.is_verified() && a.file_source().is_some());
    let owned = LoraAdapter::load(dir.path(), &model).unwrap();
    assert!(
        file_entry(&owned).is_none(),
        "held in memory: the entry copies"
    );
}
