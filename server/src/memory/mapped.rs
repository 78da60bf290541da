//! Disk-tier adapters served from their files over HTTP (issue 27, items 2 and 5). Under every
//! policy ([`crate::coldstart::ColdStartPolicy::serves_disk_miss_from_file`]), an adapter
//! whose requests arrive while it is only on disk does not wait for its whole read: its
//! safetensors file is mapped (header parsed and validated, no weight read; confined under
//! `--lora-root` like every read, [`crate::lora_open::map_confined`]) and that mapped adapter
//! becomes its host copy, so the next admission plan registers it with the engine like any
//! host-tier adapter — its device pages reserved as the plan says, and uploaded layer by layer
//! even under `cached` ([`crate::memory::apply::Upload::for_host`]; `cached` still starts its
//! requests only once every layer has landed). The upload pipeline's loader threads then read
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
/// Returns the adapters mapped. One that cannot be served from its file, or that `assist`
/// declines, is not mapped again while the same read runs ([`MemoryManager::on_map_refused`]):
/// every plan asks, and mapping (a header parse, O(tensors)) is engine-thread work.
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
        match map_adapter(&dir, root.as_deref(), bytes, model, dtype) {
            Some(a) if assist(id, &a) => {
                mgr.on_mapped(id, a, wanted);
                mapped.push(id);
            }
            Some(_) | None => mgr.on_map_refused(id),
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::lora_open::tests::fixture;
    use crate::memory::board::Board;
    use crate::memory::eviction::EvictionPolicy;
    use crate::memory::manager::{AdapterMeta, MemoryConfig};

    fn manager(dir: &Path, bytes: u64) -> MemoryManager {
        let mut m = MemoryManager::new(
            MemoryConfig {
                page_bytes: 1 << 20,
                total_pages: 64,
                policy: EvictionPolicy::Cost,
                max_loras: 4,
                max_streaming_adapters: None,
                host_max_adapters: 4,
                host_max_bytes: 1 << 30,
            },
            Arc::new(Board::default()),
        );
        m.register(
            AdapterMeta {
                id: AdapterId(1),
                path: dir.to_path_buf(),
                root: None,
                bytes,
                num_layers: 2,
                disk_secs: 0.001,
            },
            None,
        );
        m
    }

    /// The engine loop plans every step (every 2 ms while a request waits for a read) and each
    /// plan asks to map the adapters being read. A file mapped and not served from (the
    /// policy declined, as `auto` waiting for the read did) or that cannot be served as is (a
    /// dtype the backend does not read) is mapped once per read, not at every plan: the
    /// engine thread's share of a miss is O(tensors), not O(read time × tensors). A new read
    /// may map it again.
    #[test]
    fn a_file_not_served_from_is_mapped_once_per_read() {
        let model = ModelConfig::from_dir(&fixture()).unwrap();
        let dir = fixture().join("adapters/r4_qv");
        let a = LoraAdapter::map(&dir, &model).unwrap();
        let mut m = manager(&dir, a.size_bytes() as u64);
        let id = AdapterId(1);
        let none = HashSet::new();
        assert!(m.start_fetch(id).is_some());
        let asked = Cell::new(0);
        let decline = |_: AdapterId, _: &LoraAdapter| {
            asked.set(asked.get() + 1);
            false
        };
        for _ in 0..50 {
            let mapped = map_fetches(&mut m, &[id], &model, None, &none, decline);
            assert!(mapped.is_empty());
        }
        assert_eq!(asked.get(), 1, "mapped once for the read in flight");
        assert!(m.host_copy(id).is_none());

        // That read ends without a host copy (it failed, say) and the adapter is read again:
        // the new read may map it, and serves it from its file when the policy says so.
        m.on_fetched(id, None, &none);
        assert!(m.start_fetch(id).is_some(), "a new read");
        let mapped = map_fetches(&mut m, &[id], &model, None, &none, |_, _| true);
        assert_eq!(mapped, vec![id]);
        assert!(m.host_copy(id).is_some_and(|h| h.is_mapped()));

        // A file the backend cannot read as stored (it would need a conversion): refused
        // once, and not parsed again at the following plans of the same read.
        let mut m = manager(&dir, a.size_bytes() as u64);
        assert!(m.start_fetch(id).is_some());
        let other = match a.dtype() {
            WeightDtype::F32 => WeightDtype::Bf16,
            _ => WeightDtype::F32,
        };
        let map = |m: &mut MemoryManager| {
            map_fetches(m, &[id], &model, Some(other), &none, |_, _| {
                unreachable!("a refused map asks no one")
            })
        };
        assert!(m.disk_only_read(id).is_some());
        assert!(map(&mut m).is_empty());
        assert!(
            m.disk_only_read(id).is_none(),
            "not offered for mapping again during this read"
        );
        assert!(map(&mut m).is_empty());
    }

    /// A disk miss served from its mapped file goes to the device layer by layer under every
    /// policy, `cached` (whose adapters are otherwise uploaded whole) included: the stand-in is
    /// registered mapped, the upload pipeline reads, checks and copies it layer by layer (over
    /// a slow emulated link it has not landed right after it is registered, where a whole
    /// upload would have made the unread, unchecked mapping resident on the CPU backend at
    /// once), and it lands. The loader's verified copy is still uploaded whole.
    #[test]
    fn a_cached_disk_miss_is_uploaded_from_its_file_layer_by_layer() {
        use std::time::Duration;

        use thaw_runtime::backend::cpu::CpuBackend;
        use thaw_runtime::engine::{EngineConfig, HostModel};
        use thaw_runtime::residency::LinkModel;

        use crate::coldstart::ColdStartPolicy;
        use crate::memory::apply::{apply, Upload};
        use crate::memory::AdmitPlan;

        let model = HostModel::load(&fixture()).unwrap();
        // ~50 kB/s: the adapter's layers take tens of milliseconds each to copy.
        let link = LinkModel {
            gbps: 0.00005,
            latency_us: 1.0,
        };
        let backend = CpuBackend::new(&model.config).with_link(link);
        let mut engine = Engine::new(backend, model.clone(), EngineConfig::default()).unwrap();
        let dir = fixture().join("adapters/r4_qv");
        let owned = Arc::new(LoraAdapter::load_host(&dir, &model.config, None).unwrap());
        let mut m = manager(&dir, owned.size_bytes() as u64);
        let (id, none) = (AdapterId(1), HashSet::new());
        assert!(m.start_fetch(id).is_some());
        let mapped = map_fetches(&mut m, &[id], &model.config, None, &none, |_, _| true);
        assert_eq!(mapped, vec![id]);
        let stand_in = m.host_copy(id).unwrap();
        let cached = Upload::of(ColdStartPolicy::Cached);
        assert_eq!(cached, Upload::Whole);
        assert_eq!(cached.for_host(&stand_in), Upload::Stream);
        assert_eq!(cached.for_host(&owned), Upload::Whole, "a verified copy");
        assert_eq!(Upload::Stream.for_host(&owned), Upload::Stream);

        let plan = AdmitPlan {
            load: vec![id],
            ..Default::default()
        };
        let registered = apply(&mut m, &mut engine, &plan, 0, cached, &none, None);
        assert_eq!(registered, vec![id]);
        assert!(engine.adapter_is_mapped(id), "served from its file");
        let (landed, layers) = engine.adapter_landed(id).unwrap();
        assert!(
            landed < layers,
            "streamed layer by layer, not resident at once: {landed} of {layers} landed"
        );
        engine
            .wait_adapters_landed(Duration::from_secs(60))
            .unwrap();
        assert!(engine.adapter_resident(id));
        assert_eq!(engine.failed_uploads(), Vec::new());
    }
}
