//! The CPU-assist exchange's host path on the CUDA backend: rows of an activation copied out
//! to the host for the CPU workers ([`Backend::export_rows`](crate::backend::Backend::export_rows))
//! and their deltas merged back into a module output
//! ([`Backend::merge_rows`](crate::backend::Backend::merge_rows)), each through a row index
//! staged on the device. The device-mapped exchange (`exchange.rs`) avoids the host copy
//! where the driver can map the shared segment.
use std::ops::Range;

use cudarc::driver::CudaSlice;

use super::step::DevVec;
use super::{CudaBackend, CudaError};

impl CudaBackend {
    /// Row indices of `rows` into `idx` (staged on the device).
    fn stage_rows(
        gpu: &super::launch::Gpu,
        idx: &mut DevVec<u32>,
        rows: &[Range<usize>],
    ) -> Result<usize, CudaError> {
        idx.host.clear();
        idx.host
            .extend(rows.iter().flat_map(|r| r.clone().map(|i| i as u32)));
        idx.upload(gpu)?;
        Ok(idx.host.len())
    }

    pub(super) fn try_export_host(
        &mut self,
        x: &CudaSlice<f32>,
        width: usize,
        rows: &[Range<usize>],
        dst: &mut [f32],
        stride: usize,
    ) -> Result<(), CudaError> {
        let n = Self::stage_rows(&self.gpu, &mut self.export_idx, rows)?;
        assert!(
            stride >= width && dst.len() >= n.saturating_sub(1) * stride + width,
            "export_rows: dst holds {} < {n} rows of stride {stride}",
            dst.len()
        );
        if n == 0 {
            return Ok(());
        }
        if self
            .host_rows
            .dev
            .as_ref()
            .is_none_or(|d| d.len() < n * width)
        {
            self.host_rows.dev = Some(
                self.gpu
                    .alloc_zeros::<f32>((n * width).next_power_of_two())?,
            );
        }
        let mut staged = self.host_rows.dev.take().expect("sized above");
        let r = self
            .gpu
            .gather_rows(x, self.export_idx.get(), n, width, &mut staged)
            .and_then(|()| {
                let packed = &staged.slice(..n * width);
                if stride == width {
                    self.gpu.dtoh(packed, &mut dst[..n * width])?;
                } else {
                    // One copy into the host staging vector, then rows spread to the stride.
                    let host = &mut self.host_rows.host;
                    host.resize(n * width, 0.0);
                    self.gpu.dtoh(packed, &mut host[..])?;
                }
                self.gpu.sync()
            });
        self.host_rows.dev = Some(staged);
        if stride != width && r.is_ok() {
            for (d, s) in dst
                .chunks_mut(stride)
                .zip(self.host_rows.host.chunks_exact(width))
            {
                d[..width].copy_from_slice(s);
            }
        }
        r
    }

    pub(super) fn try_merge_host(
        &mut self,
        y: &mut CudaSlice<f32>,
        width: usize,
        rows: &[Range<usize>],
        src: &[f32],
        stride: usize,
    ) -> Result<(), CudaError> {
        let n = Self::stage_rows(&self.gpu, &mut self.merge_idx, rows)?;
        assert!(
            stride >= width && src.len() >= n.saturating_sub(1) * stride + width,
            "merge_rows: src holds {} < {n} rows of stride {stride}",
            src.len()
        );
        if n == 0 {
            return Ok(());
        }
        self.host_rows.host.clear();
        self.host_rows
            .host
            .extend(src.chunks(stride).take(n).flat_map(|row| &row[..width]));
        self.host_rows.upload(&self.gpu)?;
        let delta = self.gpu.p(self.host_rows.get());
        // SAFETY: `delta` is device memory holding n × width f32 (just uploaded on this
        // stream, so complete before the kernel runs) that stays allocated: `host_rows` is only
        // reallocated by a later call, after this launch is queued on the same stream.
        unsafe {
            self.gpu
                .merge_deltas(y, width, self.merge_idx.get(), n, (delta, width))
        }
    }
}
