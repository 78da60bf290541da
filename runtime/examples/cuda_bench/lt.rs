//! Products through cuBLASLt (the default, `lt.rs`, issue 29) against `cublasGemmEx`
//! (`THAW_CUDA_CUBLASLT=0`), each timed through the backend's `linear` op (so both columns include the
//! activations' cast kernel, and a biased product's GemmEx column its `add_bias` launch, which
//! cuBLASLt's epilogue replaces), bf16 weights, Llama-7B's shapes at decode and prefill rows.
//! TFLOP/s counts 2 · rows · d_in · d_out; GB/s the weight bytes plus the f32 activations read
//! and the f32 outputs written, over the time. The small-batch GEMV is off in both columns.
use thaw_runtime::backend::cuda::{CudaBackend, CudaConfig};
use thaw_runtime::backend::Backend;

use super::{fill, model_config, time_us, Res};

/// (d_in, d_out, bias, what): Llama-7B's q/k/v/o, gate/up, down and LM head, and a q/k/v with
/// a bias (Qwen2's), whose GemmEx column adds it with a separate launch.
const SHAPES: [(usize, usize, bool, &str); 5] = [
    (4096, 4096, false, "q/k/v/o"),
    (4096, 4096, true, "q/k/v + bias"),
    (4096, 11008, false, "gate/up"),
    (11008, 4096, false, "down"),
    (4096, 32000, false, "LM head"),
];

pub fn lt_table(smoke: bool) -> Res<()> {
    let c = model_config(1)?;
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    g.set_gemv(false)?;
    // On at upload, so the biased weight gets the f32 bias the epilogue reads.
    g.set_cublaslt(true)?;
    println!(
        "\n## Products, bf16 weights: cublasGemmEx (THAW_CUDA_CUBLASLT=0) vs cuBLASLt (the default, {} MiB workspace); median of {}",
        g.cublaslt_workspace() >> 20,
        if smoke { 5 } else { 30 }
    );
    println!("| product | d_in → d_out | rows | GemmEx µs | TFLOP/s | GB/s | cuBLASLt µs | TFLOP/s | GB/s | Lt speed-up |\n|---|---|---|---|---|---|---|---|---|---|");
    let rows_list: &[usize] = if smoke {
        &[1, 128]
    } else {
        &[1, 8, 32, 128, 2048]
    };
    let shapes = if smoke { &SHAPES[..2] } else { &SHAPES[..] };
    let iters = if smoke { 5 } else { 30 };
    let max_rows = rows_list.iter().copied().max().unwrap_or(1);
    for &(d_in, d_out, bias, what) in shapes {
        let b = bias.then(|| fill(d_out, 82));
        let w = g.upload_linear(fill(d_out * d_in, 80), d_out, d_in, b)?;
        let x = g.upload_f32(&fill(max_rows * d_in, 81))?;
        let mut y = g.alloc(max_rows * d_out)?;
        for &rows in rows_list {
            let flops = 2.0 * (rows * d_in * d_out) as f64;
            let bytes = (d_in * d_out * 2 + rows * (d_in + d_out) * 4) as f64;
            let mut us = [0.0; 2];
            for (i, on) in [false, true].into_iter().enumerate() {
                g.set_cublaslt(on)?;
                us[i] = time_us(&mut g, iters, |g| g.linear(&x, &w, rows, &mut y))?;
            }
            let tflops = |t: f64| flops / t / 1e6;
            let gbs = |t: f64| bytes / t / 1e3;
            println!(
                "| {what} | {d_in} → {d_out} | {rows} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} | {:.0} | {:.2}× |",
                us[0],
                tflops(us[0]),
                gbs(us[0]),
                us[1],
                tflops(us[1]),
                gbs(us[1]),
                us[0] / us[1]
            );
        }
    }
    g.set_cublaslt(false)?;
    Ok(())
}
