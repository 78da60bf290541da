//! Layer-wise start without CPU assist (DESIGN §3): a request whose adapter is still streaming
//! to the device runs in the step, and before each layer the forward waits until the step's
//! adapters have that layer on the device, instead of the request waiting for the whole
//! adapter and then for the next step. On a GPU the host waits while the device still computes
//! the layers already queued, so a copy that keeps ahead of the forward costs the step only its
//! first layer's copy; the caller decides when it does (the server's cold-start gate).
//!
//! The choice is per adapter ([`super::Engine::set_adapter_unlanded`], the engine's default
//! otherwise): one step may wait for the layers of one adapter and compute those of another on
//! the CPU, the assisted adapter's layers staying as they were when the step began.
//!
//! Nothing here touches an adapter's bytes: it polls landed counts, O(adapters) per layer.
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::{Result, RuntimeError};

/// What a step does with a layer of one of its adapters that has not landed when the step
/// starts.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum UnlandedLayers {
    /// Computed elsewhere: CPU assist (the workers, or the engine thread without them).
    #[default]
    Assist,
    /// Waited for: the forward reaches the layer only once it has landed, and computes it on
    /// the device.
    Wait,
}

/// Longest a step waits for one layer before it fails (a copy that failed, or a link that
/// stopped): far above any copy of one layer, which takes microseconds to milliseconds.
pub(super) const LAYER_WAIT_LIMIT: Duration = Duration::from_secs(10);

/// The landed layers of a step's adapters as the forward waits for them.
#[derive(Debug)]
pub(super) struct LayerWait {
    /// Per adapter of the step, in its order: layers on the device (monotonic for the waited
    /// ones; the others keep their count at the step's start).
    pub(super) landed: Vec<usize>,
    /// Per adapter of the step: whether the forward waits for its layers.
    waits: Vec<bool>,
    limit: Duration,
    /// Time the forward spent waiting, for the step's report.
    pub(super) waited: Duration,
}

impl LayerWait {
    /// The wait of a step whose adapters had `landed` of `layers` layers at its start: it
    /// waits for those adapters `i` with a layer not landed where `waits(i)` (their
    /// [`UnlandedLayers::Wait`]). None when it waits for none of them.
    pub(super) fn for_step(
        landed: &[usize],
        layers: usize,
        waits: impl Fn(usize) -> bool,
        limit: Duration,
    ) -> Option<Self> {
        let waits: Vec<bool> = (0..landed.len())
            .map(|i| landed[i] < layers && waits(i))
            .collect();
        waits.contains(&true).then(|| Self {
            landed: landed.to_vec(),
            waits,
            limit,
            waited: Duration::ZERO,
        })
    }

    /// Whether the step waits for the layers of its adapter `i`.
    pub(super) fn waits(&self, i: usize) -> bool {
        self.waits[i]
    }

    /// Returns once every waited adapter of `adapters` has layer `layer` on the device (its
    /// landed count is above `layer`), updating [`LayerWait::landed`]; an error after waiting
    /// [`LAYER_WAIT_LIMIT`] for one layer.
    pub(super) fn until<B: Backend>(
        &mut self,
        b: &B,
        adapters: &[&B::Lora],
        layer: usize,
    ) -> Result<()> {
        let t0 = Instant::now();
        let waited = self.landed.iter_mut().zip(&self.waits).zip(adapters);
        for ((landed, _), a) in waited.filter(|((_, &w), _)| w) {
            while *landed <= layer {
                *landed = b.landed_layers(a).max(*landed);
                if *landed > layer {
                    break;
                }
                if t0.elapsed() > self.limit {
                    return Err(RuntimeError::Backend(format!(
                        "layer {layer} of an adapter of the step did not land within {:?} \
                         ({} layers landed): its copy failed or the copy link stopped",
                        self.limit, *landed
                    )));
                }
                // A layer's copy takes tens of microseconds on a GPU link: poll, yielding.
                std::thread::yield_now();
            }
        }
        self.waited += t0.elapsed();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step waits for exactly its adapters marked to wait that still have a layer to land:
    /// a landed one needs no wait, an assisted one keeps its count from the step's start.
    #[test]
    fn a_step_waits_only_for_its_unlanded_adapters_marked_wait() {
        let landed = [4, 1, 0, 2];
        let marked = [true, true, false, false];
        let w = LayerWait::for_step(&landed, 4, |i| marked[i], LAYER_WAIT_LIMIT)
            .expect("adapter 1 waits");
        let got: Vec<bool> = (0..4).map(|i| w.waits(i)).collect();
        assert_eq!(got, [false, true, false, false]);
        assert_eq!(w.landed, landed);
        assert!(LayerWait::for_step(&landed, 4, |i| i == 0, LAYER_WAIT_LIMIT).is_none());
        assert!(LayerWait::for_step(&[], 4, |_| true, LAYER_WAIT_LIMIT).is_none());
    }
}
