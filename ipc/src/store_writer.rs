//! The host adapter store, writer side: the one process that inserts and removes adapters.
//! Allocation is a first-fit free list with coalescing ([`crate::alloc`]) kept in this
//! process's private memory; removal is deferred until every reader lease is gone (see the
//! protocol in [`crate::store`]). An insert can be split into reserve (here, O(layers)), fill
//! (any thread) and publish (here, O(1)): see [`crate::store_fill`].

use std::collections::HashMap;
use std::ops::{Deref, Range};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

#[path = "store_file.rs"]
mod file;
pub use file::{FileSource, FileTensors, ModuleShape};

use crate::alloc::{round_up, FreeList};
use crate::error::{IpcError, Result};
use crate::segment::{Segment, SegmentKind, HEADER_LEN};
use crate::store::{
    ModuleDesc, StoreConfig, StoreLayout, StoreReader, DESC, FREE, LIVE, RETIRED, WRITING,
};
use crate::store_fill::{self as fill, Place, StoreFill};
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
    /// Reserved, not yet published, by slot.
    filling: HashMap<u32, Filling>,
}

/// A reservation awaiting its fill ([`crate::store_fill`]).
#[derive(Debug)]
struct Filling {
    handle: AdapterHandle,
    n_layers: u32,
    off: u64,
    len: u64,
    /// Written by the fill token; read here with Acquire.
    status: Arc<AtomicU32>,
    /// Removed before it was published: freed, not published, once the token is gone.
    cancelled: bool,
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
            filling: HashMap::new(),
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
    /// The same as [`reserve`](Self::reserve), [`StoreFill::fill`] and
    /// [`settle`](Self::settle) on the calling thread.
    pub fn insert(
        &mut self,
        id: AdapterId,
        generation: Generation,
        weights: &[LayerModuleWeights<'_>],
    ) -> Result<AdapterHandle> {
        let fill = self.reserve(id, generation, weights)?;
        let handle = fill.handle();
        fill.fill(weights)?;
        self.settle();
        debug_assert!(self.live.contains_key(&(id, generation)));
        Ok(handle)
    }

    /// Takes an index slot and an arena range for an adapter of `weights`' shapes (their
    /// bytes are not read) and writes its descriptors: O(layers), no tensor bytes. The
    /// returned token fills the bytes from any thread; the adapter is published (`LIVE`) at
    /// the first [`settle`](Self::settle) after that. Until then it is invisible to readers
    /// and lookups, and [`remove`](Self::remove) cancels it.
    pub fn reserve(
        &mut self,
        id: AdapterId,
        generation: Generation,
        weights: &[LayerModuleWeights<'_>],
    ) -> Result<StoreFill> {
        let pending = self
            .filling
            .values()
            .any(|f| !f.cancelled && (f.handle.id, f.handle.generation) == (id, generation));
        if pending || self.live.contains_key(&(id, generation)) {
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
        self.settle();
        let (slot, off, len) = self.take_entry(size)?;
        let base = self.reader.layout.arena + off as usize;
        // SAFETY: [base, base+desc_bytes) lies in [base, base+len), just taken from the free
        // list. A block returns to the free list only after its entry was RETIRED and every
        // lease counter read zero (no reader can acquire it then: they see a non-LIVE state
        // first), or after its fill token was gone (no filler writes it then); and the entry
        // is WRITING, so no reader touches the bytes until it is published. The fill token
        // made below writes only the tensor ranges after the descriptor table.
        let descs = unsafe {
            self.reader
                .seg
                .mapping()
                .slice_mut::<u8>(base, desc_bytes as usize)
        };
        // Descriptors of absent (layer, module)s must read as zero; tensor bytes are all
        // written by the fill, and the alignment padding between them is never read.
        descs.fill(0);
        let mut cursor = base + desc_bytes as usize;
        let mut take = |n: usize| {
            let at = cursor;
            cursor += round_up(n as u64) as usize;
            at..at + n
        };
        let mut places = Vec::with_capacity(weights.len());
        for (w, &(d_in, d_out)) in weights.iter().zip(&shapes) {
            let (a, b) = (take(w.a_bytes.len()), take(w.b_bytes.len()));
            let desc = ModuleDesc {
                present: 1,
                rank: w.rank,
                dtype: w.dtype.code(),
                d_in,
                d_out,
                scale: w.scale,
                a_off: a.start as u64,
                b_off: b.start as u64,
                _pad: 0,
            };
            let at = (w.layer.0 as usize * NUM_MODULES + w.module.index()) * DESC;
            descs[at..at + DESC].copy_from_slice(bytemuck::bytes_of(&desc));
            places.push(Place {
                layer: w.layer,
                module: w.module,
                rank: w.rank,
                dtype: w.dtype,
                a,
                b,
            });
        }
        let handle = AdapterHandle {
            id,
            generation,
            slot,
            _pad: 0,
        };
        let status = Arc::new(AtomicU32::new(fill::PENDING));
        self.filling.insert(
            slot,
            Filling {
                handle,
                n_layers,
                off,
                len,
                status: status.clone(),
                cancelled: false,
            },
        );
        self.blocks.insert(slot, (off, len));
        Ok(StoreFill::new(
            self.reader.seg.shared_mapping(),
            handle,
            places,
            status,
        ))
    }

    /// Takes an index slot and `size` bytes of the arena for a new entry and marks the entry
    /// WRITING, so no reader reaches it until it is published: `(slot, offset, length)` with
    /// the length rounded up as the free list takes it. Gives the slot back if the arena has
    /// no such range.
    pub(crate) fn take_entry(&mut self, size: u64) -> Result<(u32, u64, u64)> {
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
        self.reader.set_entry(slot, WRITING, None);
        Ok((slot, off, round_up(size)))
    }

    /// Publishes every reservation whose fill finished (its entry becomes `LIVE`), frees
    /// those abandoned, and those cancelled once their fill cannot write any more, and reclaims retired
    /// adapters no reader leases. O(reservations + retired). Returns how many it published.
    pub fn settle(&mut self) -> usize {
        let mut published = 0;
        let done: Vec<(u32, u32)> = self
            .filling
            .iter()
            .map(|(&slot, f)| (slot, f.status.load(Ordering::Acquire), f.cancelled))
            .filter(|&(_, st, cancelled)| fill::writer_may_free(st, cancelled))
            .map(|(slot, st, _)| (slot, st))
            .collect();
        for (slot, st) in done {
            let f = self.filling.remove(&slot).expect("listed above");
            if st & fill::FILLED != 0 && !f.cancelled {
                let h = f.handle;
                self.reader
                    .set_entry(slot, LIVE, Some((h, f.n_layers, f.off, f.len)));
                self.live.insert((h.id, h.generation), (slot, f.off, f.len));
                published += 1;
            } else {
                // Never published, so no reader ever held a lease that reached the bytes;
                // and the token said its last word or can never start: nobody writes them.
                self.blocks.remove(&slot);
                self.free.free(f.off, f.len);
                self.reader.set_entry(slot, FREE, None);
                self.free_slots.push(slot);
            }
        }
        self.reclaim();
        published
    }

    /// Reservations not yet published (filling, or cancelled and awaiting their filler).
    pub fn pending_fills(&self) -> usize {
        self.filling.len()
    }

    /// Reserved, unpublished adapters with their arena byte ranges (for stats and tests).
    pub fn filling_extents(&self) -> Vec<(AdapterHandle, Range<u64>)> {
        self.filling
            .values()
            .map(|f| (f.handle, f.off..f.off + f.len))
            .collect()
    }

    /// Unpublishes an adapter: new lookups and leases fail at once; its bytes are reclaimed
    /// as soon as no reader holds a lease (now, or at a later insert/[`HostStore::reclaim`]).
    /// Returns false if `handle` was not live.
    pub fn remove(&mut self, handle: AdapterHandle) -> bool {
        if let Some(f) = self.filling.get_mut(&handle.slot) {
            if f.handle != handle || f.cancelled {
                return false;
            }
            // A fill not started yet never will: its space is freed below. One running may
            // still be writing: its space is freed once its token is gone.
            f.cancelled = true;
            f.status.fetch_or(fill::CANCELLED, Ordering::AcqRel);
            self.settle();
            return true;
        }
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
            let leased = (0..readers)
                .any(|r| self.reader.lease_word_of(slot, r).load(Ordering::SeqCst) != 0);
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
                .store(0, Ordering::SeqCst);
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
