//! The LoRA of q/k/v and gate/up per module (a shrink + expand launch pair each, Punica's
//! kernels, `THAW_CUDA_LORA_SLICES=0`) against the multi-slice launches (`lora_slices.cu`,
//! the default, issue 29: one pair per group), timed through
//! `CudaBackend::lora_group` (kernels only: the step's segment metadata is uploaded by the
//! warm-up call), bf16 adapters, one layer of this bench's Llama shape (GQA k/v 1024 wide).
//! "shared": every row on one adapter; "distinct": every row its own adapter.
use std::ops::Range;

use thaw_runtime::adapter::LoraModule;
use thaw_runtime::backend::cuda::{CudaBackend, CudaConfig, CudaLora};
use thaw_runtime::backend::{Backend, LinearDims, LoraBatch, LoraKernel, LoraLayout, LoraSite};
use thaw_runtime::ids::LayerIdx;
use thaw_runtime::microbench::synthetic_adapter;

use super::{fill, model_config, time_us, Res};

fn layout(rows: usize, distinct: bool) -> LoraLayout {
    let segments: Vec<(Range<usize>, u32)> = if distinct {
        (0..rows).map(|r| (r..r + 1, r as u32)).collect()
    } else {
        vec![(0..rows, 0)]
    };
    let row_adapter = (0..rows)
        .map(|r| Some(if distinct { r as u32 } else { 0 }))
        .collect();
    LoraLayout {
        segments,
        row_adapter,
    }
}

pub fn slices_table(smoke: bool) -> Res<()> {
    let c = model_config(1)?;
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    println!("\n## LoRA of q/k/v and gate/up: a launch pair per module (Punica, THAW_CUDA_LORA_SLICES=0) vs one pair per group (the default); one layer, median of 50");
    println!("| group | rank | rows | adapters | kernel | per-module µs | sliced µs | speed-up |\n|---|---|---|---|---|---|---|---|");
    let ranks: &[usize] = if smoke { &[16] } else { &[16, 64] };
    let rows_list: &[usize] = if smoke { &[1, 16] } else { &[1, 16, 64] };
    let max_rows = rows_list.iter().copied().max().unwrap_or(1);
    let site = |m: LoraModule| {
        let (d_in, d_out) = c.module_shape(m);
        LoraSite {
            layer: LayerIdx(0),
            module: m,
            dims: LinearDims { d_in, d_out },
        }
    };
    use LoraModule::{Gate, Up, K, Q, V};
    let targets = [Q, K, V, Gate, Up];
    let x = g.upload_f32(&fill(max_rows * c.hidden_size, 90))?;
    let width = c.intermediate_size.max(c.hidden_size);
    let mut ys: Vec<_> = (0..3)
        .map(|i| g.upload_f32(&fill(max_rows * width, 91 + i)))
        .collect::<Result<_, _>>()?;
    for &rank in ranks {
        let adapters: Vec<CudaLora> = (0..max_rows)
            .map(|i| Ok(g.upload_lora(synthetic_adapter(&c, rank, &targets, 500 + i as u64)?)?))
            .collect::<Res<_>>()?;
        for l in &adapters {
            g.wait_landed(l, std::time::Duration::from_secs(120))?;
        }
        let refs: Vec<&CudaLora> = adapters.iter().collect();
        let landed = vec![usize::MAX; refs.len()];
        for &rows in rows_list {
            for distinct in [false, true] {
                let lay = layout(rows, distinct);
                for kernel in [LoraKernel::Sgmv, LoraKernel::Bgmv] {
                    let batch = LoraBatch {
                        kernel,
                        layout: &lay,
                        adapters: &refs,
                        landed: &landed,
                    };
                    for (what, n) in [("q/k/v", 3usize), ("gate/up", 2)] {
                        let mut us = [0.0; 2];
                        for (i, on) in [false, true].into_iter().enumerate() {
                            g.set_lora_slices(on)?;
                            g.begin_step();
                            us[i] = time_us(&mut g, 50, |g| {
                                let [a, b, c3] = &mut ys[..] else {
                                    unreachable!("three buffers")
                                };
                                if n == 3 {
                                    g.lora_group(
                                        &x,
                                        [a, b, c3],
                                        [site(Q), site(K), site(V)],
                                        &batch,
                                    );
                                } else {
                                    g.lora_group(&x, [a, b], [site(Gate), site(Up)], &batch);
                                }
                            })?;
                        }
                        let adapters = if distinct { rows } else { 1 };
                        println!(
                            "| {what} | {rank} | {rows} | {adapters} | {kernel:?} | {:.1} | {:.1} | {:.2}× |",
                            us[0],
                            us[1],
                            us[0] / us[1]
                        );
                    }
                }
            }
        }
    }
    g.set_lora_slices(false)?;
    Ok(())
}
