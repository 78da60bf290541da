//! With CPU LoRA workers attached, registering an adapter copies none of its bytes on the
//! engine thread: the host-store entry is reserved there (O(layers)) and filled on the
//! background thread, then published at the next step. Its own test binary, since it holds
//! the process's one background thread.
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use thaw_ipc::HostStore;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::Engine;
use thaw_runtime::ids::AdapterId;
use thaw_tests::TestModel;
use workers_support::{cached_greedy, greedy, pool_with, streaming_engine};

mod workers_support;

fn store(e: &Engine<CpuBackend>) -> &HostStore {
    e.pool().expect("a pool is attached").store()
}

/// While the fill waits, the workers cannot read the adapter: the engine assists its cold
/// layers itself and the tokens are the cached oracle's; once the fill is published the
/// workers take over, with the same tokens. Nothing is left reserved at the end.
#[test]
fn the_host_store_is_filled_off_the_engine_thread_and_published_at_a_step() {
    let tm = TestModel::llama(71);
    let cfg = tm.model.config.clone();
    let all = ["q", "k", "v", "o", "gate", "up", "down"];
    let adapter = tm.adapter(16, &all, 991);
    let prompt: Vec<u32> = (0..20u32)
        .map(|t| 3 + (t * 41) % (cfg.vocab_size as u32 - 3))
        .collect();
    let id = AdapterId(0);
    let want = cached_greedy(&tm, &adapter, &prompt);
    // About 8 s on the link: the adapter streams through the whole test.
    let pool = pool_with(1, HostStore::create(64 << 20, 4).unwrap());
    let mut e = streaming_engine(&tm, adapter.size_bytes(), 8.0, pool);
    // Hold the background thread, so the fill queued behind this job waits.
    let (started, wait_started) = channel();
    let (release, held) = channel::<()>();
    thaw_runtime::upload::run_later(move || {
        started.send(()).unwrap();
        let _ = held.recv();
    });
    wait_started.recv().unwrap();
    e.register_adapter_streaming(id, adapter.clone()).unwrap();
    assert_eq!(store(&e).pending_fills(), 1, "reserved, not filled");
    assert!(
        store(&e).live_extents().is_empty(),
        "published before its fill"
    );
    assert_eq!(e.adapters_in_store(), 1);

    let assisted = e.rows_assisted();
    assert_eq!(
        greedy(&mut e, 2, id, &prompt),
        want,
        "assisted while filling"
    );
    assert!(
        e.rows_assisted() > assisted,
        "the cold layers were not assisted"
    );
    assert!(
        e.pool().unwrap().last_assignments().is_empty(),
        "the workers were given an adapter they cannot read yet"
    );
    assert!(
        !e.adapter_resident(id),
        "the adapter landed: the link is too fast"
    );

    drop(release);
    let deadline = Instant::now() + Duration::from_secs(60);
    while store(&e).live_extents().is_empty() {
        assert!(Instant::now() < deadline, "the fill was never published");
        std::thread::sleep(Duration::from_millis(1));
        e.release_landed();
    }
    assert_eq!(store(&e).pending_fills(), 0);
    assert_eq!(
        greedy(&mut e, 3, id, &prompt),
        want,
        "assisted by the workers"
    );
    assert!(
        !e.pool().unwrap().last_assignments().is_empty(),
        "the workers computed nothing once the adapter was published"
    );
    assert!(
        !e.adapter_resident(id),
        "the adapter landed: the link is too fast"
    );

    // Unregistered: the entry goes, and its space with it.
    e.unregister_adapter(id).unwrap();
    let s = store(&e);
    assert!(s.live_extents().is_empty() && s.pending_fills() == 0);
    assert_eq!(s.free_space().0, s.config().capacity_bytes);
    e.detach_pool().unwrap().shutdown();
}

/// A host store with room for one adapter and two streaming: the second is not refused but
/// assisted on the engine thread (the cached oracle's tokens), and gets its entry at the
/// first step after the first one leaves; the workers then assist it, with the same tokens.
#[test]
fn an_adapter_the_store_has_no_room_for_is_assisted_inline_until_it_has() {
    let tm = TestModel::llama(73);
    let cfg = tm.model.config.clone();
    let all = ["q", "k", "v", "o", "gate", "up", "down"];
    let adapters = [tm.adapter(16, &all, 993), tm.adapter(8, &all[..4], 994)];
    let prompt: Vec<u32> = (0..18u32)
        .map(|t| 3 + (t * 43) % (cfg.vocab_size as u32 - 3))
        .collect();
    let (a, b) = (AdapterId(0), AdapterId(1));
    let want = cached_greedy(&tm, &adapters[1], &prompt);
    // About 8 s each on the link, one after the other: both stream through the test.
    let pool = pool_with(1, HostStore::create(64 << 20, 1).unwrap());
    let mut e = streaming_engine(&tm, adapters[0].size_bytes(), 8.0, pool);
    e.register_adapter_streaming(a, adapters[0].clone())
        .unwrap();
    e.register_adapter_streaming(b, adapters[1].clone())
        .expect("registered without a host-store entry, not refused");
    assert_eq!(e.adapters_in_store(), 1, "the store holds one");
    assert_eq!(greedy(&mut e, 2, b, &prompt), want, "assisted inline");
    assert!(
        e.pool().unwrap().last_assignments().is_empty(),
        "the workers were given an adapter not in the store"
    );

    e.unregister_adapter(a).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while store(&e).live_extents().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the second adapter never got its entry"
        );
        std::thread::sleep(Duration::from_millis(1));
        e.release_landed();
    }
    assert_eq!(e.adapters_in_store(), 1);
    assert!(
        !e.adapter_resident(b),
        "the adapter landed: the link is too fast"
    );
    assert_eq!(
        greedy(&mut e, 3, b, &prompt),
        want,
        "assisted by the workers"
    );
    assert!(
        !e.pool().unwrap().last_assignments().is_empty(),
        "the workers computed nothing once the adapter had its entry"
    );
    e.detach_pool().unwrap().shutdown();
}
