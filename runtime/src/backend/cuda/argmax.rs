//! Greedy sampling on the device (issue 29; `thaw_kernels`' `argmax.cu`), on by default: off with
//! `THAW_CUDA_DEVICE_ARGMAX=0` (read when the backend is created, see
//! [`kernel_select::OptInPlan`](crate::backend::kernel_select::OptInPlan)); tests and benchmarks switch it with [`CudaBackend::set_device_argmax`].
//!
//! On, [`Backend::greedy_ids`] runs the LM head into the device logits buffer, then one block
//! per row finds its argmax, and only the rows' u32 ids are copied to the host. A profile of
//! an H200 decode step at batch 32 had the LM head plus the logits' copy at 578 µs (the
//! 32 × vocab f32 logits go to the host every step) and host sampling inside the 1.7 ms outside
//! every op. Graph-captured decode steps keep their graph as it is (it ends in the LM head
//! into the same buffer): [`Backend::graph_end_ids`] launches the argmax behind the replayed
//! graph, outside it, on the same stream, and copies the ids instead of the logits. So one
//! graph serves a step whether its rows are greedy or not.
//!
//! Off, both ops are the trait's defaults (the logits' copy, the host's argmax).
//!
//! [`Backend::greedy_ids`]: crate::backend::Backend::greedy_ids
//! [`Backend::graph_end_ids`]: crate::backend::Backend::graph_end_ids
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaSlice};
use thaw_kernels::cuda::registry::shape;
use thaw_kernels::cuda::KernelCache;

use super::launch::{int, launch, Gpu};
use super::weights::CudaLinear;
use super::{CudaBackend, CudaError};
use crate::error::Result;

/// `argmax_rows_f32` and the device buffer of the ids it writes.
pub(crate) struct DeviceArgmax {
    func: CudaFunction,
    /// Grown to the most rows asked for; taken out while a call uses it.
    ids: Option<CudaSlice<u32>>,
}

impl DeviceArgmax {
    pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        Ok(Self {
            func: KernelCache::global().function(ctx, "argmax_rows_f32")?,
            ids: None,
        })
    }
}

impl Gpu {
    /// `ids[r]` = the argmax of row `r` of `logits` (`rows` rows of `vocab`), by the host's
    /// rule (`sampling::argmax`), for `r < rows`.
    fn argmax_rows(
        &self,
        k: &DeviceArgmax,
        logits: &CudaSlice<f32>,
        ids: &mut CudaSlice<u32>,
        rows: usize,
        vocab: usize,
    ) -> Result<(), CudaError> {
        assert!(
            logits.len() >= rows * vocab && ids.len() >= rows,
            "argmax_rows: buffers too small"
        );
        if rows == 0 {
            return Ok(());
        }
        // SAFETY: argmax_rows_f32(const float*, u32*, int, int); one block of ARGMAX_THREADS
        // (whole warps, at most 1024: the source's THAW_ARGMAX_THREADS, checked by the
        // registry's tests) per row; logits holds rows × vocab f32 and ids `rows` u32 (checked
        // above); each block reads its row and writes only ids[row].
        unsafe {
            launch!(
                self,
                &k.func,
                (rows as u32, 1, 1),
                shape::ARGMAX_THREADS,
                [
                    self.p(logits),
                    self.p(&*ids),
                    int(rows, "rows"),
                    int(vocab, "vocab")
                ]
            )
        }
    }
}

impl CudaBackend {
    /// The argmax of the first `rows` rows (of `vocab`) of `logits`, copied into `out`. Queued
    /// behind whatever wrote the logits (one stream); waits for the copy.
    fn ids_of(
        &mut self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        out.clear();
        out.resize(rows, 0);
        if rows == 0 {
            return Ok(());
        }
        let Some(k) = self.gpu.argmax.as_mut() else {
            return Err(CudaError::Unsupported(
                "greedy ids on the device without the argmax kernel loaded".into(),
            ));
        };
        let mut ids = match k.ids.take() {
            Some(ids) if ids.len() >= rows => ids,
            _ => self.gpu.stream.alloc_zeros::<u32>(rows)?,
        };
        let k = self.gpu.argmax.as_ref().expect("checked above");
        let r = self
            .gpu
            .argmax_rows(k, logits, &mut ids, rows, vocab)
            .and_then(|()| {
                self.gpu
                    .stream
                    .memcpy_dtoh(&ids.slice(..rows), &mut out[..])?;
                self.gpu.stream.synchronize()?;
                Ok(())
            });
        if let Some(k) = self.gpu.argmax.as_mut() {
            k.ids = Some(ids);
        }
        r
    }

    /// [`CudaBackend::ids_of`] the device logits buffer (the last LM head's output).
    fn ids_from_logits(
        &mut self,
        rows: usize,
        vocab: usize,
        out: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        let Some(logits) = self.logits_dev.take() else {
            return Err(CudaError::Unsupported(
                "greedy ids asked for before any logits were computed".into(),
            ));
        };
        let r = self.ids_of(&logits, rows, vocab, out);
        self.logits_dev = Some(logits);
        r
    }

    /// The device argmax of `rows` rows of `vocab` logits already on the device (the parity
    /// tests feed it rows no LM head would give: NaNs, infinities, ties). Loads the kernel if
    /// it is off, and leaves it as it found it.
    pub fn argmax_of(
        &mut self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<Vec<u32>> {
        assert!(logits.len() >= rows * vocab, "argmax_of: logits too small");
        let was_on = self.device_argmax();
        if !was_on {
            self.set_device_argmax(true)?;
        }
        let mut out = Vec::new();
        let r = self.ids_of(logits, rows, vocab, &mut out);
        if !was_on {
            self.set_device_argmax(false)?;
        }
        r?;
        Ok(out)
    }

    /// [`Backend::greedy_ids`](crate::backend::Backend::greedy_ids) with the kernel loaded:
    /// the LM head into the device logits buffer, then the ids. Inside a graph step only the
    /// LM head runs (recorded); `graph_end_ids` brings the ids back.
    pub(super) fn try_greedy_ids(
        &mut self,
        x: &CudaSlice<f32>,
        head: &CudaLinear,
        rows: usize,
        ids: &mut Vec<u32>,
    ) -> Result<(), CudaError> {
        if let Some(a) = self.graphs.active() {
            return self.graph_logits(a, x, head);
        }
        let n = rows * head.d_out;
        if n == 0 {
            ids.clear();
            ids.resize(rows, 0);
            return Ok(());
        }
        if self.logits_dev.as_ref().is_none_or(|l| l.len() < n) {
            self.logits_dev = Some(self.gpu.stream.alloc_zeros::<f32>(n)?);
        }
        let mut dev = self.logits_dev.take().expect("sized above");
        let r = self.try_linear(x, head, rows, &mut dev);
        self.logits_dev = Some(dev);
        r?;
        self.ids_from_logits(rows, head.d_out, ids)
    }

    /// [`Backend::graph_end_ids`](crate::backend::Backend::graph_end_ids) with the kernel
    /// loaded: ends the graph step as `graph_end` does, then the argmax of the first `rows`
    /// rows of the logits the graph left, behind it on the stream, and the ids' copy.
    pub(super) fn try_graph_end_ids(
        &mut self,
        ids: &mut Vec<u32>,
        rows: usize,
    ) -> Result<bool, CudaError> {
        if !self.try_graph_finish()? {
            return Ok(false);
        }
        let vocab = self.graphs.vocab;
        self.ids_from_logits(rows, vocab, ids)?;
        Ok(true)
    }

    /// Switches greedy sampling on the device on or off (tests, benchmarks).
    pub fn set_device_argmax(&mut self, on: bool) -> Result<()> {
        self.gpu.argmax = if on {
            Some(DeviceArgmax::load(&self.gpu.ctx)?)
        } else {
            None
        };
        Ok(())
    }

    /// Whether greedy token ids are computed on the device.
    pub fn device_argmax(&self) -> bool {
        self.gpu.argmax.is_some()
    }
}
