//! The roofline inputs (the backend's copy bandwidth and GEMM rate, unless given) and the
//! SGMV / BGMV table (`lora_rows.rs`), on a one-layer backend of the model's shape.
use std::time::Instant;

use thaw_runtime::backend::any::AnyBackend;
use thaw_runtime::backend::kernel_select::{KernelPlan, OptInPlan};
use thaw_runtime::backend::{Backend, Device};
use thaw_runtime::microbench::fill;
use thaw_runtime::model::ModelConfig;
use thaw_runtime::residency::LinkModel;

use super::lora_rows::{lora_table, LoraRow};
use super::GpuArgs;

/// The roofline the report's ratios divide by, and where each figure came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Peaks {
    pub gbs: f64,
    pub gbs_source: String,
    pub tflops: f64,
    pub tflops_source: String,
}

/// µs per call of `f`: one warm-up call, then the median over 5 rounds of `iters` back-to-back
/// calls each, timed by the wall clock between two synchronisations.
pub fn wall_us(
    b: &mut AnyBackend,
    iters: usize,
    f: &mut dyn FnMut(&mut AnyBackend),
) -> thaw_runtime::Result<f64> {
    f(b);
    b.synchronize()?;
    let mut t = Vec::with_capacity(5);
    for _ in 0..5 {
        let t0 = Instant::now();
        for _ in 0..iters {
            f(b);
        }
        b.synchronize()?;
        t.push(t0.elapsed().as_secs_f64() * 1e6 / iters as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// The CUDA backend's issue-29 kernels that ran: the four and the nine.
pub type CudaPlans = (KernelPlan, OptInPlan);

/// The LoRA kernels' implementation the table runs: `punica` (the default on CUDA),
/// `classic` (`THAW_CUDA_LORA_IMPL=classic`) or `cpu`.
pub fn lora_impl(kernels: &Option<KernelPlan>) -> &'static str {
    match kernels {
        Some(k) if k.lora.is_new() => "punica",
        Some(_) => "classic",
        None => "cpu",
    }
}

/// Measures (or takes) the roofline and runs the SGMV / BGMV table; returns them with the
/// CUDA kernels that ran, the four and the nine (None on the CPU backend), and the device's
/// name.
pub fn measure(
    args: &GpuArgs,
    device: &Device,
    model: &ModelConfig,
) -> anyhow::Result<(Peaks, Vec<LoraRow>, Option<CudaPlans>, String)> {
    let mut c = model.clone();
    c.num_layers = 1;
    let mut b = AnyBackend::new(device, &c, LinkModel::default())?;
    let on_gpu = matches!(b, AnyBackend::Cuda(_));
    let name = match device {
        Device::Cpu => format!(
            "CPU backend, {} threads",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
        #[allow(unreachable_patterns)]
        Device::Cuda(d) => format!("{d:?}"),
    };
    let (gbs, gbs_source) = match args.peak_gbs {
        Some(g) => (g, "--peak-gbs".to_string()),
        None => {
            let mib = if on_gpu { 1024 } else { 64 };
            (
                copy_gbs(&mut b, mib)?,
                format!("measured: row copy of {mib} MiB, read + write"),
            )
        }
    };
    let (tflops, tflops_source) = match args.peak_tflops {
        Some(t) => (t, "--peak-tflops".to_string()),
        None => {
            let d = if on_gpu { 8192 } else { 256 };
            (
                gemm_tflops(&mut b, d)?,
                format!("measured: the backend's linear(), {d}×{d}×{d}"),
            )
        }
    };
    let peaks = Peaks {
        gbs,
        gbs_source,
        tflops,
        tflops_source,
    };
    let plans = b.cuda_kernels();
    let kernels = plans.as_ref().map(|(k, _)| k.clone());
    let lora = lora_table(args, &mut b, &c, (on_gpu, lora_impl(&kernels)))?;
    Ok((peaks, lora, plans, name))
}

/// GB/s of the backend's row copy (`gather_rows` of every row), counting bytes read and
/// written: the bandwidth any kernel that streams memory can hope for.
fn copy_gbs(b: &mut AnyBackend, mib: usize) -> anyhow::Result<f64> {
    let width = 4096;
    let rows = (mib << 20) / 4 / width;
    let x = b.alloc(rows * width)?;
    let mut out = b.alloc(rows * width)?;
    let all: Vec<usize> = (0..rows).collect();
    let us = wall_us(b, 4, &mut |b| b.gather_rows(&x, width, &all, &mut out))?;
    Ok(2.0 * (rows * width * 4) as f64 / us / 1e3)
}

/// TFLOP/s of the backend's `linear` on a `d × d` weight and `d` rows.
fn gemm_tflops(b: &mut AnyBackend, d: usize) -> anyhow::Result<f64> {
    let w = b.upload_linear(fill(d * d, 11), d, d, None)?;
    let x = b.alloc(d * d)?;
    let mut out = b.alloc(d * d)?;
    let us = wall_us(b, 3, &mut |b| b.linear(&x, &w, d, &mut out))?;
    Ok(2.0 * (d as f64).powi(3) / us / 1e6)
}
