//! The host adapter store, writer side: the one process that inserts and removes adapters.
//! Allocation is a first-fit free list with coalescing ([`crate::alloc`]) kept in this
//! process's private memory; removal is deferred until every reader lease is gone (see the
//! protocol in [`crate::store`]).

use std::collections::HashMap;
use std::ops::{Deref, Range};

#[path = "store_file.rs"]
mod file;
pub use file::{FileSource, FileTensors, ModuleShape};

use crate::alloc::{round_up, FreeList};
use crate::error::{IpcError, Result};
use crate::segment::{Segment, SegmentKind, HEADER_LEN};
use crate::store::{
    ModuleDesc, StoreConfig, StoreLayout, StoreReader, DESC, FREE, LIVE, RETIRED, WRITING,
};
use crate::types::{
    AdapterHandle, AdapterId, DType, Generation, LayerIdx, Module, ReaderSlot, NUM_MODULES,
};

/// One (layer, module) of an adapter to insert: A `[rank, d_in]` and B `[d_out, rank]` as
/// raw bytes in `dtype` (little-endian, row-major); `d_in`/`d_out` follow from the lengths.
#[derive(Debug, Clone, Copy)]
pub struct LayerModuleWeights<'a> {
    /// Layer.
    pub layer: LayerIdx,
    /// Module.
    pub module: Module,
    /// Rank.
    pub rank: u32,
    /// Scale (alpha / rank).
    pub scale: f32,
    /// Stored dtype.
    pub dtype: DType,
    /// A bytes.
    pub a_bytes: &'a [u8],
    /// B bytes.
    pub b_bytes: &'a [u8],
}

/// The writer's handle on a host store. Derefs to a [`StoreReader`] (reader slot 0).
#[derive(Debug)]
pub struct HostStore {
    reader: StoreReader,
    free: FreeList,
    free_slots: Vec<u32>,
    retired: Vec<u32>,
    live: HashMap<(AdapterId, Generation), (u32, u64, u64)>,
    blocks: HashMap<u32, (u64, u64)>,
}

impl Deref for HostStore {
    type Target = StoreReader;
    fn deref(&self) -> &StoreReader {
        &self.reader
    }
}

impl HostStore {
    /// Creates a store with `capacity_bytes` of arena and `max_adapters` index slots, and the
    /// default number of reader slots.
    pub fn create(capacity_bytes: u64, max_adapters: u32) -> Result<Self> {
        Self::create_with(StoreConfig {
            capacity_bytes,
            max_adapters,
            ..StoreConfig::default()
        })
    }

    /// Creates a store for `cfg`.
    pub fn create_with(cfg: StoreConfig) -> Result<Self> {
        let layout = StoreLayout::new(&cfg)?;
        let seg = Segment::create_with_config(
            SegmentKind::HostStore,
            "host-store",
            layout.total - HEADER_LEN,
            &StoreReader::config_words(&cfg),
        )?;
        let reader = StoreReader::open(seg, ReaderSlot(0))?;
        Ok(Self {
            reader,
            free: FreeList::new(cfg.capacity_bytes),
            free_slots: (0..cfg.max_adapters).rev().collect(),
            retired: Vec::new(),
            live: HashMap::new(),
            blocks: HashMap::new(),
        })
    }

    /// Commits the whole arena now, so inserting an adapter is a plain copy rather than a
    /// page fault per 4 KiB (several milliseconds for a 7 MB adapter, on the thread that
    /// inserts). Costs the store's full size in RAM up front, as a pinned host cache does.
    /// Returns false where the kernel cannot (Linux < 5.14): pages then fault in on use.
    pub fn populate(&self) -> bool {
        self.reader.seg.populate()
    }

    /// Arena bytes an adapter of `n_layers` layers takes, given each (layer, module)'s A and
    /// B sizes in bytes: what [`insert`](Self::insert) allocates, for sizing a store.
    pub fn footprint(n_layers: u32, tensors: impl IntoIterator<Item = (u64, u64)>) -> u64 {
        round_up((n_layers as usize * NUM_MODULES * DESC) as u64)
            + tensors
                .into_iter()
                .map(|(a, b)| round_up(a) + round_up(b))
                .sum::<u64>()
    }

    /// Copies an adapter into the arena and publishes it. Reclaims retired adapters first.
    pub fn insert(
        &mut self,
        id: AdapterId,
        generation: Generation,
        weights: &[LayerModuleWeights<'_>],
    ) -> Result<AdapterHandle> {
        if self.live.contains_key(&(id, generation)) {
            return Err(IpcError::AlreadyPresent {
                id: id.0,
                generation: generation.0,
            });
        }
        let shapes = check_weights(weights)?;
        let n_layers = weights.iter().map(|w| w.layer.0 + 1).max().unwrap_or(0);
        let desc_bytes = round_up((n_layers as usize * NUM_MODULES * DESC) as u64);
        let size = Self::footprint(
            n_layers,
            weights
                .iter()
                .map(|w| (w.a_bytes.len() as u64, w.b_bytes.len() as u64)),
        );
        self.reclaim();
        let slot = self.free_slots.pop().ok_or(IpcError::IndexFull {
            max: self.cfg.max_adapters,
        })?;
        let Some(off) = self.free.alloc(size) else {
            self.free_slots.push(slot);
            return Err(IpcError::StoreFull {
                needed: round_up(size),
                largest: self.free.largest(),
                capacity: self.free.capacity(),
            });
        };
        let len = round_up(size);
        self.reader.set_entry(slot, WRITING, None);
        let base = self.reader.layout.arena + off as usize;
        // SAFETY: [base, base+len) was just taken from the free list. A block returns to the
        // free list only after its entry was RETIRED and every lease counter read zero, after
        // which no reader can acquire it (they see a non-LIVE state first); and the entry now
        // being filled is WRITING, so no reader touches the bytes until we store LIVE below.
        // Nothing else in this process holds a slice of the block.
        let block = unsafe {
            self.reader
                .seg
                .mapping()
                .slice_mut::<u8>(base, len as usize)
        };
        // Descriptors of absent (layer, module)s must read as zero; tensor bytes are all
        // overwritten below, and the alignment padding between them is never read.
        block[..desc_bytes as usize].fill(0);
        let mut cursor = desc_bytes as usize;
        for (w, &(d_in, d_out)) in weights.iter().zip(&shapes) {
            let mut put = |bytes: &[u8]| {
                let at = cursor;
                block[at..at + bytes.len()].copy_from_slice(bytes);
                cursor += round_up(bytes.len() as u64) as usize;
                (base + at) as u64
            };
            let desc = ModuleDesc {
                present: 1,
                rank: w.rank,
                dtype: w.dtype.code(),
                d_in,
                d_out,
                scale: w.scale,
                a_off: put(w.a_bytes),
                b_off: put(w.b_bytes),
                _pad: 0,
            };
            let at = (w.layer.0 as usize * NUM_MODULES + w.module.index()) * DESC;
            block[at..at + DESC].copy_from_slice(bytemuck::bytes_of(&desc));
        }
        let handle = AdapterHandle {
            id,
            generation,
            slot,
            _pad: 0,
        };
        self.reader
            .set_entry(slot, LIVE, Some((handle, n_layers, off, len)));
        self.live.insert((id, generation), (slot, off, len));
        self.blocks.insert(slot, (off, len));
        Ok(handle)
    }

    /// Unpublishes an adapter: new lookups and leases fail at once; its bytes are reclaimed
    /// as soon as no reader holds a lease (now, or at a later insert/[`HostStore::reclaim`]).
    /// Returns false if `handle` was not live.
    pub fn remove(&mut self, handle: AdapterHandle) -> bool {
        match self.live.get(&(handle.id, handle.generation)) {
            Some(&(slot, _, _)) if slot == handle.slot => {}
            _ => return false,
        }
        self.live.remove(&(handle.id, handle.generation));
        self.reader.set_entry(handle.slot, RETIRED, None);
        self.retired.push(handle.slot);
        self.reclaim();
        true
    }

    /// Frees every retired adapter no reader holds a lease on. Returns how many.
    pub fn reclaim(&mut self) -> usize {
        let before = self.retired.len();
        let readers = self.cfg.max_readers;
        let mut i = 0;
        while i < self.retired.len() {
            let slot = self.retired[i];
            let leased = (0..readers).any(|r| {
                self.reader
                    .lease_word_of(slot, r)
                    .load(std::sync::atomic::Ordering::SeqCst)
                    != 0
            });
            if leased {
                i += 1;
                continue;
            }
            self.retired.swap_remove(i);
            let (off, len) = self.blocks.remove(&slot).expect("retired slot has a block");
            self.free.free(off, len);
            self.reader.set_entry(slot, FREE, None);
            self.free_slots.push(slot);
        }
        before - self.retired.len()
    }

    /// Drops every lease held by reader slot `reader` — call after that worker process died
    /// (it can no longer read), so adapters it had leased can be reclaimed.
    pub fn release_reader(&mut self, reader: ReaderSlot) -> Result<()> {
        if reader.0 >= self.cfg.max_readers || reader.0 == 0 {
            return Err(IpcError::NoSuchReader {
                slot: reader.0,
                max: self.cfg.max_readers,
            });
        }
        for slot in 0..self.cfg.max_adapters {
            self.reader
                .lease_word_of(slot, reader.0)
                .store(0, std::sync::atomic::Ordering::SeqCst);
        }
        self.reclaim();
        Ok(())
    }

    /// Adapters removed but still leased.
    pub fn pending_reclaim(&self) -> usize {
        self.retired.len()
    }

    /// Live adapters with their arena byte ranges (for stats and tests).
    pub fn live_extents(&self) -> Vec<(AdapterHandle, Range<u64>)> {
        self.live
            .iter()
            .map(|(&(id, generation), &(slot, off, len))| {
                (
                    AdapterHandle {
                        id,
                        generation,
                        slot,
                        _pad: 0,
                    },
                    off..off + len,
                )
            })
            .collect()
    }

    /// Free arena bytes and the largest free block.
    pub fn free_space(&self) -> (u64, u64) {
        (self.free.free_bytes(), self.free.largest())
    }

    /// The reader view (also reachable through `Deref`).
    pub fn reader(&self) -> &StoreReader {
        &self.reader
    }
}

/// Validates every (layer, module) and returns its (d_in, d_out).
fn check_weights(weights: &[LayerModuleWeights<'_>]) -> Result<Vec<(u32, u32)>> {
    let mut seen = std::collections::HashSet::new();
    weights
        .iter()
        .map(|w| {
            let bad = |reason: String| IpcError::BadWeights {
                layer: w.layer.0,
                module: w.module.index() as u32,
                reason,
            };
            if w.rank == 0 {
                return Err(bad("rank is 0".into()));
            }
            if !seen.insert((w.layer, w.module)) {
                return Err(bad("given twice".into()));
            }
            if w.layer.0 >= 1 << 16 {
                return Err(bad("layer index above 65535".into()));
            }
            if !w.scale.is_finite() {
                return Err(bad(format!("scale {} is not finite", w.scale)));
            }
            let row = w.rank as usize * w.dtype.size();
            let dim = |bytes: &[u8], what: &str| {
                if bytes.is_empty() || !bytes.len().is_multiple_of(row) {
                    return Err(bad(format!(
                        "{what} has {} bytes, not a positive multiple of rank {} × {} bytes",
                        bytes.len(),
                        w.rank,
                        w.dtype.size()
                    )));
                }
                u32::try_from(bytes.len() / row).map_err(|_| bad(format!("{what} too large")))
            };
            Ok((dim(w.a_bytes, "A")?, dim(w.b_bytes, "B")?))
        })
        .collect::<Result<Vec<_>>>()
        .and_then(|v| {
            if v.is_empty() {
                Err(IpcError::BadWeights {
                    layer: 0,
                    module: 0,
                    reason: "no weights".into(),
                })
            } else {
                Ok(v)
            }
        })
}
