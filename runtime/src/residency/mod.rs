//! Adapter residency below the host tier: device slots filled layer by layer by the upload
//! pipeline ([`crate::upload`]), demand loads first, over a (real or emulated) link.
mod link;
mod slot;

pub use link::{LinkModel, LoadPriority};
pub use slot::{layer_bytes, DeviceResidency, LoraSlot};
