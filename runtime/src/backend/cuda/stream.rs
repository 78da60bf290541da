//! Layer-wise adapter streaming (DESIGN §3): the host store is registered as pinned memory
//! (`cuMemHostRegister`, portable, not write-combined — CPU workers read it), an adapter's
//! factors are copied on their own stream layer 0 first, and an event after each layer records
//! its landing; [`StreamingLora::landed_layers`] tells the next step's plan which layers can run
//! on the GPU.
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use thaw_ipc::{AdapterLease, LayerIdx as IpcLayer, Module, Segment};

use super::launch::{copy_htod_async, host_register, host_unregister};
use super::weights::{CudaLora, LoraPlan};
use super::{CudaBackend, CudaError, DType};
use crate::adapter::LoraModule;
use crate::error::Result;

/// A host segment registered as page-locked memory for DMA; unregistered on drop.
pub struct PinnedHostRegion<'a> {
    ctx: Arc<CudaContext>,
    base: *mut u8,
    len: usize,
    _seg: PhantomData<&'a Segment>,
}

impl PinnedHostRegion<'_> {
    fn contains(&self, bytes: &[u8]) -> bool {
        let (b, e) = (self.base as usize, self.base as usize + self.len);
        let p = bytes.as_ptr() as usize;
        p >= b && p + bytes.len() <= e
    }
}

impl Drop for PinnedHostRegion<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.synchronize() {
            tracing::warn!("synchronize before unregistering the host store failed: {e}");
        }
        // SAFETY: registered in `pin_host_store`; the segment is alive (borrowed for 'a) and
        // the context is idle, so no copy reads it any more.
        unsafe { host_unregister(&self.ctx, self.base) };
    }
}

/// An adapter whose layers are landing on the device straight from the host store. Holds the
/// store lease until every copy has completed, so the source bytes cannot change under the DMA.
pub struct StreamingLora<'s> {
    lora: Option<CudaLora>,
    _lease: AdapterLease<'s>,
}

impl StreamingLora<'_> {
    /// Layers `0..n` have landed (polls the per-layer events in order; never blocks).
    pub fn landed_layers(&self) -> usize {
        self.lora.as_ref().map_or(0, CudaLora::landed_layers)
    }

    /// The device adapter. Its layers `>= landed_layers()` must not be used by GPU kernels yet
    /// (the engine's `LoraBatch::landed` enforces that).
    pub fn lora(&self) -> &CudaLora {
        self.lora.as_ref().expect("present until finish")
    }

    /// Blocks until every layer has landed, then releases the lease.
    pub fn finish(mut self) -> Result<CudaLora> {
        let lora = self.lora.take().expect("present until finish");
        if let Some(last) = lora.events.last() {
            last.synchronize().map_err(CudaError::from)?;
        }
        Ok(lora)
    }
}

impl Drop for StreamingLora<'_> {
    fn drop(&mut self) {
        // The lease (dropped after this) must outlive the DMA reading its bytes.
        if let Some(last) = self.lora.as_ref().and_then(|l| l.events.last()) {
            let _ = last.synchronize();
        }
    }
}

fn module_of(m: LoraModule) -> Module {
    Module::from_index(m.index()).expect("runtime and ipc modules share the 7 indices")
}

impl CudaBackend {
    /// Registers the host store segment as pinned memory for the copy engine.
    pub fn pin_host_store<'a>(&self, seg: &'a Segment) -> Result<PinnedHostRegion<'a>> {
        let base = seg.base_addr() as *mut u8;
        // SAFETY: the mapping lives as long as `seg`, which the guard borrows; the guard
        // unregisters on drop after the context is idle.
        unsafe { host_register(&self.gpu.ctx, base, seg.len(), false) }?;
        Ok(PinnedHostRegion {
            ctx: self.gpu.ctx.clone(),
            base,
            len: seg.len(),
            _seg: PhantomData,
        })
    }

    /// A copy stream for adapter streaming (create once, reuse).
    pub fn copy_stream(&self) -> Result<Arc<CudaStream>> {
        Ok(self.gpu.ctx.new_stream().map_err(CudaError::from)?)
    }

    /// Starts streaming a leased adapter from the pinned store on `copy`: layer 0 first, one
    /// event per layer. The stored dtype must be the backend's weight dtype (no conversion on
    /// the DMA path).
    pub fn stream_adapter<'s>(
        &self,
        copy: &Arc<CudaStream>,
        store: &PinnedHostRegion<'_>,
        lease: AdapterLease<'s>,
    ) -> Result<StreamingLora<'s>> {
        let n_layers = lease.n_layers() as usize;
        let want = self.gpu.weight_dtype;
        let mut factors = Vec::new();
        for layer in 0..n_layers {
            for m in LoraModule::ALL {
                if let Some(w) = lease.module(IpcLayer(layer as u32), module_of(m)) {
                    let dt = match w.dtype {
                        thaw_ipc::DType::F32 => DType::F32,
                        thaw_ipc::DType::F16 => DType::F16,
                        thaw_ipc::DType::BF16 => DType::Bf16,
                    };
                    if dt != want {
                        return Err(CudaError::Unsupported(format!(
                            "adapter stored as {dt:?} but the backend's weights are {want:?}; \
                             store adapters in the backend's weight dtype"
                        ))
                        .into());
                    }
                    if !store.contains(w.a) || !store.contains(w.b) {
                        return Err(CudaError::Unsupported(
                            "adapter bytes lie outside the pinned host store".into(),
                        )
                        .into());
                    }
                    factors.push((layer, m, w.rank, w.scale, w.a, w.b));
                }
            }
        }
        let plan = LoraPlan::new(
            n_layers,
            factors
                .iter()
                .map(|f| (f.0, f.1, f.2, f.3, f.4.len(), f.5.len())),
        );
        let mut weights = copy
            .alloc_zeros::<u8>(plan.total)
            .map_err(CudaError::from)?;
        let mut events = Vec::with_capacity(n_layers);
        let mut fi = 0;
        for layer in 0..n_layers {
            while fi < factors.len() && factors[fi].0 == layer {
                let (_, _, _, _, a, b) = factors[fi];
                let (a_off, b_off) = (plan.entries[fi].a_off, plan.entries[fi].b_off);
                // SAFETY: `a` / `b` lie in the pinned store (checked), stay unchanged while the
                // lease — moved into the returned StreamingLora, which waits for the last event
                // before dropping it — is held; the plan sized `weights` for every factor.
                unsafe {
                    copy_htod_async(copy, &mut weights, a_off, a.as_ptr(), a.len())?;
                    copy_htod_async(copy, &mut weights, b_off, b.as_ptr(), b.len())?;
                }
                fi += 1;
            }
            events.push(copy.record_event(None).map_err(CudaError::from)?);
        }
        // The descriptor table only holds addresses; it is uploaded on the compute stream and
        // valid at once (kernels read a layer's factors only after its event completed).
        let lora = plan.finish(&self.gpu.stream, weights, events, None)?;
        Ok(StreamingLora {
            lora: Some(lora),
            _lease: lease,
        })
    }
}
