//! The CPU backend's emulation of CUDA's 16-bit q/k/v activations (`THAW_CUDA_BF16_ACT=1`,
//! [`attn16_plan`]): a test oracle of the rounding decision, not a speed path. With
//! [`CpuBackend::set_act16`] on, [`Backend::qkv_attention`] rounds q, k and v to the 16-bit type
//! after their products (where cuBLAS stores them in 16 bits on the GPU), exactly where the
//! CUDA path (`cuda/attn16.rs`) does, by the same plan; RoPE, the K/V write and attention then
//! run in f32 over the rounded values, as CUDA's `qkv_rope16` kernel does. CUDA rounds K and V
//! into the KV cache dtype on both paths, which the CPU's own cache dtype
//! ([`CpuBackend::with_kv_cache_dtype`]) emulates, so only what the 16-bit path adds is rounded
//! here.
//!
//! The attention output: where CUDA stores it 16-bit (`stores_out16`) its kernels round the
//! f32 value they computed once on the store, and o_proj's GEMM reads that; on the f32 path
//! they store the same f32 value and o_proj's cast rounds it the same way (round to nearest
//! even both), so o's product reads the same bits on both paths and the emulation has nothing
//! to add: it keeps `out` in f32, as before, on both paths (o's LoRA, the one reader of the
//! unrounded values, only runs where the plan keeps the f32 store). The GPU parity test
//! `attention_16_bit_outputs_are_the_f32_outputs_rounded` checks the bit-for-bit premise.
use std::sync::Arc;

use super::attn16_plan::{attn16_plan, Attn16Facts};
use super::cpu::{CpuBackend, CpuKvLayer, CpuLinear};
use super::cpu_act16::{slot_rank, targets, Act16Type};
use super::kernel_select::rope_fold_unserved;
use super::{qkv_then_rope_attention, Backend, LoraBatch, LoraSite, StepLayout};
use crate::adapter::LoraModule;
use crate::ids::LayerIdx;
use crate::residency::LoraSlot;

/// Whether a row of the step has an adapter that targets q, k or v of `layer` (the plan fact
/// of an eager step, shared with the CUDA backend).
pub(crate) fn lora_on_qkv<L>(
    batch: &LoraBatch<'_, L>,
    layer: LayerIdx,
    rank: impl Fn(&L, usize, LoraModule) -> usize + Copy,
) -> bool {
    use LoraModule::{K, Q, V};
    [Q, K, V]
        .into_iter()
        .any(|m| targets(batch, layer, m, rank))
}

/// Whether a row of the step has an adapter that targets o of `layer`, whether or not that
/// layer has landed on the device (its LoRA, or the CPU-assist export of o's input, reads the
/// f32 attention output): the plan fact of an eager step, shared with the CUDA backend.
pub(crate) fn lora_on_o<L>(
    batch: &LoraBatch<'_, L>,
    layer: LayerIdx,
    rank: impl Fn(&L, usize, LoraModule) -> usize,
) -> bool {
    targets(batch, layer, LoraModule::O, rank)
}

/// The plan facts every backend derives the same way from the op's arguments: the switch and
/// the weight type are the caller's, the GEMV's and the graph's facts the backend's.
pub(crate) fn attn16_facts(
    rows: usize,
    sites: &[LoraSite; 3],
    heads: (usize, usize),
    bias: bool,
    lora_on_qkv: bool,
) -> Attn16Facts {
    let head_dim = sites[0].dims.d_out / heads.0.max(1);
    Attn16Facts {
        rows,
        lora_on_qkv,
        bias,
        rope_unserved: rope_fold_unserved(head_dim).is_some(),
        ..Default::default()
    }
}

/// The query and key/value widths the plan's traffic model prices, from the op's sites.
pub(crate) fn q_kv(sites: &[LoraSite; 3]) -> (usize, usize) {
    (sites[0].dims.d_out, sites[1].dims.d_out)
}

/// [`Backend::qkv_attention`] of the CPU backend with the emulation on as `ty`: the rounding of
/// [`attn16_plan`]'s module docs, step for step as the CUDA path runs it.
#[allow(clippy::too_many_arguments)]
pub(super) fn qkv_attention(
    b: &mut CpuBackend,
    ty: Act16Type,
    x: &Vec<f32>,
    ws: [&CpuLinear; 3],
    [q, k, v]: [&mut Vec<f32>; 3],
    sites: [LoraSite; 3],
    batch: &LoraBatch<'_, Arc<LoraSlot>>,
    heads: (usize, usize),
    kv: &mut CpuKvLayer,
    step: &StepLayout,
    out: &mut Vec<f32>,
) {
    let rows = step.rows();
    // In an emulated graph step the key's rank class decides, as on CUDA.
    let graph = b.act16_graph();
    let lora = graph.is_none() && lora_on_qkv(batch, sites[0].layer, slot_rank);
    let bias = ws.iter().any(|w| w.bias.is_some());
    let facts = Attn16Facts {
        switch_on: true,
        weights_16bit: true,
        graph: graph.is_some(),
        graph_lora: graph.unwrap_or(false),
        // The same plan as CUDA's (its output store has no numeric effect here: module docs).
        lora_on_o: graph.is_none() && lora_on_o(batch, sites[0].layer, slot_rank),
        ..attn16_facts(rows, &sites, heads, bias, lora)
    };
    if !attn16_plan(&facts, q_kv(&sites)).rounds_qkv() {
        let qkv = [q, k, v];
        return qkv_then_rope_attention(b, x, ws, qkv, sites, batch, heads, kv, step, out);
    }
    // The products, rounded once (cuBLAS's 16-bit store); no LoRA targets q, k or v here.
    b.linear_group(x, ws, rows, [&mut *q, &mut *k, &mut *v]);
    for (buf, s) in [&mut *q, &mut *k, &mut *v].into_iter().zip(&sites) {
        ty.round(&mut buf[..rows * s.dims.d_out]);
    }
    b.rope_attention((q, k, &*v), heads, kv, step, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu_act16::tests::with_rank_batch;
    use crate::backend::LinearDims;

    #[test]
    fn only_adapters_with_rows_on_q_k_or_v_decide() {
        // Ranks per module index: adapter 0 on q, 1 on v, 2 on o and gate only.
        let mut ranks = [[0usize; 7]; 3];
        ranks[0][LoraModule::Q.index()] = 8;
        ranks[1][LoraModule::V.index()] = 4;
        ranks[2][LoraModule::O.index()] = 16;
        ranks[2][LoraModule::Gate.index()] = 16;
        let on = |segments: Vec<(std::ops::Range<usize>, u32)>| {
            with_rank_batch(&ranks, segments, |b, rank| {
                lora_on_qkv(b, LayerIdx(0), rank)
            })
        };
        assert!(!on(vec![]), "base rows only");
        assert!(!on(vec![(0..2, 2)]), "o and gate only");
        assert!(on(vec![(0..2, 2), (3..4, 1)]), "v");
        assert!(on(vec![(1..3, 0)]), "q");
        assert!(!on(vec![(1..1, 0), (2..3, 2)]), "an empty segment");
    }

    #[test]
    fn facts_from_the_sites() {
        let site = |module, d_out| LoraSite {
            layer: LayerIdx(0),
            module,
            dims: LinearDims { d_in: 64, d_out },
        };
        let sites = [
            site(LoraModule::Q, 64),
            site(LoraModule::K, 16),
            site(LoraModule::V, 16),
        ];
        assert_eq!(q_kv(&sites), (64, 16));
        // 4 heads of 16: served; 64 heads of 1 (odd): not.
        assert!(!attn16_facts(3, &sites, (4, 1), false, false).rope_unserved);
        assert!(attn16_facts(3, &sites, (64, 16), false, false).rope_unserved);
    }
}
