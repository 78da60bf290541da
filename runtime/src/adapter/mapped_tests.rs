use super::*;
use crate::adapter::LoraModule;
use crate::model::fixtures;

fn model() -> ModelConfig {
    ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap()
}

/// Mapping validates like a load and reads the very bytes a load copies; the offsets it
/// hands the host store point at them in the file.
#[test]
fn a_mapped_adapter_is_the_loaded_one_read_in_place() {
    for name in ["r4_qv", "r8_all_rslora"] {
        let dir = fixtures::adapter(name);
        let loaded = LoraAdapter::load(&dir, &model()).unwrap();
        let mapped = LoraAdapter::map(&dir, &model()).unwrap();
        assert!(mapped.is_mapped() && !loaded.is_mapped());
        assert!(loaded.file_source().is_none());
        assert_eq!(mapped.targets(), loaded.targets());
        assert_eq!(mapped.size_bytes(), loaded.size_bytes());
        let pairs: Vec<_> = mapped.iter().zip(loaded.iter()).collect();
        assert_eq!(pairs.len(), loaded.iter().count());
        for ((l, m, w), (l2, m2, w2)) in pairs {
            assert_eq!((l, m), (l2, m2));
            assert_eq!(w, w2, "{name} layer {l} {m:?}");
        }
        let (src, tensors) = mapped.file_source().unwrap();
        let file = std::fs::read(&src.path).unwrap();
        assert_eq!(src.len, file.len() as u64);
        assert_eq!(tensors.len(), loaded.iter().count());
        for t in &tensors {
            t.check(src.len).unwrap();
            let m = LoraModule::ALL[t.module.index()];
            let w = loaded.get(t.layer.0 as usize, m).unwrap();
            let a = t.a_range().unwrap();
            let b = t.b_range().unwrap();
            assert_eq!(&file[a.start as usize..a.end as usize], w.a.bytes());
            assert_eq!(&file[b.start as usize..b.end as usize], w.b.bytes());
            assert_eq!((t.shape.rank as usize, t.shape.scale), (w.rank, w.scale));
        }
    }
}

#[test]
fn mapping_refuses_what_loading_refuses() {
    let missing = tempfile::tempdir().unwrap();
    let e = LoraAdapter::map(&missing.path().join("nope"), &model()).unwrap_err();
    assert!(matches!(e, AdapterError::NotFound { .. }), "{e}");
    let dir = fixtures::scratch_copy(&fixtures::adapter("r4_qv"));
    let path = dir.path().join("adapter_model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    // Cut into the tensor data: the header no longer fits the file.
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = LoraAdapter::map(dir.path(), &model()).unwrap_err();
    assert!(matches!(e, AdapterError::Corrupt { .. }), "{e}");
    std::fs::write(&path, b"").unwrap();
    let e = LoraAdapter::map(dir.path(), &model()).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
}
