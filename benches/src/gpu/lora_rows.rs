//! The SGMV / BGMV table: q_proj of the model's shape, a pool of adapters per rank, each case
//! timed twice.
//!
//! * Wall clock per call over back-to-back calls ([`wall_us`]): what the engine pays, the
//!   figure issue 29's "no small-batch call above 8 µs" is about. At a few rows it is the
//!   host's launch cost, not the kernel's.
//! * Device time per call ([`device_us`]): the backend's own clock (events on the CUDA stream;
//!   the wall clock on the CPU backend) around the same back-to-back calls, queued behind a few
//!   large products ([`Busy`]) so that every call is on the stream before the GPU reaches the
//!   first: the kernels then run without host gaps, and bytes over that time is the bandwidth
//!   the kernels reach (issue 29's "≥ 60% of HBM bandwidth at batch ≥ 16"). A round where the
//!   host took longer to queue the calls than the products kept the GPU busy is not trusted:
//!   the row then shows no device time.
//!
//! With `THAW_CUDA_LORA_SMALL=1` every case runs twice, with the two Punica launches and with
//! the one fused launch, so one run shows both side by side (the fused row says where its plan
//! declined the call and the two launches ran).
use std::time::Instant;

use thaw_runtime::adapter::LoraModule;
use thaw_runtime::backend::any::{AnyBackend, AnyBuf, AnyLinear};
use thaw_runtime::backend::profiled::OpClock;
use thaw_runtime::backend::{Backend, LinearDims, LoraKernel};
use thaw_runtime::microbench::{
    fill, run_lora_case, synthetic_adapter, ElemSizes, LoraCase, LoraCaseResult, Popularity,
};
use thaw_runtime::model::ModelConfig;

use super::peaks::wall_us;
use super::GpuArgs;

/// One row of the table.
#[derive(Clone, Debug)]
pub struct LoraRow {
    /// The kernels that ran: the backend's LoRA implementation (`punica`, `classic`, `cpu`),
    /// with `+small` where the one-launch kernel was on (and `, declined` where its plan sent
    /// the call to the two launches).
    pub imp: String,
    /// The case and its wall-clock µs per call.
    pub res: LoraCaseResult,
    /// Device µs per call; `None` where the host could not queue the calls ahead of the GPU.
    pub device_us: Option<f64>,
}

impl LoraRow {
    /// GB/s over the device time.
    pub fn device_gbs(&self) -> Option<f64> {
        self.device_us.map(|us| self.res.bytes as f64 / us / 1e3)
    }

    /// The row under [`HEADER`], percentages of `peak_gbs`.
    pub fn markdown(&self, peak_gbs: f64) -> String {
        let c = &self.res.case;
        let (dev_us, dev_gbs, dev_pct) = match (self.device_us, self.device_gbs()) {
            (Some(us), Some(g)) => (
                format!("{us:.2}"),
                format!("{g:.0}"),
                format!("{:.0}%", g / peak_gbs * 100.0),
            ),
            _ => ("host-bound".into(), "-".into(), "-".into()),
        };
        format!(
            "| {} | {:?} | {} | {} | {} | {:.1} | {:.0} | {:.0}% | {dev_us} | {dev_gbs} | {dev_pct} |",
            self.imp,
            c.kernel,
            c.rank,
            c.batch,
            c.popularity.name(),
            self.res.us,
            self.res.gbs(),
            self.res.gbs() / peak_gbs * 100.0,
        )
    }
}

/// The table's header.
pub const HEADER: &str = "| impl | kernel | rank | batch | popularity | wall µs | GB/s | % of copy peak | device µs | device GB/s | device % of copy peak |\n|---|---|---|---|---|---|---|---|---|---|---|";

/// GPU work for the timed calls to queue behind: products of a `d × d` weight over `d` rows
/// (one takes a few hundred µs on a datacenter GPU, enough to queue tens of LoRA calls).
pub struct Busy {
    w: AnyLinear,
    x: AnyBuf,
    out: AnyBuf,
    d: usize,
    /// Device µs of one product.
    one_us: f64,
}

impl Busy {
    /// The products' buffers, and one product timed on the device.
    pub fn new(b: &mut AnyBackend, d: usize) -> anyhow::Result<Self> {
        let w = b.upload_linear(fill(d * d, 7), d, d, None)?;
        let x = b.alloc(d * d)?;
        let mut out = b.alloc(d * d)?;
        b.linear(&x, &w, d, &mut out);
        let m0 = b.mark();
        b.linear(&x, &w, d, &mut out);
        let m1 = b.mark();
        b.synchronize()?;
        let one_us = AnyBackend::elapsed_us(&m0, &m1)?.max(1.0);
        Ok(Self {
            w,
            x,
            out,
            d,
            one_us,
        })
    }

    /// Products enough to keep the GPU busy for twice `host_us`.
    fn reps(&self, host_us: f64) -> usize {
        ((2.0 * host_us / self.one_us).ceil() as usize + 1).min(256)
    }

    fn run(&mut self, b: &mut AnyBackend, reps: usize) {
        for _ in 0..reps {
            b.linear(&self.x, &self.w, self.d, &mut self.out);
        }
    }
}

/// Device µs per call of `f` (module docs): the median over 5 rounds of `iters` back-to-back
/// calls, each round queued behind `busy`'s products (none on the CPU backend, whose calls run
/// as they are made). `host_us`: the wall clock's µs per call, to size the products. `None` if
/// in any round the host was still queueing when the products ended.
pub fn device_us(
    b: &mut AnyBackend,
    mut busy: Option<&mut Busy>,
    iters: usize,
    host_us: f64,
    f: &mut dyn FnMut(&mut AnyBackend),
) -> thaw_runtime::Result<Option<f64>> {
    let mut t = Vec::with_capacity(5);
    for _ in 0..5 {
        let reps = busy.as_ref().map_or(0, |k| k.reps(host_us * iters as f64));
        let t0 = Instant::now();
        let m0 = b.mark();
        if let Some(k) = busy.as_deref_mut() {
            k.run(b, reps);
        }
        let m1 = b.mark();
        for _ in 0..iters {
            f(b);
        }
        let m2 = b.mark();
        let queued_us = t0.elapsed().as_secs_f64() * 1e6;
        b.synchronize()?;
        let ahead_us = AnyBackend::elapsed_us(&m0, &m1)?;
        if busy.is_some() && queued_us >= ahead_us {
            return Ok(None);
        }
        t.push(AnyBackend::elapsed_us(&m1, &m2)? / iters as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(Some(t[t.len() / 2]))
}

/// The table: every (rank, kernel, batch, popularity) of `args`, with the backend's LoRA
/// kernels (`imp`), and again with the one-launch kernel where `THAW_CUDA_LORA_SMALL` turned it
/// on.
pub fn lora_table(
    args: &GpuArgs,
    b: &mut AnyBackend,
    c: &ModelConfig,
    (on_gpu, imp): (bool, &str),
) -> anyhow::Result<Vec<LoraRow>> {
    let Some(&max_batch) = args.lora_batches.iter().max() else {
        return Ok(Vec::new());
    };
    let (d_in, d_out) = c.module_shape(LoraModule::Q);
    let pool = max_batch.max(1);
    // Activations: rows of `fill`, gathered from a table (the trait uploads no activations).
    let table = b.upload_linear(fill(max_batch * d_in, 1), max_batch, d_in, None)?;
    let mut xs = b.alloc(max_batch * d_in)?;
    let ids: Vec<u32> = (0..max_batch as u32).collect();
    b.embed(&table, &ids, &mut xs);
    let mut y = b.alloc(max_batch * d_out)?;
    // Adapters are built in f32: the CPU backend keeps them so, CUDA converts them.
    let e = ElemSizes {
        adapter: b.element_bytes().0.unwrap_or(4),
        act: 4,
    };
    let mut busy = if on_gpu {
        Some(Busy::new(b, 4096)?)
    } else {
        None
    };
    // The one-launch kernel's rows beside the two launches', where the switch turned it on.
    let smalls: &[bool] = if b.lora_small() {
        &[false, true]
    } else {
        &[false]
    };
    let iters = if on_gpu { 20 } else { 2 };
    let mut out = Vec::new();
    for &rank in &args.lora_ranks {
        let adapters = (0..pool)
            .map(|i| b.upload_lora(synthetic_adapter(c, rank, &[LoraModule::Q], 10 + i as u64)?))
            .collect::<thaw_runtime::Result<Vec<_>>>()?;
        for kernel in [LoraKernel::Sgmv, LoraKernel::Bgmv] {
            for &batch in &args.lora_batches {
                for popularity in Popularity::ALL {
                    for &small in smalls {
                        b.set_lora_small(small)?;
                        let case = LoraCase {
                            kernel,
                            rank,
                            batch,
                            popularity,
                            dims: LinearDims { d_in, d_out },
                        };
                        let mut dev = None;
                        let res =
                            run_lora_case(b, &xs, &mut y, &adapters, case, e, &mut |b, f| {
                                b.begin_step();
                                let wall = wall_us(b, iters, f)?;
                                dev = device_us(b, busy.as_mut(), iters, wall, f)?;
                                Ok(wall)
                            })?;
                        let imp = match (small, b.lora_small_serves(kernel, batch, rank, case.dims))
                        {
                            (false, _) => imp.to_string(),
                            (true, true) => format!("{imp}+small"),
                            (true, false) => format!("{imp}+small, declined"),
                        };
                        out.push(LoraRow {
                            imp,
                            res,
                            device_us: dev,
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}
