//! Issue 29's kernels are the CUDA backend's defaults: with the thirteen variables unset a
//! backend runs flash-decoding, Punica's SGMV / BGMV, the fused kernels and, where it serves the
//! shape, the tensor-core prefill; where it does not (an f32 KV cache, head_dim 96) the backend
//! still starts and runs the classic prefill. The nine of `OptInPlan` (defaults since session
//! 24's H200 parity run) are loaded too, the 16-bit activations and residual only with 16-bit
//! weights. The resolution rules themselves are unit-tested on the CPU
//! (`thaw_runtime::backend::kernel_select`); this checks the backend wires them. Also the
//! helpers the other tests switch the nine with ([`set_nine`], [`nine_off`]): a test of a
//! classic path, or one whose counts or bit-for-bit claims were derived for it, sets it
//! explicitly rather than trusting the defaults. Part of `cuda_parity` (its helpers, its GPU
//! skip rules).
use thaw_kernels::cuda::decode_plan::OCC_MIN_CHUNK;
use thaw_runtime::backend::cuda::{
    probe, AttnImpl, CudaBackend, DType, LoraImpl, ACT16_ENV, ATTN_IMPL_ENV, ATTN_OCCUPANCY_ENV,
    CUBLASLT_ENV, DEVICE_ARGMAX_ENV, FUSED_ENV, GEMV_ENV, GROUP_GEMM_ENV, LORA_IMPL_ENV,
    LORA_SLICES_ENV, ROPE_FOLD_ENV, SPLIT_MIN_CHUNK_ENV, TC_PREFILL_ENV, WIDE_ENV,
};
use thaw_runtime::backend::kernel_select::{Choice, OptInPlan};

use super::{cfg, shape};

/// The nine choices of `p`, named.
fn nine_of(p: &OptInPlan) -> [(&'static str, &Choice); 9] {
    [
        ("group_gemm", &p.group_gemm),
        ("rope_fold", &p.rope_fold),
        ("wide", &p.wide),
        ("device_argmax", &p.device_argmax),
        ("gemv", &p.gemv),
        ("lora_slices", &p.lora_slices),
        ("attn_occupancy", &p.attn_occupancy),
        ("cublaslt", &p.cublaslt),
        ("act16", &p.act16),
    ]
}

/// Switches the nine kernels of `OptInPlan` on `g` all on or all off, whatever the environment
/// says (`benches/gpu/lease.sh` runs `opt_in` with all nine `0`): the 16-bit activations (and
/// with them the 16-bit residual) on only where `weights_16bit`, the only weights they serve.
/// Before the model loads where the grouped products matter (their weights are placed at load).
pub(super) fn set_nine(g: &mut CudaBackend, on: bool, weights_16bit: bool) {
    g.set_group_gemm(on).unwrap();
    g.set_rope_fold(on).unwrap();
    g.set_wide(on).unwrap();
    g.set_device_argmax(on).unwrap();
    g.set_gemv(on).unwrap();
    g.set_lora_slices(on).unwrap();
    g.set_attn_occupancy(on.then_some(OCC_MIN_CHUNK)).unwrap();
    g.set_cublaslt(on).unwrap();
    g.set_act16(on && weights_16bit).unwrap();
    let p = g.opt_in_plan();
    for (name, c) in nine_of(&p) {
        let want = on && (name != "act16" || weights_16bit);
        assert_eq!(c.is_new(), want, "{name}: {p}");
    }
    assert_eq!(g.residual16(), on && weights_16bit, "{p}");
}

/// The nine off: the kernels they replace, as before session 24 made them the defaults.
pub(super) fn nine_off(g: &mut CudaBackend) {
    set_nine(g, false, false);
}

#[test]
fn defaults_run_issue_29s_kernels_where_served() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let set: Vec<&str> = [
        ATTN_IMPL_ENV,
        TC_PREFILL_ENV,
        LORA_IMPL_ENV,
        FUSED_ENV,
        GROUP_GEMM_ENV,
        ROPE_FOLD_ENV,
        WIDE_ENV,
        DEVICE_ARGMAX_ENV,
        GEMV_ENV,
        LORA_SLICES_ENV,
        ATTN_OCCUPANCY_ENV,
        CUBLASLT_ENV,
        ACT16_ENV,
        // Not a switch, but it moves the occupancy decode's floor checked below.
        SPLIT_MIN_CHUNK_ENV,
    ]
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
        let mut g = CudaBackend::new(&c, &cfg(dt)).expect("the defaults never refuse a backend");
        let p = g.kernel_plan();
        let nine = g.opt_in_plan();
        println!("{dt:?} head_dim {head_dim}: {p}; {nine}");
        assert_eq!(g.attn_impl(), AttnImpl::SPLIT, "{dt:?} {head_dim}");
        assert_eq!(g.lora_impl(), LoraImpl::PUNICA, "{dt:?} {head_dim}");
        assert!(g.fused(), "{dt:?} {head_dim}");
        assert_eq!(g.tc_prefill(), tc, "{dt:?} head_dim {head_dim}");
        // Every one of the nine served at these head_dims (even, up to 256); the 16-bit
        // activations and residual only with 16-bit weights (f32 ones: the loader leaves them
        // off and says so).
        let x16 = dt != DType::F32;
        for (name, c) in nine_of(&nine) {
            let want = name != "act16" || x16;
            assert_eq!(
                c.is_new(),
                want,
                "{dt:?} head_dim {head_dim} {name}: {nine}"
            );
        }
        assert_eq!(g.residual16(), x16, "{dt:?} head_dim {head_dim}");
        assert_eq!(g.attn_occupancy(), Some(OCC_MIN_CHUNK), "{dt:?} {head_dim}");
        // The helper's off is every one of them off, and on again restores the defaults.
        nine_off(&mut g);
        set_nine(&mut g, true, x16);
        assert_eq!(g.opt_in_plan(), nine, "{dt:?} head_dim {head_dim}");
    }
}
