//! Fuzz target (proptest, as in `fuzz_parsers.rs`) for the GGUF reader and model loader:
//! a real converted file (tests/fixtures/gguf) with header fields overwritten by extreme
//! values, bytes flipped and the file cut short; random bytes behind a valid magic. Every case
//! must end in `Ok` or a clear error — no panic, hang or oversized allocation (the capped
//! allocator turns one into a failure).
mod fuzz_support;

use std::path::Path;

use proptest::prelude::*;
use thaw_runtime::model::gguf::{load_gguf_bytes, GgufFile};

use fuzz_support::fuzz;

#[global_allocator]
static ALLOC: fuzz_support::CappedAlloc = fuzz_support::CappedAlloc;

fn fixture() -> Vec<u8> {
    std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/gguf/tiny-llama-q8_0.gguf"
    ))
    .unwrap()
}

#[derive(Clone, Debug)]
enum Mutation {
    /// Overwrite 8 bytes at a header position with an extreme little-endian u64.
    Word(prop::sample::Index, u64),
    /// Overwrite 4 bytes (a type tag, a dimension count, a u32 value).
    Half(prop::sample::Index, u32),
    /// Flip one byte anywhere.
    Byte(prop::sample::Index, u8),
    /// Cut the file.
    Truncate(prop::sample::Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let extreme = prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u64::MAX / 2),
        Just(1 << 32),
        Just(1 << 40),
        any::<u64>()
    ];
    let small = prop_oneof![
        Just(0u32),
        Just(7),
        Just(9),
        Just(13),
        Just(u32::MAX),
        any::<u32>()
    ];
    prop_oneof![
        (any::<prop::sample::Index>(), extreme).prop_map(|(i, v)| Mutation::Word(i, v)),
        (any::<prop::sample::Index>(), small).prop_map(|(i, v)| Mutation::Half(i, v)),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, v)| Mutation::Byte(i, v)),
        any::<prop::sample::Index>().prop_map(Mutation::Truncate),
    ]
}

fn apply(mut b: Vec<u8>, header: usize, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        match m {
            // Positions past an earlier cut are skipped.
            Mutation::Word(i, v) => {
                let at = i.index(header - 8);
                if let Some(w) = b.get_mut(at..at + 8) {
                    w.copy_from_slice(&v.to_le_bytes());
                }
            }
            Mutation::Half(i, v) => {
                let at = i.index(header - 4);
                if let Some(w) = b.get_mut(at..at + 4) {
                    w.copy_from_slice(&v.to_le_bytes());
                }
            }
            Mutation::Byte(i, v) => {
                if !b.is_empty() {
                    let at = i.index(b.len());
                    b[at] = *v;
                }
            }
            Mutation::Truncate(i) => {
                if !b.is_empty() {
                    let n = i.index(b.len());
                    b.truncate(n);
                }
            }
        }
    }
    b
}

#[test]
fn gguf_structured() {
    let base = fixture();
    let header = GgufFile::parse(&base).unwrap().data_start;
    load_gguf_bytes(&base, Path::new("fixture.gguf")).unwrap();
    fuzz(
        "gguf_structured",
        200,
        proptest::collection::vec(mutation(), 1..4),
        |muts| {
            let b = apply(base.clone(), header, &muts);
            if let Err(e) = load_gguf_bytes(&b, Path::new("fuzz.gguf")) {
                prop_assert!(!e.to_string().is_empty());
            }
            Ok(())
        },
    );
}

#[test]
fn gguf_raw_bytes() {
    fuzz(
        "gguf_raw_bytes",
        300,
        proptest::collection::vec(any::<u8>(), 0..512),
        |tail| {
            let mut b = b"GGUF\x03\x00\x00\x00".to_vec();
            b.extend(tail);
            let _ = GgufFile::parse(&b);
            let _ = load_gguf_bytes(&b, Path::new("fuzz.gguf"));
            Ok(())
        },
    );
}
