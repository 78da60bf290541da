//! What a backend supplies to the upload pipeline: page-locked host memory for the arena, an
//! asynchronous host → device copy that signals an event, and an event query. Everything
//! else (the arena, the loader threads, the per-layer queue) is the pipeline's, the same for
//! every backend.
use std::ptr::NonNull;
use std::time::Instant;

use crate::error::{Result, RuntimeError};
use crate::residency::LinkModel;

/// The arena's memory: one allocation, made once at start-up, page-locked where the backend
/// needs that for DMA (registered with the driver once on CUDA).
pub struct PinnedMemory {
    ptr: NonNull<u8>,
    len: usize,
    /// Keeps the memory (and its registration) alive; dropped after the pipeline's threads.
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: the pipeline's plan hands out disjoint ranges: a loader thread writes a layer's range
// only while the plan marks it encoding, and a copy reads it only after that write finished
// and before the range is freed, so no two threads race on a byte.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above; shared access is only through raw pointers under that protocol.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// Memory the backend allocated (and pinned): `len` bytes at `ptr`, valid while `owner`
    /// lives.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be writable memory owned by `owner` and valid until it is dropped,
    /// and nothing else may access it meanwhile.
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: usize, owner: Box<dyn Send + Sync>) -> Self {
        Self {
            ptr,
            len,
            _owner: owner,
        }
    }

    /// Anonymous memory mapped for `len` bytes, reserving no swap: pages are committed as they
    /// are written, so a large arena (a generous `--max-cpu-lora-bytes`) costs what its
    /// adapters fill. The CPU backend's arena.
    pub fn anonymous(len: usize) -> Result<Self> {
        let mut map = memmap2::MmapOptions::new()
            .len(len.max(1))
            .no_reserve_swap()
            .map_anon()
            .map_err(|e| {
                RuntimeError::Backend(format!(
                    "allocating the {len}-byte host upload arena failed ({e}); lower \
                 --max-cpu-lora-bytes"
                ))
            })?;
        let ptr = NonNull::new(map.as_mut_ptr()).expect("mmap returns a non-null address");
        // SAFETY: the mapping is `len` writable bytes that live as long as the owner (moving
        // an MmapMut does not move its pages), and only the pipeline touches it.
        Ok(unsafe { Self::from_raw(ptr, len, Box::new(map)) })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The base address (for registration and DMA).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// `len` bytes of the arena at `off`, mutable.
    ///
    /// # Safety
    /// `off..off+len` must be inside the arena and, per the plan, written by this thread
    /// alone and read by nobody until the write is reported done.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len, "arena write out of bounds");
        // SAFETY: in bounds (checked); exclusive per this function's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

/// A backend's copy engine: the only three things the pipeline needs from it.
pub trait CopyDevice: Send + Sync + 'static {
    /// An adapter's device allocation, which copies fill.
    type Dst: Send + Sync + 'static;
    /// Signals that the copies queued before it have completed.
    type Event: Send;

    /// The arena: `bytes` of host memory the device can copy from asynchronously.
    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedMemory>;

    /// Queues a copy of `len` bytes at `src` into `dst` at byte `offset`, on the device's copy
    /// stream (behind the copies queued before it), and returns an event recorded after it.
    ///
    /// # Safety
    /// `src..src+len` must lie in memory from [`CopyDevice::alloc_pinned`] and stay valid and
    /// unchanged until the event completes; `dst` must hold `offset + len` bytes.
    unsafe fn copy_async(
        &self,
        src: *const u8,
        len: usize,
        dst: &Self::Dst,
        offset: usize,
    ) -> Result<Self::Event>;

    /// Whether the copies before `event` have completed (never blocks).
    fn query(&self, event: &Self::Event) -> bool;

    /// Blocks the calling (copy) thread until `event` completes.
    fn wait(&self, event: &Self::Event) -> Result<()>;

    /// Whether loader threads write the device image into the arena (always, for a real
    /// device: the copy reads it). Only the emulated link may skip it, for attribution runs.
    fn writes_image(&self) -> bool {
        true
    }
}

/// The CPU backend's link: the DMA is emulated (each copy completes `latency + bytes /
/// bandwidth` after the previous one, in wall-clock time, with no core burned: a DMA costs the
/// host no CPU), everything else is the real pipeline. "Device memory" is host memory (the CPU
/// backend computes from the host copy), so a copy has no destination and copies no byte.
///
/// `THAW_UPLOAD_ENCODE=0` makes the loader threads skip writing the image into the arena (the
/// one copy of an adapter's bytes a GPU host pays too): an attribution switch for
/// `thaw-bench upload-stall`, never a configuration.
#[derive(Debug)]
pub struct EmulatedLink {
    link: LinkModel,
    /// When the last queued copy completes: copies are back to back on one link, and an idle
    /// link starts afresh.
    clock: std::sync::Mutex<Instant>,
    write_image: bool,
}

impl EmulatedLink {
    pub fn new(link: LinkModel) -> Self {
        Self {
            link,
            clock: std::sync::Mutex::new(Instant::now()),
            write_image: !thaw_kernels::cpu::switched_off("THAW_UPLOAD_ENCODE"),
        }
    }

    pub fn link(&self) -> LinkModel {
        self.link
    }
}

impl CopyDevice for EmulatedLink {
    type Dst = ();
    type Event = Instant;

    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedMemory> {
        PinnedMemory::anonymous(bytes)
    }

    unsafe fn copy_async(
        &self,
        _src: *const u8,
        len: usize,
        _dst: &(),
        _off: usize,
    ) -> Result<Instant> {
        let mut clock = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        *clock = (*clock).max(Instant::now()) + self.link.transfer_time(len);
        Ok(*clock)
    }

    fn query(&self, event: &Instant) -> bool {
        Instant::now() >= *event
    }

    fn wait(&self, event: &Instant) -> Result<()> {
        let now = Instant::now();
        if *event > now {
            std::thread::sleep(*event - now);
        }
        Ok(())
    }

    fn writes_image(&self) -> bool {
        self.write_image
    }
}
