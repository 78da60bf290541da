//! CPU assist on the GPU side (DESIGN §4): the fused export (rows → mapped exchange inputs,
//! fence, sequence word; no host synchronisation) and the merge that makes the *stream* wait
//! for the workers' result words (`cuStreamWaitValue32`) before adding their deltas.
//!
//! Protocol, per step with CPU work: the host writes the job table and arms the exchange
//! (`Exchange::set_jobs`, `Exchange::arm`) — workers then spin on the sequence word — and
//! queues, per layer, [`CudaBackend::export_rows_fused`] for each shared input and
//! [`CudaBackend::merge_deltas_waited`] for each module after its base GEMM. Nothing here blocks the
//! host.
use std::marker::PhantomData;
use std::ops::{Deref, Range};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use thaw_ipc::{Exchange, ExchangeConfig, ExchangeLayout, StepSeq, WorkerId, WORKER_RESULT};

use super::launch::{host_register, host_unregister};
use super::{CudaBackend, CudaError};
use crate::adapter::LoraModule;
use crate::error::Result;

/// Where a registered exchange segment sits in the device's address space, and its shape:
/// what the export kernel, the stream waits and the merge kernel address.
#[derive(Copy, Clone, Debug)]
pub struct ExchangeAddr {
    dev: u64,
    layout: ExchangeLayout,
    cfg: ExchangeConfig,
}

impl ExchangeAddr {
    fn at(&self, off: usize) -> u64 {
        self.dev + off as u64
    }
}

/// A segment registered for device access; unregistered on drop, once the device is idle.
struct Registration {
    ctx: Arc<CudaContext>,
    /// The segment's host address (kept as an integer so the backend stays `Send`).
    host: usize,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Queued exports / merges may still touch the segment.
        if let Err(e) = self.ctx.synchronize() {
            tracing::warn!("synchronize before unregistering the exchange failed: {e}");
        }
        // SAFETY: `host` was registered by `CudaBackend::register_exchange`, its mapping is
        // alive (a MappedExchange borrows its Exchange; the engine's mapping is dropped or
        // detached before its pool, the contract of `Backend::map_assist_exchange`), and the
        // context is idle, so no GPU work uses it any more.
        unsafe { host_unregister(&self.ctx, self.host as *mut u8) };
    }
}

/// The exchange segment registered for device access (pinned, mapped, not write-combined:
/// workers read it). Unregistered on drop, after the device has finished with it.
pub struct MappedExchange<'a> {
    _reg: Registration,
    addr: ExchangeAddr,
    _exchange: PhantomData<&'a Exchange>,
}

impl Deref for MappedExchange<'_> {
    type Target = ExchangeAddr;
    fn deref(&self) -> &ExchangeAddr {
        &self.addr
    }
}

/// The engine's registration of its worker pool's exchange (no borrow: the engine keeps the
/// pool alive while this lives, see `Backend::map_assist_exchange`).
pub(super) struct EngineExchange {
    _reg: Registration,
    pub(super) addr: ExchangeAddr,
}

impl CudaBackend {
    /// Registers `ex`'s whole segment (`cuMemHostRegister`, DEVICEMAP | PORTABLE) so kernels
    /// and stream waits can address it.
    pub fn map_exchange<'a>(&self, ex: &'a Exchange) -> Result<MappedExchange<'a>> {
        let (reg, addr) = self.register_exchange(ex)?;
        Ok(MappedExchange {
            _reg: reg,
            addr,
            _exchange: PhantomData,
        })
    }

    /// Registers `ex` for the engine's assist path (`Backend::map_assist_exchange`).
    ///
    /// # Safety
    /// `ex`'s segment must stay mapped until the mapping is dropped (`unmap_assist_exchange`
    /// or the backend's drop).
    pub(super) unsafe fn attach_exchange(&mut self, ex: &Exchange) -> Result<()> {
        self.assist_ex = None;
        let (reg, addr) = self.register_exchange(ex)?;
        self.assist_ex = Some(EngineExchange { _reg: reg, addr });
        Ok(())
    }

    fn register_exchange(&self, ex: &Exchange) -> Result<(Registration, ExchangeAddr)> {
        let mem_ops = self.gpu.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
        )?;
        if mem_ops == 0 {
            return Err(CudaError::Unsupported(
                "this device cannot address registered host memory; CPU assist needs it".into(),
            )
            .into());
        }
        let seg = ex.segment();
        let host = seg.base_addr() as *mut u8;
        // SAFETY: the segment mapping lives as long as the caller guarantees (a MappedExchange
        // borrows `ex`; the engine's mapping by `attach_exchange`'s contract); the returned
        // Registration unregisters it on drop. A segment is registered at most once per
        // Registration (registering twice fails with an error, not UB).
        let dev = unsafe { host_register(&self.gpu.ctx, host, seg.len(), true) }?
            .expect("mapped registration returns a device address");
        Ok((
            Registration {
                ctx: self.gpu.ctx.clone(),
                host: host as usize,
            },
            ExchangeAddr {
                dev,
                layout: *ex.layout(),
                cfg: *ex.config(),
            },
        ))
    }

    /// Queues the fused export: `rows` of `x` (`[*, d_in]`) to exchange input buffer `input`
    /// (row `i` ← `rows[i]`), then `seq` in the step sequence word. Returns immediately.
    pub fn export_rows_fused(
        &mut self,
        ex: &ExchangeAddr,
        x: &cudarc::driver::CudaSlice<f32>,
        d_in: usize,
        rows: &[usize],
        input: u32,
        seq: StepSeq,
    ) -> Result<()> {
        let (c, l) = (&ex.cfg, &ex.layout);
        if input >= c.max_inputs || rows.len() > c.max_rows as usize || d_in > c.max_d_in as usize {
            return Err(CudaError::Unsupported(format!(
                "export of {} rows × {d_in} into input {input} exceeds the exchange's {c:?}",
                rows.len()
            ))
            .into());
        }
        assert!(
            rows.iter().all(|&r| (r + 1) * d_in <= x.len()),
            "export_rows: row outside x"
        );
        self.export_idx.host.clear();
        self.export_idx.host.extend(rows.iter().map(|&r| r as u32));
        self.export_idx.upload(&self.gpu)?;
        let dst = ex.at(l.inputs + input as usize * l.input_stride);
        // SAFETY: `dst` addresses input buffer `input` (max_rows × max_d_in f32, bounds checked
        // above) and `seq` the sequence word, both inside the registered segment that `ex`
        // keeps registered until the device is idle; the counter is 0 between launches (the
        // last block resets it) and all exports run on the one compute stream.
        unsafe {
            self.gpu.export_rows(
                x,
                d_in,
                self.export_idx.get(),
                rows.len(),
                (dst, c.max_d_in as usize),
                (ex.at(l.seq), seq.0),
                &self.export_counter,
            )
        }?;
        Ok(())
    }

    /// Queues: the stream waits until every worker in `workers` has stored a result ≥ `seq`
    /// (`cuStreamWaitValue32` GEQ on its mapped result word), then adds module `module`'s
    /// deltas (row `i` → `y` row `rows[i]`). Returns immediately; the host never waits.
    #[allow(clippy::too_many_arguments)]
    pub fn merge_deltas_waited(
        &mut self,
        ex: &ExchangeAddr,
        y: &mut cudarc::driver::CudaSlice<f32>,
        d_out: usize,
        module: LoraModule,
        rows: &[usize],
        seq: StepSeq,
        workers: &[WorkerId],
    ) -> Result<()> {
        self.wait_workers(ex, seq, workers)?;
        self.merge_deltas_at(ex, y, d_out, module, rows, 0)
    }

    /// Queues: the stream waits until every worker in `workers` has stored a result ≥ `seq`.
    pub fn wait_workers(
        &mut self,
        ex: &ExchangeAddr,
        seq: StepSeq,
        workers: &[WorkerId],
    ) -> Result<()> {
        let (c, l) = (&ex.cfg, &ex.layout);
        for w in workers {
            if w.0 >= c.max_workers {
                return Err(
                    CudaError::Unsupported(format!("worker {} beyond max_workers", w.0)).into(),
                );
            }
            let word = ex.at(l.workers + w.0 as usize * 64 + WORKER_RESULT);
            // SAFETY: `word` is worker w's result u32 inside the registered, mapped segment,
            // registered until the device is idle (Registration::drop).
            unsafe { self.gpu.wait_value_geq(word, seq.0) }?;
        }
        Ok(())
    }

    /// Queues: adds module `module`'s delta rows `first..first + rows.len()` of the exchange
    /// into rows `rows` of `y` (delta row `first + i` → `y` row `rows[i]`). Only after
    /// [`Self::wait_workers`] for the step that wrote them.
    pub fn merge_deltas_at(
        &mut self,
        ex: &ExchangeAddr,
        y: &mut cudarc::driver::CudaSlice<f32>,
        d_out: usize,
        module: LoraModule,
        rows: &[usize],
        first: usize,
    ) -> Result<()> {
        let (c, l) = (&ex.cfg, &ex.layout);
        if first + rows.len() > c.max_rows as usize || d_out > c.max_d_out as usize {
            return Err(CudaError::Unsupported(format!(
                "merge of rows {first}..{} × {d_out} exceeds the exchange's {c:?}",
                first + rows.len()
            ))
            .into());
        }
        assert!(
            rows.iter().all(|&r| (r + 1) * d_out <= y.len()),
            "merge_deltas: row outside y"
        );
        self.merge_idx.host.clear();
        self.merge_idx.host.extend(rows.iter().map(|&r| r as u32));
        self.merge_idx.upload(&self.gpu)?;
        let row_bytes = c.max_d_out as usize * std::mem::size_of::<f32>();
        let delta = ex.at(l.outputs + module.index() * l.output_stride + first * row_bytes);
        // SAFETY: `delta` is row `first` of module `module`'s output buffer (max_rows ×
        // max_d_out f32; rows first..first + rows.len() bounds checked above) in the registered
        // segment; the caller queued the waits for the step that writes them.
        unsafe {
            self.gpu.merge_deltas(
                y,
                d_out,
                self.merge_idx.get(),
                rows.len(),
                (delta, c.max_d_out as usize),
            )
        }?;
        Ok(())
    }

    /// The engine's mapped exchange, when `Backend::map_assist_exchange` set one.
    fn engine_exchange(&self) -> Result<ExchangeAddr> {
        self.assist_ex.as_ref().map(|e| e.addr).ok_or_else(|| {
            CudaError::Unsupported("no exchange is mapped for the assist path".into()).into()
        })
    }

    /// Runs `f` with `rows` flattened into row indices (a buffer reused across calls).
    fn with_rows<T>(
        &mut self,
        rows: &[Range<usize>],
        f: impl FnOnce(&mut Self, &[usize]) -> T,
    ) -> T {
        let mut idx = std::mem::take(&mut self.row_list);
        idx.clear();
        idx.extend(rows.iter().flat_map(|r| r.clone()));
        let r = f(self, &idx);
        self.row_list = idx;
        r
    }

    /// `Backend::export_rows_device`: the cold rows, packed in order, into input 0.
    pub(super) fn export_rows_engine(
        &mut self,
        x: &cudarc::driver::CudaSlice<f32>,
        width: usize,
        rows: &[Range<usize>],
        seq: StepSeq,
    ) -> Result<()> {
        let ex = self.engine_exchange()?;
        self.with_rows(rows, |g, idx| {
            g.export_rows_fused(&ex, x, width, idx, 0, seq)
        })
    }

    /// `Backend::wait_workers_device`.
    pub(super) fn wait_workers_engine(&mut self, seq: StepSeq, workers: &[WorkerId]) -> Result<()> {
        let ex = self.engine_exchange()?;
        self.wait_workers(&ex, seq, workers)
    }

    /// `Backend::merge_rows_device`.
    pub(super) fn merge_rows_engine(
        &mut self,
        y: &mut cudarc::driver::CudaSlice<f32>,
        width: usize,
        module: LoraModule,
        rows: &[Range<usize>],
        first: usize,
    ) -> Result<()> {
        let ex = self.engine_exchange()?;
        self.with_rows(rows, |g, idx| {
            g.merge_deltas_at(&ex, y, width, module, idx, first)
        })
    }
}
