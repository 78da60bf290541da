//! Products of few rows (decode): the small-batch GEMV (`gemv.cu`, the default, issue 29)
//! against cast + cuBLAS `gemm_ex` (`THAW_CUDA_GEMV=0` with `THAW_CUDA_CUBLASLT=0`, set here:
//! the path `gemv_pays`' crossover was measured against; `--lt` times cuBLASLt's), each timed through the backend's
//! `linear` op (so the cuBLAS column includes its activation cast kernel), bf16 weights. GB/s
//! counts the weight bytes plus the f32 activations read and the f32 outputs written, over the
//! time; "% of peak" is against the device-to-device copy peak measured in the same run. The
//! GEMV column runs the kernel at every row count it takes (`set_gemv_every_row`); "served"
//! says whether the backend runs it there with the switch on (`gemv_pays`, the crossover this
//! table measured on an H200).
use thaw_runtime::backend::cuda::{CudaBackend, CudaConfig};
use thaw_runtime::backend::kernel_select::gemv_pays;
use thaw_runtime::backend::Backend;

use super::{fill, model_config, time_us, Res};

/// (d_in, d_out, what): Llama-7B's q/k/v/o, gate/up, down and LM head; a small model's pair.
const SHAPES: [(usize, usize, &str); 6] = [
    (4096, 4096, "q/k/v/o"),
    (4096, 11008, "gate/up"),
    (11008, 4096, "down"),
    (4096, 32000, "LM head"),
    (576, 1536, "small up"),
    (1536, 576, "small down"),
];

pub fn gemv_table(smoke: bool, peak: f64) -> Res<()> {
    let c = model_config(1)?;
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    // cublasGemmEx, as the table says (cuBLASLt, also a default, has `--lt`'s table).
    g.set_cublaslt(false)?;
    let rows_list: &[usize] = if smoke { &[1, 8] } else { &[1, 2, 4, 8] };
    let shapes = if smoke { &SHAPES[..1] } else { &SHAPES[..] };
    println!("\n## Products of few rows, bf16 weights: cast + cuBLAS (THAW_CUDA_GEMV=0 THAW_CUDA_CUBLASLT=0) vs the small-batch GEMV (the default); median of 50");
    println!("| product | d_in → d_out | rows | cuBLAS µs | GB/s | % of peak | GEMV µs | GB/s | % of peak | GEMV speed-up | served |\n|---|---|---|---|---|---|---|---|---|---|---|");
    let max_rows = rows_list.iter().copied().max().unwrap_or(1);
    for &(d_in, d_out, what) in shapes {
        let w = g.upload_linear(fill(d_out * d_in, 80), d_out, d_in, None)?;
        let x = g.upload_f32(&fill(max_rows * d_in, 81))?;
        let mut y = g.alloc(max_rows * d_out)?;
        for &rows in rows_list {
            let bytes = d_in * d_out * 2 + rows * (d_in + d_out) * 4;
            let mut us = [0.0; 2];
            for (i, on) in [false, true].into_iter().enumerate() {
                g.set_gemv(on)?;
                g.set_gemv_every_row(true);
                us[i] = time_us(&mut g, 50, |g| g.linear(&x, &w, rows, &mut y))?;
            }
            let gbs = |t: f64| bytes as f64 / t / 1e3;
            println!(
                "| {what} | {d_in} → {d_out} | {rows} | {:.1} | {:.0} | {:.0}% | {:.1} | {:.0} | {:.0}% | {:.2}× | {} |",
                us[0],
                gbs(us[0]),
                gbs(us[0]) / peak * 100.0,
                us[1],
                gbs(us[1]),
                gbs(us[1]) / peak * 100.0,
                us[0] / us[1],
                if gemv_pays(rows, d_in, d_out) { "GEMV" } else { "cuBLAS" }
            );
        }
    }
    g.set_gemv(false)?;
    Ok(())
}
