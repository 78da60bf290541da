//! The upload pipeline's threads: loader threads encode adapters layer by layer into the
//! pinned arena, and one copy thread moves encoded layers to the device, one layer at a time,
//! waiting on the layer's event and then publishing it ([`Landing::land`]). The engine thread
//! only submits (O(layers): the image layout) and polls landed counts; it never touches an
//! adapter's bytes. Every decision is [`UploadPlan`]'s.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::device::{CopyDevice, PinnedMemory};
use super::layout::{ImageLayout, Placed};
use super::plan::{JobId, UploadPlan};
use crate::adapter::{LoraAdapter, LoraTensor, WeightDtype};
use crate::error::{Result, RuntimeError};
use crate::residency::{LoadPriority, LoraSlot};

/// Where a device copy's progress is published: the engine polls it.
pub trait Landing: Send + Sync {
    /// Layer `layer` is on the device (layers land in order, each once).
    fn land(&self, layer: usize);
    /// The copy failed; requests of this adapter fail.
    fn fail(&self);
}

impl Landing for LoraSlot {
    fn land(&self, layer: usize) {
        LoraSlot::land(self, layer);
    }

    fn fail(&self) {
        LoraSlot::fail(self);
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
    /// Nanoseconds loader threads spent writing layers into the arena.
    pub encode_ns: AtomicU64,
    pub encoded_bytes: AtomicU64,
    /// Layers landed on the device, and their bytes.
    pub layers_copied: AtomicU64,
    pub copied_bytes: AtomicU64,
}

struct State<D: CopyDevice> {
    plan: UploadPlan,
    jobs: HashMap<JobId, Upload<D>>,
    next_id: JobId,
    closed: bool,
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
                next_id: 0,
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

    /// Queues `up` behind the uploads of its class; O(layers) here, the bytes move on the
    /// pipeline's threads.
    pub fn submit(&self, up: Upload<D>, class: LoadPriority) -> Result<JobId> {
        let mut g = self.shared.lock();
        let id = g.next_id;
        g.next_id += 1;
        let layers = up.layout.layer_ranges();
        g.plan
            .submit(id, layers, up.layout.total, class)
            .map_err(|e| RuntimeError::Backend(e.to_string()))?;
        g.jobs.insert(id, up);
        drop(g);
        self.shared.cv.notify_all();
        Ok(id)
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

    /// Arena bytes reserved now, and the arena's size.
    pub fn arena_usage(&self) -> (usize, usize) {
        let g = self.shared.lock();
        (g.plan.arena_used(), g.plan.capacity())
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

/// Evicts uploads whose adapter the engine dropped (the pipeline holds the last reference);
/// forgets those the plan is done with, dropping them on the background thread: one may hold the
/// last reference to a large host copy, and freeing it under the lock would stall the engine
/// thread's next submit.
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
            g = sh.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            continue;
        };
        publish_backlog(&sh.stats, g.plan.queued_bytes());
        let job = &g.jobs[&t.job];
        let (adapter, dtype) = (job.adapter.clone(), job.dtype);
        let placed: Vec<Placed> = job
            .layout
            .entries
            .iter()
            .filter(|p| p.layer == t.layer)
            .copied()
            .collect();
        drop(g);
        let base = t.arena.start - t.image.start;
        let (mut bytes, mut work) = (0, Duration::ZERO);
        let write = sh.device.writes_image();
        for p in placed.iter().filter(|_| write) {
            let w = adapter
                .get(p.layer, p.module)
                .expect("the layout lists the adapter's own factors");
            let t0 = Instant::now();
            // SAFETY: the plan gave this thread the job's layer range (`t.arena`) to write
            // alone, and every factor of the layer lies inside it (the layout's layer range
            // spans its factors); nobody reads it until `encoded` below.
            unsafe {
                bytes += write_factor(&sh.arena, base + p.a_off, &w.a, dtype);
                bytes += write_factor(&sh.arena, base + p.b_off, &w.b, dtype);
            }
            // One factor (A and B, ≤ a few MB) is a chunk: the step running beside it, if the
            // device computes on this host, gets the host back before the next (`pace`).
            let dt = t0.elapsed();
            work += dt;
            super::pace::after_chunk(dt);
        }
        let s = &sh.stats;
        s.encode_ns.fetch_add(work.as_nanos() as u64, Relaxed);
        s.encoded_bytes.fetch_add(bytes as u64, Relaxed);
        g = sh.lock();
        g.plan.encoded(t.job, t.layer);
        reap(&mut g);
        sh.cv.notify_all();
    }
}

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

/// Writes `t` (converted to `dtype` if it is stored otherwise) at arena offset `off`;
/// returns the bytes written.
///
/// # Safety
/// The range written must be this thread's alone, per the plan.
unsafe fn write_factor(
    arena: &PinnedMemory,
    off: usize,
    t: &LoraTensor,
    dtype: Option<WeightDtype>,
) -> usize {
    let to = dtype.unwrap_or(t.dtype());
    let len = t.numel() * to.size();
    // SAFETY: per this function's contract.
    let dst = unsafe { arena.slice_mut(off, len) };
    if to == t.dtype() {
        // Nobody on the host reads the image soon: keep it out of the caches (`stream`).
        super::stream::streaming_copy(dst, t.bytes());
    } else {
        t.convert_into(to, dst);
    }
    len
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
                landing.fail();
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
