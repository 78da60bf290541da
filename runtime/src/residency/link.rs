//! The copy engine: streams adapters host → device layer by layer, layer 0 first, one adapter
//! after another, over a link.
//!
//! On the CPU backend the link is *emulated*: each layer costs `latency + bytes / bandwidth` of
//! wall-clock time spent sleeping (no core burned), then the layer is published in its
//! [`LoraSlot`]. So the cold-start logic is exercised and measured with no GPU; the CUDA copy
//! path plugs into the same queue with real async copies.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{unbounded, Receiver, Sender};

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

/// The copy engine thread and its queue.
pub struct CopyEngine {
    tx: Option<Sender<Arc<LoraSlot>>>,
    queued_bytes: Arc<AtomicU64>,
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

impl CopyEngine {
    /// Starts the copy thread for an emulated link.
    pub fn emulated(link: LinkModel) -> Self {
        let (tx, rx) = unbounded();
        let queued_bytes = Arc::new(AtomicU64::new(0));
        let q = queued_bytes.clone();
        let thread = std::thread::Builder::new()
            .name("thaw-copy".into())
            .spawn(move || {
                thaw_cpu_lora::float_current_thread();
                run(rx, link, q)
            })
            .expect("spawning the copy thread");
        Self {
            tx: Some(tx),
            queued_bytes,
            link,
            thread: Some(thread),
        }
    }

    pub fn link(&self) -> LinkModel {
        self.link
    }

    /// Bytes queued on the link and not yet landed (the cost model's backlog).
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes.load(Ordering::Acquire)
    }

    /// Queues `slot`'s adapter to stream in, layer 0 first.
    pub fn enqueue(&self, slot: Arc<LoraSlot>) {
        self.queued_bytes
            .fetch_add(slot.bytes() as u64, Ordering::AcqRel);
        if let Some(tx) = &self.tx {
            // The receiver lives until `drop` joins the thread, so this cannot fail.
            let _ = tx.send(slot);
        }
    }
}

fn run(rx: Receiver<Arc<LoraSlot>>, link: LinkModel, queued: Arc<AtomicU64>) {
    // Transfers are back to back on one link: each starts when the previous ends, so a
    // late wake-up of this thread does not slow the emulated link down.
    let mut clock = Instant::now();
    for slot in rx {
        clock = clock.max(Instant::now());
        let mut moved = 0u64;
        for layer in 0..slot.num_layers() {
            let bytes = layer_bytes(slot.adapter(), layer);
            clock += link.transfer_time(bytes);
            let now = Instant::now();
            if clock > now {
                std::thread::sleep(clock - now);
            }
            slot.land(layer);
            queued.fetch_sub(bytes as u64, Ordering::AcqRel);
            moved += bytes as u64;
        }
        // Whatever `bytes()` counts beyond the layers' factors moved with the last layer.
        queued.fetch_sub(slot.bytes() as u64 - moved, Ordering::AcqRel);
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
