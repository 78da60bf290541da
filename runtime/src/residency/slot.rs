//! An adapter's device slot on the CPU backend, filled layer by layer.
//!
//! Device residency is tracked per layer (DESIGN §3): `Absent → Streaming{landed} → Resident`.
//! The copy engine lands layer 0 first and each layer exactly once; a layer's weights are
//! immutable once landed, so readers need no lock (a `OnceLock` per layer publishes them with
//! release/acquire ordering).
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::adapter::{LoraAdapter, LoraModule, LoraWeights};

/// One layer's factors, in [`LoraModule::ALL`] order.
pub type LayerLora = [Option<LoraWeights>; 7];

/// Where an adapter's weights are on the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DeviceResidency {
    /// No layer has landed.
    Absent,
    /// `landed` of `layers` layers are on the device, layer 0 first.
    Streaming { landed: usize, layers: usize },
    /// Every layer is on the device.
    Resident,
    /// The copy failed; requests of this adapter fail with the recorded reason.
    Failed,
}

/// The device copy of one adapter.
#[derive(Debug)]
pub struct LoraSlot {
    layers: Vec<OnceLock<LayerLora>>,
    landed: AtomicUsize,
    failed: AtomicBool,
    bytes: usize,
}

impl LoraSlot {
    /// An empty slot for `num_layers` layers that will take `bytes` when full.
    pub fn empty(num_layers: usize, bytes: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| OnceLock::new()).collect(),
            landed: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            bytes,
        }
    }

    /// A slot with every layer of `adapter` landed.
    pub fn resident(adapter: &LoraAdapter) -> Self {
        let slot = Self::empty(adapter.num_layers(), adapter.size_bytes_f32());
        for l in 0..adapter.num_layers() {
            slot.land(l, layer_of(adapter, l));
        }
        slot
    }

    /// Publishes layer `layer`. Layers must land in order, each once.
    pub fn land(&self, layer: usize, weights: LayerLora) {
        assert_eq!(
            layer,
            self.landed.load(Ordering::Acquire),
            "layers land in order, layer 0 first"
        );
        assert!(
            self.layers[layer].set(weights).is_ok(),
            "layer {layer} landed twice"
        );
        self.landed.store(layer + 1, Ordering::Release);
    }

    /// Marks the copy as failed (its source vanished or was corrupt).
    pub fn fail(&self) {
        self.failed.store(true, Ordering::Release);
    }

    /// Layers landed so far (layers `0..landed` are readable).
    pub fn landed(&self) -> usize {
        self.landed.load(Ordering::Acquire)
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes the full slot occupies.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn residency(&self) -> DeviceResidency {
        if self.failed.load(Ordering::Acquire) {
            return DeviceResidency::Failed;
        }
        match self.landed() {
            0 if !self.layers.is_empty() => DeviceResidency::Absent,
            n if n == self.layers.len() => DeviceResidency::Resident,
            n => DeviceResidency::Streaming {
                landed: n,
                layers: self.layers.len(),
            },
        }
    }

    /// The factors of (layer, module) if that layer has landed and the adapter targets it.
    pub fn get(&self, layer: usize, m: LoraModule) -> Option<&LoraWeights> {
        self.layers.get(layer)?.get()?[m.index()].as_ref()
    }
}

/// A copy of one layer's factors of `adapter`, as the copy engine moves it.
pub fn layer_of(adapter: &LoraAdapter, layer: usize) -> LayerLora {
    LoraModule::ALL.map(|m| adapter.get(layer, m).cloned())
}

/// Bytes of one layer's factors (what crosses the link for that layer), as f32.
pub fn layer_bytes(adapter: &LoraAdapter, layer: usize) -> usize {
    LoraModule::ALL
        .iter()
        .filter_map(|&m| adapter.get(layer, m))
        .map(|w| (w.a.len() + w.b.len()) * std::mem::size_of::<f32>())
        .sum()
}
