//! Filling a host-store block off the writer's thread: reserve, fill, publish.
//!
//! [`crate::HostStore::insert`] copies an adapter's bytes on the thread that calls it; in
//! the server that is the engine thread, and a 76 MB adapter costs it ~17 ms. So an insert
//! is split in three, each on the thread it fits:
//!
//! 1. **reserve** ([`crate::HostStore::reserve`], writer, O(layers)): validates the shapes,
//!    takes an index slot and an arena range, writes the block's descriptor table, and
//!    leaves the entry `WRITING`. Returns a [`StoreFill`].
//! 2. **fill** ([`StoreFill::fill`], any thread, O(bytes)): copies A and B of every
//!    (layer, module) into the ranges the reservation placed, then marks the fill done. The
//!    token owns a reference to the mapping, so it stays valid even if the store is dropped.
//! 3. **publish** ([`crate::HostStore::settle`], writer, O(1) per fill): a filled
//!    reservation's entry becomes `LIVE` exactly as an insert's does.
//!
//! A fill token dropped without filling (the loader failed, the thread died) marks the
//! reservation *abandoned*; removing a reservation before its fill finished marks it
//! *cancelled*. Either way the writer frees its slot and range at the next `settle` after
//! the token is gone, so the fill never writes into space given to another adapter, and the
//! space is freed exactly once. While filling, the entry is `WRITING`: readers fail to lease
//! it (they check for `LIVE` after taking their lease), and its (id, generation) are not yet
//! in the entry, so no lookup finds it.
//!
//! The token's status word is private to this process (readers never see it): `PENDING`
//! until the fill sets `STARTED` (compare-exchange from exactly `PENDING`), then `FILLED`
//! (Release, after its last byte), or its drop sets `ABANDONED`; the writer reads it with
//! Acquire before publishing or freeing. Cancelling sets `CANCELLED`: a fill not yet started
//! (queued behind others while its adapter landed on the device) can then never start, so
//! its space is freed at once and it copies nothing; a running fill checks the bit before
//! each (layer, module) and stops, and its space is freed when its token is gone.
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::error::{IpcError, Result};
use crate::store_writer::LayerModuleWeights;
use crate::sys::Mapping;
use crate::types::{AdapterHandle, DType, LayerIdx, Module};

/// Status bits. STARTED, FILLED and ABANDONED are the token's (FILLED or ABANDONED is its
/// last word); CANCELLED is the writer's. A fill starts only from exactly PENDING, so once the
/// writer has set CANCELLED on a status without STARTED, that token never writes a byte.
pub(crate) const PENDING: u32 = 0;
pub(crate) const FILLED: u32 = 1;
pub(crate) const ABANDONED: u32 = 2;
pub(crate) const CANCELLED: u32 = 4;
pub(crate) const STARTED: u32 = 8;

/// Whether the writer may free a reservation with status `st` (`cancelled`: it removed it):
/// the token said its last word, or it was cancelled before its fill started.
pub(crate) fn writer_may_free(st: u32, cancelled: bool) -> bool {
    st & (FILLED | ABANDONED) != 0 || (cancelled && st & STARTED == 0)
}

/// Where one (layer, module)'s factors go: what the reservation was sized for.
#[derive(Debug, Clone)]
pub(crate) struct Place {
    pub layer: LayerIdx,
    pub module: Module,
    pub rank: u32,
    pub dtype: DType,
    /// Absolute offsets in the mapping.
    pub a: Range<usize>,
    pub b: Range<usize>,
}

/// The right to write one reserved, unpublished adapter block, from any thread. Obtained
/// from [`crate::HostStore::reserve`]; the writer publishes the adapter at its next
/// [`crate::HostStore::settle`] after [`StoreFill::fill`] returned `Ok`.
pub struct StoreFill {
    map: Arc<Mapping>,
    handle: AdapterHandle,
    places: Vec<Place>,
    status: Arc<AtomicU32>,
    /// Set once FILLED is stored, so the drop does not abandon.
    filled: bool,
}

impl std::fmt::Debug for StoreFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreFill")
            .field("handle", &self.handle)
            .field("parts", &self.places.len())
            .finish()
    }
}

impl StoreFill {
    pub(crate) fn new(
        map: Arc<Mapping>,
        handle: AdapterHandle,
        places: Vec<Place>,
        status: Arc<AtomicU32>,
    ) -> Self {
        Self {
            map,
            handle,
            places,
            status,
            filled: false,
        }
    }

    /// The handle the adapter will be published under.
    pub fn handle(&self) -> AdapterHandle {
        self.handle
    }

    /// Copies every (layer, module)'s bytes into the reservation and marks it filled.
    /// `weights` must be what the reservation was made for (same order, shapes and dtypes);
    /// anything else is an error and abandons the reservation, nothing published. If the
    /// writer cancelled the reservation, stops early (`Ok`): there is nothing to publish.
    pub fn fill(self, weights: &[LayerModuleWeights<'_>]) -> Result<()> {
        self.fill_with(weights, || {})
    }

    /// [`StoreFill::fill`], calling `between` after each (layer, module)'s bytes: the filling
    /// thread paces itself there (a chunk of a few MB at most) against the host's other work.
    pub fn fill_with(
        self,
        weights: &[LayerModuleWeights<'_>],
        between: impl FnMut(),
    ) -> Result<()> {
        self.fill_copying(weights, |d, s| d.copy_from_slice(s), between)
    }

    /// [`StoreFill::fill_with`], moving the bytes with `copy(dst, src)` (same lengths), which
    /// must leave `dst` equal to `src`: e.g. a copy that bypasses the caches.
    pub fn fill_copying(
        mut self,
        weights: &[LayerModuleWeights<'_>],
        mut copy: impl FnMut(&mut [u8], &[u8]),
        mut between: impl FnMut(),
    ) -> Result<()> {
        self.check(weights)?;
        let start =
            self.status
                .compare_exchange(PENDING, STARTED, Ordering::AcqRel, Ordering::Acquire);
        if start.is_err() {
            // Cancelled before it started: the writer may have given the space away already.
            return Ok(());
        }
        for (p, w) in self.places.iter().zip(weights) {
            if self.status.load(Ordering::Acquire) & CANCELLED != 0 {
                return Ok(()); // dropping `self` abandons it; the writer frees the space
            }
            // SAFETY: `p.a`/`p.b` lie in the block the writer took from its free list for
            // this reservation alone (disjoint from every other block, live or reserved).
            // The entry is WRITING, so no reader leases it. The status holds STARTED (set
            // above from exactly PENDING), so the writer neither reads nor frees the block
            // until this token sets FILLED or ABANDONED (in `Drop`), after these slices are
            // gone (`writer_may_free`). The mapping is kept alive by `self.map`.
            unsafe {
                copy(self.map.slice_mut::<u8>(p.a.start, p.a.len()), w.a_bytes);
                copy(self.map.slice_mut::<u8>(p.b.start, p.b.len()), w.b_bytes);
            }
            between();
        }
        // Release: every byte above happens-before the writer's Acquire load that publishes.
        self.status.fetch_or(FILLED, Ordering::Release);
        self.filled = true;
        Ok(())
    }

    fn check(&self, weights: &[LayerModuleWeights<'_>]) -> Result<()> {
        if weights.len() != self.places.len() {
            return Err(IpcError::BadWeights {
                layer: 0,
                module: 0,
                reason: format!(
                    "{} (layer, module)s given to fill a reservation made for {}",
                    weights.len(),
                    self.places.len()
                ),
            });
        }
        for (p, w) in self.places.iter().zip(weights) {
            let same = p.layer == w.layer
                && p.module == w.module
                && p.rank == w.rank
                && p.dtype == w.dtype
                && p.a.len() == w.a_bytes.len()
                && p.b.len() == w.b_bytes.len();
            if !same {
                return Err(IpcError::BadWeights {
                    layer: w.layer.0,
                    module: w.module.index() as u32,
                    reason: "does not match the reservation it fills (order, shape or dtype)"
                        .into(),
                });
            }
        }
        Ok(())
    }
}

impl Drop for StoreFill {
    fn drop(&mut self) {
        // Any exit but a finished fill abandons the reservation. Release: no write of this
        // token follows, so the writer may free the space once it reads this.
        if !self.filled {
            self.status.fetch_or(ABANDONED, Ordering::Release);
        }
    }
}
