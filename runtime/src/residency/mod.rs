//! Adapter residency below the host tier: device slots filled layer by layer, and the copy
//! engine that streams adapters into them over a (real or emulated) link, demand loads first.
mod link;
mod queue;
mod slot;

pub use link::{CopyEngine, LinkModel};
pub use queue::{LinkQueue, LoadPriority};
pub use slot::{layer_bytes, DeviceResidency, LoraSlot};
