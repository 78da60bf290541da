//! The upload pipeline's threads: loader threads encode adapters layer by layer into the
//! pinned arena, and one copy thread moves encoded layers to the device, one layer at a time,
//! waiting on the layer's event and then publishing it ([`Landing::land`]). The engine thread
//! only submits (O(layers): the image layout) and polls landed counts; it never touches an
//! adapter's bytes. Every decision is [`UploadPlan`]'s.
//!
//! The arena keeps each adapter's encoded image while the adapter lives (the host tier or the
//! device holds it): the image is identified by the adapter (a weak reference, so the
//! address is not reused meanwhile), its dtype and its layout. A later upload of the same image
//! queues only its copies, and [`UploadPipeline::stage`] writes an image when its adapter
//! enters the host tier, so a host-tier miss pays only the device copy. Once the adapter's last
//! reference is gone, its image is freed. `THAW_ARENA_KEEP=0` frees each image when its
//! upload is done and stages nothing (the arena as a staging buffer, as before): an attribution
//! switch for benchmarks, never a configuration.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::device::{CopyDevice, PinnedMemory};
use super::layout::{ImageLayout, Placed};
use super::plan::{ImageKey, JobId, UploadPlan};
use crate::adapter::{LoraAdapter, LoraTensor, WeightDtype};
use crate::error::{Result, RuntimeError};
use crate::residency::{LoadPriority, LoraSlot};

/// Where a device copy's progress is published: the engine polls it.
pub trait Landing: Send + Sync {
    /// Layer `layer` is on the device (layers land in order, each once).
    fn land(&self, layer: usize);
    /// The upload failed (`why`: which layer, what went wrong and what to do); requests of
    /// this adapter fail with it. Called at most once per upload: the plan evicts it.
    fn fail(&self, why: &str);
}

impl Landing for LoraSlot {
    fn land(&self, layer: usize) {
        LoraSlot::land(self, layer);
    }

    fn fail(&self, why: &str) {
        LoraSlot::fail(self, why);
    }
}

/// One adapter to upload.
pub struct Upload<D: CopyDevice> {
    pub adapter: Arc<LoraAdapter>,
    /// Its device image (the arena holds the same).
    pub layout: ImageLayout,
    /// The dtype of the image (`None`: each factor as stored).
    pub dtype: Option<WeightDtype>,
    /// The device allocation copies fill; kept alive until the last copy completed.
    pub dst: Arc<D::Dst>,
    /// Where landed layers are published. When the pipeline holds the last reference, the
    /// engine dropped the adapter: the upload is evicted.
    pub landing: Arc<dyn Landing>,
}

/// Host work the pipeline did off the engine thread, for reports.
#[derive(Debug, Default)]
pub struct UploadStats {
    /// Nanoseconds loader threads spent writing layers into the arena (wall time, waits for
    /// the pace excluded), and the CPU time they spent on it (reading and checking included).
    pub encode_ns: AtomicU64,
    pub encode_cpu_ns: AtomicU64,
    pub encoded_bytes: AtomicU64,
    /// Layers landed on the device, and their bytes.
    pub layers_copied: AtomicU64,
    pub copied_bytes: AtomicU64,
    /// Layers a loader thread could not encode (read from a mapped file that went bad: a
    /// non-finite weight, a file truncated or replaced): their images were freed and the
    /// uploads of them failed.
    pub encode_failures: AtomicU64,
    /// Uploads that found their adapter's image complete in the arena (no encode), and the
    /// bytes of those images.
    pub images_reused: AtomicU64,
    pub reused_bytes: AtomicU64,
}

/// The arena's bytes by use.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaUsage {
    pub capacity: usize,
    /// Reserved: images being written or copied, and kept ones.
    pub used: usize,
    /// Complete images no upload uses now (the host tier's encoded adapters).
    pub retained: usize,
    /// Bytes loader threads encoded so far, and bytes of images uploads found complete.
    pub encoded_bytes: u64,
    pub reused_bytes: u64,
    /// CPU time loader threads spent encoding (reading, checking and writing) so far, ns.
    pub encode_cpu_ns: u64,
    /// Nothing queued, being encoded or waiting to be staged.
    pub idle: bool,
}

/// Where an image's bytes come from: its adapter (while it lives), dtype and layout.
struct Source {
    adapter: Weak<LoraAdapter>,
    dtype: Option<WeightDtype>,
    layout: ImageLayout,
}

impl Source {
    fn is(&self, a: &Arc<LoraAdapter>, dtype: Option<WeightDtype>, layout: &ImageLayout) -> bool {
        std::ptr::eq(self.adapter.as_ptr(), Arc::as_ptr(a))
            && self.dtype == dtype
            && self.layout == *layout
    }
}

struct State<D: CopyDevice> {
    plan: UploadPlan,
    jobs: HashMap<JobId, Upload<D>>,
    images: HashMap<ImageKey, Source>,
    next_id: JobId,
    next_key: ImageKey,
    /// Images are kept and reused (`THAW_ARENA_KEEP=0` turns it off).
    keep: bool,
    closed: bool,
}

impl<D: CopyDevice> State<D> {
    /// The key of `a`'s image in `layout` and `dtype`: the kept one, or a new one.
    fn key(
        &mut self,
        a: &Arc<LoraAdapter>,
        dtype: Option<WeightDtype>,
        layout: &ImageLayout,
    ) -> ImageKey {
        let kept = self
            .images
            .iter()
            .find(|(_, s)| self.keep && s.is(a, dtype, layout))
            .map(|(&k, _)| k);
        kept.unwrap_or_else(|| {
            let k = self.next_key;
            self.next_key += 1;
            self.images.insert(
                k,
                Source {
                    adapter: Arc::downgrade(a),
                    dtype,
                    layout: layout.clone(),
                },
            );
            k
        })
    }

    /// Forgets images the plan freed (a new one has made its key up afresh).
    fn forget_freed(&mut self) {
        for (k, _) in self.plan.take_freed() {
            self.images.remove(&k);
        }
    }
}

struct Shared<D: CopyDevice> {
    device: D,
    arena: PinnedMemory,
    state: Mutex<State<D>>,
    cv: Condvar,
    stats: UploadStats,
}

impl<D: CopyDevice> Shared<D> {
    fn lock(&self) -> MutexGuard<'_, State<D>> {
        // The threads hold the lock only between steps and never panic holding it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The arena, the loader threads and the copy thread of one backend.
pub struct UploadPipeline<D: CopyDevice> {
    shared: Arc<Shared<D>>,
    threads: Vec<JoinHandle<()>>,
}

impl<D: CopyDevice> std::fmt::Debug for UploadPipeline<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UploadPipeline")
            .field("arena_bytes", &self.shared.arena.len())
            .field("queued_bytes", &self.queued_bytes())
            .finish()
    }
}

impl<D: CopyDevice> UploadPipeline<D> {
    /// Allocates the arena (`arena_bytes`, once) and starts `loaders` loader threads (at
    /// least one) and the copy thread.
    pub fn start(device: D, arena_bytes: usize, loaders: usize) -> Result<Self> {
        let arena = device.alloc_pinned(arena_bytes)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                plan: UploadPlan::new(arena.len()),
                jobs: HashMap::new(),
                images: HashMap::new(),
                next_id: 0,
                next_key: 0,
                keep: !thaw_kernels::cpu::switched_off("THAW_ARENA_KEEP"),
                closed: false,
            }),
            device,
            arena,
            cv: Condvar::new(),
            stats: UploadStats::default(),
        });
        let spawn = |name: String, f: fn(&Shared<D>)| {
            let s = shared.clone();
            std::thread::Builder::new().name(name).spawn(move || {
                thaw_cpu_lora::float_current_thread();
                // Host work that yields to the engine thread on a machine short of cores.
                super::lower_current_thread_priority();
                f(&s)
            })
        };
        let mut threads = Vec::new();
        let mut started = || -> std::io::Result<()> {
            threads.push(spawn("thaw-copy".into(), copy_loop::<D>)?);
            for i in 0..loaders.max(1) {
                threads.push(spawn(format!("thaw-upload-{i}"), encode_loop::<D>)?);
            }
            Ok(())
        };
        if let Err(e) = started() {
            let p = Self { shared, threads };
            drop(p);
            return Err(RuntimeError::Backend(format!(
                "starting the adapter upload threads: {e}"
            )));
        }
        Ok(Self { shared, threads })
    }

    /// The backend's copy device.
    pub fn device(&self) -> &D {
        &self.shared.device
    }

    /// Queues `up` behind the uploads of its class; O(layers + kept images) here, the bytes
    /// move on the pipeline's threads. If the adapter's image is in the arena already, only
    /// its copies are queued.
    pub fn submit(&self, up: Upload<D>, class: LoadPriority) -> Result<JobId> {
        let mut g = self.shared.lock();
        g.forget_freed();
        let id = g.next_id;
        g.next_id += 1;
        let key = g.key(&up.adapter, up.dtype, &up.layout);
        let layers = up.layout.layer_ranges();
        let submitted = g.plan.submit(id, key, layers, up.layout.total, class);
        g.forget_freed();
        let reused = submitted.map_err(|e| {
            if !g.plan.has_image(key) {
                g.images.remove(&key);
            }
            RuntimeError::Backend(e.to_string())
        })?;
        if !g.keep {
            // Freed when this upload is done with it: the arena as a staging buffer.
            g.plan.release(key);
        }
        if reused {
            let s = &self.shared.stats;
            s.images_reused.fetch_add(1, Relaxed);
            s.reused_bytes.fetch_add(up.layout.total as u64, Relaxed);
        }
        g.jobs.insert(id, up);
        drop(g);
        self.shared.cv.notify_all();
        Ok(id)
    }

    /// Writes `adapter`'s image (`layout`, `dtype`) into the arena behind every upload, so
    /// that a later [`UploadPipeline::submit`] of it only copies: called when the adapter
    /// enters the host tier. O(layers + kept images) here; the image is freed when the
    /// adapter's last reference is gone. An adapter larger than the arena is not staged (its
    /// upload says why). Returns the arena bytes the image holds (0: not staged), which the
    /// host tier counts as its own ([`super::ARENA_ALIGN`]-rounded, as the arena reserves it).
    pub fn stage(
        &self,
        adapter: &Arc<LoraAdapter>,
        layout: &ImageLayout,
        dtype: Option<WeightDtype>,
    ) -> usize {
        let mut g = self.shared.lock();
        if !g.keep {
            return 0;
        }
        g.forget_freed();
        let key = g.key(adapter, dtype, layout);
        let queued = g
            .plan
            .stage(key, layout.layer_ranges(), layout.total)
            .unwrap_or(false);
        let held = g.plan.has_image(key);
        if !held {
            g.images.remove(&key);
        }
        drop(g);
        if queued {
            self.shared.cv.notify_all();
        }
        if held {
            image_bytes(layout.total)
        } else {
            0
        }
    }

    /// `new` replaces `old` as the adapter its images are encoded from: the loader's owned copy
    /// of an adapter served from its mapped file, the same bytes (`Engine::adopt_host_copy`
    /// checked that the file is the one mapped). The images stay for `new` — a later stage or
    /// upload of it finds them — instead of being freed with `old` and encoded again.
    /// O(kept images).
    pub fn rebind(&self, old: &Arc<LoraAdapter>, new: &Arc<LoraAdapter>) {
        let mut g = self.shared.lock();
        for s in g.images.values_mut() {
            if std::ptr::eq(s.adapter.as_ptr(), Arc::as_ptr(old)) {
                s.adapter = Arc::downgrade(new);
            }
        }
    }

    /// Makes the queued prefetch publishing to `landing` a demand load; false if there is none.
    pub fn promote<T: Landing>(&self, landing: &Arc<T>) -> bool {
        let mut g = self.shared.lock();
        let want = Arc::as_ptr(landing) as *const ();
        let id = g
            .jobs
            .iter()
            .find(|(_, j)| Arc::as_ptr(&j.landing) as *const () == want)
            .map(|(&id, _)| id);
        let promoted = id.is_some_and(|id| g.plan.promote(id));
        drop(g);
        if promoted {
            self.shared.cv.notify_all();
        }
        promoted
    }

    /// Bytes queued and not landed yet, prefetches included.
    pub fn queued_bytes(&self) -> u64 {
        self.shared.lock().plan.queued_bytes()
    }

    /// Bytes a demand load queued now would wait behind (see [`UploadPlan::demand_backlog`]).
    pub fn demand_backlog(&self) -> u64 {
        self.shared.lock().plan.demand_backlog()
    }

    /// The arena's bytes by use.
    pub fn arena_usage(&self) -> ArenaUsage {
        let g = self.shared.lock();
        let s = &self.shared.stats;
        ArenaUsage {
            capacity: g.plan.capacity(),
            used: g.plan.arena_used(),
            retained: g.plan.retained_bytes(),
            encoded_bytes: s.encoded_bytes.load(Relaxed),
            reused_bytes: s.reused_bytes.load(Relaxed),
            encode_cpu_ns: s.encode_cpu_ns.load(Relaxed),
            idle: g.plan.is_idle(),
        }
    }

    pub fn stats(&self) -> &UploadStats {
        &self.shared.stats
    }
}

impl<D: CopyDevice> Drop for UploadPipeline<D> {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Evicts uploads whose adapter the engine dropped (the pipeline holds the last reference)
/// and releases images whose adapter is gone; forgets uploads the plan is done with, dropping
/// them on the background thread: one may hold the last reference to a large host copy, and
/// freeing it under the lock would stall the engine thread's next submit.
fn reap<D: CopyDevice>(g: &mut State<D>) {
    let gone: Vec<JobId> = g
        .jobs
        .iter()
        .filter(|(_, j)| Arc::strong_count(&j.landing) == 1)
        .map(|(&id, _)| id)
        .collect();
    for id in gone {
        g.plan.evict(id);
    }
    let dead: Vec<ImageKey> = g
        .images
        .iter()
        .filter(|(_, s)| s.adapter.strong_count() == 0)
        .map(|(&k, _)| k)
        .collect();
    for k in dead {
        g.plan.release(k);
    }
    g.forget_freed();
    let done: Vec<JobId> = g
        .jobs
        .keys()
        .copied()
        .filter(|id| !g.plan.known(*id))
        .collect();
    if !done.is_empty() {
        let gone: Vec<Upload<D>> = done.iter().filter_map(|id| g.jobs.remove(id)).collect();
        super::drop_later(gone);
    }
}

fn encode_loop<D: CopyDevice>(sh: &Shared<D>) {
    let mut g = sh.lock();
    loop {
        if g.closed {
            return;
        }
        reap(&mut g);
        let Some(t) = g.plan.next_encode() else {
            publish_backlog(&sh.stats, g.plan.queued_bytes());
            // Woken by new work, or now and then to free the images of adapters dropped
            // meanwhile (nothing signals a reference count reaching zero).
            g = sh
                .cv
                .wait_timeout(g, IMAGE_REAP_PERIOD)
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
            continue;
        };
        publish_backlog(&sh.stats, g.plan.queued_bytes());
        let src = &g.images[&t.key];
        // Gone meanwhile: nothing to write (the image is released at the next reap, and no
        // upload reads it, since an upload holds its adapter).
        let (adapter, dtype) = (src.adapter.upgrade(), src.dtype);
        let placed: Vec<Placed> = src
            .layout
            .entries
            .iter()
            .filter(|p| p.layer == t.layer && adapter.is_some())
            .copied()
            .collect();
        drop(g);
        let base = t.arena.start - t.image.start;
        let (mut bytes, mut work) = (0, Duration::ZERO);
        let cpu0 = thaw_ipc::thread_cpu_time();
        // Read from its mapped file: the layer is checked before it counts as encoded (its
        // copy queued), so the device never gets a layer of a file gone bad. The files are
        // checked unchanged before any page is read; the weights as they are copied, in the
        // same pass over the bytes (`write_factor`).
        let write = sh.device.writes_image();
        let mut checked = match adapter.as_deref() {
            Some(a) if write => super::check::files_unchanged(a, &placed),
            // Nothing copied (an attribution switch): both checks, over the mapping.
            Some(a) => super::check::check_layer(a, &placed),
            None => Ok(()),
        };
        let copy = write && checked.is_ok();
        'factors: for p in placed.iter().filter(|_| copy) {
            let w = adapter
                .as_ref()
                .and_then(|a| a.get(p.layer, p.module))
                .expect("the layout lists the adapter's own factors");
            let t0 = Instant::now();
            for (f, factor, off) in [(&w.a, "lora_A", p.a_off), (&w.b, "lora_B", p.b_off)] {
                let check = super::check::needs_finite_check(f);
                // SAFETY: the plan gave this thread the job's layer range (`t.arena`) to write
                // alone, and every factor of the layer lies inside it (the layout's layer range
                // spans its factors); nobody reads it until `encoded` below.
                let done = unsafe { write_factor(&sh.arena, base + off, f, dtype, check) };
                match done {
                    Ok(n) => bytes += n,
                    Err(index) => {
                        checked = Err(super::check::non_finite(p, factor, index));
                        break 'factors;
                    }
                }
            }
            // One factor (A and B, ≤ a few MB) is a chunk: the step running beside it, if the
            // device computes on this host, gets the host back before the next (`pace`).
            let dt = t0.elapsed();
            work += dt;
            super::pace::after_chunk(dt);
        }
        let s = &sh.stats;
        let cpu = thaw_ipc::thread_cpu_time().saturating_sub(cpu0);
        s.encode_cpu_ns.fetch_add(cpu.as_nanos() as u64, Relaxed);
        s.encode_ns.fetch_add(work.as_nanos() as u64, Relaxed);
        s.encoded_bytes.fetch_add(bytes as u64, Relaxed);
        // The last reference may be this one (the adapter dropped meanwhile): not under the lock.
        drop(adapter);
        g = sh.lock();
        match checked {
            Ok(()) => g.plan.encoded(t.key, t.layer),
            Err(why) => fail_image(&mut g, &sh.stats, t.key, t.layer, &why),
        }
        reap(&mut g);
        sh.cv.notify_all();
    }
}

/// Layer `layer` of image `key` could not be read: the plan frees the image (once, when no
/// thread uses it) and evicts its uploads, whose landings fail here with the reason (the
/// server fails the adapter's requests with it); the image is forgotten at once, so a later
/// upload of the adapter makes a new one.
fn fail_image<D: CopyDevice>(
    g: &mut State<D>,
    stats: &UploadStats,
    key: ImageKey,
    layer: usize,
    why: &str,
) {
    tracing::error!("adapter upload: layer {layer} could not be read: {why}");
    stats.encode_failures.fetch_add(1, Relaxed);
    let why = format!("layer {layer} of its file failed its check: {why}");
    for id in g.plan.encode_failed(key, layer) {
        if let Some(j) = g.jobs.get(&id) {
            j.landing.fail(&why);
        }
    }
    g.images.remove(&key);
}

/// The arena bytes an image of `total` bytes reserves.
fn image_bytes(total: usize) -> usize {
    total.max(1).next_multiple_of(super::ARENA_ALIGN)
}

/// How often an idle loader thread looks for images whose adapter is gone.
const IMAGE_REAP_PERIOD: Duration = Duration::from_millis(100);

/// Publishes the encode work queued (`queued` bytes at the rate measured so far; 4 GB/s before
/// any), so the pace rises enough for it to drain ([`super::pace::publish_backlog`]).
fn publish_backlog(stats: &UploadStats, queued: u64) {
    let (ns, bytes) = (
        stats.encode_ns.load(Relaxed),
        stats.encoded_bytes.load(Relaxed),
    );
    let ns_per_byte = if ns > 0 && bytes > 0 {
        ns as f64 / bytes as f64
    } else {
        0.25
    };
    super::pace::publish_backlog(Duration::from_nanos((queued as f64 * ns_per_byte) as u64));
}

/// Writes `t` (converted to `dtype` if it is stored otherwise) at arena offset `off`; returns
/// the bytes written. With `check`, every weight of `t` must be finite, else the result is the
/// index of the first that is not (and what was written is garbage the caller frees): checked
/// as the copy reads the bytes where it keeps the stored dtype (one pass over them), before
/// converting otherwise.
///
/// # Safety
/// The range written must be this thread's alone, per the plan.
unsafe fn write_factor(
    arena: &PinnedMemory,
    off: usize,
    t: &LoraTensor,
    dtype: Option<WeightDtype>,
    check: bool,
) -> std::result::Result<usize, usize> {
    let to = dtype.unwrap_or(t.dtype());
    let len = t.numel() * to.size();
    // SAFETY: per this function's contract.
    let dst = unsafe { arena.slice_mut(off, len) };
    if to == t.dtype() {
        // Nobody on the host reads the image soon: keep it out of the caches (`stream`).
        if !check {
            super::stream::streaming_copy(dst, t.bytes());
        } else if !super::stream::streaming_copy_finite(dst, t.bytes(), to) {
            // Found in the copy's pass; where, only now (a failure is rare).
            return Err(t.first_non_finite().unwrap_or(0));
        }
    } else {
        if let Some(index) = check.then(|| t.first_non_finite()).flatten() {
            return Err(index);
        }
        t.convert_into(to, dst);
    }
    Ok(len)
}

fn copy_loop<D: CopyDevice>(sh: &Shared<D>) {
    let mut g = sh.lock();
    loop {
        if g.closed {
            return;
        }
        reap(&mut g);
        let Some(t) = g.plan.next_copy() else {
            g = sh.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        let job = &g.jobs[&t.job];
        let (dst, landing) = (job.dst.clone(), job.landing.clone());
        drop(g);
        // SAFETY: `t.arena` lies in the arena and was fully written (the plan hands out a
        // copy only for encoded layers) and is not freed or rewritten until `landed` below,
        // which runs after the event completed; the layout sized `dst` for `t.image`.
        let copied = unsafe {
            sh.device.copy_async(
                sh.arena.as_ptr().add(t.arena.start),
                t.arena.len(),
                &dst,
                t.image.start,
            )
        }
        .and_then(|e| sh.device.wait(&e));
        g = sh.lock();
        g.plan.landed(t.job, t.layer);
        match copied {
            Ok(()) => {
                landing.land(t.layer);
                sh.stats.layers_copied.fetch_add(1, Relaxed);
                sh.stats
                    .copied_bytes
                    .fetch_add(t.arena.len() as u64, Relaxed);
            }
            Err(e) => {
                tracing::error!("copying an adapter layer to the device failed: {e}");
                landing.fail(&format!(
                    "copying layer {} to the device failed ({e}); see the server log",
                    t.layer
                ));
                g.plan.evict(t.job);
            }
        }
        reap(&mut g);
        sh.cv.notify_all();
    }
}

#[cfg(test)]
#[path = "pipeline_tests.rs"]
mod tests;
