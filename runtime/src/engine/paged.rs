//! Adapters in the KV cache's own memory: where the backend places adapter images in pages of
//! the one device budget ([`Backend::lora_pages`]), the engine takes a run of blocks out of
//! its block pool for each adapter and hands it to the backend with the KV buffers; the
//! blocks return to KV when the backend drops the lease (the adapter gone and its last copy
//! done). Elsewhere adapters load as before.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use thaw_kernels::cpu::KvLayout;

use super::Engine;
use crate::adapter::LoraAdapter;
use crate::backend::{Backend, LoraLoad, PagePlace};
use crate::error::Result;

/// Owners of page runs, unique for the process (a run outlives its registration while a copy
/// into it finishes, so ids are never reused).
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

impl<B: Backend> Engine<B> {
    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            block_size: self.cfg.kv_block_size,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// Pages of the device budget `adapter` takes on this backend when it places adapters in
    /// the KV cache (`None`: elsewhere; the server then counts `ceil(bytes / page)`).
    pub fn adapter_pages(&self, adapter: &LoraAdapter) -> Option<usize> {
        self.backend.lora_pages(adapter, self.kv_layout())
    }

    /// `adapter` entered the host tier: its device image is written into the upload arena
    /// now, off the engine thread (O(layers) here), and kept while the adapter lives, so a
    /// later load of it only copies ([`Backend::stage_lora`]). Returns the arena bytes the
    /// image holds (0: not staged), part of what the host tier holds for the adapter.
    pub fn stage_adapter(&mut self, adapter: &Arc<LoraAdapter>) -> usize {
        let layout = self.kv_layout();
        self.backend.stage_lora(adapter, layout)
    }

    /// Blocks adapters' images hold now.
    pub fn adapter_blocks(&self) -> usize {
        self.blocks.adapter_blocks()
    }

    /// The device copy of `adapter`, loaded as `load` says: into a run of KV blocks where the
    /// backend places adapters there, otherwise as the backend loads adapters.
    pub(super) fn device_lora(
        &mut self,
        adapter: &Arc<LoraAdapter>,
        load: LoraLoad,
    ) -> Result<B::Lora> {
        let Some(n) = self.backend.lora_pages(adapter, self.kv_layout()) else {
            return crate::backend::load_lora(&mut self.backend, adapter.clone(), load);
        };
        let owner = NEXT_OWNER.fetch_add(1, Ordering::Relaxed);
        let lease = self.blocks.assign_adapter(owner, n)?;
        let place = PagePlace {
            kv: self.kv.iter().collect(),
            lease,
        };
        self.backend.load_lora_paged(adapter.clone(), load, place)
    }
}
