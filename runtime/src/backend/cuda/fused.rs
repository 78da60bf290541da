//! Fused elementwise kernels (issue 29), on by default; `THAW_CUDA_FUSED=0` (read when the
//! backend is created, see [`kernel_select`](crate::backend::kernel_select)) or
//! [`CudaBackend::set_fused`] runs the separate kernels instead.
//!
//! - `add_rms_norm_T` (`norm.cu`): the residual add and the next block's RMSNorm in one pass
//!   over each row ([`Backend::add_rms_norm`](crate::backend::Backend::add_rms_norm)); bit for
//!   bit the two kernels it replaces. With 16-bit weights it also writes its output in the
//!   weight dtype (tagged like SwiGLU's below), so q and gate (and through the linear's own tag
//!   k, v and up) skip their casts.
//! - `swiglu_x16_T` (`elementwise.cu`): SwiGLU that also writes its output in the weight dtype,
//!   so the down projection's GEMM reads it without a separate cast kernel. The backend records
//!   which buffer the 16-bit copy mirrors ([`X16Tag`]); the next op, if it is a `linear` over
//!   exactly that buffer, skips its cast. Any other op in between voids the tag. A `linear`
//!   leaves such a tag too (its own cast of its input, whatever the fused switch): k and v
//!   after q, and up after gate, read q's and gate's cast.
//!
//! CPU twins: `thaw_kernels::cpu::{add_rms_norm, swiglu_x16}`.
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr};
use thaw_kernels::cuda::registry::DType;
use thaw_kernels::cuda::KernelCache;

use super::launch::{blocks, int, launch, Gpu};
use super::{CudaBackend, CudaError};
use crate::error::Result;

/// Which buffer the 16-bit GEMM input scratch mirrors, and when that was written: valid for
/// the op that directly follows (op count `at + 1`) if it reads the same `ptr` and `len`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct X16Tag {
    pub ptr: u64,
    pub len: usize,
    pub at: u64,
}

impl X16Tag {
    /// Whether a linear over (`ptr`, `len`), running as op number `op`, may read the scratch.
    pub fn serves(&self, ptr: u64, len: usize, op: u64) -> bool {
        self.ptr == ptr && self.len == len && self.at + 1 == op
    }
}

/// Whether the byte ranges `(start, len)` `a` and `b` share a byte (empty ranges share none).
pub(super) fn ranges_overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0.saturating_add(b.1) && b.0 < a.0.saturating_add(a.1)
}

/// The resolved fused kernels for one weight dtype.
pub(crate) struct Fused {
    add_norm: CudaFunction,
    /// None for f32 weights (no cast to fuse).
    swiglu16: Option<CudaFunction>,
}

impl Fused {
    pub(super) fn load(ctx: &Arc<CudaContext>, w: DType) -> Result<Self, CudaError> {
        let cache = KernelCache::global();
        let f = |name: &str| cache.function(ctx, name).map_err(CudaError::from);
        Ok(Self {
            add_norm: f(&format!("add_rms_norm_{}", w.suffix()))?,
            swiglu16: match w {
                DType::F32 => None,
                DType::Bf16 | DType::F16 => Some(f(&format!("swiglu_x16_{}", w.suffix()))?),
            },
        })
    }
}

impl Gpu {
    /// The device address of the 16-bit GEMM input scratch `x16`, grown to at least `n`
    /// elements first (its contents are unset when grown).
    ///
    /// # Safety
    /// The caller's next kernel writes the first `n` elements before anything reads them.
    pub(super) unsafe fn x16_ptr(
        &self,
        x16: &mut Option<CudaSlice<u16>>,
        n: usize,
    ) -> Result<u64, CudaError> {
        if x16.as_ref().is_none_or(|b| b.len() < n) {
            // SAFETY: written before it is read (this function's contract).
            *x16 = Some(unsafe { self.alloc_uninit::<u16>(n.max(1)) }?);
        }
        Ok(x16.as_ref().map_or(0, |b| self.p(b)))
    }

    /// residual += x; out = rms_norm(residual) · w, `rows` rows of `d` (fused kernel); with
    /// `x16` (16-bit weights only, [`Gpu::fuses_norm_x16`]), `out` in the weight dtype into it
    /// too, grown as needed.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn add_rms_norm(
        &self,
        residual: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<f32>,
        x16: Option<&mut Option<CudaSlice<u16>>>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let Some(fu) = &self.fused else {
            return Err(CudaError::Unsupported(
                "fused kernels are not loaded".into(),
            ));
        };
        let n = rows * d;
        assert!(
            residual.len() >= n && x.len() >= n && out.len() >= n,
            "add_rms_norm: buffers too small"
        );
        assert!(
            w.len() >= d * self.weight_dtype.size(),
            "add_rms_norm: weight too small"
        );
        assert!(
            x16.is_none() || self.weight_dtype != DType::F32,
            "add_rms_norm: a 16-bit copy of f32 weights' input"
        );
        if rows == 0 {
            return Ok(());
        }
        let xb = match x16 {
            // SAFETY: the kernel below writes all rows × d elements.
            Some(b) => unsafe { self.x16_ptr(b, n) }?,
            None => 0,
        };
        // SAFETY: add_rms_norm_T(float*, const float*, const T*, float*, T*, int, int, float);
        // one block of 256 threads per row, as rms_norm (block_sum needs a multiple of 32); the
        // buffers hold rows × d values and w holds d weights (checked above); `xb` is null or
        // holds rows × d 16-bit elements of the weight dtype (grown above).
        unsafe {
            launch!(
                self,
                &fu.add_norm,
                (rows as u32, 1, 1),
                256,
                [
                    self.p(residual),
                    self.p(x),
                    self.p(w),
                    self.p(out),
                    xb,
                    int(rows, "rows"),
                    int(d, "d"),
                    eps
                ]
            )
        }
    }

    /// Whether the fused add + RMSNorm writes the 16-bit GEMM input (16-bit weights, fused on).
    pub(super) fn fuses_norm_x16(&self) -> bool {
        self.fused.is_some() && self.weight_dtype != DType::F32
    }

    /// out = silu(gate) · up, and the same values in the weight dtype into `x16` (grown as
    /// needed). Err when the weights are f32 (nothing to cast).
    pub(super) fn swiglu_x16(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        x16: &mut Option<CudaSlice<u16>>,
        n: usize,
    ) -> Result<(), CudaError> {
        let Some(func) = self.fused.as_ref().and_then(|f| f.swiglu16.as_ref()) else {
            return Err(CudaError::Unsupported(
                "swiglu_x16 needs 16-bit weights and the fused kernels".into(),
            ));
        };
        assert!(
            gate.len() >= n && up.len() >= n && out.len() >= n,
            "swiglu_x16: buffers too small"
        );
        // SAFETY: the kernel below writes all n elements.
        let xb = unsafe { self.x16_ptr(x16, n) }?;
        // SAFETY: swiglu_x16_T(const float*, const float*, float*, T*, long); gate, up and out
        // hold n f32, x16 at least n 16-bit elements (grown above).
        unsafe {
            launch!(
                self,
                func,
                (blocks(n, 256, 4096), 1, 1),
                256,
                [self.p(gate), self.p(up), self.p(out), xb, n as i64]
            )
        }
    }

    /// [`Gpu::linear`] whose input's 16-bit cast is already in `x16` (a served [`X16Tag`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_from_x16(
        &self,
        x16: &CudaSlice<u16>,
        w: &impl DevicePtr<u8>,
        rows: usize,
        d_in: usize,
        d_out: usize,
        out: &mut CudaSlice<f32>,
        bias: Option<super::launch::EpilogueBias>,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::sys::cudaDataType;
        let a_type = match self.weight_dtype {
            DType::Bf16 => cudaDataType::CUDA_R_16BF,
            DType::F16 => cudaDataType::CUDA_R_16F,
            DType::F32 => {
                return Err(CudaError::Unsupported(
                    "f32 weights take no 16-bit input".into(),
                ))
            }
        };
        assert!(
            x16.len() >= rows * d_in && out.len() >= rows * d_out,
            "linear_from_x16: buffers too small"
        );
        assert!(
            w.len() >= d_in * d_out * self.weight_dtype.size(),
            "linear_from_x16: weight too small"
        );
        if rows == 0 {
            return Ok(());
        }
        self.gemm(a_type, self.p(x16), w, rows, d_in, d_out, out, bias)
    }

    /// Whether the SwiGLU + cast kernel is loaded (16-bit weights, fused on).
    pub(super) fn fuses_swiglu(&self) -> bool {
        self.fused.as_ref().is_some_and(|f| f.swiglu16.is_some())
    }
}

impl CudaBackend {
    /// Switches the fused kernels on or off (tests, benchmarks); compiles on first use.
    pub fn set_fused(&mut self, on: bool) -> Result<()> {
        self.gpu.fused = if on {
            Some(Fused::load(&self.gpu.ctx, self.gpu.weight_dtype)?)
        } else {
            None
        };
        self.x16_tag = None;
        Ok(())
    }

    /// Whether the fused kernels are in use.
    pub fn fused(&self) -> bool {
        self.gpu.fused.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_serves_only_the_next_op_over_the_same_buffer() {
        let t = X16Tag {
            ptr: 0x1000,
            len: 64,
            at: 7,
        };
        assert!(t.serves(0x1000, 64, 8));
        assert!(!t.serves(0x1000, 64, 9), "another op ran in between");
        assert!(!t.serves(0x2000, 64, 8), "another buffer");
        assert!(!t.serves(0x1000, 32, 8), "another length");
    }

    #[test]
    fn overlapping_ranges_are_found_and_adjacent_ones_are_not() {
        assert!(ranges_overlap((100, 10), (105, 10)));
        assert!(ranges_overlap((105, 10), (100, 10)));
        assert!(ranges_overlap((100, 10), (100, 1)));
        assert!(ranges_overlap((100, 50), (110, 5)), "one inside the other");
        assert!(!ranges_overlap((100, 10), (110, 10)), "adjacent");
        assert!(!ranges_overlap((110, 10), (100, 10)), "adjacent");
        assert!(!ranges_overlap((100, 0), (100, 10)), "empty");
        assert!(!ranges_overlap((u64::MAX - 4, 4), (0, 8)));
    }
}
