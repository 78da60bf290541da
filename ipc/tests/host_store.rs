//! The host adapter store: round trips, leases and reclaim, errors, a concurrent
//! writer/readers torture test, a cross-process reader, and a property test over
//! insert/remove sequences.

mod common;
#[path = "host_store/fill.rs"]
mod fill;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_ipc::*;

const FD_VAR: &str = "THAW_STORE_FD";

/// An adapter's weights as owned byte buffers (A, B) per (layer, module), filled with
/// [`common::pattern`].
struct Owned {
    parts: Vec<Part>,
}

/// (layer, module, rank, dtype, A bytes, B bytes).
type Part = (LayerIdx, Module, u32, DType, Vec<u8>, Vec<u8>);

fn make(
    id: u64,
    generation: u64,
    layers: u32,
    modules: &[Module],
    rank: u32,
    d: (u32, u32),
    dtype: DType,
) -> Owned {
    let mut parts = Vec::new();
    for l in 0..layers {
        for &m in modules {
            let na = (rank * d.0) as usize * dtype.size();
            let nb = (rank * d.1) as usize * dtype.size();
            let a = (0..na)
                .map(|i| common::pattern(id, generation, l, m.index(), 0, i))
                .collect();
            let b = (0..nb)
                .map(|i| common::pattern(id, generation, l, m.index(), 1, i))
                .collect();
            parts.push((LayerIdx(l), m, rank, dtype, a, b));
        }
    }
    Owned { parts }
}

impl Owned {
    fn weights(&self) -> Vec<LayerModuleWeights<'_>> {
        self.parts
            .iter()
            .map(|(layer, module, rank, dtype, a, b)| LayerModuleWeights {
                layer: *layer,
                module: *module,
                rank: *rank,
                scale: 2.0 / *rank as f32,
                dtype: *dtype,
                a_bytes: a,
                b_bytes: b,
            })
            .collect()
    }
}

/// Checks every byte of (layer, module) of `h` against the pattern, under one view.
/// Returns false if the adapter is gone (never a partial or foreign adapter).
fn check_view(r: &StoreReader, h: AdapterHandle, layer: u32, m: Module) -> bool {
    let Some(v) = r.view(h, LayerIdx(layer), m) else {
        return false;
    };
    let (id, g) = (h.id.0, h.generation.0);
    for (i, &b) in v.a.iter().enumerate() {
        assert_eq!(
            b,
            common::pattern(id, g, layer, m.index(), 0, i),
            "torn A of {h:?} layer {layer} {m:?}"
        );
    }
    // Give the writer a chance to remove and recycle this adapter mid-read.
    thread::yield_now();
    for (i, &b) in v.b.iter().enumerate() {
        assert_eq!(
            b,
            common::pattern(id, g, layer, m.index(), 1, i),
            "torn B of {h:?} layer {layer} {m:?}"
        );
    }
    true
}

fn reader_of(store: &HostStore, slot: u32) -> StoreReader {
    let seg = Segment::open_fd(
        store.segment().try_clone_fd().unwrap(),
        SegmentKind::HostStore,
    )
    .unwrap();
    StoreReader::open(seg, ReaderSlot(slot)).unwrap()
}

#[test]
fn insert_view_remove_round_trip() {
    let mut store = HostStore::create(1 << 20, 8).unwrap();
    let w = make(
        7,
        1,
        2,
        &[Module::Q, Module::V, Module::Down],
        4,
        (16, 24),
        DType::F32,
    );
    let h = store
        .insert(AdapterId(7), Generation(1), &w.weights())
        .unwrap();
    let r = reader_of(&store, 1);
    assert_eq!(r.lookup(AdapterId(7), Generation(1)), Some(h));
    assert_eq!(r.lookup(AdapterId(7), Generation(2)), None);
    let v = r.view(h, LayerIdx(1), Module::Down).unwrap();
    assert_eq!((v.rank, v.d_in, v.d_out, v.dtype), (4, 16, 24, DType::F32));
    assert_eq!(v.scale, 0.5);
    let (a, b) = v.f32().unwrap();
    assert_eq!((a.len(), b.len()), (64, 96));
    assert!(v.f16().is_none());
    drop(v);
    assert!(r.view(h, LayerIdx(0), Module::K).is_none(), "not targeted");
    assert!(r.view(h, LayerIdx(2), Module::Q).is_none(), "no such layer");
    for l in 0..2 {
        for m in [Module::Q, Module::V, Module::Down] {
            assert!(check_view(&r, h, l, m));
        }
    }
    assert!(store.remove(h));
    assert!(!store.remove(h));
    assert_eq!(r.lookup(AdapterId(7), Generation(1)), None);
    assert!(r.view(h, LayerIdx(0), Module::Q).is_none());
    assert_eq!(store.free_space().0, store.config().capacity_bytes);
}

#[test]
fn half_dtypes_view_typed() {
    let mut store = HostStore::create(1 << 20, 8).unwrap();
    for (i, dt) in [DType::F16, DType::BF16].into_iter().enumerate() {
        let w = make(i as u64, 0, 1, &[Module::O], 8, (32, 32), dt);
        let h = store
            .insert(AdapterId(i as u64), Generation(0), &w.weights())
            .unwrap();
        let v = store.view(h, LayerIdx(0), Module::O).unwrap();
        assert_eq!(v.dtype, dt);
        match dt {
            DType::F16 => assert_eq!(v.f16().unwrap().0.len(), 256),
            _ => assert_eq!(v.bf16().unwrap().1.len(), 256),
        }
    }
}

#[test]
fn leased_adapter_outlives_removal() {
    let mut store = HostStore::create(1 << 20, 8).unwrap();
    let r = reader_of(&store, 3);
    let w = make(1, 1, 1, &[Module::Q], 4, (8, 8), DType::F32);
    let h = store
        .insert(AdapterId(1), Generation(1), &w.weights())
        .unwrap();
    let lease = r.lease(h).unwrap();
    assert!(store.remove(h));
    assert_eq!(store.pending_reclaim(), 1, "leased: bytes must stay");
    assert!(r.lease(h).is_none(), "no new leases after removal");
    // The old lease still reads the whole, unchanged adapter, even while new ones land.
    let w2 = make(2, 1, 1, &[Module::Q], 4, (8, 8), DType::F32);
    store
        .insert(AdapterId(2), Generation(1), &w2.weights())
        .unwrap();
    let q = lease.module(LayerIdx(0), Module::Q).unwrap();
    assert!(q
        .a
        .iter()
        .enumerate()
        .all(|(i, &b)| b == common::pattern(1, 1, 0, 0, 0, i)));
    drop(lease);
    assert_eq!(store.reclaim(), 1);
    assert_eq!(store.pending_reclaim(), 0);

    // A dead reader's leases are dropped by the engine.
    let h3 = store
        .insert(AdapterId(3), Generation(1), &w.weights())
        .unwrap();
    std::mem::forget(r.lease(h3).unwrap()); // as if the worker died holding it
    store.remove(h3);
    assert_eq!(store.pending_reclaim(), 1);
    store.release_reader(ReaderSlot(3)).unwrap();
    assert_eq!(store.pending_reclaim(), 0);
}

#[test]
fn errors_are_specific() {
    let mut store = HostStore::create(8192, 2).unwrap();
    let w = make(1, 1, 1, &[Module::Q], 4, (8, 8), DType::F32);
    let h = store
        .insert(AdapterId(1), Generation(1), &w.weights())
        .unwrap();
    assert!(matches!(
        store.insert(AdapterId(1), Generation(1), &w.weights()),
        Err(IpcError::AlreadyPresent {
            id: 1,
            generation: 1
        })
    ));
    let big = make(2, 1, 4, &[Module::Q, Module::K], 16, (64, 64), DType::F32);
    let err = store
        .insert(AdapterId(2), Generation(1), &big.weights())
        .unwrap_err();
    assert!(matches!(err, IpcError::StoreFull { .. }), "{err}");
    store
        .insert(AdapterId(3), Generation(1), &w.weights())
        .unwrap();
    let err = store
        .insert(AdapterId(4), Generation(1), &w.weights())
        .unwrap_err();
    assert!(matches!(err, IpcError::IndexFull { max: 2 }), "{err}");
    store.remove(h);
    let mut bad = w.weights();
    bad[0].a_bytes = &bad[0].a_bytes[..5];
    let err = store.insert(AdapterId(5), Generation(1), &bad).unwrap_err();
    assert!(
        matches!(
            err,
            IpcError::BadWeights {
                layer: 0,
                module: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(matches!(
        StoreReader::open(
            Segment::open_fd(
                store.segment().try_clone_fd().unwrap(),
                SegmentKind::HostStore
            )
            .unwrap(),
            ReaderSlot(1000)
        ),
        Err(IpcError::NoSuchReader { .. })
    ));
}

#[test]
fn concurrent_writer_and_readers_never_see_torn_adapters() {
    const MODS: [Module; 3] = [Module::Q, Module::Up, Module::Down];
    let mut store = HostStore::create(256 * 1024, 16).unwrap();
    let readers = [
        Arc::new(reader_of(&store, 1)),
        Arc::new(reader_of(&store, 2)),
    ];
    let live: Arc<Mutex<Vec<AdapterHandle>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let verified = Arc::new(AtomicU64::new(0));
    let missed = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (r, live, stop) = (readers[t % 2].clone(), live.clone(), stop.clone());
            let (verified, missed) = (verified.clone(), missed.clone());
            thread::spawn(move || {
                let mut rng = ChaCha8Rng::seed_from_u64(100 + t as u64);
                let mut seen: Vec<AdapterHandle> = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    // Often reuse a handle seen earlier: it may have been removed and its
                    // slot and bytes recycled since.
                    let pick = if !seen.is_empty() && rng.random_bool(0.3) {
                        Some(seen[rng.random_range(0..seen.len())])
                    } else {
                        let l = live.lock().unwrap();
                        (!l.is_empty()).then(|| l[rng.random_range(0..l.len())])
                    };
                    let Some(h) = pick else { continue };
                    if seen.len() < 16 {
                        seen.push(h);
                    } else {
                        let i = rng.random_range(0..16);
                        seen[i] = h;
                    }
                    // Also look it up by identity, like a reader that only knows (id, gen).
                    let h = if rng.random_bool(0.5) {
                        r.lookup(h.id, h.generation).unwrap_or(h)
                    } else {
                        h
                    };
                    let m = MODS[rng.random_range(0..MODS.len())];
                    if check_view(&r, h, rng.random_range(0..3), m) {
                        verified.fetch_add(1, Ordering::Relaxed);
                    } else {
                        missed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut mine: Vec<AdapterHandle> = Vec::new();
    let start = std::time::Instant::now();
    for generation in 0u64.. {
        // Enough churn, and the readers verified enough views while it went on (they may get
        // little CPU on a loaded machine: keep writing until they did, up to a minute).
        let enough =
            verified.load(Ordering::Relaxed) > 100 || start.elapsed() > Duration::from_secs(60);
        if generation >= 3000 && start.elapsed() > Duration::from_millis(500) && enough {
            break;
        }
        if mine.len() > 6 || (!mine.is_empty() && rng.random_bool(0.4)) {
            let h = mine.swap_remove(rng.random_range(0..mine.len()));
            live.lock().unwrap().retain(|x| *x != h);
            assert!(store.remove(h));
        }
        let id = rng.random_range(0..5u64);
        let rank = [2, 4, 8][rng.random_range(0..3)];
        let w = make(
            id,
            generation,
            3,
            &MODS,
            rank,
            (rng.random_range(4..40), rng.random_range(4..40)),
            DType::F16,
        );
        match store.insert(AdapterId(id), Generation(generation), &w.weights()) {
            Ok(h) => {
                mine.push(h);
                live.lock().unwrap().push(h);
            }
            Err(IpcError::StoreFull { .. } | IpcError::IndexFull { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let (v, m) = (
        verified.load(Ordering::Relaxed),
        missed.load(Ordering::Relaxed),
    );
    println!("verified {v} views, {m} lookups of just-removed adapters");
    assert!(v > 100, "readers verified only {v} views");
}

#[test]
fn child_entry() {
    let Some(role) = common::role() else { return };
    assert_eq!(role, "store-reader");
    let seg = Segment::from_inherited_env(FD_VAR, SegmentKind::HostStore).unwrap();
    let r = StoreReader::open(seg, ReaderSlot(1)).unwrap();
    let g: u64 = std::env::var("THAW_GEN").unwrap().parse().unwrap();
    let h = r
        .lookup(AdapterId(42), Generation(g))
        .expect("adapter visible in child");
    for l in 0..2 {
        assert!(check_view(&r, h, l, Module::K));
    }
    std::process::exit(0);
}

#[test]
fn another_process_reads_the_same_adapter() {
    let mut store = HostStore::create(1 << 20, 4).unwrap();
    let w = make(42, 9, 2, &[Module::K], 8, (64, 32), DType::BF16);
    store
        .insert(AdapterId(42), Generation(9), &w.weights())
        .unwrap();
    let child = common::spawn_child(
        "store-reader",
        &[(store.segment(), FD_VAR)],
        &[("THAW_GEN", "9".into())],
    );
    common::expect_success(child, Duration::from_secs(20));
}

#[derive(Debug, Clone)]
enum Op {
    Insert {
        layers: u32,
        rank: u32,
        d_in: u32,
        d_out: u32,
        dtype: u8,
    },
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u32..3, 1u32..9, 1u32..48, 1u32..48, 0u8..3)
            .prop_map(|(layers, rank, d_in, d_out, dtype)| Op::Insert { layers, rank, d_in, d_out, dtype }),
        2 => any::<usize>().prop_map(Op::Remove),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn insert_remove_sequences_keep_allocations_disjoint_and_bytes_intact(ops in proptest::collection::vec(op(), 1..60)) {
        let mut store = HostStore::create(48 * 1024, 12).unwrap();
        let mut live: Vec<AdapterHandle> = Vec::new();
        for (generation, op) in ops.into_iter().enumerate() {
            match op {
                Op::Insert { layers, rank, d_in, d_out, dtype } => {
                    let dtype = [DType::F32, DType::F16, DType::BF16][dtype as usize];
                    let id = generation as u64 % 4;
                    let w = make(id, generation as u64, layers, &[Module::Gate, Module::O], rank, (d_in, d_out), dtype);
                    match store.insert(AdapterId(id), Generation(generation as u64), &w.weights()) {
                        Ok(h) => live.push(h),
                        Err(IpcError::StoreFull { .. } | IpcError::IndexFull { .. }) => {}
                        Err(e) => return Err(TestCaseError::fail(e.to_string())),
                    }
                }
                Op::Remove(i) if !live.is_empty() => {
                    let h = live.swap_remove(i % live.len());
                    prop_assert!(store.remove(h));
                }
                Op::Remove(_) => {}
            }
            let mut ext = store.live_extents();
            prop_assert_eq!(ext.len(), live.len());
            ext.sort_by_key(|(_, r)| r.start);
            for pair in ext.windows(2) {
                prop_assert!(pair[0].1.end <= pair[1].1.start, "overlap {:?}", pair);
            }
            for h in &live {
                for l in 0..2 {
                    for m in [Module::Gate, Module::O] {
                        let present = store.view(*h, LayerIdx(l), m).is_some();
                        prop_assert_eq!(present, check_view(&store, *h, l, m));
                    }
                }
                prop_assert!(check_view(&store, *h, 0, Module::Gate));
            }
        }
    }
}
