//! The machine's real host → device link, measured once for the cold-start cost model.
use std::time::Instant;

use super::{CudaBackend, CudaError};
use crate::backend::any::GpuExtras;
use crate::error::Result;
use crate::residency::LinkModel;

/// Bytes of the bandwidth probe: large enough that the per-copy latency is noise.
const PROBE_BYTES: usize = 64 << 20;

impl CudaBackend {
    /// Pinned host → device bandwidth (best of three 64 MiB copies on a fresh stream) and the
    /// latency of a 4 KiB copy.
    pub fn measure_link(&self) -> Result<LinkModel, CudaError> {
        let ctx = self.stream().context().clone();
        let s = ctx.new_stream()?;
        // SAFETY: the pinned buffer's contents are never read as values: only its bytes are
        // copied to measure the link.
        let pinned = unsafe { ctx.alloc_pinned::<u8>(PROBE_BYTES) }?;
        let mut dst = s.alloc_zeros::<u8>(PROBE_BYTES)?;
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            s.memcpy_htod(&pinned, &mut dst)?;
            s.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        // SAFETY: as above, only the bytes are copied.
        let small = unsafe { ctx.alloc_pinned::<u8>(4096) }?;
        let mut small_dst = s.alloc_zeros::<u8>(4096)?;
        let mut lat = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            s.memcpy_htod(&small, &mut small_dst)?;
            s.synchronize()?;
            lat = lat.min(t.elapsed().as_secs_f64());
        }
        Ok(LinkModel {
            gbps: PROBE_BYTES as f64 / best / 1e9,
            latency_us: lat * 1e6,
        })
    }
}

impl GpuExtras for CudaBackend {
    fn measured_link(&self) -> LinkModel {
        self.measure_link().unwrap_or_else(|e| {
            tracing::warn!("measuring the host → device link failed ({e}); assuming PCIe 4.0 x16");
            LinkModel::default()
        })
    }

    fn check(&mut self) -> Result<()> {
        CudaBackend::check(self)
    }

    fn start_upload(&mut self, bytes: usize) -> Result<()> {
        CudaBackend::start_upload(self, bytes)
    }

    fn link_backlog(&self) -> u64 {
        CudaBackend::link_backlog(self)
    }

    fn memory_info(&self) -> Result<(u64, u64)> {
        // Waits for queued work first, so frees and allocations already issued are counted.
        self.stream().synchronize().map_err(CudaError::from)?;
        let (free, total) = self
            .stream()
            .context()
            .mem_get_info()
            .map_err(CudaError::from)?;
        Ok((free as u64, total as u64))
    }
}
