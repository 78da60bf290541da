//! Carrying an [`AdmitPlan`] out on an engine: evictions first (their pages are what the loads
//! use), then host → device loads, prefetches (behind every demand load on the copy link), and
//! disk reads for the loader.
use std::collections::HashSet;

use thaw_runtime::backend::Backend;
use thaw_runtime::engine::Engine;
use thaw_runtime::error::RuntimeError;
use thaw_runtime::ids::AdapterId;

use super::admission::AdmitPlan;
use super::loader::{FetchJob, Loader};
use super::manager::MemoryManager;

/// How adapters go to the device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Upload {
    /// Every layer at once (the `cached` cold-start policy).
    Whole,
    /// Layer by layer over the copy engine, served meanwhile as the cold-start policy says.
    Stream,
}

/// Applies `plan`; returns the adapters registered with the engine (to watch them land).
pub fn apply<B: Backend>(
    mgr: &mut MemoryManager,
    engine: &mut Engine<B>,
    plan: &AdmitPlan,
    kv_reserved: usize,
    upload: Upload,
    wanted: &HashSet<AdapterId>,
    loader: Option<&Loader>,
) -> Vec<AdapterId> {
    for &v in &plan.evict {
        match engine.unregister_adapter(v) {
            // The engine does not have it: its pages are free all the same.
            Ok(()) | Err(RuntimeError::UnknownAdapter(_)) => mgr.on_evicted(v, wanted),
            Err(e) => tracing::warn!("evicting adapter {v}: {e}"),
        }
    }
    let mut registered = Vec::new();
    let loads = plan.load.iter().map(|a| (*a, false));
    for (a, prefetch) in loads.chain(plan.prefetch.iter().map(|a| (*a, true))) {
        if engine.has_adapter(a) {
            continue;
        }
        let Some(host) = mgr.host_copy(a) else {
            continue;
        };
        if let Err(e) = mgr.on_registered(a, kv_reserved, prefetch) {
            tracing::debug!("adapter {a} does not fit yet: {e}");
            continue;
        }
        let r = match upload {
            Upload::Whole => engine.register_adapter(a, host),
            // A prefetch yields the link to every demand load until its request runs.
            Upload::Stream if prefetch => engine.prefetch_adapter(a, host),
            Upload::Stream => engine.register_adapter_streaming(a, host),
        };
        match r {
            Ok(()) => registered.push(a),
            Err(e) => {
                tracing::warn!("registering adapter {a} with the engine: {e}");
                mgr.on_register_failed(a);
            }
        }
    }
    if let Some(loader) = loader {
        for &a in &plan.fetch {
            let Some(bytes) = mgr.bytes(a) else { continue };
            let root = mgr.root(a);
            if let Some(path) = mgr.start_fetch(a) {
                if !loader.fetch(FetchJob {
                    id: a,
                    path,
                    root,
                    bytes,
                }) {
                    tracing::error!("the adapter loader thread has stopped");
                }
            }
        }
    }
    registered
}
