//! Issue 29's wide elementwise kernels (`thaw_kernels`' `wide.cu`), each on by default and off
//! where its variable is `0` (read when the backend is created, see
//! [`kernel_select::OptInPlan`](crate::backend::kernel_select::OptInPlan)); tests and
//! benchmarks switch them with [`CudaBackend::set_wide`], [`CudaBackend::set_rope_fold`] and
//! [`CudaBackend::set_group_gemm`].
//!
//! - wide (`THAW_CUDA_WIDE_NORM`): RMSNorm, add + RMSNorm and RoPE with one wide block per row
//!   whose threads issue all their loads at once. The classic kernels are chains of dependent
//!   loads (16 rounds a thread for a 4096-wide row, RoPE one head after another), which is
//!   what held them at 14–17 µs a call at batch 1 on an H200 (`cuda-h100.md` §8). Not the host:
//!   those ops allocate nothing and synchronise nothing (RoPE's positions go up once a step),
//!   and the profile's events (`op_clock.rs`) bracketed SwiGLU, one grid-stride launch over
//!   11008 values, at 5 µs a call in the same step, so launch and timing cost less than that.
//!   Rows the wide norm does not serve ([`wide_norm_block`]) take the classic kernel.
//! - RoPE folded (`THAW_CUDA_ROPE_FOLD`): [`Backend::rope_attention`] rotates q and k inside
//!   the kernel that writes K/V to the paged cache: one launch instead of three.
//! - the grouped product's split (`THAW_CUDA_GROUP_GEMM`, `group.rs`).
//!
//! [`Backend::rope_attention`]: crate::backend::Backend::rope_attention
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr};
use thaw_kernels::cuda::registry::DType;
use thaw_kernels::cuda::KernelCache;

use super::launch::{blocks, int, launch, Gpu};
use super::{CudaBackend, CudaError, CudaKvLayer};
use crate::backend::kernel_select::{wide_norm_block, wide_rope_block};
use crate::backend::StepLayout;
use crate::error::Result;

/// The wide norm and RoPE kernels for one weight dtype.
pub(crate) struct Wide {
    rms_norm: CudaFunction,
    add_norm: CudaFunction,
    rope: CudaFunction,
}

impl Wide {
    pub(super) fn load(ctx: &Arc<CudaContext>, w: DType) -> Result<Self, CudaError> {
        let cache = KernelCache::global();
        let f = |name: &str| cache.function(ctx, name).map_err(CudaError::from);
        Ok(Self {
            rms_norm: f(&format!("rms_norm_wide_{}", w.suffix()))?,
            add_norm: f(&format!("add_rms_norm_wide_{}", w.suffix()))?,
            rope: f("rope_wide_f32")?,
        })
    }
}

/// RoPE folded into the KV write, for one KV dtype.
pub(crate) struct RopeFold {
    write_kv_rope: CudaFunction,
}

impl RopeFold {
    pub(super) fn load(ctx: &Arc<CudaContext>, kv: DType) -> Result<Self, CudaError> {
        let name = format!("write_kv_rope_{}", kv.suffix());
        Ok(Self {
            write_kv_rope: KernelCache::global().function(ctx, &name)?,
        })
    }
}

/// What q/k/v RoPE folded into the KV write needs besides the buffers.
#[derive(Copy, Clone, Debug)]
pub(super) struct FoldShape {
    pub rows: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl Gpu {
    /// Whether the wide add + RMSNorm writes the 16-bit GEMM input too (wide on, 16-bit
    /// weights): [`Gpu::norm_wide`] with `x16` given.
    pub(super) fn wide_norm_x16(&self) -> bool {
        self.wide.is_some() && self.weight_dtype != DType::F32
    }

    /// Wide RMSNorm of `rows` rows of `d` (with `residual`: residual += x first, and the sum is
    /// normalised; with `residual` and `x16` where [`Gpu::wide_norm_x16`], the output also
    /// into `x16` in the weight dtype, grown as needed). Ok(false) when the wide kernels are
    /// off or do not serve `d`: nothing ran.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_wide(
        &self,
        residual: Option<&mut CudaSlice<f32>>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<f32>,
        x16: Option<&mut Option<CudaSlice<u16>>>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<bool, CudaError> {
        let (Some(k), Some(threads)) = (&self.wide, wide_norm_block(d)) else {
            return Ok(false);
        };
        let n = rows * d;
        assert!(
            x.len() >= n && out.len() >= n,
            "norm_wide: buffers too small"
        );
        assert!(
            w.len() >= d * self.weight_dtype.size(),
            "norm_wide: weight too small"
        );
        let mut ptrs = [self.p(x), self.p(out), 0];
        if let Some(h) = &residual {
            ptrs[2] = self.p(&**h);
        }
        if ptrs.iter().any(|p| p % 16 != 0) {
            // float4 loads need 16-byte rows: the classic kernel serves this call.
            return Ok(false);
        }
        if rows == 0 {
            return Ok(true);
        }
        let grid = (rows as u32, 1, 1);
        match residual {
            Some(h) => {
                assert!(h.len() >= n, "norm_wide: residual too small");
                let x16 = x16.filter(|_| self.weight_dtype != DType::F32);
                let xb = match x16 {
                    // SAFETY: the kernel below writes all rows × d elements.
                    Some(b) => unsafe { self.x16_ptr(b, n) }?,
                    None => 0,
                };
                // SAFETY: add_rms_norm_wide_T(float*, const float*, const T*, float*, T*, int,
                // int, float); one block of `threads` (whole warps, d / 4 <= threads · WIDE_VPT:
                // wide_norm_block) per row; residual, x and out hold rows × d f32 and w d
                // weights (checked above); d % 4 == 0 and every buffer starts on 16 bytes
                // (checked above), so each row's float4s are aligned; `xb` is null or holds
                // rows × d 16-bit elements of the weight dtype (grown above), written with
                // scalar stores.
                unsafe {
                    launch!(
                        self,
                        &k.add_norm,
                        grid,
                        threads,
                        [
                            self.p(h),
                            self.p(x),
                            self.p(w),
                            self.p(out),
                            xb,
                            int(rows, "rows"),
                            int(d, "d"),
                            eps
                        ]
                    )
                }?
            }
            // SAFETY: rms_norm_wide_T(const float*, const T*, float*, int, int, float); the
            // launch shape and sizes as above.
            None => unsafe {
                launch!(
                    self,
                    &k.rms_norm,
                    grid,
                    threads,
                    [
                        self.p(x),
                        self.p(w),
                        self.p(out),
                        int(rows, "rows"),
                        int(d, "d"),
                        eps
                    ]
                )
            }?,
        }
        Ok(true)
    }

    /// Wide RoPE over `[tokens, n_heads, head_dim]` in place. Ok(false) when the wide kernels
    /// are off: nothing ran.
    pub(super) fn rope_wide(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &impl DevicePtr<u32>,
        inv_freq: &CudaSlice<f32>,
        (tokens, n_heads, head_dim): (usize, usize, usize),
    ) -> Result<bool, CudaError> {
        let Some(k) = &self.wide else {
            return Ok(false);
        };
        assert!(x.len() >= tokens * n_heads * head_dim && positions.len() >= tokens);
        assert!(
            inv_freq.len() * 2 == head_dim
                && head_dim <= 2 * thaw_kernels::cuda::registry::shape::ROPE_MAX_HALF,
            "rope_wide: inv_freq is not head_dim / 2, or head_dim is above the staged table"
        );
        if tokens == 0 {
            return Ok(true);
        }
        let threads = wide_rope_block(n_heads * head_dim / 2);
        // SAFETY: rope_wide_f32(float*, const u32*, const float*, int, int, int); one block per
        // token of whole warps; x holds tokens × n_heads × head_dim, positions `tokens`
        // entries, inv_freq head_dim / 2 ≤ THAW_ROPE_MAX_HALF (checked above).
        unsafe {
            launch!(
                self,
                &k.rope,
                (tokens as u32, 1, 1),
                threads,
                [
                    self.p(x),
                    self.p(positions),
                    self.p(inv_freq),
                    int(tokens, "tokens"),
                    int(n_heads, "n_heads"),
                    int(head_dim, "head_dim")
                ]
            )
        }?;
        Ok(true)
    }

    /// RoPE of q and k in place and the K/V write into the cache slots `slots`, one launch
    /// (`write_kv_rope_T`): the result of [`Gpu::rope`] on q, on k, then [`Gpu::write_kv`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_kv_rope(
        &self,
        (q, k, v): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &CudaSlice<f32>),
        (kc, vc): (&mut CudaSlice<u8>, &mut CudaSlice<u8>),
        slots: &impl DevicePtr<u32>,
        positions: &impl DevicePtr<u32>,
        inv_freq: &CudaSlice<f32>,
        s: FoldShape,
    ) -> Result<(), CudaError> {
        let Some(f) = &self.rope_fold else {
            return Err(CudaError::Unsupported(
                "RoPE folded into the KV write is not loaded".into(),
            ));
        };
        let token_len = s.n_kv_heads * s.head_dim;
        assert!(
            q.len() >= s.rows * s.n_heads * s.head_dim
                && k.len() >= s.rows * token_len
                && v.len() >= s.rows * token_len
                && slots.len() >= s.rows
                && positions.len() >= s.rows,
            "write_kv_rope: buffers too small"
        );
        assert!(
            inv_freq.len() * 2 == s.head_dim
                && s.head_dim <= 2 * thaw_kernels::cuda::registry::shape::ROPE_MAX_HALF,
            "write_kv_rope: inv_freq is not head_dim / 2, or head_dim is above the staged table"
        );
        if s.rows == 0 {
            return Ok(());
        }
        let threads = wide_rope_block((s.n_heads + s.n_kv_heads) * s.head_dim / 2);
        // SAFETY: write_kv_rope_T(float* q, float* k, const float* v, T* kc, T* vc,
        // const u32* slots, const u32* positions, const float* inv_freq, int rows, int n_heads,
        // int n_kv_heads, int head_dim); one block per row; q, k, v hold `rows` rows (checked
        // above) and the slots address whole token rows inside the caches (built by step.rs /
        // the graph metadata from the block tables, as for write_kv); inv_freq fits the
        // kernel's shared table (checked above).
        unsafe {
            launch!(
                self,
                &f.write_kv_rope,
                (s.rows as u32, 1, 1),
                threads,
                [
                    self.p(q),
                    self.p(k),
                    self.p(v),
                    self.p(kc),
                    self.p(vc),
                    self.p(slots),
                    self.p(positions),
                    self.p(inv_freq),
                    int(s.rows, "rows"),
                    int(s.n_heads, "n_heads"),
                    int(s.n_kv_heads, "n_kv_heads"),
                    int(s.head_dim, "head_dim")
                ]
            )
        }
    }

    /// `src` `[rows, Σ widths]` into `outs[i]` `[rows, widths[i]]` (two or three outputs).
    pub(super) fn split_cols(
        &self,
        split: &CudaFunction,
        src: &CudaSlice<f32>,
        rows: usize,
        outs: &mut [&mut CudaSlice<f32>],
        widths: &[usize],
    ) -> Result<(), CudaError> {
        assert!(
            matches!(outs.len(), 2 | 3) && outs.len() == widths.len(),
            "split_cols: two or three outputs"
        );
        let total: usize = widths.iter().sum();
        assert!(src.len() >= rows * total, "split_cols: source too small");
        for (o, &w) in outs.iter().zip(widths) {
            assert!(o.len() >= rows * w, "split_cols: an output is too small");
        }
        if rows == 0 {
            return Ok(());
        }
        let ptr = |i: usize| outs.get(i).map_or(0, |o| self.p(&**o));
        let width = |i: usize| int(widths.get(i).copied().unwrap_or(0), "width");
        // SAFETY: split_cols3_f32(const float*, int, float*, int, float*, int, float*, int);
        // src holds rows × Σ widths and each output rows × its width (checked above); a third
        // output of width 0 (a pair) is never written, so its null pointer is never used.
        unsafe {
            launch!(
                self,
                split,
                (blocks(rows * total, 256, 4096), 1, 1),
                256,
                [
                    self.p(src),
                    int(rows, "rows"),
                    ptr(0),
                    width(0),
                    ptr(1),
                    width(1),
                    ptr(2),
                    width(2)
                ]
            )
        }
    }
}

impl CudaBackend {
    /// [`Backend::rope_attention`](crate::backend::Backend::rope_attention) with RoPE folded
    /// into the KV write: `write_kv_rope`, then the attention kernels `attention` runs.
    pub(super) fn try_rope_attention(
        &mut self,
        (q, k, v): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &CudaSlice<f32>),
        (n_heads, n_kv_heads): (usize, usize),
        kv: &mut CudaKvLayer,
        step: &StepLayout,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let s = self.attn_shape(kv);
        let fold = FoldShape {
            rows: step.rows(),
            n_heads,
            n_kv_heads,
            head_dim: self.head_dim,
        };
        assert_eq!(
            (n_heads, n_kv_heads),
            (s.n_heads, s.n_kv_heads),
            "rope_attention: head counts differ from the backend's model"
        );
        if let Some(a) = self.graphs.active() {
            return self.graph_rope_attention(a, (q, k, v), kv, out, s, fold);
        }
        self.ensure_positions(&step.positions)?;
        self.attn_prepare(step, kv)?;
        self.gpu.write_kv_rope(
            (&mut *q, &mut *k, v),
            (&mut kv.k, &mut kv.v),
            &self.attn.slots(),
            self.positions.get(),
            &self.inv_freq,
            fold,
        )?;
        self.attend(q, kv, out.into(), s)
    }

    /// Switches the wide norm and RoPE kernels on or off (tests, benchmarks).
    pub fn set_wide(&mut self, on: bool) -> Result<()> {
        self.gpu.wide = if on {
            Some(Wide::load(&self.gpu.ctx, self.gpu.weight_dtype)?)
        } else {
            None
        };
        Ok(())
    }

    /// Whether the wide norm and RoPE kernels run.
    pub fn wide(&self) -> bool {
        self.gpu.wide.is_some()
    }

    /// Switches RoPE folded into the KV write on or off (tests, benchmarks); an error where
    /// this model's heads do not allow it.
    pub fn set_rope_fold(&mut self, on: bool) -> Result<()> {
        if on {
            if let Some(why) = crate::backend::kernel_select::rope_fold_unserved(self.head_dim) {
                return Err(CudaError::Unsupported(format!("RoPE cannot be folded: {why}")).into());
            }
        }
        self.gpu.rope_fold = if on {
            Some(RopeFold::load(&self.gpu.ctx, self.gpu.kv_dtype)?)
        } else {
            None
        };
        Ok(())
    }

    /// Whether RoPE is folded into the KV write.
    pub fn rope_fold(&self) -> bool {
        self.gpu.rope_fold.is_some()
    }
}
