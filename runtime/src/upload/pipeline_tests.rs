use std::time::Duration;

use super::*;
use crate::model::{fixtures, ModelConfig};
use crate::residency::LinkModel;
use crate::upload::device::EmulatedLink;

/// Polls `done` every millisecond; panics after a minute (a hung pipeline thread).
fn wait_for(what: &str, done: impl Fn() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{what} never happened"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A device whose copies really copy, at once, into a host buffer: the image the GPU would get.
struct MemCopy;

impl CopyDevice for MemCopy {
    type Dst = Mutex<Vec<u8>>;
    type Event = ();

    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedMemory> {
        PinnedMemory::anonymous(bytes)
    }

    unsafe fn copy_async(
        &self,
        src: *const u8,
        len: usize,
        dst: &Self::Dst,
        off: usize,
    ) -> Result<()> {
        // SAFETY: per the trait's contract, `src..src+len` is valid and unchanged now.
        let src = unsafe { std::slice::from_raw_parts(src, len) };
        dst.lock().unwrap()[off..off + len].copy_from_slice(src);
        Ok(())
    }

    fn query(&self, _: &()) -> bool {
        true
    }

    fn wait(&self, _: &()) -> Result<()> {
        Ok(())
    }
}

fn config() -> ModelConfig {
    ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap()
}

/// The device image holds every factor's bytes where the layout puts them: as stored, or
/// converted by a loader thread to the image's dtype.
#[test]
fn the_device_image_holds_the_stored_or_converted_bytes() {
    let c = config();
    let a = Arc::new(
        crate::adapter::LoraAdapter::load(&fixtures::adapter("r8_all_rslora"), &c).unwrap(),
    );
    let p = UploadPipeline::start(MemCopy, 1 << 20, 2).unwrap();
    for dtype in [None, Some(WeightDtype::Bf16)] {
        let layout = ImageLayout::of(&a, dtype);
        let dst = Arc::new(Mutex::new(vec![0u8; layout.total]));
        let slot = Arc::new(LoraSlot::empty(a.clone()));
        let up = Upload {
            adapter: a.clone(),
            layout: layout.clone(),
            dtype,
            dst: dst.clone(),
            landing: slot.clone(),
        };
        p.submit(up, LoadPriority::Demand).unwrap();
        wait_for("the upload", || slot.landed() == a.num_layers());
        let img = dst.lock().unwrap();
        for e in &layout.entries {
            let w = a.get(e.layer, e.module).unwrap();
            let want = match dtype {
                Some(d) => w.b.converted(d),
                None => w.b.clone(),
            };
            assert_eq!(&img[e.b_off..e.b_off + e.b_len], want.bytes(), "{dtype:?}");
            let a_len = want.bytes().len() / w.b.numel() * w.a.numel();
            let want_a = match dtype {
                Some(d) => w.a.converted(d),
                None => w.a.clone(),
            };
            assert_eq!(&img[e.a_off..e.a_off + a_len], want_a.bytes());
        }
        wait_for("the upload's end", || {
            p.arena_usage().retained == p.arena_usage().used
        });
    }
    assert!(p.stats().encoded_bytes.load(Relaxed) > 0);
    // Both images are kept while the adapter lives, and freed once it is gone.
    assert_eq!(p.arena_usage().retained, p.arena_usage().used);
    assert!(p.arena_usage().retained > 0);
    drop(a);
    wait_for("the images to be freed", || {
        p.shared.cv.notify_all();
        p.arena_usage().used == 0
    });
}

/// Over an emulated link: a demand load passes queued prefetches (which still land), a
/// promoted prefetch goes next, and an adapter the engine drops mid-upload leaves the link
/// and gives its arena space back.
#[test]
fn demand_loads_pass_queued_prefetches_which_still_land() {
    let c = config();
    let a = Arc::new(crate::adapter::LoraAdapter::load(&fixtures::adapter("r4_qv"), &c).unwrap());
    // 3,584 bytes a layer at 20 kB/s: ~180 ms a layer (slow enough that a descheduled test
    // thread does not miss an ordering), 2 layers an adapter.
    let link = LinkModel {
        gbps: 2e-5,
        latency_us: 0.0,
    };
    let p = UploadPipeline::start(EmulatedLink::new(link), 1 << 20, 1).unwrap();
    let enqueue = |class| {
        let slot = Arc::new(LoraSlot::empty(a.clone()));
        let up = Upload {
            adapter: a.clone(),
            layout: ImageLayout::of(&a, None),
            dtype: None,
            dst: Arc::new(()),
            landing: slot.clone(),
        };
        p.submit(up, class).unwrap();
        slot
    };
    let pre: Vec<Arc<LoraSlot>> = (0..4).map(|_| enqueue(LoadPriority::Prefetch)).collect();
    let demand = enqueue(LoadPriority::Demand);
    let landed = || pre.iter().map(|s| s.landed()).sum::<usize>();
    let before = landed();
    wait_for("the demand load", || demand.landed() == 2);
    // At most the prefetch layer in flight when the demand load came landed meanwhile.
    assert!(landed() <= before + 1, "{before} → {}", landed());
    assert!(p.promote(&pre[3]));
    assert!(!p.promote(&demand), "a landed demand load is no prefetch");
    wait_for("the promoted prefetch", || pre[3].landed() == 2);
    assert!(pre[1].landed() + pre[2].landed() <= 1);
    let gone = Arc::downgrade(&pre[2]);
    let [p0, p1, p2, p3]: [Arc<LoraSlot>; 4] = pre.try_into().unwrap();
    drop(p2);
    wait_for("the prefetches", || {
        p0.landed() == 2 && p1.landed() == 2 && p.queued_bytes() == 0
    });
    assert_eq!(p3.landed(), 2);
    wait_for("the dropped slot to leave", || gone.upgrade().is_none());
    // One image for all five uploads of the adapter: encoded once, kept while it lives.
    let layout = ImageLayout::of(&a, None);
    assert_eq!(p.arena_usage().used, layout.total.next_multiple_of(256));
    assert_eq!(p.stats().encoded_bytes.load(Relaxed), a.size_bytes() as u64);
    drop((p0, p1, p3, demand, a));
    wait_for("the image to be freed", || {
        p.shared.cv.notify_all();
        p.arena_usage().used == 0
    });
    assert_eq!(p.demand_backlog(), 0);
}

/// An adapter larger than the whole arena is refused with what to do.
#[test]
fn an_adapter_larger_than_the_arena_is_refused() {
    let c = config();
    let a = Arc::new(
        crate::adapter::LoraAdapter::load(&fixtures::adapter("r8_all_rslora"), &c).unwrap(),
    );
    let p = UploadPipeline::start(MemCopy, 4096, 1).unwrap();
    let layout = ImageLayout::of(&a, None);
    let up = Upload {
        adapter: a.clone(),
        dst: Arc::new(Mutex::new(vec![0; layout.total])),
        layout,
        dtype: None,
        landing: Arc::new(LoraSlot::empty(a.clone())),
    };
    let e = p.submit(up, LoadPriority::Demand).unwrap_err().to_string();
    assert!(e.contains("--max-cpu-lora-bytes"), "{e}");
}

/// An upload of `a` (its own image, as stored) into a fresh device buffer, and its slot.
fn upload_of(a: &Arc<crate::adapter::LoraAdapter>) -> (Upload<MemCopy>, Arc<LoraSlot>) {
    let layout = ImageLayout::of(a, None);
    let slot = Arc::new(LoraSlot::empty(a.clone()));
    let up = Upload {
        adapter: a.clone(),
        dst: Arc::new(Mutex::new(vec![0; layout.total])),
        layout,
        dtype: None,
        landing: slot.clone(),
    };
    (up, slot)
}

/// An adapter served from its mapped file whose last layer holds a NaN: the bad layer is never
/// copied (each layer is checked whole before its copy is queued; those copied before the
/// failure stay landed), the upload fails saying which layer and why, its arena space comes
/// back once, and the pipeline goes on with the next upload.
#[test]
fn a_mapped_layer_that_fails_its_check_fails_the_upload_and_frees_its_space() {
    let c = config();
    let (dir, last) = crate::upload::check::tests::poisoned_last_layer(&c);
    let bad = Arc::new(crate::adapter::LoraAdapter::map(dir.path(), &c).unwrap());
    let p = UploadPipeline::start(MemCopy, 1 << 20, 1).unwrap();
    let (up, slot) = upload_of(&bad);
    p.submit(up, LoadPriority::Demand).unwrap();
    wait_for("the failure", || {
        slot.residency() == crate::residency::DeviceResidency::Failed
    });
    wait_for("the space to come back", || {
        p.shared.cv.notify_all();
        p.arena_usage().used == 0 && p.arena_usage().idle
    });
    assert!(slot.landed() <= last, "the bad layer never lands");
    // The reason the server fails the adapter's requests with: which layer, what, what to do.
    let why = slot.failure().expect("a failed upload says why");
    assert!(
        why.contains(&format!("layer {last} of its file failed its check"))
            && why.contains("NaN")
            && why.contains("re-save"),
        "{why}"
    );
    assert_eq!(p.stats().encode_failures.load(Relaxed), 1);
    let copied = p.stats().layers_copied.load(Relaxed);
    assert_eq!(copied, slot.landed() as u64);
    // The next upload (a sound copy of the adapter, mapped too) is served.
    let good = Arc::new(crate::adapter::LoraAdapter::map(&fixtures::adapter("r4_qv"), &c).unwrap());
    let (up, slot) = upload_of(&good);
    p.submit(up, LoadPriority::Demand).unwrap();
    wait_for("the sound upload", || slot.landed() == good.num_layers());
    assert_eq!(p.stats().encode_failures.load(Relaxed), 1);
}

/// The loader's owned copy replacing an adapter served from its mapped file takes over the
/// mapped copy's image: dropping the mapping frees nothing, staging the owned copy encodes
/// nothing, and the image goes when the owned copy does.
#[test]
fn an_owned_copy_takes_over_the_mapped_copys_image() {
    let c = config();
    let dir = fixtures::adapter("r8_all_rslora");
    let mapped = Arc::new(crate::adapter::LoraAdapter::map(&dir, &c).unwrap());
    let p = UploadPipeline::start(MemCopy, 1 << 20, 1).unwrap();
    let layout = ImageLayout::of(&mapped, None);
    let held = p.stage(&mapped, &layout, None);
    assert_eq!(held, layout.total.next_multiple_of(256));
    wait_for("the staging", || p.arena_usage().idle);
    let encoded = p.stats().encoded_bytes.load(Relaxed);
    assert_eq!(encoded, mapped.size_bytes() as u64);
    let owned = Arc::new(crate::adapter::LoraAdapter::load(&dir, &c).unwrap());
    p.rebind(&mapped, &owned);
    drop(mapped);
    // Past a reap period: an image of a dropped adapter would be gone by now.
    std::thread::sleep(IMAGE_REAP_PERIOD * 3);
    p.shared.cv.notify_all();
    assert_eq!(p.arena_usage().used, held, "the image stayed");
    assert_eq!(p.stage(&owned, &ImageLayout::of(&owned, None), None), held);
    wait_for("the second staging", || p.arena_usage().idle);
    assert_eq!(
        p.stats().encoded_bytes.load(Relaxed),
        encoded,
        "nothing encoded again"
    );
    drop(owned);
    wait_for("the image to be freed", || {
        p.shared.cv.notify_all();
        p.arena_usage().used == 0
    });
}

/// A factor as large as a rank-512 one (well past the streaming threshold, so its check runs
/// inside the copy): written whole when every weight is finite; with a NaN or an infinity
/// anywhere, the write reports that element's index, in its stored dtype and converted alike;
/// unchecked, it is copied as is.
#[test]
fn a_checked_write_reports_the_first_non_finite_weight_of_a_large_factor() {
    let n = 256 * 1024 + 7;
    let values: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
    let arena = PinnedMemory::anonymous(8 * n + 4096).unwrap();
    for dtype in [WeightDtype::Bf16, WeightDtype::F16, WeightDtype::F32] {
        let clean = LoraTensor::encode(&values, dtype);
        // SAFETY: this test is the arena's only user.
        let wrote = unsafe { write_factor(&arena, 256, &clean, None, true) };
        assert_eq!(wrote, Ok(clean.bytes().len()), "{dtype:?}");
        // SAFETY: as above; the range is inside the arena and no thread writes it now.
        let image = unsafe { arena.slice_mut(256, clean.bytes().len()) };
        assert_eq!(image, clean.bytes());
        for (bad, value) in [
            (0, f32::NAN),
            (n / 2 + 3, f32::INFINITY),
            (n - 1, f32::NEG_INFINITY),
        ] {
            let mut v = values.clone();
            v[bad] = value;
            let t = LoraTensor::encode(&v, dtype);
            for to in [None, Some(WeightDtype::F32), Some(WeightDtype::Bf16)] {
                // SAFETY: as above.
                let wrote = unsafe { write_factor(&arena, 256, &t, to, true) };
                assert_eq!(wrote, Err(bad), "{dtype:?} → {to:?}, bad at {bad}");
            }
            // Unchecked (a verified file, or a copy held in memory): copied as is.
            // SAFETY: as above.
            let wrote = unsafe { write_factor(&arena, 256, &t, None, false) };
            assert_eq!(wrote, Ok(t.bytes().len()));
        }
    }
}
