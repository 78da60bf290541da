//! Adapter memory: one device budget in pages shared by KV blocks and adapters, the host and
//! disk tiers, cost-aware eviction, prefetch, and the adapter-aware admission the scheduler
//! calls. The engine thread owns the [`MemoryManager`]; the registry tells it about adapters
//! through a [`NoticeSink`] and reads tiers from the [`Board`]; neither imports the other.
//!
//! - [`budget`]: sizing the budget on a GPU (`--gpu-memory-utilization`).
//! - [`profile`]: building the engine with that budget measured.
//! - [`pool`]: the page budget (unified, or the `fixed-slots` baseline).
//! - [`eviction`]: Chameleon's score and LRU.
//! - [`admission`]: who may join the batch, and what memory must do for them (pure).
//! - [`nocache`]: the `no-cache` baseline's drops (S-LoRA keeps no cache).
//! - [`manager`]: tiers, host bounds, eviction order, published numbers.
//! - [`apply`]: carrying a plan out on an engine.
//! - [`loader`]: disk reads off the engine thread.
//! - [`tiers`]: which adapters are in which tier, so per-step work is O(active).
//! - [`waits`]: what each request waited for before its first token.
pub mod admission;
pub mod apply;
pub mod board;
pub mod budget;
pub mod eviction;
pub mod loader;
pub mod manager;
pub mod mapped;
pub mod nocache;
pub mod pool;
pub mod profile;
pub mod tiers;
pub mod waits;

#[cfg(test)]
mod admission_engine_tests;
#[cfg(test)]
mod admission_tests;
#[cfg(test)]
mod nocache_tests;

use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::ids::AdapterId;

pub use admission::{
    admit, AdapterState, AdmitPlan, Device, EvictionOrder, HeadWait, Limits, MemView, Registered,
};
pub use board::{Board, MemorySnapshot, Residence, Tier};
pub use eviction::EvictionPolicy;
pub use manager::{AdapterMeta, MemoryConfig, MemoryManager, ReloadCost};
pub use pool::{Layout, PagePool};

/// What the registry tells the memory manager.
#[derive(Debug)]
pub enum Notice {
    /// A new adapter (generation); `host` is the copy just read, if any. `warm` asks to make
    /// it device-resident now if idle memory allows. `done` is answered once it is known.
    Register {
        meta: AdapterMeta,
        host: Option<Arc<LoraAdapter>>,
        warm: bool,
        done: Option<tokio::sync::oneshot::Sender<()>>,
    },
    /// An unloaded or replaced adapter no request uses any more: drop it everywhere.
    Retire(AdapterId),
}

/// Where notices go (the engine thread). Err means it has stopped.
pub trait NoticeSink: Send + Sync {
    fn notify(&self, n: Notice) -> Result<(), crate::error::ServerError>;
}
