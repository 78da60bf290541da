//! The attention input (q/k/v products, RoPE, the K/V write, decode attention over a context of
//! one) of Llama-3-8B's shape (4096 → 32 q / 8 kv heads of 128, bf16 weights and KV, no LoRA)
//! with f32 activations (`THAW_CUDA_BF16_ACT=0`: q, k, v written in f32, RoPE of q and of k, the
//! KV write) against the 16-bit ones (the default, `attn16.rs`: q, k, v stored in bf16
//! by cuBLAS, one `qkv_rope16`, the attention output stored in bf16 as o_proj's GEMM input), at
//! rows 1, 32, 128 and 2048 (one row a sequence, so the attention kernels' own work is small),
//! each timed through the backend's op (`qkv_attention`) and o_proj's product over its output
//! (`linear`: the f32 path casts the output first, the 16-bit one reads it), so the columns
//! include the input's cast. "act GB/s" counts the q/k/v and attention-output bytes each path
//! moves ([`attn16_traffic_bytes`]: the f32 path priced with RoPE folded, the fewest it moves)
//! over the time. No LoRA row: with LoRA on q/k/v the plan keeps f32
//! (`AttnF32Why::LoraOnQkv`), so both columns would time the same path.
use thaw_kernels::cpu::KvLayout;
use thaw_runtime::adapter::LoraModule;
use thaw_runtime::backend::attn16_plan::{attn16_traffic_bytes, Attn16Plan, AttnF32Why};
use thaw_runtime::backend::cuda::{CudaBackend, CudaConfig};
use thaw_runtime::backend::{
    Backend, LinearDims, LoraBatch, LoraKernel, LoraLayout, LoraSite, SeqSlice, StepLayout,
};
use thaw_runtime::ids::LayerIdx;

use super::{fill, model_config, time_us, Res};

pub fn attn16_table(smoke: bool) -> Res<()> {
    let c = model_config(1)?;
    let (h, qd, kvd) = (c.hidden_size, c.q_dim(), c.kv_dim());
    let heads = (c.num_heads, c.num_kv_heads);
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    g.set_gemv(false)?;
    let rows_list: &[usize] = if smoke { &[1, 32] } else { &[1, 32, 128, 2048] };
    let max_rows = rows_list.iter().copied().max().unwrap_or(1);
    let wq = g.upload_linear(fill(qd * h, 80), qd, h, None)?;
    let wk = g.upload_linear(fill(kvd * h, 81), kvd, h, None)?;
    let wv = g.upload_linear(fill(kvd * h, 82), kvd, h, None)?;
    let wo = g.upload_linear(fill(h * qd, 84), h, qd, None)?;
    let x = g.upload_f32(&fill(max_rows * h, 83))?;
    let (mut q, mut k, mut v) = (
        g.alloc(max_rows * qd)?,
        g.alloc(max_rows * kvd)?,
        g.alloc(max_rows * kvd)?,
    );
    let mut out = g.alloc(max_rows * qd)?;
    let mut o = g.alloc(max_rows * h)?;
    let layout = KvLayout {
        block_size: 16,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
    };
    // One block a sequence, one sequence a row.
    let mut kv = g.alloc_kv_layer(layout, max_rows)?;
    let site = |module, d_out| LoraSite {
        layer: LayerIdx(0),
        module,
        dims: LinearDims { d_in: h, d_out },
    };
    let sites = [
        site(LoraModule::Q, qd),
        site(LoraModule::K, kvd),
        site(LoraModule::V, kvd),
    ];
    let lora = LoraLayout::default();
    let batch = LoraBatch {
        kernel: LoraKernel::Sgmv,
        layout: &lora,
        adapters: &[],
        landed: &[],
    };
    println!(
        "\n## Attention {h} → q {qd} / kv {kvd}, RoPE, KV write, decode attention (context 1), o_proj, bf16 weights and KV: f32 activations (THAW_CUDA_BF16_ACT=0) vs 16-bit (the default); median of 20"
    );
    println!("| rows | f32 µs | act GB/s | 16-bit µs | act GB/s | 16-bit plan | speed-up |\n|---|---|---|---|---|---|---|");
    for &rows in rows_list {
        let step = StepLayout {
            token_ids: vec![1; rows],
            positions: vec![0; rows],
            seqs: (0..rows)
                .map(|r| SeqSlice {
                    rows: r..r + 1,
                    start_pos: 0,
                    blocks: r..r + 1,
                })
                .collect(),
            block_tables: (0..rows as u32).collect(),
            logit_rows: Vec::new(),
        };
        let mut us = [0.0; 2];
        let mut plan = Attn16Plan::F32(AttnF32Why::Off);
        for (i, on) in [false, true].into_iter().enumerate() {
            g.set_act16(on)?;
            if on {
                plan = g.attn16_plan_for([&wq, &wk, &wv], rows, &sites, heads, &batch);
            }
            us[i] = time_us(&mut g, 20, |g| {
                g.begin_step();
                let qkv = [&mut q, &mut k, &mut v];
                let w = [&wq, &wk, &wv];
                g.qkv_attention(&x, w, qkv, sites, &batch, heads, &mut kv, &step, &mut out);
                g.linear(&out, &wo, rows, &mut o);
            })?;
        }
        let f32_bytes = attn16_traffic_bytes(Attn16Plan::F32(AttnF32Why::Off), rows, qd, kvd);
        let b16 = attn16_traffic_bytes(plan, rows, qd, kvd);
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
    Ok(())
}
