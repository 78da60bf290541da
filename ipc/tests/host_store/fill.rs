//! Reserve / fill / publish (`HostStore::reserve`, `StoreFill::fill`, `HostStore::settle`):
//! an entry is never readable while it is being written, an abandoned or cancelled
//! reservation frees its space exactly once, and reservations never over-commit the arena.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

use proptest::prelude::*;
use thaw_ipc::*;

use super::{check_view, make, reader_of};

const MODS: [Module; 2] = [Module::Q, Module::Down];

/// Asserts that nobody can read `h` (it is reserved, filling, or cancelled).
fn unreadable(r: &StoreReader, h: AdapterHandle) {
    assert!(!r.is_live(h), "{h:?} is live while being written");
    assert_eq!(r.lookup(h.id, h.generation), None);
    assert!(r.lease(h).is_none(), "{h:?} leased while being written");
    assert!(r.view(h, LayerIdx(0), MODS[0]).is_none());
}

#[test]
fn a_reservation_is_unreadable_until_filled_and_settled() {
    let mut store = HostStore::create(1 << 20, 4).unwrap();
    let r = reader_of(&store, 1);
    let w = make(3, 9, 2, &MODS, 4, (16, 24), DType::BF16);
    let fill = store
        .reserve(AdapterId(3), Generation(9), &w.weights())
        .unwrap();
    let h = fill.handle();
    unreadable(&r, h);
    assert_eq!(store.pending_fills(), 1);
    assert!(store.live_extents().is_empty());
    let (free, _) = store.free_space();
    assert!(
        free < store.config().capacity_bytes,
        "the space is taken at reserve"
    );
    // The same (id, generation) cannot be reserved or inserted twice.
    assert!(matches!(
        store.reserve(AdapterId(3), Generation(9), &w.weights()),
        Err(IpcError::AlreadyPresent { .. })
    ));
    assert!(matches!(
        store.insert(AdapterId(3), Generation(9), &w.weights()),
        Err(IpcError::AlreadyPresent { .. })
    ));
    // Filled on another thread: still unreadable until the writer settles.
    let owned = w.parts.clone();
    thread::spawn(move || {
        let w = super::Owned { parts: owned };
        fill.fill(&w.weights()).unwrap();
    })
    .join()
    .unwrap();
    unreadable(&r, h);
    assert_eq!(store.settle(), 1);
    assert!(r.is_live(h));
    assert_eq!(r.lookup(AdapterId(3), Generation(9)), Some(h));
    for l in 0..2 {
        for m in MODS {
            assert!(check_view(&r, h, l, m));
        }
    }
    assert_eq!(store.pending_fills(), 0);
    assert!(store.remove(h));
    assert_eq!(store.free_space().0, store.config().capacity_bytes);
}

#[test]
fn abandoned_and_cancelled_reservations_free_their_space_once() {
    let mut store = HostStore::create(64 * 1024, 2).unwrap();
    let cap = store.config().capacity_bytes;
    let w = make(1, 1, 2, &MODS, 8, (64, 64), DType::F32);
    // Abandoned: the token is dropped unfilled.
    let fill = store
        .reserve(AdapterId(1), Generation(1), &w.weights())
        .unwrap();
    drop(fill);
    assert_eq!(store.pending_fills(), 1, "freed only by the writer");
    assert_eq!(store.settle(), 0);
    assert_eq!(store.pending_fills(), 0);
    assert_eq!(store.free_space().0, cap);
    // Cancelled before its fill started: freed at once, and the late fill writes nothing
    // (the space went to another adapter meanwhile, whose bytes stay intact).
    let late = store
        .reserve(AdapterId(1), Generation(2), &w.weights())
        .unwrap();
    let h = late.handle();
    assert!(store.remove(h));
    assert!(!store.remove(h), "cancelled twice");
    assert_eq!(store.free_space().0, cap);
    assert_eq!(store.pending_fills(), 0);
    let other = make(8, 1, 2, &MODS, 8, (64, 64), DType::F32);
    let o = store
        .insert(AdapterId(8), Generation(1), &other.weights())
        .unwrap();
    late.fill(&w.weights()).unwrap();
    assert_eq!(
        store.settle(),
        0,
        "a cancelled reservation is not published"
    );
    unreadable(store.reader(), h);
    for l in 0..2 {
        for m in MODS {
            assert!(
                check_view(&store, o, l, m),
                "the cancelled fill wrote into {o:?}"
            );
        }
    }
    assert!(store.remove(o));
    assert_eq!(store.free_space().0, cap);
    // Both index slots are free again.
    let a = store
        .insert(AdapterId(5), Generation(1), &w.weights())
        .unwrap();
    let b = store
        .insert(AdapterId(6), Generation(1), &w.weights())
        .unwrap();
    assert_ne!(a.slot, b.slot);
}

#[test]
fn a_fill_that_does_not_match_its_reservation_is_refused_and_abandoned() {
    let mut store = HostStore::create(1 << 20, 4).unwrap();
    let w = make(2, 1, 2, &MODS, 4, (16, 16), DType::F16);
    let other = make(2, 1, 2, &MODS, 4, (16, 32), DType::F16);
    let fill = store
        .reserve(AdapterId(2), Generation(1), &w.weights())
        .unwrap();
    let h = fill.handle();
    let e = fill.fill(&other.weights()).unwrap_err();
    assert!(
        e.to_string().contains("does not match the reservation"),
        "{e}"
    );
    let fill = store
        .reserve(AdapterId(2), Generation(2), &w.weights())
        .unwrap();
    let e = fill.fill(&w.weights()[1..]).unwrap_err();
    assert!(e.to_string().contains("made for 4"), "{e}");
    assert_eq!(store.settle(), 0);
    unreadable(store.reader(), h);
    assert_eq!(store.free_space().0, store.config().capacity_bytes);
}

/// Readers spin on a handle while another thread fills it and the writer settles: a lease
/// either fails or sees every byte of the pattern, never a partly written adapter.
#[test]
fn readers_never_see_a_half_filled_adapter() {
    let mut store = HostStore::create(4 << 20, 8).unwrap();
    let reader = Arc::new(reader_of(&store, 1));
    for g in 0..12u64 {
        let w = make(4, g, 3, &MODS, 16, (128, 96), DType::BF16);
        let fill = store
            .reserve(AdapterId(4), Generation(g), &w.weights())
            .unwrap();
        let h = fill.handle();
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(AtomicU64::new(0));
        let spinner = {
            let (r, stop, seen) = (reader.clone(), stop.clone(), seen.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if check_view(&r, h, 2, Module::Down) {
                        seen.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let owned = w.parts.clone();
        let filler = thread::spawn(move || {
            let w = super::Owned { parts: owned };
            fill.fill(&w.weights()).unwrap();
        });
        while store.settle() == 0 {
            thread::yield_now();
        }
        filler.join().unwrap();
        while seen.load(Ordering::Relaxed) == 0 {
            thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        spinner.join().unwrap();
        assert!(store.remove(h));
    }
    assert_eq!(store.free_space().0, store.config().capacity_bytes);
}

#[derive(Debug, Clone)]
enum Op {
    Reserve { layers: u32, rank: u32, d: u32 },
    Fill(usize),
    Abandon(usize),
    Cancel(usize),
    Remove(usize),
    LateFill(usize),
    Settle,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u32..3, 1u32..9, 1u32..64).prop_map(|(layers, rank, d)| Op::Reserve { layers, rank, d }),
        3 => any::<usize>().prop_map(Op::Fill),
        1 => any::<usize>().prop_map(Op::Abandon),
        1 => any::<usize>().prop_map(Op::Cancel),
        2 => any::<usize>().prop_map(Op::Remove),
        1 => any::<usize>().prop_map(Op::LateFill),
        2 => Just(Op::Settle),
    ]
}

/// A reservation in the model: its handle, its token (until filled or dropped), whether
/// its fill finished, whether it was cancelled, and the bytes it must hold once live.
struct Pending {
    handle: AdapterHandle,
    fill: Option<StoreFill>,
    filled: bool,
    cancelled: bool,
    w: super::Owned,
}

type Live = Vec<(AdapterHandle, super::Owned)>;

/// What the writer's settle did (it also runs inside `reserve` and a cancelling `remove`):
/// reservations filled and not cancelled went live; cancelled ones (their fills here never
/// run concurrently, so never started) and abandoned ones were freed. Returns how many went
/// live.
fn absorb(pending: &mut Vec<Pending>, live: &mut Live) -> usize {
    let mut published = 0;
    for p in std::mem::take(pending) {
        match (&p.fill, p.filled, p.cancelled) {
            (_, _, true) | (None, false, _) => {}
            (Some(_), _, false) => pending.push(p),
            (None, true, false) => {
                live.push((p.handle, p.w));
                published += 1;
            }
        }
    }
    published
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn reserve_fill_settle_sequences_never_expose_writing_entries_or_leak_space(
        ops in proptest::collection::vec(op(), 1..60)
    ) {
        let mut store = HostStore::create(48 * 1024, 10).unwrap();
        let cap = store.config().capacity_bytes;
        let mut pending: Vec<Pending> = Vec::new();
        let mut live: Live = Vec::new();
        let mut late: Vec<(StoreFill, super::Owned)> = Vec::new();
        for (g, op) in ops.into_iter().enumerate() {
            let g = g as u64;
            match op {
                Op::Reserve { layers, rank, d } => {
                    let w = make(g % 3, g, layers, &MODS, rank, (d, d + 3), DType::BF16);
                    let r = store.reserve(AdapterId(g % 3), Generation(g), &w.weights());
                    absorb(&mut pending, &mut live);
                    match r {
                        Ok(fill) => pending.push(Pending {
                            handle: fill.handle(),
                            fill: Some(fill),
                            filled: false,
                            cancelled: false,
                            w,
                        }),
                        Err(IpcError::StoreFull { .. } | IpcError::IndexFull { .. }) => {}
                        Err(e) => return Err(TestCaseError::fail(e.to_string())),
                    }
                }
                Op::Fill(i) if !pending.is_empty() => {
                    let n = pending.len();
                    let p = &mut pending[i % n];
                    if let Some(fill) = p.fill.take() {
                        fill.fill(&p.w.weights()).unwrap();
                        p.filled = true;
                    }
                }
                Op::LateFill(i) if !late.is_empty() => {
                    // A cancelled, freed reservation's fill runs late: it must not write.
                    let n = late.len();
                    let (fill, w) = late.swap_remove(i % n);
                    fill.fill(&w.weights()).unwrap();
                }
                Op::Abandon(i) if !pending.is_empty() => {
                    let n = pending.len();
                    pending[i % n].fill.take();
                }
                Op::Cancel(i) if !pending.is_empty() => {
                    let n = pending.len();
                    let p = &mut pending[i % n];
                    if !p.cancelled {
                        prop_assert!(store.remove(p.handle));
                        p.cancelled = true;
                        if let Some(fill) = p.fill.take() {
                            late.push((fill, super::Owned { parts: p.w.parts.clone() }));
                        }
                        absorb(&mut pending, &mut live);
                    }
                }
                Op::Remove(i) if !live.is_empty() => {
                    let n = live.len();
                    let (h, _) = live.swap_remove(i % n);
                    prop_assert!(store.remove(h));
                }
                Op::Settle => {
                    let published = absorb(&mut pending, &mut live);
                    prop_assert_eq!(store.settle(), published);
                }
                _ => {}
            }
            prop_assert_eq!(store.pending_fills(), pending.len());
            // Every unpublished reservation is unreadable.
            for p in &pending {
                unreadable(store.reader(), p.handle);
            }
            // Every live adapter reads back intact.
            prop_assert_eq!(store.live_extents().len(), live.len());
            for (h, _) in &live {
                prop_assert!(store.is_live(*h));
                for l in 0..2 {
                    for m in MODS {
                        let present = store.view(*h, LayerIdx(l), m).is_some();
                        prop_assert_eq!(present, check_view(&store, *h, l, m));
                    }
                }
                prop_assert!(check_view(&store, *h, 0, MODS[0]));
            }
            // Never over-committed, and freed exactly once: live and reserved blocks are
            // disjoint, inside the arena, and with the free space add up to the capacity.
            let mut ext: Vec<_> = store.live_extents().into_iter().chain(store.filling_extents()).collect();
            ext.sort_by_key(|(_, r)| r.start);
            for pair in ext.windows(2) {
                prop_assert!(pair[0].1.end <= pair[1].1.start, "overlap {:?}", pair);
            }
            prop_assert!(ext.last().is_none_or(|(_, r)| r.end <= cap));
            let used: u64 = ext.iter().map(|(_, r)| r.end - r.start).sum();
            prop_assert_eq!(store.free_space().0 + used, cap);
        }
    }
}
