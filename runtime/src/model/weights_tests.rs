use super::*;
use crate::model::fixtures;

/// Deterministic, non-constant values.
fn ramp(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect()
}

fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn fixture_weights_load_with_expected_shapes() {
    let mut w = Weights::load_dir(&fixtures::tiny_llama()).unwrap();
    assert_eq!(w.len(), 21);
    assert!(w.contains("lm_head.weight"));
    let emb = w.take("model.embed_tokens.weight", &[300, 64]).unwrap();
    assert_eq!(emb.data.len(), 300 * 64);
    assert!(emb.data.iter().any(|&x| x != 0.0));
    let q = w
        .take("model.layers.1.self_attn.q_proj.weight", &[64, 64])
        .unwrap();
    assert_eq!(q.shape, vec![64, 64]);
    assert!(!w.contains("model.embed_tokens.weight"));
    assert_eq!(w.names().count(), 19);
}

#[test]
fn take_reports_missing_and_shape_mismatch() {
    let mut w = Weights::load_dir(&fixtures::tiny_llama()).unwrap();
    match w.take("model.layers.0.self_attn.k_proj.weight", &[64, 64]) {
        Err(ModelError::ShapeMismatch {
            tensor,
            expected,
            got,
        }) => {
            assert_eq!(tensor, "model.layers.0.self_attn.k_proj.weight");
            assert_eq!((expected, got), (vec![64, 64], vec![32, 64]));
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
    assert!(matches!(
        w.take("model.layers.5.mlp.up_proj.weight", &[1]),
        Err(ModelError::MissingTensor { .. })
    ));
}

#[test]
fn sharded_index_loads_all_shards() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, c) = (ramp(6, 0.0), ramp(4, 1.0), ramp(3, 2.0));
    write_st(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &[
            ("a", Dtype::F32, vec![2, 3], f32_bytes(&a)),
            ("b", Dtype::F32, vec![4], f32_bytes(&b)),
        ],
    );
    write_st(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &[("c", Dtype::F32, vec![3, 1], f32_bytes(&c))],
    );
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        r#"{"metadata": {"total_size": 52}, "weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let mut w = Weights::load_dir(dir.path()).unwrap();
    assert_eq!(w.len(), 3);
    assert_eq!(w.take("a", &[2, 3]).unwrap().data, a);
    assert_eq!(w.take("c", &[3, 1]).unwrap().data, c);

    // A shard the index names but that is absent.
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    assert!(matches!(
        Weights::load_dir(dir.path()),
        Err(ModelError::MissingFile { .. })
    ));
}

#[test]
fn f16_and_bf16_are_widened() {
    let dir = tempfile::tempdir().unwrap();
    let v = ramp(10, 3.0);
    let h: Vec<u8> = v
        .iter()
        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
        .collect();
    let bf: Vec<u8> = v
        .iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect();
    write_st(
        &dir.path().join("model.safetensors"),
        &[
            ("h", Dtype::F16, vec![10], h),
            ("bf", Dtype::BF16, vec![2, 5], bf),
        ],
    );
    let mut w = Weights::load_dir(dir.path()).unwrap();
    let h = w.take("h", &[10]).unwrap();
    let bf = w.take("bf", &[2, 5]).unwrap();
    for ((x, h), bf) in v.iter().zip(&h.data).zip(&bf.data) {
        // f16 keeps 11 significant bits, bf16 8: relative error below 2^-11 and 2^-8.
        assert!((h - x).abs() <= x.abs() * 4.9e-4 + 1e-7, "f16 {x} -> {h}");
        assert!(
            (bf - x).abs() <= x.abs() * 3.9e-3 + 1e-7,
            "bf16 {x} -> {bf}"
        );
    }
}

#[test]
fn unsupported_dtype_names_tensor() {
    let dir = tempfile::tempdir().unwrap();
    write_st(
        &dir.path().join("model.safetensors"),
        &[("q", Dtype::I32, vec![2], vec![1, 0, 0, 0, 2, 0, 0, 0])],
    );
    match Weights::load_dir(dir.path()) {
        Err(ModelError::UnsupportedDtype { tensor, dtype }) => {
            assert_eq!(tensor, "q");
            assert_eq!(dtype, "I32");
        }
        other => panic!("expected UnsupportedDtype, got {other:?}"),
    }
}

#[test]
fn truncated_and_missing_weights_are_errors() {
    let dir = fixtures::scratch_copy(&fixtures::tiny_llama());
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        Weights::load_dir(dir.path()),
        Err(ModelError::Safetensors { .. })
    ));
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(
        Weights::load_dir(dir.path()),
        Err(ModelError::Safetensors { .. })
    ));
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(
        Weights::load_dir(dir.path()),
        Err(ModelError::MissingFile { .. })
    ));
}

/// A payload that starts at an odd offset cannot be viewed as f32/f16/bf16 in place: the
/// byte-by-byte path decodes it to the same values as the aligned one.
#[test]
fn unaligned_payloads_widen_like_aligned_ones() {
    let want = ramp(37, 0.5);
    let f16: Vec<u8> = want
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect();
    let bf16: Vec<u8> = want
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
        .collect();
    for (dtype, bytes, tol) in [
        (Dtype::F32, f32_bytes(&want), 0.0),
        (Dtype::F16, f16, 1e-3),
        (Dtype::BF16, bf16, 1e-2),
    ] {
        let aligned = {
            let v = TensorView::new(dtype, vec![37], &bytes).unwrap();
            view_to_f32(&v).unwrap()
        };
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        let v = TensorView::new(dtype, vec![37], &shifted[1..]).unwrap();
        let unaligned = view_to_f32(&v).unwrap();
        assert_eq!(unaligned, aligned, "{dtype:?}");
        for (a, b) in aligned.iter().zip(&want) {
            assert!((a - b).abs() <= tol, "{dtype:?}: {a} vs {b}");
        }
    }
}
