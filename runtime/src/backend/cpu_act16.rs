//! The CPU backend's emulation of CUDA's 16-bit MLP activations (`THAW_CUDA_BF16_ACT=1`,
//! [`act16_plan`]): a test oracle of the rounding decision, not a speed path. With
//! [`CpuBackend::set_act16`] on, [`Backend::gated_mlp_in`] rounds gate and up to the 16-bit
//! type after their products (where cuBLAS stores them in 16 bits on the GPU) and the SwiGLU
//! output where every consumer reads it rounded ([`Act16Plan::rounds_act`]), exactly where the
//! CUDA path does, by the same plan. Everything else stays f32, so a test that compares greedy
//! tokens with and without it measures what the switch changes.
use half::{bf16, f16};

use super::act16_plan::{act16_plan, Act16Facts, Act16Plan};
use super::cpu::{CpuBackend, CpuLinear};
use super::{gate_up_then_swiglu, Backend, LoraBatch, LoraSite};
use crate::adapter::LoraModule;
use crate::ids::LayerIdx;
use crate::residency::LoraSlot;

/// The 16-bit type activations are stored in: the weights' on the GPU.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Act16Type {
    Bf16,
    F16,
}

impl Act16Type {
    /// Rounds each value to the type (round to nearest even, as CUDA's conversions and
    /// cuBLAS's 16-bit stores do) and back.
    pub fn round(self, v: &mut [f32]) {
        match self {
            Self::Bf16 => v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32()),
            Self::F16 => v.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
        }
    }
}

/// Whether a row of the step has an adapter that targets `module` of `layer` (whether or not
/// its layer has landed: a row computed elsewhere only keeps the step on f32).
pub(crate) fn targets<L>(
    batch: &LoraBatch<'_, L>,
    layer: LayerIdx,
    module: LoraModule,
    rank: impl Fn(&L, usize, LoraModule) -> usize,
) -> bool {
    batch
        .layout
        .segments
        .iter()
        .any(|(rows, a)| !rows.is_empty() && rank(batch.adapters[*a as usize], layer.0, module) > 0)
}

/// The plan facts of the MLP at `layer` that the step's adapters decide.
pub(crate) fn lora_facts<L>(
    batch: &LoraBatch<'_, L>,
    layer: LayerIdx,
    rank: impl Fn(&L, usize, LoraModule) -> usize + Copy,
) -> (bool, bool) {
    let on = |m| targets(batch, layer, m, rank);
    (
        on(LoraModule::Gate) || on(LoraModule::Up),
        on(LoraModule::Down),
    )
}

pub(super) fn slot_rank(s: &std::sync::Arc<LoraSlot>, layer: usize, m: LoraModule) -> usize {
    s.adapter().get(layer, m).map_or(0, |w| w.rank)
}

/// [`Backend::gated_mlp_in`] of the CPU backend with the emulation on as `ty`: the rounding of
/// [`act16_plan`]'s module docs, step for step as the CUDA path (`cuda/act16.rs`) runs it.
#[allow(clippy::too_many_arguments)]
pub(super) fn gated_mlp_in(
    b: &mut CpuBackend,
    ty: Act16Type,
    x: &Vec<f32>,
    ws: [&CpuLinear; 2],
    rows: usize,
    [gate, up]: [&mut Vec<f32>; 2],
    sites: [LoraSite; 2],
    batch: &LoraBatch<'_, std::sync::Arc<LoraSlot>>,
    act: &mut Vec<f32>,
) {
    // In an emulated graph step the key's rank class decides, as on CUDA.
    let graph = b.act16_graph();
    let (lora_on_gate_up, lora_on_down) = match graph {
        Some(_) => (false, false),
        None => lora_facts(batch, sites[0].layer, slot_rank),
    };
    let plan = act16_plan(&Act16Facts {
        switch_on: true,
        weights_16bit: true,
        rows,
        lora_on_gate_up,
        lora_on_down,
        graph: graph.is_some(),
        graph_lora: graph.unwrap_or(false),
        gemv: false,
        bias: ws.iter().any(|w| w.bias.is_some()),
    });
    let Act16Plan::Act16 { f32_copy } = plan else {
        return gate_up_then_swiglu(b, x, ws, rows, [gate, up], sites, batch, act);
    };
    let n = rows * sites[0].dims.d_out;
    // The products, rounded once (cuBLAS's 16-bit store); no LoRA targets gate or up here.
    b.linear_group(x, ws, rows, [&mut *gate, &mut *up]);
    ty.round(&mut gate[..n]);
    ty.round(&mut up[..n]);
    b.swiglu(gate, up, n, act);
    if !f32_copy {
        ty.round(&mut act[..n]);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `f` over a batch of `segments` whose adapters are `ranks` (rank per module index, the
    /// same at every layer), with the rank function the plan facts read.
    pub(crate) fn with_rank_batch<R>(
        ranks: &[[usize; 7]],
        segments: Vec<(std::ops::Range<usize>, u32)>,
        f: impl FnOnce(&LoraBatch<'_, [usize; 7]>, fn(&[usize; 7], usize, LoraModule) -> usize) -> R,
    ) -> R {
        use crate::backend::{LoraKernel, LoraLayout};
        let adapters: Vec<&[usize; 7]> = ranks.iter().collect();
        let layout = LoraLayout {
            segments,
            row_adapter: Vec::new(),
        };
        let landed = vec![9; ranks.len()];
        let batch = LoraBatch {
            kernel: LoraKernel::Sgmv,
            layout: &layout,
            adapters: &adapters,
            landed: &landed,
        };
        f(&batch, |a, _layer, m| a[m.index()])
    }

    #[test]
    fn only_adapters_with_rows_decide_the_lora_facts() {
        // Ranks per module index: adapter 0 on gate and up, 1 on down, 2 on q only.
        let mut ranks = [[0usize; 7]; 3];
        ranks[0][LoraModule::Gate.index()] = 8;
        ranks[0][LoraModule::Up.index()] = 8;
        ranks[1][LoraModule::Down.index()] = 4;
        ranks[2][LoraModule::Q.index()] = 16;
        let facts = |segments: Vec<(std::ops::Range<usize>, u32)>| {
            with_rank_batch(&ranks, segments, |b, rank| lora_facts(b, LayerIdx(0), rank))
        };
        assert_eq!(facts(vec![]), (false, false), "base rows only");
        assert_eq!(facts(vec![(0..2, 2)]), (false, false), "q only");
        assert_eq!(facts(vec![(0..2, 2), (3..4, 1)]), (false, true));
        assert_eq!(facts(vec![(1..3, 0)]), (true, false));
        assert_eq!(
            facts(vec![(1..1, 0), (2..3, 1)]),
            (false, true),
            "an empty segment"
        );
    }

    #[test]
    fn rounding_keeps_8_or_11_significant_bits() {
        let mut v = vec![1.0 + 1.0 / 256.0 + 1.0 / 1024.0, 2.71, -0.1];
        let f = v.clone();
        Act16Type::Bf16.round(&mut v);
        assert_eq!(v[0], 1.0 + 1.0 / 128.0, "ties and above round up to 8 bits");
        for (a, b) in v.iter().zip(&f) {
            assert!(((a - b) / b).abs() <= 1.0 / 256.0, "{a} vs {b}");
        }
        let mut h = f.clone();
        Act16Type::F16.round(&mut h);
        for (a, b) in h.iter().zip(&f) {
            assert!(((a - b) / b).abs() <= 1.0 / 2048.0, "{a} vs {b}");
        }
    }
}
