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
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use thaw_ipc::{Exchange, ExchangeConfig, ExchangeLayout, StepSeq, WorkerId, WORKER_RESULT};

use super::launch::{host_register, host_unregister};
use super::{CudaBackend, CudaError};
use crate::adapter::LoraModule;
use crate::error::Result;

/// The exchange segment registered for device access (pinned, mapped, not write-combined:
/// workers read it). Unregistered on drop, after the device has finished with it.
pub struct MappedExchange<'a> {
    ctx: Arc<CudaContext>,
    host: *mut u8,
    dev: u64,
    layout: ExchangeLayout,
    cfg: ExchangeConfig,
    _exchange: PhantomData<&'a Exchange>,
}

impl Drop for MappedExchange<'_> {
    fn drop(&mut self) {
        // Queued exports / merges may still touch the segment.
        if let Err(e) = self.ctx.synchronize() {
            tracing::warn!("synchronize before unregistering the exchange failed: {e}");
        }
        // SAFETY: `host` was registered in `map_exchange`, the mapping is alive (we borrow the
        // Exchange for 'a), and the context is idle, so no GPU work uses it any more.
        unsafe { host_unregister(&self.ctx, self.host) };
    }
}

impl MappedExchange<'_> {
    fn at(&self, off: usize) -> u64 {
        self.dev + off as u64
    }
}

impl CudaBackend {
    /// Registers `ex`'s whole segment (`cuMemHostRegister`, DEVICEMAP | PORTABLE) so kernels
    /// and stream waits can address it.
    pub fn map_exchange<'a>(&self, ex: &'a Exchange) -> Result<MappedExchange<'a>> {
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
        // SAFETY: the segment mapping lives as long as `ex`, which the returned guard borrows;
        // the guard unregisters it on drop. A segment is registered at most once per guard
        // (registering twice fails with an error, not UB).
        let dev = unsafe { host_register(&self.gpu.ctx, host, seg.len(), true) }?
            .expect("mapped registration returns a device address");
        Ok(MappedExchange {
            ctx: self.gpu.ctx.clone(),
            host,
            dev,
            layout: *ex.layout(),
            cfg: *ex.config(),
            _exchange: PhantomData,
        })
    }

    /// Queues the fused export: `rows` of `x` (`[*, d_in]`) to exchange input buffer `input`
    /// (row i ← rows[i]), then `seq` in the step sequence word. Returns immediately.
    pub fn export_rows_fused(
        &mut self,
        ex: &MappedExchange<'_>,
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
        self.export_idx.upload(&self.gpu.stream)?;
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
    /// deltas (row i → y row rows[i]). Returns immediately; the host never waits.
    #[allow(clippy::too_many_arguments)]
    pub fn merge_deltas_waited(
        &mut self,
        ex: &MappedExchange<'_>,
        y: &mut cudarc::driver::CudaSlice<f32>,
        d_out: usize,
        module: LoraModule,
        rows: &[usize],
        seq: StepSeq,
        workers: &[WorkerId],
    ) -> Result<()> {
        let (c, l) = (&ex.cfg, &ex.layout);
        if rows.len() > c.max_rows as usize || d_out > c.max_d_out as usize {
            return Err(CudaError::Unsupported(format!(
                "merge of {} rows × {d_out} exceeds the exchange's {c:?}",
                rows.len()
            ))
            .into());
        }
        assert!(
            rows.iter().all(|&r| (r + 1) * d_out <= y.len()),
            "merge_deltas: row outside y"
        );
        for w in workers {
            if w.0 >= c.max_workers {
                return Err(
                    CudaError::Unsupported(format!("worker {} beyond max_workers", w.0)).into(),
                );
            }
            let word = ex.at(l.workers + w.0 as usize * 64 + WORKER_RESULT);
            // SAFETY: `word` is worker w's result u32 inside the registered, mapped segment,
            // registered until the device is idle (MappedExchange::drop).
            unsafe { self.gpu.wait_value_geq(word, seq.0) }?;
        }
        self.merge_idx.host.clear();
        self.merge_idx.host.extend(rows.iter().map(|&r| r as u32));
        self.merge_idx.upload(&self.gpu.stream)?;
        let delta = ex.at(l.outputs + module.index() * l.output_stride);
        // SAFETY: `delta` is module `module`'s output buffer (max_rows × max_d_out f32, bounds
        // checked above) in the registered segment; the waits queued above release only after
        // every worker has published this step's rows.
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
}
