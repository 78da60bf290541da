//! Adapters streamed to the GPU through the shared upload pipeline (`crate::upload`): the
//! pipeline started on first use or at start-up with `--max-cpu-lora-bytes`, an adapter queued
//! at its priority into its own allocation or into a run of KV blocks (paged), and the waits
//! on its layers landing. The engine thread here does only O(layers) work: the loader threads
//! fill the pinned arena and the copy thread issues the layer copies.
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaStream;
use thaw_kernels::cpu::KvLayout;

use super::backend::CudaKvLayer;
use super::launch::dptr;
use super::upload::{CudaCopy, CudaDst, LayerLanding};
use super::weights::{finish_lora, plan_lora, weight_dtype, CudaLora, LoraPlan};
use super::{CudaBackend, CudaError};
use crate::adapter::LoraAdapter;
use crate::backend::PagePlace;
use crate::error::Result;
use crate::residency::LoadPriority;
use crate::upload::{Upload, UploadPipeline};

/// Arena of a pipeline started on first use: the default `--max-cpu-lora-bytes`.
const DEFAULT_UPLOAD_ARENA: usize = 4 << 30;

/// Loader threads of the CUDA backend's upload pipeline.
const UPLOAD_LOADERS: usize = 4;

impl CudaBackend {
    /// The upload pipeline, started (arena allocated and registered) on first use unless
    /// [`CudaBackend::start_upload`] did it at start-up.
    pub(super) fn upload(&self) -> Result<&UploadPipeline<CudaCopy>> {
        if let Some(p) = self.upload.get() {
            return Ok(p);
        }
        let copy = CudaCopy::new(&self.gpu.ctx)?;
        let started = UploadPipeline::start(copy, DEFAULT_UPLOAD_ARENA, UPLOAD_LOADERS)?;
        // The backend is used from one thread (`&self` here only because `upload_lora` takes
        // it), so nobody set it meanwhile; if someone had, theirs is kept and ours dropped.
        Ok(self.upload.get_or_init(|| started))
    }

    /// Allocates the pinned upload arena (`bytes`, `--max-cpu-lora-bytes`), registers it with
    /// the driver once, and starts the pipeline's threads (replacing one started on first use).
    pub fn start_upload(&mut self, bytes: usize) -> Result<()> {
        let copy = CudaCopy::new(&self.gpu.ctx)?;
        self.upload = OnceLock::from(UploadPipeline::start(copy, bytes, UPLOAD_LOADERS)?);
        Ok(())
    }

    /// Queues `adapter` on the upload pipeline at `class`, into the run of KV blocks `place`
    /// holds or, without one, into an allocation of its own. Here, on the engine thread: its
    /// layout (O(layers)), the destination and the descriptor table; loader threads write its
    /// bytes into the pinned arena (in the weight dtype, converted there if the loader did
    /// not), the copy thread copies each layer on the copy stream and publishes it after the
    /// layer's event. Nothing proportional to the adapter's bytes runs here.
    pub(super) fn try_stream_lora(
        &self,
        adapter: &Arc<LoraAdapter>,
        class: LoadPriority,
        place: Option<PagePlace<'_, CudaKvLayer>>,
    ) -> Result<CudaLora> {
        let max = thaw_kernels::cuda::registry::shape::MAX_LORA_RANK;
        if adapter.max_rank() > max {
            return Err(CudaError::Unsupported(format!(
                "adapter rank {} is above the CUDA LoRA kernels' limit of {max}; use an adapter \
                 of rank {max} or less",
                adapter.max_rank()
            ))
            .into());
        }
        let dt = self.gpu.weight_dtype;
        let pipeline = self.upload()?;
        let (plan, weights) = match place {
            None => {
                let plan = plan_lora(adapter, dt);
                let w = pipeline.device().alloc(plan.total)?;
                (plan, w)
            }
            Some(p) => self.paged_dst(adapter, p, pipeline.device().stream())?,
        };
        let weights = Arc::new(weights);
        let landing = Arc::new(LayerLanding::default());
        let lora = finish_lora(
            &plan,
            &self.gpu.stream,
            weights.clone(),
            Some(landing.clone()),
        )?;
        pipeline.submit(
            Upload {
                adapter: adapter.clone(),
                layout: plan,
                dtype: Some(weight_dtype(dt)),
                dst: weights,
                landing,
            },
            class,
        )?;
        Ok(lora)
    }

    /// KV-block chunk bytes (one layer's K or V block) of `layout` in this backend's KV dtype.
    pub(super) fn kv_chunk(&self, layout: KvLayout) -> usize {
        layout.block_len() * self.gpu.kv_dtype.size()
    }

    /// The paged image of `adapter` and its destination: in each layer's K and V buffers, the
    /// blocks of `place`'s run.
    pub(super) fn paged_dst(
        &self,
        adapter: &LoraAdapter,
        place: PagePlace<'_, CudaKvLayer>,
        stream: &CudaStream,
    ) -> Result<(LoraPlan, CudaDst)> {
        let PagePlace { kv, lease } = place;
        let bad = |what: String| -> crate::error::RuntimeError {
            CudaError::Unsupported(format!("placing an adapter in KV blocks: {what}")).into()
        };
        let first = kv.first().ok_or_else(|| bad("no KV cache".into()))?;
        let chunk = self.kv_chunk(first.layout);
        let dt = weight_dtype(self.gpu.weight_dtype);
        let (n, plan) = LoraPlan::of_paged(adapter, Some(dt), chunk)
            .ok_or_else(|| bad(format!("blocks of {chunk} bytes hold no paged image")))?;
        let run = lease.run();
        if run.len() != n || kv.len() != plan.n_layers || kv.iter().any(|l| run.end > l.num_blocks)
        {
            return Err(bad(format!(
                "{} blocks at {run:?} of {} layers for an image of {n} pages and {} layers",
                run.len(),
                kv.len(),
                plan.n_layers
            )));
        }
        let start = (run.start * chunk) as u64;
        let regions = kv
            .iter()
            .flat_map(|l| [dptr(&l.k, stream) + start, dptr(&l.v, stream) + start])
            .collect();
        Ok((
            plan,
            CudaDst::Paged {
                regions,
                region_len: n * chunk,
                _lease: lease,
            },
        ))
    }

    /// Bytes a demand load queued now waits behind on the copy stream (0 before any upload).
    pub fn link_backlog(&self) -> u64 {
        self.upload.get().map_or(0, UploadPipeline::demand_backlog)
    }

    /// Blocks until every layer of `lora` is on the device, or `timeout` passes (tests and
    /// benchmarks that time resident adapters; the serving loop never waits).
    pub fn wait_landed(&self, lora: &CudaLora, timeout: std::time::Duration) -> Result<()> {
        let t0 = std::time::Instant::now();
        loop {
            if lora.landed_layers() >= lora.num_layers() {
                return Ok(());
            }
            if let Some(why) = lora.landing.as_ref().and_then(|l| l.failure()) {
                return Err(
                    CudaError::Unsupported(format!("uploading the adapter failed: {why}")).into(),
                );
            }
            if t0.elapsed() > timeout {
                return Err(CudaError::Unsupported(format!(
                    "the adapter's layers did not land within {timeout:?} ({} of {})",
                    lora.landed_layers(),
                    lora.num_layers()
                ))
                .into());
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }
}
