//! The residual add + RMSNorm of Llama-3-8B's width (4096, bf16 weights) with the residual
//! stream in f32 (`THAW_CUDA_BF16_ACT=0`: the fused `add_rms_norm_T`) against the 16-bit
//! residual (the default, `residual16.rs`: `add_rms_norm_h16_T`, the stream stored in bf16),
//! at rows 1, 32, 128 and 2048, each timed through the backend's op (`add_rms_norm`, which
//! also writes the next projections' 16-bit input on both paths). "model MB" is the bytes the
//! traffic model counts for the op ([`residual_traffic_bytes`]: 18 B against 14 B per
//! element), "GB/s" those bytes over its time.
use thaw_runtime::backend::cuda::{CudaBackend, CudaConfig};
use thaw_runtime::backend::residual16_plan::{residual_traffic_bytes, ResidualRepr};
use thaw_runtime::backend::Backend;

use super::{fill, model_config, time_us, Res};

pub fn residual16_table(smoke: bool) -> Res<()> {
    let c = model_config(1)?;
    let h = c.hidden_size;
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    // The classic norm blocks on both paths, as the table names them (the wide ones, a
    // default, would replace `add_rms_norm_T` and widen the 16-bit kernel's block).
    g.set_wide(false)?;
    let rows_list: &[usize] = if smoke { &[1, 32] } else { &[1, 32, 128, 2048] };
    let max_rows = rows_list.iter().copied().max().unwrap_or(1);
    // The stream starts from embedded rows (an embedding table of max_rows rows), so each
    // path's buffer holds its own representation; x is small, so 20 adds stay finite.
    let table = g.upload_linear(fill(max_rows * h, 80), max_rows, h, None)?;
    let ids: Vec<u32> = (0..max_rows as u32).collect();
    let x = g.upload_f32(&fill(max_rows * h, 81))?;
    let w = g.upload_vector(fill(h, 82))?;
    let mut hbuf = g.alloc(max_rows * h)?;
    let mut out = g.alloc(max_rows * h)?;
    println!(
        "\n## Residual add + RMSNorm, width {h}, bf16 weights: the stream in f32 (THAW_CUDA_BF16_ACT=0) vs 16-bit (the default), classic norm blocks (THAW_CUDA_WIDE_NORM=0); median of 20"
    );
    println!("| rows | f32 µs | model MB | GB/s | 16-bit µs | model MB | GB/s | speed-up |\n|---|---|---|---|---|---|---|---|");
    for &rows in rows_list {
        let mut us = [0.0; 2];
        for (i, on) in [false, true].into_iter().enumerate() {
            g.set_act16(on)?;
            assert_eq!(g.residual16(), on, "the switch decides the residual");
            g.begin_step();
            g.embed(&table, &ids[..rows], &mut hbuf);
            us[i] = time_us(&mut g, 20, |g| {
                g.add_rms_norm(&mut hbuf, &x, &w, 1e-5, rows, h, &mut out);
            })?;
        }
        let b = |r| residual_traffic_bytes(r, rows, h);
        let (b32, b16) = (b(ResidualRepr::F32), b(ResidualRepr::Sixteen));
        let gbs = |b: usize, t: f64| b as f64 / t / 1e3;
        println!(
            "| {rows} | {:.1} | {:.2} | {:.0} | {:.1} | {:.2} | {:.0} | {:.2}× |",
            us[0],
            b32 as f64 / 1e6,
            gbs(b32, us[0]),
            us[1],
            b16 as f64 / 1e6,
            gbs(b16, us[1]),
            us[0] / us[1]
        );
    }
    g.set_act16(false)?;
    Ok(())
}
