//! The opt-in one-launch small-batch LoRA (`THAW_CUDA_LORA_SMALL=1`, `lora_fused_small.cu`)
//! against the CPU twins (`sgmv_*` / `bgmv_*` through the CPU backend) and against the two
//! Punica launches it replaces: SGMV and BGMV, 1 to 8 rows, ranks 8, 16 and 64 (and 6, whose B
//! rows are not 16-byte multiples) mixed in one call with rows without an adapter and one
//! adapter not landed, then each rank alone on every row; f32, bf16 and f16 adapters; Llama-7B's
//! q (4096 → 4096), gate (4096 → 11008) and down (11008 → 4096) shapes, and 1030 / 2054 wide
//! projections (not multiples of 4, so no row of A is a 16-byte multiple in any dtype: the
//! scalar path). Each fused call is also counted: one kernel launch, no copy, allocation or
//! synchronisation (the step's metadata was uploaded by the call before it); where the plan
//! declines (rank 64 on down's 11008-wide input), the two launches run and still match. Part of
//! `cuda_parity` (its helpers, its GPU skip rules).
//!
//! Tolerances (normwise relative error of the deltas): against the CPU, which keeps the
//! adapters in f32, f32 ≤ 1e-4 (same math, another summation order), bf16 ≤ 1e-2 (8-bit
//! mantissa: ~4e-3 a rounding of A and of B), f16 ≤ 2e-3 (11 bits: ~5e-4 a rounding); fused
//! against the two launches, 1e-4 in every dtype: the same rounded weights, f32 accumulation
//! and v in f32 on both, only the K chunks the f32 sums are grouped in differ (the split-K
//! plan's against the fused kernel's 1024), plus one f32 rounding of y each.
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use thaw_runtime::adapter::{LoraAdapter, LoraModule};
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cuda::{CudaBackend, CudaLora, DType, LoraImpl};
use thaw_runtime::backend::device_counts::DeviceCounts;
use thaw_runtime::backend::{Backend, LinearDims, LoraBatch, LoraKernel, LoraLayout};
use thaw_runtime::ids::LayerIdx;
use thaw_runtime::microbench::synthetic_adapter;
use thaw_runtime::model::ModelConfig;
use thaw_server::gen::{self, ModelPreset, WeightDtype};
use thaw_tests::test_preset;

use super::{cfg, check, mixed_lora_layout, rand_vec};

/// The adapters' ranks: 8, 16, 64, and 6 (B rows of 12 / 24 bytes: the scalar expand).
const RANKS: [usize; 4] = [8, 16, 64, 6];
/// Fused against the two launches (module docs).
const TOL_PATHS: f64 = 1e-4;

/// Against the CPU, per adapter dtype (module docs).
fn tol_cpu(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-4,
        DType::Bf16 => 1e-2,
        DType::F16 => 2e-3,
    }
}

/// A one-layer config of `hidden` / `intermediate` with `heads` query heads of 128 or 32
/// (no weights: the LoRA ops need only the shapes).
fn config(name: &'static str, hidden: usize, intermediate: usize, heads: usize) -> ModelConfig {
    let head_dim = if heads * 128 == hidden { 128 } else { 32 };
    let p = ModelPreset {
        name,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: 1,
        num_attention_heads: heads,
        num_key_value_heads: heads / 4,
        head_dim,
        ..test_preset()
    };
    let json = gen::model_config(&p, WeightDtype::F32).to_string();
    ModelConfig::from_json(&json).expect("generated config parses")
}

/// The projections each shape tests.
fn shapes() -> Vec<(ModelConfig, Vec<LoraModule>)> {
    use LoraModule::{Down, Gate, Q};
    vec![
        // Llama-7B: q is 4096 → 4096 (32 heads of 128).
        (config("7b-lora", 4096, 11008, 32), vec![Q, Gate, Down]),
        (config("odd-lora", 1030, 2054, 4), vec![Gate, Down]),
    ]
}

/// Every row on adapter 0: one segment.
fn one_adapter(rows: usize) -> LoraLayout {
    LoraLayout {
        segments: vec![(0..rows, 0)],
        row_adapter: vec![Some(0); rows],
    }
}

/// One call on the GPU: the delta it adds to `y0`, and the driver counts of that call alone
/// (a first call of the same step uploads the metadata and grows any scratch, as an engine
/// step's first layer does).
fn gpu_call(
    g: &mut CudaBackend,
    xg: &<CudaBackend as Backend>::Buf,
    y0: &[f32],
    (dims, at): (LinearDims, (LayerIdx, LoraModule)),
    batch: &LoraBatch<'_, CudaLora>,
) -> (Vec<f32>, DeviceCounts) {
    let mut warm = g.upload_f32(y0).unwrap();
    let mut y = g.upload_f32(y0).unwrap();
    g.begin_step();
    g.lora(xg, &mut warm, dims, at, batch);
    let before = g.device_counts();
    g.lora(xg, &mut y, dims, at, batch);
    let counts = g.device_counts().since(&before);
    g.check().unwrap();
    let got = g.download_f32(&y, y0.len()).unwrap();
    (got.iter().zip(y0).map(|(a, b)| a - b).collect(), counts)
}

/// One projection of one layout, both GPU paths against the CPU; whether it ran fused.
struct Case<'a> {
    what: String,
    kernel: LoraKernel,
    layout: &'a LoraLayout,
    /// Indices into the uploaded adapters, in the batch's order.
    pick: &'a [usize],
    landed: &'a [usize],
    module: LoraModule,
}

/// Runs `case` and checks it; returns whether the fused kernel served it.
fn run_case(
    (cpu, lc): (&mut CpuBackend, &[<CpuBackend as Backend>::Lora]),
    (g, lg): (&mut CudaBackend, &[CudaLora]),
    c: &ModelConfig,
    case: &Case<'_>,
    (dt, rng): (DType, &mut ChaCha8Rng),
) -> bool {
    let (d_in, d_out) = c.module_shape(case.module);
    let dims = LinearDims { d_in, d_out };
    let at = (LayerIdx(0), case.module);
    let rows = case.layout.row_adapter.len();
    let x = rand_vec(rng, rows * d_in, 1.0);
    // Of the deltas' size, so y's own rounding does not hide their error.
    let y0 = rand_vec(rng, rows * d_out, 0.05);
    let rc: Vec<_> = case.pick.iter().map(|&i| &lc[i]).collect();
    let rg: Vec<_> = case.pick.iter().map(|&i| &lg[i]).collect();
    let mut yc = y0.clone();
    let bc = LoraBatch {
        kernel: case.kernel,
        layout: case.layout,
        adapters: &rc,
        landed: case.landed,
    };
    cpu.lora(&x, &mut yc, dims, at, &bc);
    let want: Vec<f32> = yc.iter().zip(&y0).map(|(a, b)| a - b).collect();
    let bg = LoraBatch {
        kernel: case.kernel,
        layout: case.layout,
        adapters: &rg,
        landed: case.landed,
    };
    let xg = g.upload_f32(&x).unwrap();
    // The call's max rank: over the batch's landed adapters (what the backend launches for).
    let max_rank = case
        .pick
        .iter()
        .zip(case.landed)
        .filter(|(_, &l)| l > 0)
        .map(|(&i, _)| RANKS[i])
        .max()
        .unwrap_or(0);
    g.set_lora_small(true).unwrap();
    let (fused, fc) = gpu_call(g, &xg, &y0, (dims, at), &bg);
    let serves = g.lora_small_serves(case.kernel, rows, max_rank, dims);
    g.set_lora_small(false).unwrap();
    let (pair, pc) = gpu_call(g, &xg, &y0, (dims, at), &bg);
    let what = &case.what;
    check(&format!("small {what}"), dt, tol_cpu(dt), &fused, &want);
    check(&format!("punica {what}"), dt, tol_cpu(dt), &pair, &want);
    check(
        &format!("small vs punica {what}"),
        dt,
        TOL_PATHS,
        &fused,
        &pair,
    );
    // The two-launch path is a shrink and an expand; the fused one a single launch, and
    // neither copies, allocates or waits once the step's metadata is on the device.
    assert_eq!(pc.launches, 2, "{what}: two-launch path {pc:?}");
    assert_eq!(fc.launches, if serves { 1 } else { 2 }, "{what}: {fc:?}");
    for k in [fc, pc] {
        let quiet = (k.htod, k.dtoh, k.allocs, k.syncs, k.gemms, k.graph_launches);
        assert_eq!(quiet, (0, 0, 0, 0, 0, 0), "{what}: {k:?}");
    }
    serves
}

#[test]
fn small_batch_lora_matches_cpu_and_the_two_launch_path() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(2930);
    let mut fused = 0;
    let mut total = 0;
    for (c, modules) in shapes() {
        let adapters: Vec<Arc<LoraAdapter>> = RANKS
            .iter()
            .enumerate()
            .map(|(i, &r)| synthetic_adapter(&c, r, &modules, 500 + i as u64).unwrap())
            .collect();
        let mut cpu = CpuBackend::new(&c);
        let lc: Vec<_> = adapters
            .iter()
            .map(|a| cpu.upload_lora(a.clone()).unwrap())
            .collect();
        for dt in [DType::F32, DType::Bf16, DType::F16] {
            let mut g = CudaBackend::new(&c, &cfg(dt)).unwrap();
            g.set_lora_impl(LoraImpl::PUNICA).unwrap();
            let lg: Vec<CudaLora> = adapters
                .iter()
                .map(|a| g.upload_lora(a.clone()).unwrap())
                .collect();
            for l in &lg {
                g.wait_landed(l, std::time::Duration::from_secs(120))
                    .unwrap();
            }
            let all: Vec<usize> = (0..RANKS.len()).collect();
            let (every, one_not) = (vec![99; RANKS.len()], vec![99, 0, 99, 99]);
            for rows in 1..=8 {
                // Mixed ranks with base rows between them (all landed, then rank 16's not),
                // then each rank alone on every row.
                let mixed = mixed_lora_layout(&mut rng, rows, RANKS.len() as u32);
                let mut layouts: Vec<(String, LoraLayout, Vec<usize>, Vec<usize>)> = vec![
                    ("mixed".into(), mixed.clone(), all.clone(), every.clone()),
                    (
                        "mixed, r16 not landed".into(),
                        mixed,
                        all.clone(),
                        one_not.clone(),
                    ),
                ];
                for (i, r) in RANKS.iter().enumerate() {
                    layouts.push((format!("r{r} alone"), one_adapter(rows), vec![i], vec![99]));
                }
                for (name, layout, pick, landed) in &layouts {
                    if layout.segments.is_empty() {
                        continue;
                    }
                    for kernel in [LoraKernel::Sgmv, LoraKernel::Bgmv] {
                        for &module in &modules {
                            let (d_in, d_out) = c.module_shape(module);
                            let case = Case {
                                what: format!(
                                    "{kernel:?} {module:?} {d_in}→{d_out} b{rows} {name}"
                                ),
                                kernel,
                                layout,
                                pick,
                                landed,
                                module,
                            };
                            let cpu_side = (&mut cpu, &lc[..]);
                            let gpu_side = (&mut g, &lg[..]);
                            fused += usize::from(run_case(
                                cpu_side,
                                gpu_side,
                                &c,
                                &case,
                                (dt, &mut rng),
                            ));
                            total += 1;
                        }
                    }
                }
            }
        }
    }
    // Most calls here are the plan's (rows ≤ 8, rank ≤ 64); the declined ones (rank 64 on
    // down's 11008-wide input in bf16/f16, rank 64 at 4096 in f32) took the two launches.
    println!("lora_small: {fused} of {total} calls fused");
    assert!(fused * 2 > total, "only {fused} of {total} calls ran fused");
    assert!(fused < total, "no call exercised the plan's fallback");
}
