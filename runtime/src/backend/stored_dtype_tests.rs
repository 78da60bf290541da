//! The CPU backend computes LoRA deltas from the adapters' stored bytes (f32, bf16, f16) with
//! f32 accumulation: checked against an f64 oracle over the same stored values.
use std::sync::Arc;

use super::cpu::CpuBackend;
use super::{test_adapter, test_values, Backend, LinearDims, LoraBatch, LoraKernel, LoraLayout};
use crate::adapter::{LoraAdapter, LoraModule, WeightDtype};
use crate::ids::LayerIdx;
use crate::model::{fixtures, ModelConfig};
use crate::residency::LoraSlot;

/// `y[r] += scale · x[r] · Aᵀ · Bᵀ` in f64 from the factors' stored values (widened exactly);
/// with `abs`, of every value's magnitude (the scale of the rounding error bound).
#[allow(clippy::too_many_arguments)]
fn oracle(
    a: &LoraAdapter,
    layer: usize,
    m: LoraModule,
    x: &[f32],
    y: &mut [f64],
    d: LinearDims,
    abs: bool,
) {
    let Some(w) = a.get(layer, m) else { return };
    let f = |v: Vec<f32>| -> Vec<f32> {
        v.into_iter()
            .map(|z| if abs { z.abs() } else { z })
            .collect()
    };
    let (fa, fb) = (f(w.a.to_f32()), f(w.b.to_f32()));
    let x: Vec<f32> = f(x.to_vec());
    for (xr, yr) in x.chunks_exact(d.d_in).zip(y.chunks_exact_mut(d.d_out)) {
        let t: Vec<f64> = (0..w.rank)
            .map(|k| {
                let row = &fa[k * d.d_in..(k + 1) * d.d_in];
                row.iter().zip(xr).map(|(&p, &q)| p as f64 * q as f64).sum()
            })
            .collect();
        for (o, yo) in yr.iter_mut().enumerate() {
            let brow = &fb[o * w.rank..(o + 1) * w.rank];
            let s: f64 = brow.iter().zip(&t).map(|(&p, &q)| p as f64 * q).sum();
            *yo += w.scale as f64 * s;
        }
    }
}

/// A mixed batch — a bf16, an f16 and an f32 adapter and base-only rows — through SGMV and
/// BGMV: every row within 1e-4 of the largest delta of the f64 oracle over the same stored
/// values (f32 accumulation over d_in = 64 terms of values below 0.5 is far inside that), and
/// the bf16 adapter's deltas within the rounding bound of its f32 original (each factor's
/// values rounded by at most 2⁻⁸ relative).
#[test]
fn stored_dtype_deltas_match_an_f64_oracle() {
    use LoraModule::*;
    let c = ModelConfig::from_dir(&fixtures::tiny_llama()).unwrap();
    let original = test_adapter(&c, 8, &LoraModule::ALL, 5);
    let adapters = [
        original.clone().into_dtype(WeightDtype::Bf16),
        test_adapter(&c, 16, &[Q, V, Down], 6).into_dtype(WeightDtype::F16),
        test_adapter(&c, 4, &[Q, Up], 7),
    ];
    let f32_bytes = original.size_bytes();
    assert_eq!(2 * adapters[0].size_bytes(), f32_bytes);
    let slots: Vec<Arc<LoraSlot>> = adapters
        .iter()
        .map(|a| Arc::new(LoraSlot::resident(Arc::new(a.clone()))))
        .collect();
    let refs: Vec<&Arc<LoraSlot>> = slots.iter().collect();
    let row_adapter = [
        Some(0),
        Some(0),
        Some(0),
        None,
        Some(1),
        Some(1),
        Some(2),
        None,
    ];
    let layout = LoraLayout {
        segments: vec![(0..3, 0), (4..6, 1), (6..7, 2)],
        row_adapter: row_adapter.to_vec(),
    };
    let rows = row_adapter.len();
    let mut b = CpuBackend::new(&c);
    for kernel in [LoraKernel::Sgmv, LoraKernel::Bgmv] {
        let batch = LoraBatch {
            kernel,
            layout: &layout,
            adapters: &refs,
            landed: &[2, 2, 2],
        };
        for m in LoraModule::ALL {
            let (d_in, d_out) = c.module_shape(m);
            let d = LinearDims { d_in, d_out };
            let x = test_values(11 + m.index() as u32)(rows * d_in);
            let mut y = vec![0.0f32; rows * d_out];
            b.lora(&x, &mut y, d, (LayerIdx(1), m), &batch);
            let mut want = vec![0.0f64; rows * d_out];
            for (r, ai) in row_adapter.iter().enumerate() {
                let Some(ai) = ai else { continue };
                let (xr, yr) = (
                    &x[r * d_in..(r + 1) * d_in],
                    &mut want[r * d_out..(r + 1) * d_out],
                );
                oracle(&adapters[*ai as usize], 1, m, xr, yr, d, false);
            }
            let scale = want.iter().fold(0f64, |s, v| s.max(v.abs()));
            assert!(scale > 0.0, "{m:?}: no delta at all");
            for (i, (g, w)) in y.iter().zip(&want).enumerate() {
                let err = (*g as f64 - w).abs();
                assert!(
                    err <= 1e-4 * scale,
                    "{kernel:?} {m:?} element {i}: {g} vs {w} (scale {scale})"
                );
            }
            // The bf16 adapter against its f32 original: each factor's value moved by at
            // most 2⁻⁸ of itself, so each product term by at most (1 + 2⁻⁸)² − 1 < 2⁻⁷ + 2⁻¹⁶
            // of its magnitude; plus the f32 accumulation allowance above.
            let (mut orig, mut mag) = (vec![0.0f64; 3 * d_out], vec![0.0f64; 3 * d_out]);
            oracle(&original, 1, m, &x[..3 * d_in], &mut orig, d, false);
            oracle(&original, 1, m, &x[..3 * d_in], &mut mag, d, true);
            let bound = 1.0 / 128.0 + 1.0 / 65536.0;
            for ((g, w), a) in y[..3 * d_out].iter().zip(&orig).zip(&mag) {
                let err = (*g as f64 - w).abs();
                assert!(
                    err <= bound * a + 1e-4 * scale,
                    "{kernel:?} {m:?}: {g} vs {w}"
                );
            }
        }
    }
}
