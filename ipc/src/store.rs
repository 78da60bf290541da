//! The host adapter store, reader side: an index of adapters over an arena of weights in
//! shared memory, readable zero-copy from any process that maps the segment.
//!
//! Layout (offsets from the segment start):
//!
//! ```text
//! 4096    index   max_adapters × 64 B entries: state u32, n_layers u32, id u64,
//!                 generation u64, alloc_off u64, alloc_len u64 (all atomics)
//! leases          max_adapters × max_readers × u32 lease counters (entry-major)
//! arena           capacity bytes (page aligned). One block per adapter:
//!                 n_layers × 7 ModuleDesc, then for each present (layer, module)
//!                 A [rank, d_in] and B [d_out, rank] in the stored dtype, 64 B aligned
//! ```
//!
//! **Publication protocol** (chosen: immutable-once-published + reader leases). The writer
//! fills a block nobody can reach (entry state `WRITING`), then stores `LIVE` (SeqCst). A
//! reader increments its lease counter for the entry, *then* loads the state (both SeqCst)
//! and the identity; anything but `LIVE` with the expected id/generation drops the lease
//! and fails. A `LIVE` entry's bytes are never written. Removal stores `RETIRED`; the block
//! is reclaimed (entry `FREE`, bytes reusable) only when every lease counter of the entry
//! reads zero. In SeqCst order either the writer sees the reader's lease, or the reader sees
//! `RETIRED` and never touches the bytes — so no reader ever sees a half-written or
//! recycled adapter. Leases are counted per reader slot so the engine can drop those of a
//! worker that died ([`crate::HostStore::release_reader`]). The writer may leave the filling
//! of a `WRITING` block to another thread ([`crate::HostStore::reserve`]): the entry goes
//! `LIVE` only once that thread said it wrote the last byte.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

use crate::error::{IpcError, Result};
use crate::segment::{Segment, SegmentKind, HEADER_LEN};
use crate::types::NUM_MODULES;
use crate::types::{AdapterHandle, AdapterId, DType, Generation, LayerIdx, Module, ReaderSlot};

pub(crate) const FREE: u32 = 0;
pub(crate) const WRITING: u32 = 1;
pub(crate) const LIVE: u32 = 2;
pub(crate) const RETIRED: u32 = 3;

/// [`ModuleDesc::present`]: A and B are in the arena at `a_off`/`b_off` (segment offsets).
pub(crate) const IN_ARENA: u32 = 1;
/// [`ModuleDesc::present`]: A and B are in the adapter's safetensors file at `a_off`/`b_off`
/// (file offsets; see `crate::store_file`).
pub(crate) const IN_FILE: u32 = 2;

const ENTRY: usize = 64;
const E_STATE: usize = 0;
const E_LAYERS: usize = 4;
const E_ID: usize = 8;
const E_GEN: usize = 16;
const E_OFF: usize = 24;
const E_LEN: usize = 32;

/// Capacities of a host store. Stored in the segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// Arena bytes for weights and descriptors.
    pub capacity_bytes: u64,
    /// Index slots (live adapters plus those awaiting reclaim).
    pub max_adapters: u32,
    /// Reader slots (slot 0 is the writer's own process; one per worker after that).
    pub max_readers: u32,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            capacity_bytes: 1 << 30,
            max_adapters: 256,
            max_readers: 65,
        }
    }
}

/// Per (layer, module) descriptor at the start of an adapter's block. Offsets are from the
/// segment start.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub(crate) struct ModuleDesc {
    pub present: u32,
    pub rank: u32,
    pub dtype: u32,
    pub d_in: u32,
    pub d_out: u32,
    pub scale: f32,
    pub a_off: u64,
    pub b_off: u64,
    pub _pad: u64,
}

pub(crate) const DESC: usize = std::mem::size_of::<ModuleDesc>();

/// Offsets of a host store's regions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StoreLayout {
    pub index: usize,
    pub leases: usize,
    pub arena: usize,
    pub total: usize,
}

impl StoreLayout {
    pub(crate) fn new(cfg: &StoreConfig) -> Result<Self> {
        let too_big = || IpcError::InvalidConfig(format!("{cfg:?} does not fit in memory"));
        if cfg.max_adapters == 0 || cfg.max_readers == 0 {
            return Err(IpcError::InvalidConfig(
                "max_adapters and max_readers must be >= 1".into(),
            ));
        }
        let index = HEADER_LEN;
        let leases = index
            + (cfg.max_adapters as usize)
                .checked_mul(ENTRY)
                .ok_or_else(too_big)?;
        let n_leases = (cfg.max_adapters as usize)
            .checked_mul(cfg.max_readers as usize)
            .and_then(|n| n.checked_mul(4))
            .ok_or_else(too_big)?;
        let arena = (leases + n_leases).div_ceil(4096) * 4096;
        let cap = usize::try_from(cfg.capacity_bytes).map_err(|_| too_big())?;
        let total = arena.checked_add(cap).ok_or_else(too_big)?;
        Ok(Self {
            index,
            leases,
            arena,
            total,
        })
    }
}

/// One (layer, module) of a leased adapter: its shape and its A/B bytes in the stored dtype.
#[derive(Debug, Clone, Copy)]
pub struct LoraWeights<'a> {
    /// Rank.
    pub rank: u32,
    /// Scale (alpha / rank).
    pub scale: f32,
    /// Stored dtype.
    pub dtype: DType,
    /// Input features.
    pub d_in: u32,
    /// Output features.
    pub d_out: u32,
    /// A, `[rank, d_in]` row-major.
    pub a: &'a [u8],
    /// B, `[d_out, rank]` row-major.
    pub b: &'a [u8],
}

impl<'a> LoraWeights<'a> {
    /// A and B as f32, if that is the stored dtype.
    pub fn f32(&self) -> Option<(&'a [f32], &'a [f32])> {
        (self.dtype == DType::F32)
            .then(|| (bytemuck::cast_slice(self.a), bytemuck::cast_slice(self.b)))
    }

    /// A and B as f16, if that is the stored dtype.
    pub fn f16(&self) -> Option<(&'a [f16], &'a [f16])> {
        (self.dtype == DType::F16)
            .then(|| (bytemuck::cast_slice(self.a), bytemuck::cast_slice(self.b)))
    }

    /// A and B as bf16, if that is the stored dtype.
    pub fn bf16(&self) -> Option<(&'a [bf16], &'a [bf16])> {
        (self.dtype == DType::BF16)
            .then(|| (bytemuck::cast_slice(self.a), bytemuck::cast_slice(self.b)))
    }
}

/// A read lease on one adapter: while it lives, the adapter's bytes stay valid and
/// unchanged even if the writer removes it. Released on drop.
#[derive(Debug)]
pub struct AdapterLease<'a> {
    pub(crate) store: &'a StoreReader,
    handle: AdapterHandle,
    pub(crate) n_layers: u32,
    pub(crate) block: (usize, usize),
}

impl<'a> AdapterLease<'a> {
    /// The leased adapter.
    pub fn handle(&self) -> AdapterHandle {
        self.handle
    }

    /// Layers the adapter covers (`0..n_layers`; some (layer, module) may be absent).
    pub fn n_layers(&self) -> u32 {
        self.n_layers
    }

    /// The weights of (layer, module), or `None` if the adapter does not target it.
    pub fn module(&self, layer: LayerIdx, module: Module) -> Option<LoraWeights<'_>> {
        self.weights(layer, module)
    }

    /// Like [`AdapterLease::module`] but borrowing the store, not the lease: only for
    /// [`LoraView`], which keeps the lease alive next to the weights.
    fn weights(&self, layer: LayerIdx, module: Module) -> Option<LoraWeights<'a>> {
        if layer.0 >= self.n_layers {
            return None;
        }
        let (start, len) = self.block;
        let map: &'a crate::sys::Mapping = self.store.seg.mapping();
        let at = start + (layer.0 as usize * NUM_MODULES + module.index()) * DESC;
        // SAFETY: we hold a lease on an entry we saw LIVE (SeqCst, after taking the lease),
        // so its block was fully written before publication and is not written again until
        // our lease is dropped; the descriptor table lies inside the block (checked below
        // for the weights, and by n_layers * 7 * DESC <= alloc_len at insert).
        let d = unsafe { map.slice::<ModuleDesc>(at, 1) }[0];
        // Absent, or in the adapter's file rather than the arena (`crate::store_file`).
        if d.present != IN_ARENA {
            return None;
        }
        let dtype = DType::from_code(d.dtype)?;
        let a_len = d.rank as usize * d.d_in as usize * dtype.size();
        let b_len = d.rank as usize * d.d_out as usize * dtype.size();
        let inside = |off: u64, n: usize| {
            (off as usize) >= start
                && (off as usize)
                    .checked_add(n)
                    .is_some_and(|e| e <= start + len)
        };
        if !inside(d.a_off, a_len)
            || !inside(d.b_off, b_len)
            || d.a_off % 64 != 0
            || d.b_off % 64 != 0
        {
            return None;
        }
        // SAFETY: as above — both ranges are inside the leased, immutable block.
        let (a, b) = unsafe {
            (
                map.slice::<u8>(d.a_off as usize, a_len),
                map.slice::<u8>(d.b_off as usize, b_len),
            )
        };
        Some(LoraWeights {
            rank: d.rank,
            scale: d.scale,
            dtype,
            d_in: d.d_in,
            d_out: d.d_out,
            a,
            b,
        })
    }
}

impl Drop for AdapterLease<'_> {
    fn drop(&mut self) {
        self.store.lease_word(self.handle.slot).fetch_sub(1, SeqCst);
    }
}

/// One (layer, module) view that carries its own lease ([`StoreReader::view`]).
#[derive(Debug)]
pub struct LoraView<'a> {
    weights: LoraWeights<'a>,
    _lease: AdapterLease<'a>,
}

impl<'a> std::ops::Deref for LoraView<'a> {
    type Target = LoraWeights<'a>;
    fn deref(&self) -> &LoraWeights<'a> {
        &self.weights
    }
}

/// A mapping of a host store, for looking adapters up and reading them. The writer
/// ([`crate::HostStore`]) derefs to one; a worker opens its own with [`StoreReader::open`].
#[derive(Debug)]
pub struct StoreReader {
    pub(crate) seg: Segment,
    pub(crate) cfg: StoreConfig,
    pub(crate) layout: StoreLayout,
    reader: ReaderSlot,
}

impl StoreReader {
    /// Wraps a host-store segment (received as an fd) for reader slot `reader`. Each process
    /// must use its own slot (the engine assigns them; slot 0 is the writer's).
    pub fn open(seg: Segment, reader: ReaderSlot) -> Result<Self> {
        if seg.kind() != SegmentKind::HostStore {
            return Err(IpcError::KindMismatch {
                found: seg.header().kind,
                expected: SegmentKind::HostStore,
            });
        }
        let w = seg.config_words();
        let cfg = StoreConfig {
            capacity_bytes: w[0],
            max_adapters: u32::try_from(w[1])
                .map_err(|_| IpcError::CorruptHeader("max_adapters".into()))?,
            max_readers: u32::try_from(w[2])
                .map_err(|_| IpcError::CorruptHeader("max_readers".into()))?,
        };
        let layout = StoreLayout::new(&cfg).map_err(|e| IpcError::CorruptHeader(e.to_string()))?;
        if layout.total > seg.len() {
            return Err(IpcError::CorruptHeader(format!(
                "store needs {} bytes, segment has {}",
                layout.total,
                seg.len()
            )));
        }
        if reader.0 >= cfg.max_readers {
            return Err(IpcError::NoSuchReader {
                slot: reader.0,
                max: cfg.max_readers,
            });
        }
        Ok(Self {
            seg,
            cfg,
            layout,
            reader,
        })
    }

    pub(crate) fn config_words(cfg: &StoreConfig) -> [u64; 3] {
        [
            cfg.capacity_bytes,
            u64::from(cfg.max_adapters),
            u64::from(cfg.max_readers),
        ]
    }

    /// The segment (to hand its fd to workers).
    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Capacities.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    pub(crate) fn entry_u32(&self, slot: u32, field: usize) -> &AtomicU32 {
        self.seg
            .atomic_u32(self.layout.index + slot as usize * ENTRY + field)
    }

    pub(crate) fn entry_u64(&self, slot: u32, field: usize) -> &AtomicU64 {
        self.seg
            .atomic_u64(self.layout.index + slot as usize * ENTRY + field)
    }

    pub(crate) fn lease_word_of(&self, slot: u32, reader: u32) -> &AtomicU32 {
        let i = slot as usize * self.cfg.max_readers as usize + reader as usize;
        self.seg.atomic_u32(self.layout.leases + 4 * i)
    }

    fn lease_word(&self, slot: u32) -> &AtomicU32 {
        self.lease_word_of(slot, self.reader.0)
    }

    pub(crate) fn state(&self, slot: u32) -> u32 {
        self.entry_u32(slot, E_STATE).load(SeqCst)
    }

    pub(crate) fn set_entry(
        &self,
        slot: u32,
        state: u32,
        fields: Option<(AdapterHandle, u32, u64, u64)>,
    ) {
        if let Some((h, n_layers, off, len)) = fields {
            self.entry_u32(slot, E_LAYERS).store(n_layers, SeqCst);
            self.entry_u64(slot, E_ID).store(h.id.0, SeqCst);
            self.entry_u64(slot, E_GEN).store(h.generation.0, SeqCst);
            self.entry_u64(slot, E_OFF).store(off, SeqCst);
            self.entry_u64(slot, E_LEN).store(len, SeqCst);
        }
        self.entry_u32(slot, E_STATE).store(state, SeqCst);
    }

    /// The live adapter (id, generation), if any.
    pub fn lookup(&self, id: AdapterId, generation: Generation) -> Option<AdapterHandle> {
        (0..self.cfg.max_adapters).find_map(|slot| {
            let live = self.state(slot) == LIVE
                && self.entry_u64(slot, E_ID).load(SeqCst) == id.0
                && self.entry_u64(slot, E_GEN).load(SeqCst) == generation.0;
            live.then_some(AdapterHandle {
                id,
                generation,
                slot,
                _pad: 0,
            })
        })
    }

    /// Whether `handle`'s adapter is published: `LIVE` under its id and generation. One
    /// reserved and still filling ([`crate::HostStore::reserve`]) is not. O(1).
    pub fn is_live(&self, handle: AdapterHandle) -> bool {
        handle.slot < self.cfg.max_adapters
            && self.state(handle.slot) == LIVE
            && self.entry_u64(handle.slot, E_ID).load(SeqCst) == handle.id.0
            && self.entry_u64(handle.slot, E_GEN).load(SeqCst) == handle.generation.0
    }

    /// Takes a read lease on `handle`'s adapter; `None` if it is gone or being replaced.
    pub fn lease(&self, handle: AdapterHandle) -> Option<AdapterLease<'_>> {
        if handle.slot >= self.cfg.max_adapters {
            return None;
        }
        let s = handle.slot;
        self.lease_word(s).fetch_add(1, SeqCst);
        let mut lease = AdapterLease {
            store: self,
            handle,
            n_layers: 0,
            block: (0, 0),
        };
        if self.state(s) != LIVE
            || self.entry_u64(s, E_ID).load(SeqCst) != handle.id.0
            || self.entry_u64(s, E_GEN).load(SeqCst) != handle.generation.0
        {
            return None; // dropping `lease` gives the count back
        }
        let off = self.entry_u64(s, E_OFF).load(SeqCst);
        let len = self.entry_u64(s, E_LEN).load(SeqCst);
        let n_layers = self.entry_u32(s, E_LAYERS).load(SeqCst);
        let start = self.layout.arena as u64 + off;
        let end = start.checked_add(len)?;
        let descs = n_layers as u64 * (NUM_MODULES * DESC) as u64;
        if end > self.layout.total as u64 || descs > len {
            return None;
        }
        lease.n_layers = n_layers;
        lease.block = (start as usize, len as usize);
        Some(lease)
    }

    /// A leased view of (layer, module) of `handle`'s adapter.
    pub fn view(
        &self,
        handle: AdapterHandle,
        layer: LayerIdx,
        module: Module,
    ) -> Option<LoraView<'_>> {
        let lease = self.lease(handle)?;
        let weights = lease.weights(layer, module)?;
        Some(LoraView {
            weights,
            _lease: lease,
        })
    }
}
