use std::path::PathBuf;

use proptest::prelude::*;

use super::*;
use crate::store_writer::LayerModuleWeights;

fn source(len: u64) -> FileSource {
    FileSource {
        path: PathBuf::from("/models/adapters/a/adapter_model.safetensors"),
        len,
        dev: 7,
        ino: 42,
    }
}

fn tensor(layer: u32, module: Module, a_off: u64, b_off: u64) -> FileTensors {
    FileTensors {
        layer: LayerIdx(layer),
        module,
        shape: ModuleShape {
            rank: 4,
            scale: 0.5,
            dtype: DType::BF16,
            d_in: 16,
            d_out: 8,
        },
        a_off,
        b_off,
    }
}

/// A is 4·16·2 = 128 bytes, B 8·4·2 = 64: one (layer, module) takes 192 bytes of the file.
fn layered(n_layers: u32) -> Vec<FileTensors> {
    (0..n_layers)
        .flat_map(|l| {
            let base = 100 + u64::from(l) * 2 * 192;
            [
                tensor(l, Module::Q, base, base + 128),
                tensor(l, Module::V, base + 192, base + 320),
            ]
        })
        .collect()
}

#[test]
fn a_file_entry_round_trips_and_is_not_an_arena_entry() {
    let mut store = HostStore::create(1 << 20, 8).unwrap();
    let ts = layered(3);
    let len = 100 + 3 * 2 * 192;
    let src = source(len);
    let h = store
        .insert_file(AdapterId(5), Generation(2), &src, &ts)
        .unwrap();
    assert_eq!(store.lookup(AdapterId(5), Generation(2)), Some(h));
    let lease = store.lease(h).unwrap();
    assert!(lease.is_file());
    assert_eq!(lease.file_source(), Some(src));
    for t in &ts {
        assert_eq!(lease.file_module(t.layer, t.module), Some(*t));
        // The arena path never reads file offsets as arena offsets.
        assert!(lease.module(t.layer, t.module).is_none());
        assert_eq!(store.shape(h, t.layer, t.module), Some(t.shape));
    }
    assert_eq!(lease.file_module(LayerIdx(1), Module::K), None);
    assert_eq!(lease.file_module(LayerIdx(3), Module::Q), None);
    drop(lease);
    // A few hundred bytes of arena, not the weights.
    let (_, range) = store.live_extents()[0].clone();
    assert!(range.end - range.start < 4096, "{range:?}");
}

#[test]
fn an_arena_entry_is_not_a_file_entry() {
    let mut store = HostStore::create(1 << 20, 8).unwrap();
    let a = vec![1u8; 4 * 16 * 2];
    let b = vec![2u8; 8 * 4 * 2];
    let h = store
        .insert(
            AdapterId(1),
            Generation(1),
            &[LayerModuleWeights {
                layer: LayerIdx(0),
                module: Module::Q,
                rank: 4,
                scale: 0.5,
                dtype: DType::BF16,
                a_bytes: &a,
                b_bytes: &b,
            }],
        )
        .unwrap();
    let lease = store.lease(h).unwrap();
    assert!(!lease.is_file());
    assert_eq!(lease.file_source(), None);
    assert_eq!(lease.file_module(LayerIdx(0), Module::Q), None);
    let s = store.shape(h, LayerIdx(0), Module::Q).unwrap();
    assert_eq!((s.rank, s.d_in, s.d_out), (4, 16, 8));
}

#[test]
fn a_retired_file_entry_is_reclaimed_once_its_leases_are_gone() {
    let mut store = HostStore::create(1 << 16, 2).unwrap();
    let (free0, _) = store.free_space();
    let ts = layered(2);
    let src = source(10_000);
    let h = store
        .insert_file(AdapterId(1), Generation(1), &src, &ts)
        .unwrap();
    let reader = StoreReader::open(
        crate::Segment::open_fd(
            store.segment().try_clone_fd().unwrap(),
            crate::SegmentKind::HostStore,
        )
        .unwrap(),
        crate::ReaderSlot(1),
    )
    .unwrap();
    let lease = reader.lease(h).unwrap();
    assert!(store.remove(h));
    // Retired: new leases fail at once, the block waits for the worker's lease.
    assert!(store.lease(h).is_none());
    assert!(store.lookup(AdapterId(1), Generation(1)).is_none());
    assert_eq!(store.pending_reclaim(), 1);
    assert_eq!(lease.file_source(), Some(src.clone()));
    drop(lease);
    assert_eq!(store.reclaim(), 1);
    assert_eq!(store.free_space().0, free0);
    // A worker that dies holding a lease: released with its reader slot.
    let h = store
        .insert_file(AdapterId(1), Generation(2), &src, &ts)
        .unwrap();
    std::mem::forget(reader.lease(h).unwrap());
    assert!(store.remove(h));
    assert_eq!(store.pending_reclaim(), 1);
    store.release_reader(crate::ReaderSlot(1)).unwrap();
    assert_eq!(store.pending_reclaim(), 0);
    assert_eq!(store.free_space().0, free0);
}

#[test]
fn bad_file_entries_are_refused_with_the_reason() {
    let mut store = HostStore::create(1 << 16, 4).unwrap();
    let src = source(500);
    let err = |ts: &[FileTensors], src: &FileSource, store: &mut HostStore| {
        store
            .insert_file(AdapterId(1), Generation(1), src, ts)
            .unwrap_err()
            .to_string()
    };
    // B ends at 100 + 128 + 64 + 300 = 592 > 500.
    let e = err(&[tensor(0, Module::Q, 100, 528)], &src, &mut store);
    assert!(
        e.contains("B bytes 528..592 lie outside the file's 500 bytes"),
        "{e}"
    );
    let e = err(&[tensor(0, Module::Q, u64::MAX - 10, 0)], &src, &mut store);
    assert!(e.contains("too large"), "{e}");
    let twice = [tensor(0, Module::Q, 0, 128), tensor(0, Module::Q, 0, 128)];
    assert!(err(&twice, &src, &mut store).contains("given twice"));
    let mut zero = tensor(0, Module::Q, 0, 128);
    zero.shape.rank = 0;
    assert!(err(&[zero], &src, &mut store).contains("positive"));
    assert!(err(&[], &src, &mut store).contains("no weights"));
    let relative = FileSource {
        path: PathBuf::from("adapter_model.safetensors"),
        ..src.clone()
    };
    assert!(err(&[tensor(0, Module::Q, 0, 128)], &relative, &mut store).contains("absolute"));
    // Nothing leaked by the refusals.
    assert_eq!(store.free_space().0, store.config().capacity_bytes);
    assert!(store.live_extents().is_empty());
}

#[test]
fn a_changed_file_is_told_apart_from_the_registered_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("adapter_model.safetensors");
    std::fs::write(&path, vec![0u8; 300]).unwrap();
    let src = FileSource::of(path.clone()).unwrap();
    assert_eq!(src.len, 300);
    src.matches(&std::fs::metadata(&path).unwrap()).unwrap();
    // Truncated in place: same inode, other length.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(100)
        .unwrap();
    let e = src.matches(&std::fs::metadata(&path).unwrap()).unwrap_err();
    assert!(e.contains("100 bytes, 300 when"), "{e}");
    // Replaced by a new file of the same length.
    let tmp = dir.path().join("new");
    std::fs::write(&tmp, vec![0u8; 300]).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    let e = src.matches(&std::fs::metadata(&path).unwrap()).unwrap_err();
    assert!(e.contains("replaced"), "{e}");
}

proptest! {
    /// `check` accepts exactly the tensors whose A and B both end inside the file, and the
    /// ranges it accepts are the ones a reader slices.
    #[test]
    fn check_accepts_exactly_the_tensors_inside_the_file(
        rank in 0u32..64,
        d_in in 0u32..512,
        d_out in 0u32..512,
        dt in 0u32..3,
        a_off in 0u64..(1 << 20),
        b_off in prop_oneof![0u64..(1 << 20), Just(u64::MAX - 3)],
        file_len in 0u64..(1 << 21),
    ) {
        let dtype = DType::from_code(dt).unwrap();
        let t = FileTensors {
            layer: LayerIdx(0),
            module: Module::O,
            shape: ModuleShape { rank, scale: 1.0, dtype, d_in, d_out },
            a_off,
            b_off,
        };
        let es = dtype.size() as u128;
        let a_end = u128::from(a_off) + u128::from(rank) * u128::from(d_in) * es;
        let b_end = u128::from(b_off) + u128::from(rank) * u128::from(d_out) * es;
        let inside = rank > 0 && d_in > 0 && d_out > 0
            && a_end <= u128::from(file_len)
            && b_end <= u128::from(file_len);
        prop_assert_eq!(t.check(file_len).is_ok(), inside);
        if inside {
            prop_assert_eq!(u128::from(t.a_range().unwrap().end), a_end);
            prop_assert_eq!(u128::from(t.b_range().unwrap().end), b_end);
        }
    }

    /// Inserting and removing file entries in any order never leaks arena space or index
    /// slots, and every live entry reads back what was inserted.
    #[test]
    fn file_entries_never_leak(ops in proptest::collection::vec((0u64..6, any::<bool>()), 1..40)) {
        let mut store = HostStore::create(1 << 14, 4).unwrap();
        let cap = store.config().capacity_bytes;
        let mut live: Vec<(u64, AdapterHandle)> = Vec::new();
        let mut gen = 0;
        for (id, insert) in ops {
            if insert {
                gen += 1;
                let ts = layered((id % 3 + 1) as u32);
                match store.insert_file(AdapterId(id), Generation(gen), &source(5000), &ts) {
                    Ok(h) => live.push((id, h)),
                    Err(IpcError::IndexFull { .. } | IpcError::StoreFull { .. }) => {}
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            } else if let Some(i) = live.iter().position(|&(x, _)| x == id) {
                let (_, h) = live.swap_remove(i);
                prop_assert!(store.remove(h));
            }
            for &(id, h) in &live {
                let lease = store.lease(h).unwrap();
                prop_assert!(lease.is_file());
                let n = (id % 3 + 1) as u32;
                prop_assert_eq!(lease.n_layers, n);
                prop_assert!(lease.file_module(LayerIdx(n - 1), Module::V).is_some());
            }
        }
        for (_, h) in live {
            prop_assert!(store.remove(h));
        }
        prop_assert_eq!(store.free_space().0, cap);
        prop_assert_eq!(store.pending_reclaim(), 0);
    }
}
