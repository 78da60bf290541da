//! One upload pipeline for every backend (DESIGN §3, §6): loader threads encode adapters
//! layer by layer into a pinned host arena allocated once at start-up, one copy thread moves
//! each encoded layer to the device and publishes it when its event completes, and the engine
//! only polls landed layers. A backend supplies only [`CopyDevice`]: pinned memory, an async
//! copy, an event query. The CPU backend's emulated link is this same pipeline with the DMA
//! emulated ([`EmulatedLink`]), so a CPU benchmark pays every host cost a GPU pays.
//!
//! | file | job |
//! | --- | --- |
//! | `plan.rs` | the pure decisions: arena space, images kept for the host tier, encode and copy order, eviction |
//! | `arena.rs` | the arena's free list |
//! | `check.rs` | a layer read from a mapped file is checked (file unchanged, weights finite) before its copy is queued |
//! | `layout.rs` | an adapter's device image: factor offsets, layer ranges; paged in the budget's pages |
//! | `device.rs` | what a backend supplies, and the CPU backend's emulated link |
//! | `pipeline.rs` | the loader and copy threads |
//! | `background.rs` | lower priority for host threads; host work (freeing, filling) off the engine thread |
//! | `store_fill.rs` | the workers' host store: reserved on the engine thread, filled on the background one |
//! | `pace.rs` | byte work paced against the steps running on the same host (CPU backend) |
//! | `stream.rs` | copies of adapter bytes that bypass the caches (non-temporal stores) |
mod arena;
mod background;
pub(crate) mod check;
mod device;
mod layout;
mod pace;
mod pipeline;
mod plan;
mod store_fill;
mod stream;

pub use arena::{ArenaAlloc, ARENA_ALIGN};
pub use background::{
    byte_thread_sched, drop_later, lower_current_thread_priority, run_later, ByteThreadSched,
    BACKGROUND_NICE,
};
pub use device::{CopyDevice, EmulatedLink, PinnedMemory};
pub use layout::{region_pieces, Factor, ImageLayout, Placed};
pub use pace::{
    after_chunk, busy_pace, host_step, host_step_running, publish_backlog, HostStep, Pace,
    DEFAULT_BUSY_SHARE, MIN_BUSY_SHARE, PACED_DEADLINE,
};
pub use pipeline::{ArenaUsage, Landing, Upload, UploadPipeline, UploadStats};
pub use plan::{CopyTask, EncodeTask, ImageKey, JobId, PlanError, UploadPlan};
pub use store_fill::reserve_and_fill_later;
pub use stream::{streaming_copy, use_streaming, STREAMING_MIN_BYTES};
