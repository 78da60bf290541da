//! One worker's share of a step: for each of its jobs and each module, read the adapter's
//! (layer, module) weights in place from the host store — or, for a file entry, from the
//! adapter's memory-mapped file ([`crate::file_maps`]) — and write
//! `Δ = scale · (x · Aᵀ) · Bᵀ` into the exchange. Used by the worker process and, for a dead
//! worker's slice, by the engine standing in for it ([`crate::pool`]) — one code path.

use std::time::Instant;

use thaw_ipc::{DType, Job, StepSeq, StoreReader, WorkerPort};

use crate::file_maps::FileMaps;
use crate::kernel::{lora_delta, LoraMat, LoraProblem, Scratch, WeightDtype};
use crate::stats::WorkerStepStat;

/// Maps the store's dtype code to the kernel's.
pub fn weight_dtype(d: DType) -> WeightDtype {
    match d {
        DType::F32 => WeightDtype::F32,
        DType::F16 => WeightDtype::F16,
        DType::BF16 => WeightDtype::Bf16,
    }
}

/// Buffers reused across steps: after the first steps of the largest shapes nothing is
/// allocated ([`Vec`]s only grow).
#[derive(Debug, Default)]
pub struct ComputeState {
    jobs: Vec<Job>,
    scratch: Scratch,
    /// `x` rows packed to stride `d_in` when the exchange's stride is wider.
    x_packed: Vec<f32>,
    /// Δ rows at stride `d_out`, scattered to the exchange's wider stride.
    y_packed: Vec<f32>,
    /// Adapter files mapped for the host store's file entries.
    files: FileMaps,
}

/// Called after each (job, module) is written: the fault-injection hook of tests.
pub type MidJobHook<'a> = &'a mut dyn FnMut();

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

impl ComputeState {
    /// State sized for an exchange with `max_jobs` jobs.
    pub fn new(max_jobs: usize) -> Self {
        Self {
            jobs: Vec::with_capacity(max_jobs),
            ..Self::default()
        }
    }

    /// Computes every job of the step `port` is in for its worker slot, then returns what
    /// to record (the caller records it and calls `port.complete()`). A (job, module) whose
    /// weights are missing or whose shapes do not fit gets NaN rows and counts as failed.
    pub fn run_step(
        &mut self,
        port: &mut WorkerPort,
        store: &StoreReader,
        seq: StepSeq,
        mut hook: Option<MidJobHook<'_>>,
    ) -> WorkerStepStat {
        let t0 = Instant::now();
        self.files.tend(store);
        self.jobs.clear();
        self.jobs.extend(port.my_jobs());
        let cfg = *port.exchange().config();
        let (sx, sy) = (cfg.max_d_in as usize, cfg.max_d_out as usize);
        let mut stat = WorkerStepStat {
            seq,
            ..Default::default()
        };
        for ji in 0..self.jobs.len() {
            let job = self.jobs[ji];
            let rows = job.row_count as usize;
            let mut packed_d_in = None;
            for module in job.modules.iter() {
                port.beat();
                let Ok((x, y)) = port.job_io(&job, module) else {
                    stat.failed += 1;
                    continue;
                };
                let view = store.view(job.adapter, job.layer, module);
                let weights = match view.as_deref() {
                    Some(w) => Some(*w),
                    None => self
                        .files
                        .weights(store, job.adapter, job.layer, module)
                        .unwrap_or_else(|e| {
                            tracing::error!(
                                adapter = job.adapter.id.0,
                                layer = job.layer.0,
                                "CPU LoRA from the adapter's file: {e}"
                            );
                            None
                        }),
                };
                let ok = weights.as_ref().is_some_and(|v| {
                    let (d_in, d_out) = (v.d_in as usize, v.d_out as usize);
                    if d_in > sx || d_out > sy {
                        return false;
                    }
                    let p = LoraProblem {
                        rows,
                        d_in,
                        d_out,
                        rank: v.rank as usize,
                        scale: v.scale,
                    };
                    let dtype = weight_dtype(v.dtype);
                    let a = LoraMat { dtype, bytes: v.a };
                    let b = LoraMat { dtype, bytes: v.b };
                    let xs: &[f32] = if d_in == sx {
                        &x[..rows * d_in]
                    } else {
                        let xp = grow(&mut self.x_packed, rows * d_in);
                        if packed_d_in != Some(d_in) {
                            for (dst, src) in xp.chunks_exact_mut(d_in).zip(x.chunks_exact(sx)) {
                                dst.copy_from_slice(&src[..d_in]);
                            }
                            packed_d_in = Some(d_in);
                        }
                        xp
                    };
                    if d_out == sy {
                        let out = &mut y[..rows * d_out];
                        lora_delta(&p, xs, a, b, out, false, &mut self.scratch).is_ok()
                    } else {
                        let yp = grow(&mut self.y_packed, rows * d_out);
                        let r = lora_delta(&p, xs, a, b, yp, false, &mut self.scratch);
                        for (dst, src) in y.chunks_exact_mut(sy).zip(yp.chunks_exact(d_out)) {
                            dst[..d_out].copy_from_slice(src);
                        }
                        r.is_ok()
                    }
                });
                if ok {
                    stat.rows += job.row_count;
                } else {
                    y.fill(f32::NAN);
                    stat.failed += 1;
                }
                if let Some(h) = hook.as_mut() {
                    h();
                }
            }
        }
        stat.compute_ns = t0.elapsed().as_nanos() as u64;
        stat
    }
}
