//! The upload arena is the host tier's memory: an adapter's encoded device image stays in the
//! arena while the adapter lives, so loading it again after a device eviction, or loading an
//! adapter staged when it entered the host tier, queues only the (emulated) copies and encodes
//! nothing; once the adapter's last reference is gone its image is freed.
use std::time::{Duration, Instant};

use thaw_runtime::backend::Backend as _;
use thaw_runtime::engine::EngineConfig;
use thaw_runtime::ids::AdapterId;
use thaw_runtime::upload::ArenaUsage;
use thaw_tests::{cpu_engine, CpuEngine, TestModel};

fn usage(e: &CpuEngine) -> ArenaUsage {
    e.backend().upload_arena().expect("the pipeline is started")
}

/// Waits until `done` holds of the arena; panics after a minute.
fn wait_arena(e: &CpuEngine, what: &str, done: impl Fn(&ArenaUsage) -> bool) -> ArenaUsage {
    let t = Instant::now();
    loop {
        let u = usage(e);
        if done(&u) {
            return u;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "{what}: {u:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_reload_after_device_eviction_or_of_a_staged_adapter_encodes_nothing() {
    let m = TestModel::llama(11);
    let a = m.adapter(16, &["q", "k", "v", "o"], 3);
    let b = m.adapter(8, &["q", "v", "down"], 4);
    let mut e = cpu_engine(m.model, EngineConfig::default());
    let (ia, ib) = (AdapterId(1), AdapterId(2));
    let landed = Duration::from_secs(60);

    // First load: every byte encoded once, and the image kept after its copy landed.
    e.register_adapter_streaming(ia, a.clone()).unwrap();
    e.wait_adapters_landed(landed).unwrap();
    let first = wait_arena(&e, "the upload's end", |u| u.idle);
    assert_eq!(first.encoded_bytes, a.size_bytes() as u64);
    assert_eq!(first.reused_bytes, 0);
    assert!(first.retained >= a.size_bytes() && first.retained == first.used);

    // Evicted from the device, the host tier (this test) still holding it: the second load
    // copies the kept image and encodes nothing.
    e.unregister_adapter(ia).unwrap();
    e.register_adapter_streaming(ia, a.clone()).unwrap();
    e.wait_adapters_landed(landed).unwrap();
    let second = wait_arena(&e, "the reload's end", |u| u.idle);
    assert_eq!(second.encoded_bytes, first.encoded_bytes, "no encode work");
    let image = second.reused_bytes as usize;
    assert!(image >= a.size_bytes() && image.next_multiple_of(256) == first.retained);
    assert_eq!(second.used, first.used, "one image, not two");

    // Staged when it entered the host tier: encoded then, not when it is loaded.
    // It answers the arena bytes the image holds (what the host tier counts for it).
    let held = e.stage_adapter(&b);
    assert!(held >= b.size_bytes() && held.is_multiple_of(256), "{held}");
    let staged = wait_arena(&e, "the staging", |u| u.idle);
    assert_eq!(
        staged.used,
        second.used + held,
        "the staged image holds what it said"
    );
    // Staged again (already there): the same bytes, no new image.
    assert_eq!(e.stage_adapter(&b), held);
    assert_eq!(
        wait_arena(&e, "a second staging", |u| u.idle).used,
        staged.used
    );
    assert_eq!(
        staged.encoded_bytes,
        second.encoded_bytes + b.size_bytes() as u64
    );
    e.register_adapter_streaming(ib, b.clone()).unwrap();
    e.wait_adapters_landed(landed).unwrap();
    let third = wait_arena(&e, "the staged load's end", |u| u.idle);
    assert_eq!(third.encoded_bytes, staged.encoded_bytes, "no encode work");
    assert!(third.reused_bytes > second.reused_bytes);

    // Gone from the device and the host tier: both images are freed.
    e.unregister_adapter(ia).unwrap();
    e.unregister_adapter(ib).unwrap();
    drop((a, b));
    let gone = wait_arena(&e, "the images to be freed", |u| u.used == 0);
    assert_eq!(gone.retained, 0);
}
