//! Adapters served from the disk tier (issue 27): a [`LoraAdapter::map`]ped adapter is
//! registered the moment its request arrives; its host-store entry names the file instead of
//! holding a copy, so the CPU LoRA workers read each layer from the memory-mapped safetensors
//! file while the upload pipeline reads the same pages into the arena and the device. As each
//! layer lands the device computes it; once all have, the entry is released (and the workers
//! unmap the file). When the loader's full read of the same file finishes, its copy —
//! verified in place where the backend reads the stored dtype, so the file's bytes are in host
//! memory once — replaces the stand-in as the engine's host copy ([`Engine::adopt_host_copy`]).
use std::sync::Arc;

use thaw_cpu_lora::LoraPool;
use thaw_ipc::AdapterHandle;

use super::Engine;
use crate::adapter::LoraAdapter;
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use crate::ids::AdapterId;

/// Puts an adapter in the workers' host store: a file entry (no copy) when its factors are
/// read in place from its file — a disk-tier stand-in, or a host copy read in place
/// ([`LoraAdapter::load_in_place`]), at every load — otherwise a reservation whose bytes a
/// background thread copies (O(layers) here, [`crate::upload::reserve_and_fill_later`]).
/// `None` when the store has no room now: the adapter is assisted on the engine thread until
/// it has.
pub(super) fn store_insert(
    pool: &mut LoraPool,
    id: AdapterId,
    generation: u32,
    a: &Arc<LoraAdapter>,
) -> Result<Option<AdapterHandle>> {
    let Some((source, tensors)) = file_entry(a) else {
        return crate::upload::reserve_and_fill_later(pool, id, generation, a);
    };
    match pool.store_mut().insert_file(
        thaw_ipc::AdapterId(id.0 as u64),
        thaw_ipc::Generation(generation as u64),
        &source,
        &tensors,
    ) {
        Ok(h) => Ok(Some(h)),
        Err(thaw_ipc::IpcError::StoreFull { .. } | thaw_ipc::IpcError::IndexFull { .. }) => {
            Ok(None)
        }
        Err(e) => Err(RuntimeError::Backend(format!(
            "host adapter store (file entry): {e}"
        ))),
    }
}

/// The file and offsets a host-store file entry for `a` names, if the workers can read `a`
/// from its file: every factor is read in place from one mapped file, and the file at its
/// path is still that file (one `stat`; the workers open it by path). A verified mapping whose
/// file was replaced meanwhile is still `a`'s bytes here, but not there: its entry is filled
/// with a copy of the mapped bytes instead.
pub(super) fn file_entry(
    a: &LoraAdapter,
) -> Option<(thaw_ipc::FileSource, Vec<thaw_ipc::FileTensors>)> {
    let (source, tensors) = a.file_source()?;
    let same = std::fs::metadata(&source.path).is_ok_and(|m| source.matches(&m).is_ok());
    same.then_some((source, tensors))
}

impl<B: Backend> Engine<B> {
    /// Replaces the host copy of adapter `id` — registered mapped from its file — with
    /// `owned`, the loader's full read of the same file (same layers, modules, ranks, scales,
    /// dtypes and shapes): held in memory, or read in place and verified whole
    /// ([`LoraAdapter::load_in_place`], no second copy of the bytes); sequences using the
    /// adapter carry on. The workers' file entry and the device copy in flight are left as
    /// they are.
    ///
    /// O(layers × modules) and one `stat`, never O(bytes) (this runs on the engine thread):
    /// the bytes are the same because the file is still the one mapped (same device, inode
    /// and length: a replaced or truncated file is refused), and adapter files are not
    /// rewritten in place while served (see `crate::adapter::mapped`).
    pub fn adopt_host_copy(&mut self, id: AdapterId, owned: Arc<LoraAdapter>) -> Result<()> {
        let a = self
            .adapters
            .get_mut(&id)
            .ok_or(RuntimeError::UnknownAdapter(id))?;
        let shaped = |w: &crate::adapter::LoraWeights| {
            let (a, b) = (&w.a, &w.b);
            (w.rank, w.scale, a.dtype(), a.numel(), b.dtype(), b.numel())
        };
        let same = a.host.num_layers() == owned.num_layers()
            && a.host.iter().count() == owned.iter().count()
            && a.host
                .iter()
                .zip(owned.iter())
                .all(|((l, m, x), (k, n, y))| (l, m) == (k, n) && shaped(x) == shaped(y));
        let mapped = a.host.file_source().map(|(src, _)| src);
        let unchanged = mapped
            .as_ref()
            .is_none_or(|src| std::fs::metadata(&src.path).is_ok_and(|m| src.matches(&m).is_ok()));
        // A copy read in place must be of the very file mapped (not one renamed over it
        // between the two opens).
        let same_file = match (&mapped, owned.file_source()) {
            (Some(x), Some((y, _))) => (x.dev, x.ino, x.len) == (y.dev, y.ino, y.len),
            _ => true,
        };
        if !same || !unchanged || !same_file {
            return Err(RuntimeError::InvalidRequest(format!(
                "adapter {id:?}: the loaded copy differs from the mapped file it replaces \
                 (was the file rewritten?); unload and load the adapter again"
            )));
        }
        let old = std::mem::replace(&mut a.host, owned.clone());
        // Its arena image stays, now the owned copy's: not freed with the mapping and encoded
        // again when the owned copy is staged.
        self.backend.rebind_lora(&old, &owned);
        crate::upload::drop_later(old);
        Ok(())
    }

    /// Whether adapter `id` is served from its mapped file while the loader's read of it is
    /// still to come: its host copy is read in place and not verified whole. A host copy read
    /// in place by the loader ([`LoraAdapter::load_in_place`]) is a full one: false.
    pub fn adapter_is_mapped(&self, id: AdapterId) -> bool {
        self.adapters.get(&id).is_some_and(|a| a.host.is_stand_in())
    }

    /// The adapters whose upload failed, each with why ([`Backend::lora_failure`]: a layer
    /// read from its file failed its check, or a copy failed): they will never land, so the
    /// caller fails their requests and unregisters them. O(adapters); allocates only when one
    /// failed.
    pub fn failed_uploads(&self) -> Vec<(AdapterId, String)> {
        self.adapters
            .iter()
            .filter_map(|(&id, a)| Some((id, self.backend.lora_failure(&a.dev)?)))
            .collect()
    }
}

#[cfg(test)]
#[path = "from_disk_tests.rs"]
mod tests;
