//! The copy engine: streams adapters host → device layer by layer, layer 0 first, over a link;
//! demand loads go ahead of prefetches at every layer boundary ([`LinkQueue`]).
//!
//! On the CPU backend the link is *emulated*: each layer costs `latency + bytes / bandwidth` of
//! wall-clock time spent sleeping (no core burned), then the layer is published in its
//! [`LoraSlot`]. So the cold-start logic is exercised and measured with no GPU; the CUDA copy
//! path plugs into the same queue with real async copies.
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::queue::{LinkQueue, LoadPriority};
use super::slot::{layer_bytes, LoraSlot};

/// A host → device link: bandwidth and per-transfer latency.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct LinkModel {
    /// Gigabytes (10⁹ bytes) per second.
    pub gbps: f64,
    /// Fixed cost of each transfer (one per layer).
    pub latency_us: f64,
}

impl Default for LinkModel {
    /// A PCIe 4.0 x16 link moving pinned memory (~25 GB/s, ~10 µs per transfer).
    fn default() -> Self {
        Self {
            gbps: 25.0,
            latency_us: 10.0,
        }
    }
}

impl LinkModel {
    /// Time to move `bytes` in one transfer.
    pub fn transfer_time(&self, bytes: usize) -> Duration {
        let secs = self.latency_us * 1e-6 + bytes as f64 / (self.gbps.max(1e-9) * 1e9);
        Duration::from_secs_f64(secs)
    }
}

/// What the copy thread and the engine share.
#[derive(Debug, Default)]
struct Shared {
    queue: LinkQueue<Arc<LoraSlot>>,
    /// The engine dropped its end: finish what is queued, then stop.
    closed: bool,
}

/// The copy engine thread and its queue (demand loads first, see [`LinkQueue`]).
pub struct CopyEngine {
    shared: Arc<(Mutex<Shared>, Condvar)>,
    link: LinkModel,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyEngine")
            .field("link", &self.link)
            .field("queued_bytes", &self.queued_bytes())
            .finish()
    }
}

/// Bytes of `slot` not landed yet (what it still holds of the link); whatever `bytes()` counts
/// beyond the layers' factors moves with the last layer.
fn remaining_bytes(slot: &LoraSlot) -> u64 {
    if slot.landed() >= slot.num_layers() {
        return 0;
    }
    let landed: usize = (0..slot.landed())
        .map(|l| layer_bytes(slot.adapter(), l))
        .sum();
    (slot.bytes() - landed) as u64
}

impl CopyEngine {
    /// Starts the copy thread for an emulated link.
    pub fn emulated(link: LinkModel) -> Self {
        let shared = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("thaw-copy".into())
            .spawn(move || {
                thaw_cpu_lora::float_current_thread();
                run(&s, link)
            })
            .expect("spawning the copy thread");
        Self {
            shared,
            link,
            thread: Some(thread),
        }
    }

    pub fn link(&self) -> LinkModel {
        self.link
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        // The copy thread holds the lock only between layers and never panics holding it.
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes queued on the link and not yet landed, prefetches included.
    pub fn queued_bytes(&self) -> u64 {
        let g = self.lock();
        [LoadPriority::Demand, LoadPriority::Prefetch]
            .into_iter()
            .flat_map(|p| g.queue.iter(p))
            .map(|s| remaining_bytes(s))
            .sum()
    }

    /// Bytes a demand load queued now would wait behind: the demand loads queued or in flight,
    /// and at most one layer of a prefetch in flight (prefetches yield at each layer).
    pub fn demand_backlog(&self) -> u64 {
        let g = self.lock();
        let demand: u64 = g
            .queue
            .iter(LoadPriority::Demand)
            .map(|s| remaining_bytes(s))
            .sum();
        let layer = match g.queue.in_flight() {
            Some((s, LoadPriority::Prefetch)) if s.landed() < s.num_layers() => {
                layer_bytes(s.adapter(), s.landed()) as u64
            }
            _ => 0,
        };
        demand + layer
    }

    /// Queues `slot`'s adapter to stream in, layer 0 first, behind the transfers of its class.
    pub fn enqueue(&self, slot: Arc<LoraSlot>, priority: LoadPriority) {
        self.lock().queue.push(slot, priority);
        self.shared.1.notify_one();
    }

    /// Makes a queued prefetch of `slot` a demand load (its request is about to run); false if
    /// it is not a queued prefetch (a demand load already, landed, or never queued).
    pub fn promote(&self, slot: &Arc<LoraSlot>) -> bool {
        self.lock().queue.promote(|s| Arc::ptr_eq(s, slot))
    }
}

fn run(shared: &(Mutex<Shared>, Condvar), link: LinkModel) {
    // Transfers are back to back on one link: each layer starts when the previous ends, so a
    // late wake-up of this thread does not slow the emulated link down.
    let mut clock = Instant::now();
    let (lock, cv) = shared;
    let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        // Adapters evicted before they landed: only the queue holds them now (the engine
        // dropped its slot, and nobody can take a new reference), so they leave the link.
        g.queue.remove_where(|s| Arc::strong_count(s) == 1);
        let closed = g.closed;
        let slot = match g.queue.start() {
            Some((s, _)) => s.clone(),
            None if closed => return,
            None => {
                g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
                // An idle link starts afresh: no catching up on the time it sat idle.
                clock = Instant::now();
                continue;
            }
        };
        drop(g);
        clock = clock.max(Instant::now());
        let layer = slot.landed();
        let done = if layer < slot.num_layers() {
            let bytes = layer_bytes(slot.adapter(), layer);
            clock += link.transfer_time(bytes);
            let now = Instant::now();
            if clock > now {
                std::thread::sleep(clock - now);
            }
            slot.land(layer);
            layer + 1 == slot.num_layers()
        } else {
            true
        };
        drop(slot);
        g = lock.lock().unwrap_or_else(|e| e.into_inner());
        g.queue.finish_layer(done);
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        self.lock().closed = true;
        self.shared.1.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapter::LoraAdapter;
    use crate::model::{fixtures, ModelConfig};

    /// Polls `done` every millisecond; panics after a minute (a hung copy thread).
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

    #[test]
    fn demand_loads_pass_queued_prefetches_which_still_land() {
        let cfg = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
        let a = Arc::new(LoraAdapter::load(&fixtures::adapter("r4_qv"), &cfg).unwrap());
        // 3,584 bytes a layer at 20 kB/s: ~180 ms a layer (slow enough that a descheduled test
        // thread does not miss an ordering), 2 layers an adapter.
        let eng = CopyEngine::emulated(LinkModel {
            gbps: 2e-5,
            latency_us: 0.0,
        });
        let slot = || Arc::new(LoraSlot::empty(a.clone()));
        let pre: Vec<Arc<LoraSlot>> = (0..4).map(|_| slot()).collect();
        for p in &pre {
            eng.enqueue(p.clone(), LoadPriority::Prefetch);
        }
        let demand = slot();
        eng.enqueue(demand.clone(), LoadPriority::Demand);
        let landed = || pre.iter().map(|s| s.landed()).sum::<usize>();
        let before = landed();
        wait_for("the demand load", || demand.landed() == 2);
        // At most the prefetch layer in flight when the demand load came landed meanwhile.
        assert!(landed() <= before + 1, "{before} → {}", landed());
        // A promoted prefetch goes next: the last one queued lands before the second.
        assert!(eng.promote(&pre[3]));
        assert!(!eng.promote(&demand), "a landed demand load is no prefetch");
        wait_for("the promoted prefetch", || pre[3].landed() == 2);
        assert!(pre[1].landed() + pre[2].landed() <= 1);
        // One the engine drops before it lands leaves the link; the others complete.
        let gone = Arc::downgrade(&pre[2]);
        let [p0, p1, p2, p3]: [Arc<LoraSlot>; 4] = pre.try_into().unwrap();
        drop(p2);
        wait_for("the prefetches", || {
            p0.landed() == 2 && p1.landed() == 2 && eng.queued_bytes() == 0
        });
        assert_eq!(p3.landed(), 2);
        assert!(
            gone.upgrade().is_none(),
            "the link still holds a dropped slot"
        );
        assert_eq!(eng.demand_backlog(), 0);
    }

    #[test]
    fn transfer_time_is_latency_plus_bytes_over_bandwidth() {
        let l = LinkModel {
            gbps: 2.0,
            latency_us: 50.0,
        };
        let t = l.transfer_time(4_000_000);
        assert!((t.as_secs_f64() - (50e-6 + 2e-3)).abs() < 1e-9, "{t:?}");
    }
}
