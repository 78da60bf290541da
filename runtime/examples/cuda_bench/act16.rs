//! The MLP block (gate/up products, SwiGLU, down) of Llama-3-8B's shape (4096 → 14336 → 4096,
//! bf16 weights, no LoRA) with f32 activations (`THAW_CUDA_BF16_ACT=0`: gate and up written and
//! read in f32, the fused SwiGLU + cast) against the 16-bit activations (the default,
//! `act16.rs`: gate and up stored in bf16 by cuBLAS, `swiglu16`, down reading its output), at
//! rows 1, 32, 128 and 2048, side by side; each timed through the backend's ops
//! (`gated_mlp_in` then `linear`), so the columns include the input's cast. "act GB/s" counts
//! the activation bytes between the products and SwiGLU that each path moves
//! ([`act16_traffic_bytes`]) over the block's time; weights are read the same either way. No
//! LoRA row: with LoRA on gate/up the plan keeps f32 (`F32Why::LoraOnGateUp`: the 16-bit path
//! with the deltas in f32 would move 28–32 B per element against f32's 24), so both columns
//! would time the same path.
use thaw_runtime::adapter::LoraModule;
use thaw_runtime::backend::act16_plan::{act16_traffic_bytes, Act16Plan, F32Why};
use thaw_runtime::backend::cuda::{CudaBackend, CudaConfig};
use thaw_runtime::backend::{Backend, LinearDims, LoraBatch, LoraKernel, LoraLayout, LoraSite};
use thaw_runtime::ids::LayerIdx;

use super::{fill, model_config, time_us, Res};

pub fn act16_table(smoke: bool) -> Res<()> {
    let c = model_config(1)?;
    let (h, inter) = (c.hidden_size, c.intermediate_size);
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    g.set_gemv(false)?;
    let rows_list: &[usize] = if smoke { &[1, 32] } else { &[1, 32, 128, 2048] };
    let max_rows = rows_list.iter().copied().max().unwrap_or(1);
    let wg = g.upload_linear(fill(inter * h, 90), inter, h, None)?;
    let wu = g.upload_linear(fill(inter * h, 91), inter, h, None)?;
    let wd = g.upload_linear(fill(h * inter, 92), h, inter, None)?;
    let x = g.upload_f32(&fill(max_rows * h, 93))?;
    let mut gate = g.alloc(max_rows * inter)?;
    let mut up = g.alloc(max_rows * inter)?;
    let mut act = g.alloc(max_rows * inter)?;
    let mut out = g.alloc(max_rows * h)?;
    let site = |module, d_in, d_out| LoraSite {
        layer: LayerIdx(0),
        module,
        dims: LinearDims { d_in, d_out },
    };
    let sites = [
        site(LoraModule::Gate, h, inter),
        site(LoraModule::Up, h, inter),
    ];
    let layout = LoraLayout::default();
    let batch = LoraBatch {
        kernel: LoraKernel::Sgmv,
        layout: &layout,
        adapters: &[],
        landed: &[],
    };
    println!(
        "\n## MLP block {h} → {inter} → {h}, bf16 weights: f32 activations (THAW_CUDA_BF16_ACT=0) vs 16-bit (the default); median of 20"
    );
    println!("| rows | f32 µs | act GB/s | 16-bit µs | act GB/s | 16-bit plan | speed-up |\n|---|---|---|---|---|---|---|");
    for &rows in rows_list {
        let mut us = [0.0; 2];
        let mut plan = Act16Plan::F32(F32Why::Off);
        for (i, on) in [false, true].into_iter().enumerate() {
            g.set_act16(on)?;
            if on {
                plan = g.act16_plan_for([&wg, &wu], rows, &sites, &batch);
            }
            us[i] = time_us(&mut g, 20, |g| {
                g.begin_step();
                let outs = [&mut gate, &mut up];
                g.gated_mlp_in(&x, [&wg, &wu], rows, outs, sites, &batch, &mut act);
                g.linear(&act, &wd, rows, &mut out);
            })?;
        }
        let f32_bytes = act16_traffic_bytes(Act16Plan::F32(F32Why::Off), rows, inter);
        let b16 = act16_traffic_bytes(plan, rows, inter);
        let gbs = |b: usize, t: f64| b as f64 / t / 1e3;
        println!(
            "| {rows} | {:.1} | {:.0} | {:.1} | {:.0} | {plan:?} | {:.2}× |",
            us[0],
            gbs(f32_bytes, us[0]),
            us[1],
            gbs(b16, us[1]),
            us[0] / us[1]
        );
    }
    g.set_act16(false)?;
    // The switch's other half: the residual stream between layers.
    super::residual16::residual16_table(smoke)
}
