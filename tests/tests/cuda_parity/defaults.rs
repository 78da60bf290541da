//! Issue 29's kernels are the CUDA backend's defaults: with the four variables unset a backend
//! runs flash-decoding, Punica's SGMV / BGMV, the fused kernels and, where it serves the shape,
//! the tensor-core prefill; where it does not (an f32 KV cache, head_dim 96) the backend still
//! starts and runs the classic prefill. The resolution rules themselves are unit-tested on the
//! CPU (`thaw_runtime::backend::kernel_select`); this checks the backend wires them. Part of
//! `cuda_parity` (its helpers, its GPU skip rules).
use thaw_runtime::backend::cuda::{
    probe, AttnImpl, CudaBackend, DType, LoraImpl, ATTN_IMPL_ENV, FUSED_ENV, LORA_IMPL_ENV,
    TC_PREFILL_ENV,
};

use super::{cfg, shape};

#[test]
fn defaults_run_issue_29s_kernels_where_served() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let set: Vec<&str> = [ATTN_IMPL_ENV, TC_PREFILL_ENV, LORA_IMPL_ENV, FUSED_ENV]
        .into_iter()
        .filter(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()))
        .collect();
    if !set.is_empty() {
        println!("skipping the defaults' check: {set:?} set in the environment");
        return;
    }
    let sm80 = probe(0).unwrap().compute_capability >= (8, 0);
    let base = shape().config;
    for (dt, head_dim, tc) in [
        (DType::Bf16, base.head_dim, sm80),
        (DType::F16, 128, sm80),
        (DType::F32, base.head_dim, false),
        (DType::Bf16, 96, false),
    ] {
        let mut c = base.clone();
        c.head_dim = head_dim;
        let g = CudaBackend::new(&c, &cfg(dt)).expect("the defaults never refuse a backend");
        let p = g.kernel_plan();
        println!("{dt:?} head_dim {head_dim}: {p}");
        assert_eq!(g.attn_impl(), AttnImpl::SPLIT, "{dt:?} {head_dim}");
        assert_eq!(g.lora_impl(), LoraImpl::PUNICA, "{dt:?} {head_dim}");
        assert!(g.fused(), "{dt:?} {head_dim}");
        assert_eq!(g.tc_prefill(), tc, "{dt:?} head_dim {head_dim}");
    }
}
