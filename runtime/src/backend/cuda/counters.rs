//! The CUDA backend's running [`DeviceCounts`]: every kernel launch, cuBLAS product, graph
//! launch, allocation, copy and synchronisation the compute stream's code makes through
//! [`Gpu`]'s helpers below is counted here (relaxed atomics: a few ns each, against µs of
//! driver call). Not counted: model and adapter uploads at load (`weights.rs`, the upload
//! pipeline's copy stream) and the eager logits copy (`try_logits`: one device → host copy
//! and one synchronisation a step, by construction).
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::launch::Gpu;
use super::{CudaBackend, CudaError};
use crate::backend::device_counts::DeviceCounts;

/// Running totals, one field per [`DeviceCounts`] field.
#[derive(Default)]
pub(super) struct Counters {
    launches: AtomicU64,
    gemms: AtomicU64,
    lt_products: AtomicU64,
    bias_epilogues: AtomicU64,
    graph_launches: AtomicU64,
    allocs: AtomicU64,
    alloc_bytes: AtomicU64,
    htod: AtomicU64,
    htod_bytes: AtomicU64,
    dtoh: AtomicU64,
    dtoh_bytes: AtomicU64,
    syncs: AtomicU64,
}

impl Counters {
    pub fn launch(&self) {
        self.launches.fetch_add(1, Relaxed);
    }

    pub fn gemm(&self) {
        self.gemms.fetch_add(1, Relaxed);
    }

    /// A cuBLASLt product (also counted in [`Counters::gemm`]); `bias`: its epilogue added
    /// the bias, one `add_bias` launch saved.
    pub fn lt_product(&self, bias: bool) {
        self.lt_products.fetch_add(1, Relaxed);
        self.bias_epilogues.fetch_add(u64::from(bias), Relaxed);
    }

    pub fn graph_launch(&self) {
        self.graph_launches.fetch_add(1, Relaxed);
    }

    pub fn alloc(&self, bytes: usize) {
        self.allocs.fetch_add(1, Relaxed);
        self.alloc_bytes.fetch_add(bytes as u64, Relaxed);
    }

    pub fn htod(&self, bytes: usize) {
        self.htod.fetch_add(1, Relaxed);
        self.htod_bytes.fetch_add(bytes as u64, Relaxed);
    }

    pub fn dtoh(&self, bytes: usize) {
        self.dtoh.fetch_add(1, Relaxed);
        self.dtoh_bytes.fetch_add(bytes as u64, Relaxed);
    }

    pub fn sync(&self) {
        self.syncs.fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> DeviceCounts {
        DeviceCounts {
            launches: self.launches.load(Relaxed),
            gemms: self.gemms.load(Relaxed),
            lt_products: self.lt_products.load(Relaxed),
            bias_epilogues: self.bias_epilogues.load(Relaxed),
            graph_launches: self.graph_launches.load(Relaxed),
            allocs: self.allocs.load(Relaxed),
            alloc_bytes: self.alloc_bytes.load(Relaxed),
            htod: self.htod.load(Relaxed),
            htod_bytes: self.htod_bytes.load(Relaxed),
            dtoh: self.dtoh.load(Relaxed),
            dtoh_bytes: self.dtoh_bytes.load(Relaxed),
            syncs: self.syncs.load(Relaxed),
        }
    }
}

impl Gpu {
    /// A zeroed device buffer of `n` elements on the compute stream (counted).
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.counters.alloc(n * std::mem::size_of::<T>());
        Ok(self.stream.alloc_zeros::<T>(n)?)
    }

    /// A device buffer of `n` elements whose contents are unset (counted).
    ///
    /// # Safety
    /// The caller writes every element before any kernel or copy reads it.
    pub unsafe fn alloc_uninit<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        self.counters.alloc(n * std::mem::size_of::<T>());
        // SAFETY: forwarded to the caller (see `# Safety`).
        Ok(unsafe { self.stream.alloc::<T>(n) }?)
    }

    /// Copies `src` (pageable host memory) into `dst` on the compute stream (counted).
    pub fn htod<T: DeviceRepr>(
        &self,
        src: &[T],
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), CudaError> {
        self.counters.htod(std::mem::size_of_val(src));
        Ok(self.stream.memcpy_htod(src, dst)?)
    }

    /// Copies `src` into the host slice `dst` on the compute stream (counted); the copy is
    /// complete only after [`Gpu::sync`].
    pub fn dtoh<T: DeviceRepr>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut [T],
    ) -> Result<(), CudaError> {
        self.counters.dtoh(std::mem::size_of_val(dst));
        Ok(self.stream.memcpy_dtoh(src, dst)?)
    }

    /// Waits for everything queued on the compute stream (counted).
    pub fn sync(&self) -> Result<(), CudaError> {
        self.counters.sync();
        Ok(self.stream.synchronize()?)
    }
}

impl CudaBackend {
    /// The running totals of what this backend asked of the driver on its compute stream
    /// (see [`DeviceCounts`]); take two and [`DeviceCounts::since`] for an interval.
    pub fn device_counts(&self) -> DeviceCounts {
        self.gpu.counters.snapshot()
    }
}
