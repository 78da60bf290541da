//! An adapter's device slot on the CPU backend, filled layer by layer.
//!
//! Device residency is tracked per layer (DESIGN §3): `Absent → Streaming{landed} → Resident`.
//! The copy engine lands layer 0 first and each layer exactly once. On the CPU backend the
//! device memory *is* host memory, so the slot shares the adapter's host copy and landing a
//! layer only publishes it (release/acquire on the landed count): the emulated link spends
//! wall-clock time, not a core copying bytes a GPU's copy engine would move.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::adapter::{LoraAdapter, LoraModule, LoraWeights};

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
    adapter: Arc<LoraAdapter>,
    landed: AtomicUsize,
    /// Why its upload failed, once it has.
    failure: OnceLock<String>,
}

impl LoraSlot {
    /// A slot of `adapter` with no layer landed yet.
    pub fn empty(adapter: Arc<LoraAdapter>) -> Self {
        Self {
            adapter,
            landed: AtomicUsize::new(0),
            failure: OnceLock::new(),
        }
    }

    /// A slot with every layer of `adapter` landed.
    pub fn resident(adapter: Arc<LoraAdapter>) -> Self {
        let slot = Self::empty(adapter);
        slot.landed
            .store(slot.adapter.num_layers(), Ordering::Release);
        slot
    }

    /// The adapter this slot holds.
    pub fn adapter(&self) -> &Arc<LoraAdapter> {
        &self.adapter
    }

    /// Publishes layer `layer`. Layers must land in order, each once.
    pub fn land(&self, layer: usize) {
        assert_eq!(
            layer,
            self.landed.load(Ordering::Acquire),
            "layers land in order, layer 0 first (or layer {layer} landed twice)"
        );
        assert!(layer < self.num_layers(), "layer {layer} is past the last");
        self.landed.store(layer + 1, Ordering::Release);
    }

    /// Marks the upload as failed (its source vanished or was corrupt, or a copy failed) for
    /// `why`; the first reason stays.
    pub fn fail(&self, why: &str) {
        let _ = self.failure.set(why.to_string());
    }

    /// Why its upload failed, if it has.
    pub fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    /// Layers landed so far (layers `0..landed` are readable).
    pub fn landed(&self) -> usize {
        self.landed.load(Ordering::Acquire)
    }

    pub fn num_layers(&self) -> usize {
        self.adapter.num_layers()
    }

    /// Bytes the full slot occupies (the adapter's stored bytes).
    pub fn bytes(&self) -> usize {
        self.adapter.size_bytes()
    }

    pub fn residency(&self) -> DeviceResidency {
        if self.failure.get().is_some() {
            return DeviceResidency::Failed;
        }
        match self.landed() {
            0 if self.num_layers() > 0 => DeviceResidency::Absent,
            n if n == self.num_layers() => DeviceResidency::Resident,
            n => DeviceResidency::Streaming {
                landed: n,
                layers: self.num_layers(),
            },
        }
    }

    /// The factors of (layer, module) if that layer has landed and the adapter targets it.
    pub fn get(&self, layer: usize, m: LoraModule) -> Option<&LoraWeights> {
        if layer >= self.landed() {
            return None;
        }
        self.adapter.get(layer, m)
    }
}

/// Bytes of one layer's factors as stored (what crosses the link for that layer).
pub fn layer_bytes(adapter: &LoraAdapter, layer: usize) -> usize {
    LoraModule::ALL
        .iter()
        .filter_map(|&m| adapter.get(layer, m))
        .map(LoraWeights::bytes)
        .sum()
}
