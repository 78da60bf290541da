//! The CUDA backend's part of the upload pipeline ([`crate::upload`]): the arena registered as
//! page-locked memory once at start-up, async copies on a copy stream of their own, one event
//! per layer. The pipeline's copy thread issues the copies and waits on the events; the engine
//! thread only reads [`LayerLanding`].
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};

use super::launch::{copy_htod_async, copy_htod_async_to, host_register, host_unregister};
use super::CudaError;
use crate::error::{Result, RuntimeError};
use crate::upload::{CopyDevice, Landing, PinnedMemory};

/// A streamed adapter's landed layers, as the copy thread publishes them.
#[derive(Debug, Default)]
pub struct LayerLanding {
    landed: AtomicUsize,
    /// Why the upload failed, once it has.
    failure: OnceLock<String>,
}

impl LayerLanding {
    /// Layers `0..n` are on the device.
    pub fn landed(&self) -> usize {
        self.landed.load(Ordering::Acquire)
    }

    /// The upload failed: the adapter never becomes resident.
    pub fn failed(&self) -> bool {
        self.failure.get().is_some()
    }

    /// Why the upload failed, if it has.
    pub fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }
}

impl Landing for LayerLanding {
    fn land(&self, layer: usize) {
        let was = self.landed.swap(layer + 1, Ordering::AcqRel);
        assert_eq!(was, layer, "layers land in order, each once");
    }

    fn fail(&self, why: &str) {
        let _ = self.failure.set(why.to_string());
    }
}

/// The copy stream and its context.
pub struct CudaCopy {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl CudaCopy {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        Ok(Self {
            ctx: ctx.clone(),
            stream: ctx.new_stream()?,
        })
    }

    /// Device memory for an adapter image, allocated on the copy stream (so its free is
    /// ordered after the copies that fill it).
    pub fn alloc(&self, bytes: usize) -> Result<CudaDst, CudaError> {
        Ok(CudaDst::Alloc(self.stream.alloc_zeros::<u8>(bytes.max(1))?))
    }

    /// The copy stream (device addresses of allocations are read on it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

/// Where an adapter's image lives on the device.
pub enum CudaDst {
    /// An allocation of its own (the image as one range).
    Alloc(CudaSlice<u8>),
    /// A run of KV blocks ([`crate::upload::ImageLayout::paged`]): the virtual image's region
    /// `r` (`region_len` bytes at `r × region_len`) is the `region_len` bytes at
    /// `regions[r]`, inside layer `r / 2`'s K (even `r`) or V buffer. The lease keeps the
    /// blocks from sequences while this lives, and the engine's KV buffers outlive the
    /// backend, whose upload pipeline finishes every copy before it stops.
    Paged {
        regions: Vec<u64>,
        region_len: usize,
        _lease: crate::kv::blocks::PageLease,
    },
}

impl CudaDst {
    /// The device address of byte `off` of the image.
    pub fn addr(&self, stream: &CudaStream, off: usize) -> u64 {
        match self {
            Self::Alloc(s) => super::launch::dptr(s, stream) + off as u64,
            Self::Paged {
                regions,
                region_len,
                ..
            } => regions[off / region_len] + (off % region_len) as u64,
        }
    }

    /// Bytes of the (virtual) image.
    pub fn len(&self) -> usize {
        match self {
            Self::Alloc(s) => s.len(),
            Self::Paged {
                regions,
                region_len,
                ..
            } => regions.len() * region_len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The arena mapping and its registration; unregisters before the mapping goes.
struct Registered {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    _map: memmap2::MmapMut,
}

// SAFETY: `ptr` is only used to unregister the mapping on drop; the mapping itself is plain
// memory owned here.
unsafe impl Send for Registered {}
// SAFETY: as above: no method reads through `ptr`.
unsafe impl Sync for Registered {}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.synchronize() {
            tracing::warn!("synchronize before unregistering the upload arena failed: {e}");
        }
        // SAFETY: registered in `alloc_pinned`; the context is idle, so no copy reads it.
        unsafe { host_unregister(&self.ctx, self.ptr) };
    }
}

impl CopyDevice for CudaCopy {
    type Dst = CudaDst;
    type Event = CudaEvent;

    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedMemory> {
        let mut map = memmap2::MmapMut::map_anon(bytes.max(1)).map_err(|e| {
            RuntimeError::Backend(format!(
                "allocating the {bytes}-byte host upload arena failed ({e}); lower \
                 --max-cpu-lora-bytes"
            ))
        })?;
        let ptr = map.as_mut_ptr();
        // SAFETY: the mapping is `bytes` long and lives in `Registered`, which unregisters it
        // (after the context is idle) before unmapping it.
        unsafe { host_register(&self.ctx, ptr, map.len(), false) }?;
        let owner = Registered {
            ctx: self.ctx.clone(),
            ptr,
            _map: map,
        };
        let nn = NonNull::new(ptr).expect("mmap returns a non-null address");
        // SAFETY: `bytes` writable bytes owned by `owner` (the mapping does not move when the
        // owner does), accessed only by the pipeline.
        Ok(unsafe { PinnedMemory::from_raw(nn, bytes.max(1), Box::new(owner)) })
    }

    unsafe fn copy_async(
        &self,
        src: *const u8,
        len: usize,
        dst: &CudaDst,
        offset: usize,
    ) -> Result<CudaEvent> {
        self.ctx.bind_to_thread().map_err(CudaError::from)?;
        match dst {
            CudaDst::Alloc(d) if len > 0 => {
                // SAFETY: per the trait's contract, `src..src+len` lies in the registered arena
                // and stays unchanged until the event below completes; `d` holds offset + len
                // bytes.
                unsafe { copy_htod_async(&self.stream, d, offset, src, len) }?;
            }
            CudaDst::Alloc(_) => {}
            CudaDst::Paged { region_len, .. } => {
                assert!(offset + len <= dst.len(), "copy past the adapter's blocks");
                for (at, n) in crate::upload::region_pieces(offset, len, *region_len) {
                    let to = dst.addr(&self.stream, at);
                    // SAFETY: the arena range as above (`at - offset` stays inside it); `to`
                    // lies in the adapter's own run of KV blocks (one region, per `pieces`),
                    // which its lease keeps from sequences and which outlives this copy (the
                    // pipeline holds `dst` until the event completes).
                    unsafe { copy_htod_async_to(&self.stream, to, src.add(at - offset), n) }?;
                }
            }
        }
        Ok(self.stream.record_event(None).map_err(CudaError::from)?)
    }

    fn query(&self, event: &CudaEvent) -> bool {
        event.is_complete()
    }

    fn wait(&self, event: &CudaEvent) -> Result<()> {
        Ok(event.synchronize().map_err(CudaError::from)?)
    }
}
