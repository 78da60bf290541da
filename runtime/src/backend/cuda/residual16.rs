//! The residual stream in 16 bits (issue 29, `THAW_CUDA_BF16_ACT`; on by default with 16-bit
//! weights, `0` for f32): `thaw_kernels`' `residual16.cu`.
//!
//! Where [`residual16_plan`] says so (the switch on, 16-bit weights: facts fixed while the
//! switch is), the hidden state `h` is stored in the weight dtype in the first half of the f32
//! buffer's bytes, and only the residual ops touch it ([`Backend`](crate::backend::Backend)'s
//! docs):
//! - `embed` copies the 16-bit table's rows (no widening), eager and in a CUDA graph;
//! - `add_rms_norm` sums `h + x` in f32, stores the sum rounded to `h` and normalises the
//!   rounded sum (as transformers' bf16 Llama does), writing the f32 output and, where the f32
//!   path writes it (fused or wide norms with 16-bit weights), its 16-bit GEMM copy, tagged
//!   ([`X16Tag`](super::fused::X16Tag)) for the projections that follow;
//! - `residual_norm` (layer 0) reads `h`, `residual_add` (after the last layer) rounds the sum,
//!   and `gather_residual` widens the logit rows to f32 for the final norm (eager: the row
//!   indices uploaded; a graph: from its persistent buffer).
//!
//! Each add + norm moves 14 B per element against 18 B
//! ([`residual_traffic_bytes`](crate::backend::residual16_plan::residual_traffic_bytes)); no op
//! allocates in a steady step (the 16-bit GEMM copy is the shared `x16` scratch, grown to the
//! largest step, reserved before a graph capture). One kernel pair serves the classic and the
//! wide norm shapes: a block of 256 threads per row, or with `THAW_CUDA_WIDE_NORM=1` up to 1024
//! (a row's loads issued at once). The switch is read per op from [`Gpu::residual16`], set
//! with `set_act16` between forward passes (each pass's `embed` rewrites `h`); a captured
//! graph is recaptured when it flips, as the act16 scratch in its fingerprint tells. CPU twin:
//! [`CpuBackend::set_act16`](crate::backend::cpu::CpuBackend::set_act16).
//!
//! [`residual16_plan`]: crate::backend::residual16_plan::residual16_plan
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, DevicePtr};
use thaw_kernels::cuda::registry::DType;
use thaw_kernels::cuda::KernelCache;

use super::launch::{blocks, int, launch, Gpu};
use super::weights::{CudaLinear, CudaVector};
use super::{CudaBackend, CudaError};
use crate::backend::residual16_plan::{residual16_plan, Residual16Facts, ResidualRepr};

/// The resolved `residual16.cu` kernels for one 16-bit weight dtype.
pub(crate) struct Residual16 {
    embed: CudaFunction,
    norm: CudaFunction,
    add_norm: CudaFunction,
    add: CudaFunction,
    gather: CudaFunction,
}

impl Residual16 {
    fn load(ctx: &Arc<CudaContext>, w: DType) -> Result<Self, CudaError> {
        let cache = KernelCache::global();
        let f = |base: &str| {
            (cache.function(ctx, &format!("{base}_{}", w.suffix()))).map_err(CudaError::from)
        };
        Ok(Self {
            embed: f("embed16")?,
            norm: f("rms_norm_h16")?,
            add_norm: f("add_rms_norm_h16")?,
            add: f("residual_add_h16")?,
            gather: f("gather_rows_h16")?,
        })
    }
}

impl Gpu {
    /// Loads the kernels where [`residual16_plan`] stores the residual in 16 bits for the
    /// switch as it is now (`self.act16`), drops them otherwise; after every change of the
    /// switch.
    pub(super) fn load_residual16(&mut self) -> Result<(), CudaError> {
        let facts = Residual16Facts {
            switch_on: self.act16.is_some(),
            weights_16bit: self.weight_dtype != DType::F32,
        };
        self.residual16 = match residual16_plan(&facts) {
            ResidualRepr::Sixteen => Some(Residual16::load(&self.ctx, self.weight_dtype)?),
            ResidualRepr::F32 => None,
        };
        Ok(())
    }

    fn r16(&self) -> Result<&Residual16, CudaError> {
        self.residual16
            .as_ref()
            .ok_or_else(|| CudaError::Unsupported("the residual16 kernels are not loaded".into()))
    }

    /// Threads a block of the row kernels: 256 (as norm.cu's), or with the wide norms on, up
    /// to 1024 (a multiple of 32, as `block_sum` needs).
    fn r16_block(&self, d: usize) -> u32 {
        match self.wide {
            Some(_) => d.next_multiple_of(32).clamp(32, 1024) as u32,
            None => 256,
        }
    }

    /// Asserts `h` (an f32 buffer) holds `n` 16-bit elements in its first half.
    fn h16_fits(h: &CudaSlice<f32>, n: usize, what: &str) {
        assert!(2 * h.len() >= n, "{what}: the residual buffer is too small");
    }

    /// The residual stream `h[r, :] = table[ids[r], :]` in the backend's representation: the
    /// 16-bit rows copied with the switch on, [`Gpu::embed`] (widened to f32) otherwise.
    pub(super) fn embed_residual(
        &self,
        table: &impl DevicePtr<u8>,
        ids: &impl DevicePtr<u32>,
        h: &mut CudaSlice<f32>,
        rows: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let Some(k) = &self.residual16 else {
            return self.embed(table, ids, h, rows, d);
        };
        assert!(ids.len() >= rows, "embed16: ids too small");
        Self::h16_fits(h, rows * d, "embed16");
        if rows == 0 {
            return Ok(());
        }
        // SAFETY: embed16_T(const T*, const u32*, T*, int, int); `h` holds rows × d 16-bit
        // elements (checked); the ids were validated against the vocabulary, the row count
        // `table` was uploaded with, by the engine.
        unsafe {
            launch!(
                self,
                &k.embed,
                (rows as u32, 1, 1),
                256,
                [
                    self.p(table),
                    self.p(ids),
                    self.p(h),
                    int(rows, "rows"),
                    int(d, "d")
                ]
            )
        }
    }

    /// `out = rms_norm(h) · w` over `rows` rows of `d` of the 16-bit residual (f32 `out`).
    pub fn rms_norm_h16(
        &self,
        h: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<f32>,
        (rows, d): (usize, usize),
        eps: f32,
    ) -> Result<(), CudaError> {
        let k = self.r16()?;
        Self::h16_fits(h, rows * d, "rms_norm_h16");
        assert!(out.len() >= rows * d, "rms_norm_h16: out too small");
        assert!(w.len() >= 2 * d, "rms_norm_h16: weight too small");
        if rows == 0 {
            return Ok(());
        }
        // SAFETY: rms_norm_h16_T(const T*, const T*, float*, int, int, float); h holds rows × d
        // 16-bit elements, out rows × d f32, w d weights of the 16-bit weight dtype (checked);
        // the block is a multiple of 32 threads; the buffers start at cudaMalloc addresses, as
        // the vector path (d a multiple of 4) needs.
        unsafe {
            launch!(
                self,
                &k.norm,
                (rows as u32, 1, 1),
                self.r16_block(d),
                [
                    self.p(h),
                    self.p(w),
                    self.p(out),
                    int(rows, "rows"),
                    int(d, "d"),
                    eps
                ]
            )
        }
    }

    /// `h = T(h + x)`, `out = rms_norm(h) · w` over `rows` rows of `d`; with `x16`, `out` in
    /// the weight dtype into it too, grown as needed.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_h16(
        &self,
        h: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        out: &mut CudaSlice<f32>,
        x16: Option<&mut Option<CudaSlice<u16>>>,
        (rows, d): (usize, usize),
        eps: f32,
    ) -> Result<(), CudaError> {
        let k = self.r16()?;
        let n = rows * d;
        Self::h16_fits(h, n, "add_rms_norm_h16");
        assert!(
            x.len() >= n && out.len() >= n,
            "add_rms_norm_h16: buffers too small"
        );
        assert!(w.len() >= 2 * d, "add_rms_norm_h16: weight too small");
        if rows == 0 {
            return Ok(());
        }
        let xb = match x16 {
            // SAFETY: the kernel below writes all rows × d elements.
            Some(b) => unsafe { self.x16_ptr(b, n) }?,
            None => 0,
        };
        // SAFETY: add_rms_norm_h16_T(T*, const float*, const T*, float*, T*, int, int, float);
        // h holds rows × d 16-bit elements, x and out rows × d f32, w d 16-bit weights
        // (checked); `xb` is null or holds rows × d 16-bit elements (grown above); the block is
        // a multiple of 32 threads; every buffer starts at a cudaMalloc address (256-byte
        // aligned), so with d a multiple of 4 each row is aligned for the vector path's 8- and
        // 16-byte accesses.
        unsafe {
            launch!(
                self,
                &k.add_norm,
                (rows as u32, 1, 1),
                self.r16_block(d),
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
        }
    }

    /// `h[..n] = T(h + x)` over the 16-bit residual.
    pub fn residual_add_h16(
        &self,
        h: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        let k = self.r16()?;
        Self::h16_fits(h, n, "residual_add_h16");
        assert!(x.len() >= n, "residual_add_h16: x too small");
        // 4 elements a thread on the vector path (n a multiple of 4), 1 otherwise.
        let per = if n.is_multiple_of(4) { n / 4 } else { n };
        // SAFETY: residual_add_h16_T(T*, const float*, long); h holds n 16-bit elements and x
        // n f32 (checked); both start at a cudaMalloc address (256-byte aligned), as the 8-
        // and 16-byte accesses of the vector path need.
        unsafe {
            launch!(
                self,
                &k.add,
                (blocks(per, 256, 4096), 1, 1),
                256,
                [self.p(h), self.p(x), n as i64]
            )
        }
    }

    /// `out[i, :] = x[rows[i], :]` in f32: [`Gpu::gather_rows`] of an f32 `x`, or with `h16`
    /// the widened rows of the 16-bit residual.
    pub(super) fn gather_rows_as(
        &self,
        x: &CudaSlice<f32>,
        rows: &impl DevicePtr<u32>,
        (n, width): (usize, usize),
        out: &mut CudaSlice<f32>,
        h16: bool,
    ) -> Result<(), CudaError> {
        if !h16 {
            return self.gather_rows(x, rows, n, width, out);
        }
        let k = self.r16()?;
        assert!(
            rows.len() >= n && out.len() >= n * width,
            "gather_rows_h16: buffers too small"
        );
        if n == 0 {
            return Ok(());
        }
        // SAFETY: gather_rows_h16_T(const T*, const u32*, float*, int, int); out holds
        // n × width f32; every row index was checked against `x` (whose first half holds the
        // 16-bit rows, so a row inside `x` in f32 units is inside it in 16-bit ones) by the
        // caller.
        unsafe {
            launch!(
                self,
                &k.gather,
                (n as u32, 1, 1),
                256,
                [
                    self.p(x),
                    self.p(rows),
                    self.p(out),
                    int(n, "n"),
                    int(width, "width")
                ]
            )
        }
    }
}

impl CudaBackend {
    /// Whether the residual stream is stored in 16 bits now.
    pub fn residual16(&self) -> bool {
        self.gpu.residual16.is_some()
    }

    /// [`Backend::add_rms_norm`](crate::backend::Backend::add_rms_norm) over the 16-bit
    /// residual, op `at`: the 16-bit GEMM copy written and tagged where the f32 path writes it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_add_rms_norm_h16(
        &mut self,
        h: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaVector,
        eps: f32,
        rows: usize,
        out: &mut CudaSlice<f32>,
        at: u64,
    ) -> Result<(), CudaError> {
        let keep = self.gpu.fuses_norm_x16() || self.gpu.wide_norm_x16();
        let x16 = keep.then_some(&mut self.x16);
        (self.gpu).add_rms_norm_h16(h, x, &w.v, out, x16, (rows, w.len), eps)?;
        if keep {
            self.x16_tag = Some(super::fused::X16Tag {
                ptr: self.gpu.p(out),
                len: rows * w.len,
                at,
            });
        }
        Ok(())
    }

    /// The gather of `rows` rows of `width` of `x` (with `h16`, the 16-bit residual) into the
    /// f32 `out`: eager, the row indices uploaded; in a graph, the logit rows of its
    /// persistent buffer.
    pub(super) fn try_gather(
        &mut self,
        x: &CudaSlice<f32>,
        width: usize,
        rows: &[usize],
        out: &mut CudaSlice<f32>,
        h16: bool,
    ) -> Result<(), CudaError> {
        if let Some(a) = self.graphs.active() {
            return self.graph_gather(a, x, width, out, h16);
        }
        self.gather.host.clear();
        self.gather.host.extend(rows.iter().map(|&r| r as u32));
        self.gather.upload(&self.gpu)?;
        let n = rows.len();
        (self.gpu).gather_rows_as(x, self.gather.get(), (n, width), out, h16)
    }

    /// `residual16.cu`'s kernels over host data (parity tests and benchmarks; synchronises):
    /// with `x`, `h = T(h + x)` then the norm of `h`, else the norm alone (layer 0's); returns
    /// the 16-bit `h` after, the f32 output and its 16-bit copy. `h` holds bit patterns of the
    /// weight dtype, `w` the norm weights as f32 (stored in the weight dtype). Needs the
    /// switch on.
    pub fn residual_norm16_host(
        &mut self,
        h: &[u16],
        x: Option<&[f32]>,
        w: &[f32],
        (rows, d): (usize, usize),
        eps: f32,
    ) -> crate::error::Result<(Vec<u16>, Vec<f32>, Vec<u16>)> {
        let n = rows * d;
        assert!(h.len() == n && x.is_none_or(|x| x.len() == n) && w.len() == d);
        let wv = crate::backend::Backend::upload_vector(self, w.to_vec())?;
        let g = &self.gpu;
        let mut hd = g.alloc_zeros::<f32>(n.div_ceil(2).max(1))?;
        {
            // SAFETY: u16 and f32 are plain bit patterns: the view reinterprets the f32
            // buffer's first n·2 bytes, which it holds (n.div_ceil(2) f32).
            let mut h_bits = unsafe { hd.transmute_mut::<u16>(n.max(1)) }
                .ok_or_else(|| CudaError::Unsupported("residual buffer view".into()))?;
            g.htod(h, &mut h_bits)?;
        }
        let mut out = g.alloc_zeros::<f32>(n.max(1))?;
        let mut x16 = None;
        match x {
            Some(x) => {
                let mut xd = g.alloc_zeros::<f32>(n.max(1))?;
                g.htod(x, &mut xd)?;
                g.add_rms_norm_h16(
                    &mut hd,
                    &xd,
                    &wv.v,
                    &mut out,
                    Some(&mut x16),
                    (rows, d),
                    eps,
                )?;
            }
            None => g.rms_norm_h16(&hd, &wv.v, &mut out, (rows, d), eps)?,
        }
        // SAFETY: as above.
        let h_bits = unsafe { hd.transmute::<u16>(n.max(1)) }
            .ok_or_else(|| CudaError::Unsupported("residual buffer view".into()))?;
        let mut h_after = vec![0u16; n];
        g.dtoh(&h_bits.slice(..n), &mut h_after[..])?;
        let mut o16 = vec![0u16; n];
        if let Some(b) = &x16 {
            g.dtoh(&b.slice(..n), &mut o16[..])?;
        }
        g.sync()?;
        let o32 = self.download_f32(&out, n)?;
        Ok((h_after, o32, o16))
    }

    /// `embed` then `gather_residual` of `rows`, through the backend's residual ops (parity
    /// tests): the f32 rows the final norm would read.
    pub fn embed_gather_host(
        &mut self,
        table: &CudaLinear,
        ids: &[u32],
        rows: Range<usize>,
    ) -> crate::error::Result<Vec<f32>> {
        use crate::backend::Backend;
        let d = table.d_in;
        let mut h = self.alloc(ids.len() * d)?;
        let mut out = self.alloc(rows.len() * d)?;
        self.embed(table, ids, &mut h);
        let pick: Vec<usize> = rows.clone().collect();
        self.gather_residual(&h, d, &pick, &mut out);
        self.check()?;
        self.download_f32(&out, rows.len() * d)
    }
}
