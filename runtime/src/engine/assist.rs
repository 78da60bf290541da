//! CPU assist: LoRA deltas for rows whose adapter layer has not landed on the device.
//!
//! Per layer and per distinct input (normed hidden → q,k,v; attention output → o; normed
//! hidden → gate,up; SwiGLU product → down), the engine exports the cold rows once, starts the
//! CPU computation, runs the base GEMMs meanwhile, then waits and merges (DESIGN §4). The CPU
//! side is either the pool of pinned worker processes (`thaw-cpu-lora`) reading the adapter
//! from the shared host store, or — with no pool — the engine thread itself.
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thaw_cpu_lora::kernel::{lora_delta, LoraMat, LoraProblem, Scratch};
use thaw_cpu_lora::{LoraJob, LoraPool, Ticket};
use thaw_ipc::{AdapterHandle, LayerIdx as IpcLayer, Module, ModuleMask};

use crate::adapter::{LoraAdapter, LoraModule};
use crate::error::{Result, RuntimeError};

/// Rows of one cold segment: where they sit in the step, and in the packed export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ColdSeg {
    pub rows: Range<usize>,
    pub packed: Range<usize>,
    /// Index into the step's adapter list.
    pub adapter: u32,
}

/// How long the engine waits for the workers before the pool's own recovery gives up.
const ASSIST_DEADLINE: Duration = Duration::from_secs(30);

fn ipc_module(m: LoraModule) -> Module {
    Module::ALL[m.index()]
}

/// Reusable buffers of the assist path (sized on first use, then reused).
#[derive(Default)]
pub(crate) struct AssistBuffers {
    pub input: Vec<f32>,
    pub out: [Vec<f32>; 7],
    scratch: Scratch,
    jobs: Vec<LoraJob>,
}

/// Where the deltas are computed.
pub(crate) enum AssistPath<'a> {
    /// On the engine thread, from the adapters' host copies.
    Inline,
    /// On the worker pool, from the host store.
    Pool {
        pool: &'a mut LoraPool,
        handles: &'a [Option<AdapterHandle>],
        ticket: Option<Ticket>,
    },
}

/// One step's assist state.
pub(crate) struct Assist<'a> {
    pub path: AssistPath<'a>,
    pub host: &'a [&'a Arc<LoraAdapter>],
    pub buf: &'a mut AssistBuffers,
    /// Rows the CPU computed this step (row × module), for metrics.
    pub rows_assisted: usize,
}

impl Assist<'_> {
    /// Starts Δ for `group` of `layer` over the packed input in `buf.input` (`[n, d_in]`).
    pub fn start(
        &mut self,
        layer: usize,
        group: &[LoraModule],
        segs: &[ColdSeg],
        d_in: usize,
        d_out: impl Fn(LoraModule) -> usize,
    ) -> Result<()> {
        let n: usize = segs.iter().map(|s| s.packed.len()).sum();
        match &mut self.path {
            AssistPath::Inline => self.compute_inline(layer, group, segs, d_in, &d_out),
            AssistPath::Pool {
                pool,
                handles,
                ticket,
            } => {
                let cap = pool.exchange().config();
                if n > cap.max_rows as usize || d_in > cap.max_d_in as usize {
                    // More cold rows than the exchange holds: this group runs on the engine
                    // thread (correct, just not overlapped). Size the exchange's max_rows to
                    // the step's token budget to avoid it.
                    tracing::debug!(
                        n,
                        cap = cap.max_rows,
                        "cold rows exceed the exchange; assisting inline"
                    );
                    return self.compute_inline(layer, group, segs, d_in, &d_out);
                }
                let pool_err = |e: thaw_cpu_lora::CpuLoraError| {
                    RuntimeError::Backend(format!("CPU LoRA workers: {e}"))
                };
                pool.write_input(0, 0, &self.buf.input[..n * d_in], d_in)
                    .map_err(pool_err)?;
                self.buf.jobs.clear();
                for s in segs {
                    let modules: ModuleMask = group
                        .iter()
                        .filter(|&&m| self.host[s.adapter as usize].get(layer, m).is_some())
                        .map(|&m| ipc_module(m))
                        .collect();
                    if modules == ModuleMask::EMPTY {
                        continue;
                    }
                    let handle = handles[s.adapter as usize].ok_or_else(|| {
                        RuntimeError::Backend("cold adapter is not in the host store".into())
                    })?;
                    self.rows_assisted += s.packed.len() * modules.iter().count();
                    self.buf.jobs.push(LoraJob {
                        adapter: handle,
                        layer: IpcLayer(layer as u32),
                        modules,
                        input: 0,
                        rows: s.packed.start as u32..s.packed.end as u32,
                    });
                }
                *ticket = Some(pool.submit(&self.buf.jobs).map_err(pool_err)?);
                Ok(())
            }
        }
    }

    /// Δ for `group` computed on the engine thread from the adapters' host copies.
    fn compute_inline(
        &mut self,
        layer: usize,
        group: &[LoraModule],
        segs: &[ColdSeg],
        d_in: usize,
        d_out: &impl Fn(LoraModule) -> usize,
    ) -> Result<()> {
        let n: usize = segs.iter().map(|s| s.packed.len()).sum();
        for &m in group {
            let out = &mut self.buf.out[m.index()];
            out.clear();
            out.resize(n * d_out(m), 0.0);
        }
        for s in segs {
            let a = self.host[s.adapter as usize];
            for &m in group {
                let Some(w) = a.get(layer, m) else { continue };
                let d = d_out(m);
                let p = LoraProblem {
                    rows: s.packed.len(),
                    d_in,
                    d_out: d,
                    rank: w.rank,
                    scale: w.scale,
                };
                lora_delta(
                    &p,
                    &self.buf.input[s.packed.start * d_in..s.packed.end * d_in],
                    LoraMat::from_f32(&w.a),
                    LoraMat::from_f32(&w.b),
                    &mut self.buf.out[m.index()][s.packed.start * d..s.packed.end * d],
                    false,
                    &mut self.buf.scratch,
                )
                .expect("LoRA shapes were validated when the adapter was loaded");
                self.rows_assisted += s.packed.len();
            }
        }
        Ok(())
    }

    /// Waits for the deltas of the last [`Assist::start`] and leaves them packed in
    /// `buf.out[module]` (`[n, d_out]`).
    pub fn finish(
        &mut self,
        group: &[LoraModule],
        n: usize,
        d_out: impl Fn(LoraModule) -> usize,
    ) -> Result<()> {
        let AssistPath::Pool { pool, ticket, .. } = &mut self.path else {
            return Ok(());
        };
        let Some(t) = ticket.take() else {
            return Ok(());
        };
        pool.wait(t, Instant::now() + ASSIST_DEADLINE)
            .map_err(|e| RuntimeError::Backend(format!("CPU LoRA workers: {e}")))?;
        let stride = pool.output_stride();
        for &m in group {
            let d = d_out(m);
            let src = pool
                .output(ipc_module(m), 0..n as u32)
                .map_err(|e| RuntimeError::Backend(format!("CPU LoRA workers: {e}")))?;
            let out = &mut self.buf.out[m.index()];
            out.clear();
            for r in 0..n {
                out.extend_from_slice(&src[r * stride..r * stride + d]);
            }
        }
        Ok(())
    }
}
