use super::*;
use crate::model::fixtures;

fn model() -> ModelConfig {
    ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap()
}

/// Read in place, an adapter is the loaded one: the same factors, byte for byte (so the same
/// numerics), every one read from the mapped file (nothing held in memory), and verified —
/// unlike a bare mapping, which stands in only until a full read.
#[test]
fn read_in_place_is_the_loaded_adapter_verified() {
    for name in ["r4_qv", "r8_all_rslora"] {
        let dir = fixtures::adapter(name);
        let loaded = LoraAdapter::load(&dir, &model()).unwrap();
        let in_place = LoraAdapter::load_in_place(&dir, &model()).unwrap();
        assert!(in_place.is_mapped() && in_place.is_verified());
        assert!(
            in_place.file_source().is_some(),
            "every factor is in the file"
        );
        assert_eq!(in_place.heap_bytes(), 0);
        assert_eq!(loaded.heap_bytes(), loaded.size_bytes());
        assert!(loaded.is_verified() && !loaded.is_mapped());
        assert_eq!(in_place.size_bytes(), loaded.size_bytes());
        assert_eq!(in_place.iter().count(), loaded.iter().count());
        for ((l, m, w), (l2, m2, w2)) in in_place.iter().zip(loaded.iter()) {
            assert_eq!((l, m), (l2, m2));
            assert_eq!(w, w2, "{name} layer {l} {m:?}");
        }
        let mapped = LoraAdapter::map(&dir, &model()).unwrap();
        assert!(!mapped.is_verified(), "a bare mapping is not checked");
        mapped.verify_in_place().unwrap();
        assert!(mapped.is_verified());
    }
}

/// A NaN in the file fails the read in place as it fails a load, naming the tensor; the file
/// is not marked verified.
#[test]
fn a_non_finite_weight_fails_the_read_in_place() {
    let (dir, last) = crate::upload::check::tests::poisoned_last_layer(&model());
    let e = LoraAdapter::load(dir.path(), &model()).unwrap_err();
    assert!(matches!(e, AdapterError::NonFinite { .. }), "{e}");
    let e = LoraAdapter::load_in_place(dir.path(), &model()).unwrap_err();
    match &e {
        AdapterError::NonFinite { tensor, index } => {
            assert!(tensor.contains(&format!("layers.{last}.")), "{e}");
            assert_eq!(*index, 1, "{e}");
        }
        other => panic!("expected a non-finite weight, got {other}"),
    }
    let mapped = LoraAdapter::map(dir.path(), &model()).unwrap();
    assert!(mapped.verify_in_place().is_err());
    assert!(!mapped.is_verified());
    assert!(LoraAdapter::load_host(dir.path(), &model(), None).is_err());
}

/// The host copy is read in place when the backend reads the stored dtype, and read into
/// memory and converted once when it does not; both hold the same values (a conversion
/// rounds, so compared after the same conversion).
#[test]
fn the_host_copy_is_read_in_place_unless_it_must_be_converted() {
    let dir = fixtures::adapter("r4_qv");
    let loaded = LoraAdapter::load(&dir, &model()).unwrap();
    let stored = loaded.dtype();
    let other = [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::F16]
        .into_iter()
        .find(|&d| d != stored)
        .unwrap();
    for want in [None, Some(stored)] {
        let a = LoraAdapter::load_host(&dir, &model(), want).unwrap();
        assert!(a.is_mapped() && a.is_verified() && a.stored_as(want));
    }
    let before = file_bytes_copied();
    let converted = LoraAdapter::load_host(&dir, &model(), Some(other)).unwrap();
    assert!(!converted.is_mapped() && converted.stored_as(Some(other)));
    assert!(!converted.stored_as(Some(stored)) && converted.stored_as(None));
    let file = std::fs::metadata(dir.join("adapter_model.safetensors")).unwrap();
    // Other tests read adapters meanwhile: at least this one's file was counted.
    assert!(file_bytes_copied() - before >= file.len());
    let expect = loaded.into_dtype(other);
    for ((_, _, w), (_, _, w2)) in converted.iter().zip(expect.iter()) {
        assert_eq!(w, w2);
    }
}
