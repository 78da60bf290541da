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

/// `id` may have entered the host tier (registered with its weights, or read from disk): if the
/// tier kept it, its device image is written into the engine's upload arena now, off the engine
/// thread, so a later load of it only copies. The arena frees the image once the adapter's last
/// reference (the host tier's, the device copy's) is gone. The host tier counts the image's
/// bytes, with the heap copy's if the host copy is held in memory (not read in place), against
/// `--max-cpu-lora-bytes` (`wanted`: adapters of queued requests, kept over the bound).
pub fn stage_host<B: Backend>(
    mgr: &mut MemoryManager,
    engine: &mut Engine<B>,
    id: AdapterId,
    wanted: &HashSet<AdapterId>,
) {
    if let Some(h) = mgr.host_copy(id) {
        let image = engine.stage_adapter(&h);
        mgr.on_staged(id, image as u64, wanted);
    }
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
                    bytes: Some(bytes),
                }) {
                    tracing::error!("the adapter loader thread has stopped");
                }
            }
        }
    }
    registered
}

/// Which of the requests admission chose may run after [`apply`]: those without an adapter or
/// whose adapter the engine holds. A load the engine refused (no run of free pages while KV
/// blocks in use split them) leaves its requests waiting, planned again at the next step:
/// queued, never failed. `adapter_of` answers a waiting request's adapter.
pub fn runnable_after_apply(
    admit: &mut Vec<thaw_runtime::ids::SeqId>,
    adapter_of: impl Fn(thaw_runtime::ids::SeqId) -> Option<AdapterId>,
    registered: impl Fn(AdapterId) -> bool,
) {
    admit.retain(|&id| adapter_of(id).is_none_or(&registered));
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use thaw_runtime::ids::SeqId;

    use super::*;

    proptest! {
        /// A request stays admitted exactly when it has no adapter or the engine holds its
        /// adapter; the order of the admitted ones is kept.
        #[test]
        fn refused_loads_leave_their_requests_waiting(
            reqs in prop::collection::vec(prop::option::of(0u32..6), 0..24),
            held in prop::collection::vec(any::<bool>(), 6),
        ) {
            let ids: Vec<SeqId> = (0..reqs.len() as u64).map(SeqId).collect();
            let adapter_of = |id: SeqId| reqs[id.0 as usize].map(AdapterId);
            let registered = |a: AdapterId| held[a.0 as usize];
            let mut admit = ids.clone();
            runnable_after_apply(&mut admit, adapter_of, registered);
            let want: Vec<SeqId> = ids
                .into_iter()
                .filter(|&id| adapter_of(id).is_none_or(registered))
                .collect();
            prop_assert_eq!(&admit, &want);
            for id in admit {
                if let Some(a) = adapter_of(id) {
                    prop_assert!(held[a.0 as usize], "request {:?} admitted with adapter {:?} not held", id, a);
                }
            }
        }
    }
}
