//! Layer-wise start without CPU assist (DESIGN §3): a request whose adapter is still streaming
//! to the device runs in the step, and before each layer the forward waits until the step's
//! adapters have that layer on the device, instead of the request waiting for the whole
//! adapter and then for the next step. On a GPU the host waits while the device still computes
//! the layers already queued, so a copy that keeps ahead of the forward costs the step only its
//! first layer's copy; the caller decides when it does (the server's `on-demand` gate).
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
    /// Per adapter of the step, in its order: layers on the device (monotonic).
    pub(super) landed: Vec<usize>,
    limit: Duration,
    /// Time the forward spent waiting, for the step's report.
    pub(super) waited: Duration,
}

impl LayerWait {
    /// A step's wait starting from the layers landed at its start.
    pub(super) fn new(landed: &[usize], limit: Duration) -> Self {
        Self {
            landed: landed.to_vec(),
            limit,
            waited: Duration::ZERO,
        }
    }

    /// Returns once every adapter of `adapters` has layer `layer` on the device (its landed
    /// count is above `layer`), updating [`LayerWait::landed`]; an error after waiting
    /// [`LAYER_WAIT_LIMIT`] for one layer.
    pub(super) fn until<B: Backend>(
        &mut self,
        b: &B,
        adapters: &[&B::Lora],
        layer: usize,
    ) -> Result<()> {
        let t0 = Instant::now();
        for (landed, a) in self.landed.iter_mut().zip(adapters) {
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
