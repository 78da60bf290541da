//! The multi-slice LoRA launches (a default, off: `THAW_CUDA_LORA_SLICES=0`; `lora_slices.cu`) against
//! the per-module Punica launches they replace: q/k/v (GQA: k and v narrower) and gate/up of
//! one Llama-7B-shaped layer, ranks 8/16/64/128, batches 1/4/16/64, SGMV and BGMV, distinct
//! adapters with rows without one between them and one adapter shared by every row; and whole
//! engines with the switch on against off. Part of `cuda_parity` (its helpers, its GPU skip
//! rules).
//!
//! Tolerance: bit for bit. Every slice runs `lora_punica.cu`'s block code with the arguments
//! and the split-K plan of its per-module launch (`slices_plan::common_split`), only with its
//! v partials at another offset of the scratch: the same f32 operations in the same order. That
//! the sliced path ran is checked by its launch count: 2 for the group against 2 per module.
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use thaw_runtime::adapter::{LoraAdapter, LoraModule};
use thaw_runtime::backend::cuda::{CudaBackend, CudaLora, DType, LoraImpl};
use thaw_runtime::backend::{Backend, LinearDims, LoraBatch, LoraKernel, LoraLayout, LoraSite};
use thaw_runtime::ids::LayerIdx;
use thaw_server::gen::ModelPreset;
use thaw_tests::{test_preset, TestModel};

use super::gemv::{check_off_on, off_on_runs};
use super::opt_in::bitwise;
use super::{cfg, mixed_lora_layout, rand_vec, CONFIGS};

/// One layer of Llama-7B's shape with GQA (8 KV heads: k and v are 1024 wide), a small vocab.
fn layer_7b() -> ModelPreset {
    ModelPreset {
        name: "7b-layer",
        hidden_size: 4096,
        intermediate_size: 11008,
        num_hidden_layers: 1,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 128,
        ..test_preset()
    }
}

/// Every row on adapter `a`: one segment.
fn shared_layout(rows: usize, a: u32) -> LoraLayout {
    LoraLayout {
        segments: vec![(0..rows, a)],
        row_adapter: vec![Some(a); rows],
    }
}

/// The group's outputs after `lora_group` from `x` and `y0`, and the kernel launches it made.
fn group_run(
    g: &mut CudaBackend,
    xg: &<CudaBackend as Backend>::Buf,
    y0: &[Vec<f32>],
    sites: &[LoraSite],
    batch: &LoraBatch<'_, CudaLora>,
    rows: usize,
) -> (Vec<Vec<f32>>, u64) {
    let mut ys: Vec<_> = y0.iter().map(|y| g.upload_f32(y).unwrap()).collect();
    g.begin_step();
    let before = g.device_counts();
    match (&mut ys[..], sites) {
        ([a, b, c], [s0, s1, s2]) => g.lora_group(xg, [a, b, c], [*s0, *s1, *s2], batch),
        ([a, b], [s0, s1]) => g.lora_group(xg, [a, b], [*s0, *s1], batch),
        _ => unreachable!("groups of two or three"),
    }
    let launches = g.device_counts().since(&before).launches;
    g.check().unwrap();
    let out = ys
        .iter()
        .zip(sites)
        .map(|(y, s)| g.download_f32(y, rows * s.dims.d_out).unwrap())
        .collect();
    (out, launches)
}

#[test]
fn sliced_lora_equals_per_module_punica_bit_for_bit() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::from_preset(&layer_7b(), 290);
    let c = &tm.model.config;
    let all = ["q", "k", "v", "o", "gate", "up", "down"];
    let ranks = [8, 16, 64, 128];
    let adapters: Vec<Arc<LoraAdapter>> = ranks
        .iter()
        .enumerate()
        .map(|(i, &r)| tm.adapter(r, &all, 300 + i as u64))
        .collect();
    let n = adapters.len() as u32;
    let groups: [&[LoraModule]; 2] = [
        &[LoraModule::Q, LoraModule::K, LoraModule::V],
        &[LoraModule::Gate, LoraModule::Up],
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(2929);
    for dt in [DType::Bf16, DType::F32] {
        let mut g = CudaBackend::new(c, &cfg(dt)).unwrap();
        g.set_lora_impl(LoraImpl::PUNICA).unwrap();
        let lg: Vec<CudaLora> = adapters
            .iter()
            .map(|a| g.upload_lora(a.clone()).unwrap())
            .collect();
        for l in &lg {
            g.wait_landed(l, std::time::Duration::from_secs(120))
                .unwrap();
        }
        let rg: Vec<&CudaLora> = lg.iter().collect();
        let landed = vec![99; lg.len()];
        for rows in [1, 4, 16, 64] {
            // Distinct adapters (base rows between them), then each rank shared by every row.
            let mut layouts = vec![("distinct".to_string(), mixed_lora_layout(&mut rng, rows, n))];
            for (i, r) in ranks.iter().enumerate() {
                layouts.push((format!("shared r{r}"), shared_layout(rows, i as u32)));
            }
            for (what, layout) in &layouts {
                if layout.segments.is_empty() {
                    continue;
                }
                for kernel in [LoraKernel::Sgmv, LoraKernel::Bgmv] {
                    let batch = LoraBatch {
                        kernel,
                        layout,
                        adapters: &rg,
                        landed: &landed,
                    };
                    for modules in groups {
                        let sites: Vec<LoraSite> = modules
                            .iter()
                            .map(|&m| {
                                let (d_in, d_out) = c.module_shape(m);
                                LoraSite {
                                    layer: LayerIdx(0),
                                    module: m,
                                    dims: LinearDims { d_in, d_out },
                                }
                            })
                            .collect();
                        let d_in = sites[0].dims.d_in;
                        let x = rand_vec(&mut rng, rows * d_in, 1.0);
                        let y0: Vec<Vec<f32>> = sites
                            .iter()
                            .map(|s| rand_vec(&mut rng, rows * s.dims.d_out, 1.0))
                            .collect();
                        let xg = g.upload_f32(&x).unwrap();
                        g.set_lora_slices(false).unwrap();
                        let (off, l_off) = group_run(&mut g, &xg, &y0, &sites, &batch, rows);
                        g.set_lora_slices(true).unwrap();
                        let (on, l_on) = group_run(&mut g, &xg, &y0, &sites, &batch, rows);
                        let label = format!("{dt:?} b{rows} {what} {kernel:?} {modules:?}");
                        assert_eq!(l_off, 2 * sites.len() as u64, "{label}: per module");
                        assert_eq!(l_on, 2, "{label}: one shrink + one expand");
                        for (i, ((a, b), y)) in off.iter().zip(&on).zip(&y0).enumerate() {
                            assert!(a != y, "{label}: slice {i} added no delta");
                            assert!(bitwise(a, b), "{label}: slice {i} differs");
                        }
                        println!("{label}: bit for bit, {l_off} launches -> {l_on}");
                    }
                }
            }
        }
        g.check().unwrap();
    }
}

/// Whole engines, the switch off against on: eager logits bit for bit (so the same greedy
/// tokens), for batches with no adapter, a rank-8 adapter on q,v only (the group then has two
/// live slices of three) and a rank-32 adapter on every projection. With CUDA graphs the
/// deltas are added per module (`graph.rs`) over the bucket's padded rows, whose split-K plan
/// may differ from the eager one: that run is held to the suite's tolerance and the same
/// greedy tokens (`check_off_on`).
#[test]
fn engines_with_sliced_lora_give_the_same_logits() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(7);
    let adapters = [
        tm.adapter(8, &["q", "v"], 92),
        tm.adapter(32, &["q", "k", "v", "o", "gate", "up", "down"], 93),
    ];
    let batches = [1, 3, 8, 20];
    let who = |b: usize| -> Vec<Option<u32>> {
        (0..b).map(|i| [None, Some(0), Some(1)][i % 3]).collect()
    };
    for (dt, tol) in CONFIGS {
        let runs = off_on_runs(&tm.model, dt, &adapters, &batches, who, 5, 400, |g, on| {
            g.set_lora_impl(LoraImpl::PUNICA).unwrap();
            g.set_lora_slices(on).unwrap();
        });
        let mut seqs = 0;
        for (off, on) in runs[0].iter().zip(&runs[1]) {
            for (a, b) in off.iter().zip(on) {
                assert_eq!(a.tokens, b.tokens, "{dt:?} eager: greedy tokens");
                assert!(bitwise(&a.logits, &b.logits), "{dt:?} eager: logits");
                seqs += 1;
            }
        }
        println!("{dt:?} sliced LoRA eager: {seqs} sequences, logits bit for bit");
        check_off_on("sliced LoRA", dt, tol, &runs, tm.model.config.vocab_size);
    }
}
