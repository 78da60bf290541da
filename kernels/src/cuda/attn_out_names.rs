//! The attention kernels' 16-bit-output entry points (issue 29, `THAW_CUDA_BF16_ACT=1`): the
//! names the runtime loads for a cache of one dtype and weights of another, as one pure
//! function, so a test checks every name it can form is a registered entry (a name the
//! registry lacks would fail the backend's start with the switch on, on a GPU only).
use super::registry::DType;
use super::{prefill_fa_plan, prefill_tc_plan};

/// One (KV dtype, weight dtype) pair's 16-bit-output entries: `attention.cu`'s decode and
/// prefill, flash-decoding's reduce (its split pass writes f32 partials), the occupancy
/// decode, and the tensor-core prefill's where it serves the head size and the cache's dtype
/// is the weight dtype (other pairs keep its f32 store and o_proj's cast), and the
/// FlashAttention-2-style prefill's under the same rule (`THAW_CUDA_PREFILL_FA=1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttnOut16Names {
    pub decode: String,
    pub prefill: String,
    pub reduce: String,
    pub ilp: String,
    pub tc: Option<String>,
    pub fa: Option<String>,
}

/// The entries for a cache of `kv`, weights of `w` (bf16 or f16: the output's type) and heads
/// of `head_dim`; `None` for f32 weights (no 16-bit type to store in).
pub fn attn_out16_names(kv: DType, w: DType, head_dim: usize) -> Option<AttnOut16Names> {
    if w == DType::F32 {
        return None;
    }
    let (k, o) = (kv.suffix(), w.suffix());
    let tc = prefill_tc_plan::entry_point(kv, head_dim)
        .filter(|_| kv == w)
        .map(|name| format!("{name}_out_{o}"));
    let fa = prefill_fa_plan::entry_point(kv, head_dim)
        .filter(|_| kv == w)
        .map(|name| format!("{name}_out_{o}"));
    Some(AttnOut16Names {
        decode: format!("attn_decode_{k}_out_{o}"),
        prefill: format!("attn_prefill_{k}_out_{o}"),
        reduce: format!("attn_decode_reduce_out_{o}"),
        ilp: format!("attn_decode_split_ilp_{k}_out_{o}"),
        tc,
        fa,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::registry::source_of;

    const ALL: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

    #[test]
    fn every_name_the_runtime_can_load_is_a_registered_entry() {
        let (mut tc, mut fa) = (0, 0);
        for kv in ALL {
            for w in [DType::Bf16, DType::F16] {
                for head_dim in [32, 64, 80, 128] {
                    let n = attn_out16_names(kv, w, head_dim).expect("16-bit weights");
                    let mut names = vec![n.decode, n.prefill, n.reduce, n.ilp];
                    names.extend(n.tc.clone());
                    names.extend(n.fa.clone());
                    for name in names {
                        assert!(source_of(&name).is_some(), "{name} is not registered");
                    }
                    // The tensor-core prefill's only where it serves and the dtypes match.
                    let served = prefill_tc_plan::entry_point(kv, head_dim).is_some();
                    assert_eq!(n.tc.is_some(), served && kv == w, "{kv:?} {w:?} {head_dim}");
                    tc += usize::from(n.tc.is_some());
                    // The FA prefill's exactly where the tensor-core prefill's is (it runs in
                    // its place), named after it.
                    assert_eq!(n.fa.is_some(), n.tc.is_some(), "{kv:?} {w:?} {head_dim}");
                    if let (Some(t), Some(f)) = (&n.tc, &n.fa) {
                        assert_eq!(f, &t.replace("_tc", "_fa"));
                    }
                    fa += usize::from(n.fa.is_some());
                }
            }
        }
        // bf16 and f16 caches of their own weight dtype, head sizes 32, 64 and 128.
        assert_eq!((tc, fa), (6, 6));
        assert_eq!(attn_out16_names(DType::Bf16, DType::F32, 64), None);
    }
}
