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

use thaw_cpu_lora::kernel::{lora_delta, LoraProblem, Scratch};
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

/// Where an engine's CPU-assisted steps spent their time, summed since the engine started.
/// Each stage runs on the engine thread; `base` is the device work the CPU overlaps with.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AssistProfile {
    /// (layer, input group) pairs that needed the CPU.
    pub groups: u64,
    /// Cold rows copied out of the activations (straight into the exchange).
    pub export: Duration,
    /// Input written to the exchange and jobs submitted (or, inline, the deltas computed).
    pub submit: Duration,
    /// Base projections of the group, run while the CPU works.
    pub base: Duration,
    /// Waiting for the workers after the base projections.
    pub wait: Duration,
    /// Deltas added into the module outputs (straight from the exchange).
    pub merge: Duration,
}

impl AssistProfile {
    /// Engine-thread time the assist path added on top of the base projections.
    pub fn overhead(&self) -> Duration {
        self.export + self.submit + self.wait + self.merge
    }

    /// What was spent between `before` (an earlier reading) and this one.
    pub fn since(&self, before: &AssistProfile) -> AssistProfile {
        AssistProfile {
            groups: self.groups - before.groups,
            export: self.export - before.export,
            submit: self.submit - before.submit,
            base: self.base - before.base,
            wait: self.wait - before.wait,
            merge: self.merge - before.merge,
        }
    }
}

/// Reusable buffers of the assist path (sized on first use, then reused).
#[derive(Default)]
pub(crate) struct AssistBuffers {
    pub input: Vec<f32>,
    pub out: [Vec<f32>; 7],
    scratch: Scratch,
    pub(super) jobs: Vec<LoraJob>,
    pub profile: AssistProfile,
    /// The device path's state ([`super::assist_device`]).
    pub(super) device: super::assist_device::DeviceAssist,
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
    /// Whether the current group's input and deltas live in the workers' exchange.
    pub on_pool: bool,
}

/// Fills `jobs` with one job per cold segment whose adapter targets a module of `group` in
/// `layer` (rows in the packed export, input 0); returns the row × module deltas they compute.
pub(super) fn cold_jobs(
    host: &[&Arc<LoraAdapter>],
    handles: &[Option<AdapterHandle>],
    layer: usize,
    group: &[LoraModule],
    segs: &[ColdSeg],
    jobs: &mut Vec<LoraJob>,
) -> Result<usize> {
    jobs.clear();
    let mut rows = 0;
    for s in segs {
        let modules: ModuleMask = group
            .iter()
            .filter(|&&m| host[s.adapter as usize].get(layer, m).is_some())
            .map(|&m| ipc_module(m))
            .collect();
        if modules == ModuleMask::EMPTY {
            continue;
        }
        let handle = handles[s.adapter as usize]
            .ok_or_else(|| RuntimeError::Backend("cold adapter is not in the host store".into()))?;
        rows += s.packed.len() * modules.iter().count();
        jobs.push(LoraJob {
            adapter: handle,
            layer: IpcLayer(layer as u32),
            modules,
            input: 0,
            rows: s.packed.start as u32..s.packed.end as u32,
        });
    }
    Ok(rows)
}

pub(super) fn pool_err(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Backend(format!("CPU LoRA workers: {e}"))
}

/// A failed wait for the workers' deltas: an adapter whose file they could not read is named
/// (its requests fail, the step's others can run again); anything else is a backend error.
pub(super) fn wait_err(e: thaw_cpu_lora::CpuLoraError) -> RuntimeError {
    match e {
        thaw_cpu_lora::CpuLoraError::AdapterFile { adapter, .. } => {
            RuntimeError::AdapterUnreadable {
                adapter: crate::ids::AdapterId(adapter as u32),
                message: e.to_string(),
            }
        }
        e => pool_err(e),
    }
}

impl Assist<'_> {
    /// Where to export the `n` cold rows (`d_in` wide) of the next group: the workers'
    /// exchange when they can take it, else the engine's own buffer. Returns the buffer and
    /// its row stride.
    pub fn input(&mut self, n: usize, d_in: usize) -> Result<(&mut [f32], usize)> {
        self.on_pool = false;
        if let AssistPath::Pool { pool, .. } = &mut self.path {
            let cap = pool.exchange().config();
            if n <= cap.max_rows as usize && d_in <= cap.max_d_in as usize {
                self.on_pool = true;
                let stride = pool.input_stride();
                let dst = pool.input_mut(0, 0..n as u32).map_err(pool_err)?;
                return Ok((dst, stride));
            }
            // More cold rows than the exchange holds: this group runs on the engine thread
            // (correct, just not overlapped). Size the exchange's max_rows to the step's
            // token budget to avoid it.
            tracing::debug!(
                n,
                cap = cap.max_rows,
                "cold rows exceed the exchange; assisting inline"
            );
        }
        self.buf.input.clear();
        self.buf.input.resize(n * d_in, 0.0);
        Ok((&mut self.buf.input, d_in))
    }

    /// Starts Δ for `group` of `layer` over the input filled through [`Assist::input`].
    pub fn start(
        &mut self,
        layer: usize,
        group: &[LoraModule],
        segs: &[ColdSeg],
        d_in: usize,
        d_out: impl Fn(LoraModule) -> usize,
    ) -> Result<()> {
        let t0 = Instant::now();
        let r = if self.on_pool {
            self.submit(layer, group, segs)
        } else {
            self.compute_inline(layer, group, segs, d_in, &d_out);
            Ok(())
        };
        self.buf.profile.groups += 1;
        self.buf.profile.submit += t0.elapsed();
        r
    }

    /// Posts one job per cold segment to the workers.
    fn submit(&mut self, layer: usize, group: &[LoraModule], segs: &[ColdSeg]) -> Result<()> {
        let AssistPath::Pool {
            pool,
            handles,
            ticket,
        } = &mut self.path
        else {
            unreachable!("on_pool is only set with a pool");
        };
        self.rows_assisted +=
            cold_jobs(self.host, handles, layer, group, segs, &mut self.buf.jobs)?;
        *ticket = Some(pool.submit(&self.buf.jobs).map_err(pool_err)?);
        Ok(())
    }

    /// Δ for `group` computed on the engine thread from the adapters' host copies.
    fn compute_inline(
        &mut self,
        layer: usize,
        group: &[LoraModule],
        segs: &[ColdSeg],
        d_in: usize,
        d_out: &impl Fn(LoraModule) -> usize,
    ) {
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
                    w.a.mat(),
                    w.b.mat(),
                    &mut self.buf.out[m.index()][s.packed.start * d..s.packed.end * d],
                    false,
                    &mut self.buf.scratch,
                )
                .expect("LoRA shapes were validated when the adapter was loaded");
                self.rows_assisted += s.packed.len();
            }
        }
    }

    /// Waits for the deltas of the last [`Assist::start`].
    pub fn finish(&mut self) -> Result<()> {
        let AssistPath::Pool { pool, ticket, .. } = &mut self.path else {
            return Ok(());
        };
        let Some(t) = ticket.take() else {
            return Ok(());
        };
        let t0 = Instant::now();
        pool.wait(t, t0 + ASSIST_DEADLINE).map_err(wait_err)?;
        self.buf.profile.wait += t0.elapsed();
        Ok(())
    }

    /// The `[n, d_out]` deltas of `m` from the last finished group, and their row stride.
    pub fn deltas(&self, m: LoraModule, n: usize, d_out: usize) -> Result<(&[f32], usize)> {
        match &self.path {
            AssistPath::Pool { pool, .. } if self.on_pool => {
                let src = pool.output(ipc_module(m), 0..n as u32).map_err(pool_err)?;
                Ok((src, pool.output_stride()))
            }
            _ => Ok((&self.buf.out[m.index()][..n * d_out], d_out)),
        }
    }
}
