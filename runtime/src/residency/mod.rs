//! Adapter residency below the host tier: device slots filled layer by layer, and the copy
//! engine that streams adapters into them over a (real or emulated) link.
mod link;
mod slot;

pub use link::{CopyEngine, LinkModel};
pub use slot::{layer_bytes, DeviceResidency, LoraSlot};
