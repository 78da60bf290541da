//! GGUF against the HF fixture it was converted from (`tests/fixtures/gguf/make_tiny_gguf.py`
//! does what llama.cpp's converter does), and the reader's errors on broken files.

use std::path::{Path, PathBuf};

use thaw_kernels::cpu::{WeightFormat, WeightMatrix};

use super::*;
use crate::engine::HostModel;
use crate::model::{fixtures, ModelConfig, ModelError, Tokenizer};

fn tiny(name: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/gguf"
    ))
    .join(name)
}

fn hf() -> (HostModel, Tokenizer) {
    HostModel::load_with_tokenizer(&fixtures::tiny_llama()).unwrap()
}

/// Every matrix of the GGUF model equals the HF model's matrix re-encoded in the GGUF
/// tensor's format by Thaw (ggml's reference quantiser, checked byte-exact against gguf-py
/// in thaw-kernels) — so names, shapes and the Q/K un-permutation are all exact.
fn assert_same_weights(g: &HostModel, h: &HostModel) {
    let same = |what: &str, a: &WeightMatrix, b: &WeightMatrix| {
        let want = b.convert(a.format()).unwrap();
        assert!(
            a == &want,
            "{what}: {} differs from the HF weight",
            a.format()
        );
    };
    same("embed", &g.embed, &h.embed);
    same(
        "lm_head",
        g.lm_head.as_ref().unwrap(),
        h.lm_head.as_ref().unwrap(),
    );
    for (i, (a, b)) in g.layers.iter().zip(&h.layers).enumerate() {
        for p in 0..7 {
            same(&format!("layer {i} proj {p}"), &a.proj[p], &b.proj[p]);
        }
        assert_eq!(a.input_norm, b.input_norm);
        assert_eq!(a.post_norm, b.post_norm);
    }
    assert_eq!(g.norm, h.norm);
}

#[test]
fn config_matches_hf() {
    let (h, _) = hf();
    let g = load_gguf(&tiny("tiny-llama-f16.gguf")).unwrap();
    let want = ModelConfig {
        eos_token_ids: h.config.eos_token_ids.clone(),
        ..h.config.clone()
    };
    assert_eq!(g.config, want);
    assert_eq!(g.name.as_deref(), Some("thaw tiny llama"));
}

#[test]
fn f16_and_mixed_quant_files_equal_the_hf_weights() {
    let (h, _) = hf();
    for (file, formats) in [
        ("tiny-llama-f16.gguf", &[WeightFormat::F16][..]),
        (
            "tiny-llama-q8_0.gguf",
            &[
                WeightFormat::Q8_0,
                WeightFormat::F16,
                WeightFormat::Q4_1,
                WeightFormat::Q4_0,
            ][..],
        ),
    ] {
        let (g, _) = HostModel::load_with_tokenizer(&tiny(file)).unwrap();
        assert_same_weights(&g, &h);
        let mut seen: Vec<_> = g.layers[0].proj.iter().map(WeightMatrix::format).collect();
        seen.push(g.embed.format());
        seen.push(g.lm_head.as_ref().unwrap().format());
        for f in formats {
            assert!(seen.contains(f), "{file}: no {f} matrix in {seen:?}");
        }
    }
}

/// The tokenizer rebuilt from `tokenizer.ggml.*` encodes and decodes like the HF one.
#[test]
fn tokenizer_matches_hf() {
    let (_, ht) = hf();
    let (_, gt) = HostModel::load_with_tokenizer(&tiny("tiny-llama-q8_0.gguf")).unwrap();
    for text in [
        "Hello world, this is Thaw!",
        "  leading spaces\nand 12345 digits",
        "<s>special</s> tokens",
        "ünïcødé ✓",
    ] {
        let a = ht.encode(text, true).unwrap();
        let b = gt.encode(text, true).unwrap();
        assert_eq!(a, b, "{text:?}");
        assert_eq!(ht.decode(&a, false).unwrap(), gt.decode(&b, false).unwrap());
    }
    assert_eq!(gt.eos_token_ids(), &[1]);
    assert_eq!(gt.bos_token_id(), Some(0));
    assert_eq!(gt.eos_token(), Some("</s>"));
    assert!(gt
        .chat_template()
        .unwrap()
        .contains("add_generation_prompt"));
}

fn parse_err(b: &[u8]) -> String {
    match load_gguf_bytes(b, Path::new("x.gguf")) {
        Ok(_) => panic!("a broken file loaded"),
        Err(e) => e.to_string(),
    }
}

/// Every truncation of a real file is an error that says so (header prefixes are truncated
/// reads; cut tensor data runs past the end of the file).
#[test]
fn truncated_files_are_errors() {
    let b = std::fs::read(tiny("tiny-llama-q8_0.gguf")).unwrap();
    let f = GgufFile::parse(&b).unwrap();
    let mut cuts: Vec<usize> = (0..f.data_start.min(4096)).step_by(7).collect();
    cuts.extend([f.data_start, f.data_start + 1, b.len() - 1]);
    for cut in cuts {
        let e = parse_err(&b[..cut]);
        assert!(
            e.contains("truncated") || e.contains("not a GGUF file"),
            "cut at {cut}: {e}"
        );
    }
}

/// Builds a minimal GGUF v3 file with one tensor `t` of `dims` and ggml type `ty` at `offset`.
fn one_tensor(dims: &[u64], ty: u32, offset: u64, data: usize) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // kv
    b.extend(17u64.to_le_bytes());
    b.extend(b"general.alignment");
    b.extend(4u32.to_le_bytes()); // u32
    b.extend(64u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(b"t");
    b.extend((dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend(d.to_le_bytes());
    }
    b.extend(ty.to_le_bytes());
    b.extend(offset.to_le_bytes());
    b.resize(b.len().next_multiple_of(64) + data, 0);
    b
}

#[test]
fn lying_headers_are_clear_errors() {
    let ok = one_tensor(&[64, 2], 8, 0, 2 * 68);
    let f = GgufFile::parse(&ok).unwrap();
    assert_eq!(f.alignment, 64);
    assert_eq!(f.tensors[0].format, WeightFormat::Q8_0);
    assert_eq!(f.tensors[0].shape(), vec![2, 64]);
    assert_eq!(f.data_start % 64, 0);

    let cases: [(Vec<u8>, &str); 7] = [
        (one_tensor(&[64, 2], 8, 64, 2 * 68), "run past the end"),
        (
            one_tensor(&[64, 2], 8, 3, 2 * 68),
            "not a multiple of the alignment",
        ),
        (one_tensor(&[64, 2], 7, 0, 4096), "ggml type 7"),
        (one_tensor(&[48, 2], 8, 0, 4096), "whole Q8_0 blocks"),
        (one_tensor(&[1 << 40, 1 << 40], 0, 0, 0), "too large"),
        (one_tensor(&[u64::MAX, 2], 0, 0, 0), "too large"),
        (one_tensor(&[1, 1, 1, 1, 1], 0, 0, 0), "5 dimensions"),
    ];
    for (b, want) in cases {
        let e = GgufFile::parse(&b).unwrap_err().to_string();
        assert!(e.contains(want), "{e} (want {want:?})");
    }
    let mut v1 = ok.clone();
    v1[4] = 1;
    assert!(parse_err(&v1).contains("versions 2 and 3"));
    let mut bad = ok.clone();
    bad[0] = b'X';
    assert!(parse_err(&bad).contains("not a GGUF file"));
    // A string or array count larger than the file is truncation, caught before allocating.
    let mut huge = ok.clone();
    huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(parse_err(&huge).contains("truncated"));
    let mut n = ok;
    n[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(parse_err(&n).contains("truncated"));
}

#[test]
fn non_llama_files_say_what_is_supported() {
    let b = one_tensor(&[64, 2], 8, 0, 2 * 68);
    match load_gguf_bytes(&b, Path::new("x.gguf")) {
        Err(ModelError::UnsupportedArchitecture { found }) => {
            assert!(found.contains("general.architecture"), "{found}")
        }
        other => panic!("{:?}", other.err()),
    }
}

/// Regression (found by `fuzz_gguf` in CI): a Q/K tensor whose dimension was overwritten with
/// 0 passed the "multiple of 2·heads" check (0 is a multiple of everything) and divided by
/// zero while un-permuting. It must be a clear error instead.
#[test]
fn zero_row_attention_tensor_is_an_error() {
    let t = GgufTensorInfo {
        name: "blk.0.attn_q.weight".into(),
        dims: vec![64, 0],
        format: WeightFormat::F32,
        start: 0,
        len: 0,
    };
    let e = llama::check_permutable(Path::new("x.gguf"), &t, 4).unwrap_err();
    assert!(e.to_string().contains("positive number of rows"), "{e}");
    let ok = GgufTensorInfo {
        dims: vec![64, 8],
        ..t
    };
    llama::check_permutable(Path::new("x.gguf"), &ok, 4).unwrap();
}
