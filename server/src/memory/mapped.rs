//! Disk-tier adapters served from their files over HTTP (issue 27, items 2 and 5). When
//! adapters stream to the device (every policy but `cached`; under `auto` with CPU LoRA
//! workers only when the cost model says to assist from the disk), an adapter whose requests
//! arrive while it is only on disk does not wait for its whole read: its safetensors file is
//! mapped (header parsed and validated, no weight read; confined under `--lora-root` like
//! every read, [`crate::lora_open::map_confined`]) and that mapped adapter becomes its host
//! copy, so the next admission plan registers it with the engine like any host-tier adapter —
//! its device pages reserved as the plan says. The upload pipeline's loader threads then read
//! each layer from the file, check it (file unchanged, weights finite) and encode it into the
//! arena, and its copy is queued as soon as that layer is in, so the first layers land while
//! later ones are still read; the workers, if any, compute its layers from the file meanwhile.
//!
//! The loader's full read runs as before and stays authoritative: when it lands, its copy —
//! the file read in place and verified where the backend reads the stored dtype (no heap copy:
//! the bytes stay the page cache's, [`crate::memory::loader`]) — replaces the stand-in in the
//! memory manager and, through [`thaw_runtime::engine::Engine::adopt_host_copy`], in the
//! engine. When it fails (the file
//! is corrupt, has a non-finite weight, changed, or was moved out of the root), every request
//! for the adapter fails with the loader's message, as without mapping, and the adapter leaves
//! the engine (its pages and its workers' host-store entry go back): see
//! [`drop_mapped`].
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use thaw_runtime::adapter::{LoraAdapter, WeightDtype};
use thaw_runtime::backend::Backend;
use thaw_runtime::engine::Engine;
use thaw_runtime::ids::AdapterId;
use thaw_runtime::model::ModelConfig;

use super::manager::MemoryManager;
use crate::lora_open::map_confined;

/// `dir`'s adapter mapped from its file (confined to `root` if it has one), if it can be served
/// as is: the backend reads its stored dtype (a conversion needs every byte, so it is the
/// loader's) and it weighs what it weighed when registered. `None` otherwise; the loader's
/// read then reports what is wrong, if anything.
pub fn map_adapter(
    dir: &Path,
    root: Option<&Path>,
    bytes: u64,
    model: &ModelConfig,
    dtype: Option<WeightDtype>,
) -> Option<Arc<LoraAdapter>> {
    let a = match root {
        Some(root) => map_confined(root, dir, model).ok()?,
        None => LoraAdapter::map(dir, model).ok()?,
    };
    if dtype.is_some_and(|d| a.dtype() != d) || a.size_bytes() as u64 != bytes {
        return None;
    }
    Some(Arc::new(a))
}

/// For each adapter of `fetch` still being read from disk with no host copy: maps it and, if
/// `assist(id, &mapped)`, makes the mapped adapter its host copy (the next plan loads it).
/// Returns the adapters mapped.
pub fn map_fetches(
    mgr: &mut MemoryManager,
    fetch: &[AdapterId],
    model: &ModelConfig,
    dtype: Option<WeightDtype>,
    wanted: &HashSet<AdapterId>,
    assist: impl Fn(AdapterId, &LoraAdapter) -> bool,
) -> Vec<AdapterId> {
    let mut mapped = Vec::new();
    for &id in fetch {
        let Some((dir, root, bytes)) = mgr.disk_only_read(id) else {
            continue;
        };
        let Some(a) = map_adapter(&dir, root.as_deref(), bytes, model, dtype) else {
            continue;
        };
        if assist(id, &a) {
            mgr.on_mapped(id, a, wanted);
            mapped.push(id);
        }
    }
    mapped
}

/// The loader's read of `id` succeeded: if the engine serves `id` from its mapped file, the
/// owned copy replaces it there. An error (the copy differs from the file mapped) fails the
/// adapter like a failed read.
pub fn adopt<B: Backend>(
    engine: &mut Engine<B>,
    id: AdapterId,
    owned: &Arc<LoraAdapter>,
) -> Result<(), String> {
    if !engine.adapter_is_mapped(id) {
        return Ok(());
    }
    engine
        .adopt_host_copy(id, owned.clone())
        .map_err(|e| format!("adapter {id}: {e}"))
}

/// The loader's read of `id` failed: if the engine holds it (registered from its mapped file),
/// it leaves the engine and its pages the pool. Call after the requests using it are gone.
pub fn drop_mapped<B: Backend>(
    engine: &mut Engine<B>,
    mgr: &mut MemoryManager,
    id: AdapterId,
    wanted: &HashSet<AdapterId>,
) {
    if !engine.has_adapter(id) {
        return;
    }
    match engine.unregister_adapter(id) {
        Ok(()) => mgr.on_evicted(id, wanted),
        Err(e) => tracing::warn!("dropping adapter {id} whose read failed: {e}"),
    }
}
