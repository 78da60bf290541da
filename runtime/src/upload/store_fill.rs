//! The workers' host store, filled off the engine thread (DESIGN §3: the engine thread never
//! touches an adapter's bytes). With CPU LoRA workers attached, every streaming adapter also
//! goes into the pool's shared host store, where the workers read it. Copying it there is
//! O(bytes) (17 ms of CPU for a 76.5 MB adapter, `benches/results/upload-stall.md`), so the
//! engine thread only *reserves* the store entry (O(layers): an index slot, an arena range,
//! the descriptor table), the background thread copies the bytes, and the engine publishes
//! the entry at its next step ([`thaw_ipc::HostStore::settle`], O(1) per adapter).
//!
//! Until an adapter's entry is published the workers cannot read it: a step with a cold
//! layer of such an adapter computes its CPU deltas on the engine thread from the host copy
//! (the no-pool path, same numerics), and the step after the fill hands them to the workers.
//! The same holds for an adapter the store has no room for when it is registered (more
//! adapters streaming at once than the store holds): the engine reserves again at each step
//! until it has room or the adapter has landed, rather than refusing the adapter.
//!
//! Only a host copy held in memory is copied here: one the disk loader read in place (the
//! default where the backend reads the stored dtype, [`crate::adapter::LoraAdapter::load_in_place`])
//! gets a file entry at every load instead, and the workers read the file's pages
//! ([`crate::engine`]'s `store_insert`). What is still copied, all off the engine thread: the
//! upload pipeline's loader writes the adapter into the pinned arena once (when it enters the
//! host tier, or at its first load; the arena keeps that image while the adapter lives, so
//! later loads only copy it to the device), and, for a host copy held in memory (converted to
//! the backend's dtype, or `THAW_LOAD_IN_PLACE=0`), the background thread copies it into this
//! store at each load. The store and the arena are two memories because the arena holds
//! the device image (the backend's dtype, the device layout) and the store the workers'
//! (stored dtype, descriptor table): one memory for both would need the host tier itself
//! to be store-backed tensors and the device image to be read from the store's layout.
use std::sync::Arc;

use thaw_cpu_lora::LoraPool;
use thaw_ipc::{AdapterHandle, LayerModuleWeights, StoreFill};

use crate::adapter::{LoraAdapter, WeightDtype};
use crate::error::{Result, RuntimeError};
use crate::ids::AdapterId;

/// Reserves `a`'s entry in `pool`'s host store under (`id`, `generation`) on the calling
/// thread (O(layers)) and queues the copy of its bytes on the background thread. The handle
/// leases nothing until [`StoreReader::is_live`](thaw_ipc::StoreReader::is_live) says so.
/// `None` when the store has no room now (more adapters streaming than it holds, or fills
/// still running): the caller assists the adapter on the engine thread and asks again later.
pub fn reserve_and_fill_later(
    pool: &mut LoraPool,
    id: AdapterId,
    generation: u32,
    a: &Arc<LoraAdapter>,
) -> Result<Option<AdapterHandle>> {
    let reserved = pool.store_mut().reserve(
        thaw_ipc::AdapterId(id.0 as u64),
        thaw_ipc::Generation(generation as u64),
        &store_parts(a),
    );
    let fill = match reserved {
        Ok(fill) => fill,
        Err(thaw_ipc::IpcError::StoreFull { .. } | thaw_ipc::IpcError::IndexFull { .. }) => {
            return Ok(None)
        }
        Err(e) => return Err(RuntimeError::Backend(format!("host adapter store: {e}"))),
    };
    let handle = fill.handle();
    let a = a.clone();
    super::run_later(move || fill_now(fill, &a));
    Ok(Some(handle))
}

/// Copies `a`'s bytes into its reservation. A failure abandons the reservation (the store
/// frees it); the adapter's layers are then assisted on the engine thread until they land.
///
/// Each (layer, module) is a chunk paced against the steps running on this host
/// ([`super::pace`]). `THAW_STORE_FILL=0` abandons every fill instead (the workers never read
/// the entry; its layers are assisted on the engine thread): an attribution switch for
/// `thaw-bench upload-stall`, never a configuration.
fn fill_now(fill: StoreFill, a: &LoraAdapter) {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| thaw_kernels::cpu::switched_off("THAW_STORE_FILL")) {
        return;
    }
    let handle = fill.handle();
    let mut t0 = std::time::Instant::now();
    let paced = || {
        super::pace::after_chunk(t0.elapsed());
        t0 = std::time::Instant::now();
    };
    // The workers read an entry long after its fill: keep it out of the caches (`stream`).
    if let Err(e) = fill.fill_copying(&store_parts(a), super::streaming_copy, paced) {
        tracing::error!(?handle, "filling the host adapter store failed: {e}");
    }
}

/// `a`'s factors as the host store takes them: in their stored dtype, borrowed.
fn store_parts(a: &LoraAdapter) -> Vec<LayerModuleWeights<'_>> {
    a.iter()
        .map(|(layer, m, w)| LayerModuleWeights {
            layer: thaw_ipc::LayerIdx(layer as u32),
            module: thaw_ipc::Module::ALL[m.index()],
            rank: w.rank as u32,
            scale: w.scale,
            dtype: ipc_dtype(w.a.dtype()),
            a_bytes: w.a.bytes(),
            b_bytes: w.b.bytes(),
        })
        .collect()
}

/// The host store's code for a stored dtype.
fn ipc_dtype(d: WeightDtype) -> thaw_ipc::DType {
    match d {
        WeightDtype::F32 => thaw_ipc::DType::F32,
        WeightDtype::F16 => thaw_ipc::DType::F16,
        WeightDtype::Bf16 => thaw_ipc::DType::BF16,
    }
}
