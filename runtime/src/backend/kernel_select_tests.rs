use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

const SM75: GpuArch = GpuArch { major: 7, minor: 5 };
const SWITCHES: [Switch; 4] = [ATTN, TC_PREFILL, LORA, FUSED];

/// Llama-7B's shape on an H100: every new kernel serves it.
fn llama7b() -> ServedShape {
    ServedShape {
        kv: DType::Bf16,
        head_dim: 128,
        max_lora_d_in: 11008,
        arch: GpuArch::SM90,
    }
}

/// An environment lookup over `vars`.
fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}

fn plan(vars: &[(&str, &str)], s: &ServedShape) -> Result<KernelPlan, String> {
    KernelPlan::resolve(env(vars), s)
}

#[test]
fn every_switch_parses_its_values_and_the_default() {
    for sw in SWITCHES {
        for v in ["", "  ", "auto", "AUTO"] {
            assert_eq!(sw.parse(v), Ok(Ask::Default), "{} {v:?}", sw.env);
        }
        assert_eq!(sw.parse(sw.on), Ok(Ask::On), "{}", sw.env);
        assert_eq!(
            sw.parse(&format!(" {} ", sw.off.to_uppercase())),
            Ok(Ask::Off)
        );
    }
    assert_eq!(ATTN.parse("Flash-Decoding"), Ok(Ask::On));
    for v in ["true", "on", "yes"] {
        assert_eq!(TC_PREFILL.parse(v), Ok(Ask::On));
        assert_eq!(FUSED.parse(v), Ok(Ask::On));
    }
    for v in ["false", "off", "no"] {
        assert_eq!(TC_PREFILL.parse(v), Ok(Ask::Off));
        assert_eq!(FUSED.parse(v), Ok(Ask::Off));
    }
    // A named switch does not take 1/0, an on/off one does not take names.
    assert!(ATTN.parse("1").is_err());
    assert!(LORA.parse("0").is_err());
    assert!(FUSED.parse("classic").is_err());
    assert!(TC_PREFILL.parse("split").is_err());
}

#[test]
fn a_bad_value_names_the_variable_and_what_to_use() {
    let e = ATTN.parse("paged").unwrap_err();
    assert!(
        e.contains(ATTN_IMPL_ENV) && e.contains("\"split\"") && e.contains("\"classic\""),
        "{e}"
    );
    let e = LORA.parse("cutlass").unwrap_err();
    assert!(e.contains(LORA_IMPL_ENV) && e.contains("\"punica\""), "{e}");
    let e = TC_PREFILL.parse("fast").unwrap_err();
    assert!(
        e.contains(TC_PREFILL_ENV) && e.contains("\"1\"") && e.contains("\"0\""),
        "{e}"
    );
    let e = FUSED.parse("2").unwrap_err();
    assert!(e.contains(FUSED_ENV) && e.contains("\"auto\""), "{e}");
}

#[test]
fn the_default_falls_back_and_an_explicit_on_errs_where_unserved() {
    let why = || Some("no reason".to_string());
    for sw in SWITCHES {
        assert_eq!(sw.resolve(Ask::Default, None), Ok(Choice::New));
        assert_eq!(sw.resolve(Ask::On, None), Ok(Choice::New));
        assert_eq!(sw.resolve(Ask::Off, None), Ok(Choice::Classic));
        assert_eq!(sw.resolve(Ask::Off, why()), Ok(Choice::Classic));
        assert_eq!(
            sw.resolve(Ask::Default, why()),
            Ok(Choice::Fallback("no reason".into()))
        );
        let e = sw.resolve(Ask::On, why()).unwrap_err();
        let off = format!("{}={}", sw.env, sw.off);
        assert!(e.contains(&off) && e.contains("no reason"), "{e}");
    }
}

#[test]
fn the_tensor_core_prefill_serves_16_bit_caches_of_its_head_dims_on_sm80_and_up() {
    for arch in [GpuArch::SM80, GpuArch::SM90] {
        for kv in [DType::Bf16, DType::F16] {
            for hd in [32, 64, 128] {
                assert_eq!(tc_prefill_unserved(kv, hd, arch), None, "{kv:?} {hd}");
            }
        }
    }
    let f32_cache = tc_prefill_unserved(DType::F32, 128, GpuArch::SM90).unwrap();
    assert!(f32_cache.contains("f32"), "{f32_cache}");
    let hd96 = tc_prefill_unserved(DType::Bf16, 96, GpuArch::SM90).unwrap();
    assert!(hd96.contains("96"), "{hd96}");
    let turing = tc_prefill_unserved(DType::Bf16, 128, SM75).unwrap();
    assert!(turing.contains("8.0") && turing.contains("7.5"), "{turing}");
}

#[test]
fn flash_decoding_and_punica_have_their_limits() {
    assert_eq!(split_unserved(shape::SPLIT_MAX_HEAD_DIM), None);
    assert!(split_unserved(shape::SPLIT_MAX_HEAD_DIM + 1).is_some());
    assert_eq!(punica_unserved(PUNICA_MAX_D_IN), None);
    let e = punica_unserved(PUNICA_MAX_D_IN + 8).unwrap();
    assert!(e.contains(&PUNICA_MAX_D_IN.to_string()), "{e}");
    // The limit is the split planner's: it plans PUNICA_MAX_D_IN and refuses one more.
    let plan = |d| punica_plan::SplitK::plan(d, 1, 132, shape::PUNICA_K_CHUNK);
    assert!(plan(PUNICA_MAX_D_IN).is_some());
    assert!(plan(PUNICA_MAX_D_IN + 1).is_none());
}

#[test]
fn unset_variables_turn_every_kernel_on_where_served() {
    let all_new = KernelPlan {
        attn: Choice::New,
        tc_prefill: Choice::New,
        lora: Choice::New,
        fused: Choice::New,
    };
    assert_eq!(plan(&[], &llama7b()), Ok(all_new.clone()));
    let empty: Vec<(&str, &str)> = SWITCHES.iter().map(|s| (s.env, "")).collect();
    assert_eq!(plan(&empty, &llama7b()), Ok(all_new.clone()));
    let on: Vec<(&str, &str)> = SWITCHES.iter().map(|s| (s.env, s.on)).collect();
    assert_eq!(plan(&on, &llama7b()), Ok(all_new));
    let off: Vec<(&str, &str)> = SWITCHES.iter().map(|s| (s.env, s.off)).collect();
    assert_eq!(
        plan(&off, &llama7b()),
        Ok(KernelPlan {
            attn: Choice::Classic,
            tc_prefill: Choice::Classic,
            lora: Choice::Classic,
            fused: Choice::Classic,
        })
    );
}

#[test]
fn an_f32_cache_falls_back_by_default_and_errs_when_asked_for() {
    let f32_kv = ServedShape {
        kv: DType::F32,
        ..llama7b()
    };
    let p = plan(&[], &f32_kv).unwrap();
    assert!(matches!(p.tc_prefill, Choice::Fallback(_)), "{p:?}");
    assert!(
        p.attn.is_new() && p.lora.is_new() && p.fused.is_new(),
        "{p:?}"
    );
    let line = p.to_string();
    assert!(
        line.contains("prefill attention: classic") && line.contains("f32"),
        "{line}"
    );
    let e = plan(&[(TC_PREFILL_ENV, "1")], &f32_kv).unwrap_err();
    assert!(
        e.contains("THAW_CUDA_TC_PREFILL=0") && e.contains("bf16 or f16"),
        "{e}"
    );
    // Turned off explicitly: no error, no fallback.
    let p = plan(&[(TC_PREFILL_ENV, "0")], &f32_kv).unwrap();
    assert_eq!(p.tc_prefill, Choice::Classic);
    // A wide model on Punica, asked for.
    let wide = ServedShape {
        max_lora_d_in: PUNICA_MAX_D_IN * 2,
        ..llama7b()
    };
    assert!(matches!(
        plan(&[], &wide).unwrap().lora,
        Choice::Fallback(_)
    ));
    let e = plan(&[(LORA_IMPL_ENV, "punica")], &wide).unwrap_err();
    assert!(e.contains("THAW_CUDA_LORA_IMPL=classic"), "{e}");
    // A bad value anywhere is an error, whatever the shape.
    let e = plan(&[(FUSED_ENV, "maybe")], &llama7b()).unwrap_err();
    assert!(e.contains(FUSED_ENV), "{e}");
}

#[test]
fn the_log_line_names_every_kernel() {
    let p = plan(&[(ATTN_IMPL_ENV, "classic")], &llama7b()).unwrap();
    assert_eq!(
        p.to_string(),
        "decode attention: classic (THAW_CUDA_ATTN_IMPL=classic); prefill attention: \
         tensor-core prefill (off: THAW_CUDA_TC_PREFILL=0); LoRA: punica (off: \
         THAW_CUDA_LORA_IMPL=classic); elementwise: fused (off: THAW_CUDA_FUSED=0)"
    );
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn arch() -> impl Strategy<Value = GpuArch> {
    (6u32..=10, 0u32..=9).prop_map(|(major, minor)| GpuArch { major, minor })
}

proptest! {
    /// The tensor-core prefill is served exactly where it has an entry point and the device
    /// runs bf16/f16 mma.sync; the default never errs, an explicit 1 errs exactly where it
    /// falls back, and 0 is always the classic kernel.
    #[test]
    fn tc_prefill_resolution_matches_its_entry_points(
        kv in dtype(), hd in 1usize..=300, a in arch(),
    ) {
        let served = a >= GpuArch::SM80 && prefill_tc_plan::entry_point(kv, hd).is_some();
        let why = tc_prefill_unserved(kv, hd, a);
        prop_assert_eq!(why.is_none(), served);
        let d = TC_PREFILL.choose("", why.clone()).unwrap();
        prop_assert_eq!(d.is_new(), served);
        prop_assert_eq!(TC_PREFILL.choose("1", why.clone()).is_ok(), served);
        prop_assert_eq!(TC_PREFILL.choose("0", why).unwrap(), Choice::Classic);
    }

    /// Whatever the shape, the variables set to their off values give the classic kernels
    /// and unset ones never err.
    #[test]
    fn off_is_always_classic_and_the_default_never_errs(
        kv in dtype(), hd in 1usize..=300, d_in in 1usize..200_000, a in arch(),
    ) {
        let s = ServedShape { kv, head_dim: hd, max_lora_d_in: d_in, arch: a };
        prop_assert!(plan(&[], &s).is_ok());
        let off: Vec<(&str, &str)> = SWITCHES.iter().map(|w| (w.env, w.off)).collect();
        let p = plan(&off, &s).unwrap();
        prop_assert!([&p.attn, &p.tc_prefill, &p.lora, &p.fused]
            .iter()
            .all(|c| **c == Choice::Classic));
    }
}

const NINE: [Switch; 9] = [
    GROUP_GEMM,
    ROPE_FOLD,
    WIDE,
    DEVICE_ARGMAX,
    GEMV,
    LORA_SLICES,
    ATTN_OCCUPANCY,
    CUBLASLT,
    ACT16,
];

fn nine(vars: &[(&str, &str)], head_dim: usize) -> Result<OptInPlan, String> {
    OptInPlan::resolve(env(vars), head_dim)
}

/// Every one of the nine switches at its new kernel.
fn nine_new() -> OptInPlan {
    OptInPlan {
        group_gemm: Choice::New,
        rope_fold: Choice::New,
        wide: Choice::New,
        device_argmax: Choice::New,
        gemv: Choice::New,
        lora_slices: Choice::New,
        attn_occupancy: Choice::New,
        cublaslt: Choice::New,
        act16: Choice::New,
        // Opt-in still: off unless `1`.
        prefill_fa: Choice::Classic,
        lora_small: Choice::Classic,
    }
}

/// The nine plan's choices in [`NINE`]'s order.
fn nine_choices(p: &OptInPlan) -> [&Choice; 9] {
    [
        &p.group_gemm,
        &p.rope_fold,
        &p.wide,
        &p.device_argmax,
        &p.gemv,
        &p.lora_slices,
        &p.attn_occupancy,
        &p.cublaslt,
        &p.act16,
    ]
}

#[test]
fn the_nine_switches_are_on_unless_set_to_0() {
    let classic = OptInPlan {
        group_gemm: Choice::Classic,
        rope_fold: Choice::Classic,
        wide: Choice::Classic,
        device_argmax: Choice::Classic,
        gemv: Choice::Classic,
        lora_slices: Choice::Classic,
        attn_occupancy: Choice::Classic,
        cublaslt: Choice::Classic,
        act16: Choice::Classic,
        prefill_fa: Choice::Classic,
        lora_small: Choice::Classic,
    };
    assert_eq!(nine(&[], 128), Ok(nine_new()));
    let auto: Vec<(&str, &str)> = NINE.iter().map(|s| (s.env, "auto")).collect();
    assert_eq!(nine(&auto, 128), Ok(nine_new()));
    let on: Vec<(&str, &str)> = NINE.iter().map(|s| (s.env, " ON ")).collect();
    assert_eq!(nine(&on, 128), Ok(nine_new()));
    let zero: Vec<(&str, &str)> = NINE.iter().map(|s| (s.env, "0")).collect();
    assert_eq!(nine(&zero, 128), Ok(classic.clone()));
    let off: Vec<(&str, &str)> = NINE.iter().map(|s| (s.env, " Off ")).collect();
    assert_eq!(nine(&off, 128), Ok(classic));
    // One at a time: each variable moves its own choice only.
    for (i, sw) in NINE.iter().enumerate() {
        let p = nine(&[(sw.env, "0")], 64).unwrap();
        let got = nine_choices(&p).map(Choice::is_new);
        let want: [bool; 9] = std::array::from_fn(|j| j != i);
        assert_eq!(got, want, "{}", sw.env);
    }
    // The nine do not move the four, nor the four the nine.
    assert_eq!(
        plan(&zero, &llama7b()),
        plan(&[], &llama7b()),
        "the nine at 0 moved a default of the four"
    );
    let four_off: Vec<(&str, &str)> = SWITCHES.iter().map(|s| (s.env, s.off)).collect();
    assert_eq!(nine(&four_off, 128), Ok(nine_new()));
}

/// Every one of the thirteen switches: unset (or empty, or `auto`) resolves to the new kernel
/// where served and its off value to the classic one, served or not; where the new kernel
/// does not serve the shape, unset still falls back (with the reason) and an explicit on
/// still errs.
#[test]
fn every_switch_is_new_when_unset_and_classic_when_off() {
    let why = || Some("no reason".to_string());
    for sw in SWITCHES.iter().chain(&NINE) {
        assert!(sw.default_new, "{} is not a default", sw.env);
        for unset in ["", " ", "auto"] {
            assert_eq!(
                sw.choose(unset, None),
                Ok(Choice::New),
                "{} {unset:?}",
                sw.env
            );
            assert_eq!(
                sw.choose(unset, why()),
                Ok(Choice::Fallback("no reason".into())),
                "{} {unset:?}",
                sw.env
            );
        }
        assert_eq!(sw.choose(sw.off, None), Ok(Choice::Classic), "{}", sw.env);
        assert_eq!(sw.choose(sw.off, why()), Ok(Choice::Classic), "{}", sw.env);
        assert_eq!(sw.choose(sw.on, None), Ok(Choice::New), "{}", sw.env);
        let e = sw.choose(sw.on, why()).unwrap_err();
        assert!(e.contains(&format!("{}={}", sw.env, sw.off)), "{e}");
    }
    // The fallbacks the plans compute from the shape, unset: RoPE folding on an odd head_dim
    // and the occupancy decode past flash-decoding's heads fall back; the rest stay new.
    let odd = nine(&[], 65).unwrap();
    assert!(
        matches!(&odd.rope_fold, Choice::Fallback(w) if w.contains("65")),
        "{odd:?}"
    );
    assert!(odd.attn_occupancy.is_new(), "{odd:?}");
    let big = shape::SPLIT_MAX_HEAD_DIM * 2;
    let wide_heads = nine(&[], big).unwrap();
    assert!(
        matches!(&wide_heads.attn_occupancy, Choice::Fallback(w) if w.contains(&big.to_string())),
        "{wide_heads:?}"
    );
    // The same shapes at 0: classic, no fallback, no error.
    let zero: Vec<(&str, &str)> = NINE.iter().map(|s| (s.env, "0")).collect();
    for hd in [65, big] {
        let p = nine(&zero, hd).unwrap();
        assert!(
            nine_choices(&p).iter().all(|c| **c == Choice::Classic),
            "{p:?}"
        );
    }
    // flash-decoding's own fallback, unset, beside the occupancy decode's.
    let s = ServedShape {
        head_dim: big,
        ..llama7b()
    };
    assert!(matches!(plan(&[], &s).unwrap().attn, Choice::Fallback(_)));
}

#[test]
fn one_of_the_nine_names_itself_when_its_value_or_shape_is_bad() {
    let e = nine(&[(GROUP_GEMM_ENV, "fast")], 128).unwrap_err();
    assert!(e.contains(GROUP_GEMM_ENV) && e.contains("\"1\""), "{e}");
    let e = nine(&[(WIDE_ENV, "classic")], 128).unwrap_err();
    assert!(e.contains(WIDE_ENV), "{e}");
    // RoPE folding needs an even head_dim the attention kernels take.
    assert_eq!(rope_fold_unserved(128), None);
    assert_eq!(rope_fold_unserved(shape::MAX_HEAD_DIM), None);
    assert!(rope_fold_unserved(shape::MAX_HEAD_DIM + 2).is_some());
    assert!(rope_fold_unserved(65).is_some());
    let e = nine(&[(ROPE_FOLD_ENV, "1")], 65).unwrap_err();
    assert!(
        e.contains("THAW_CUDA_ROPE_FOLD=0") && e.contains("65"),
        "{e}"
    );
    // Unset, an odd head_dim is no error: the separate RoPE runs, and the log says why.
    let p = nine(&[], 65).unwrap();
    assert!(matches!(p.rope_fold, Choice::Fallback(_)), "{p:?}");
    assert!(
        p.to_string()
            .contains("RoPE: separate (the folded into the KV write kernels do not serve"),
        "{p}"
    );
}

#[test]
fn the_log_line_names_each_of_the_nine_and_how_to_turn_it_off() {
    let p = nine(&[], 128).unwrap();
    assert_eq!(
        p.to_string(),
        "q/k/v and gate/up products: grouped (off: THAW_CUDA_GROUP_GEMM=0); RoPE: folded into \
         the KV write (off: THAW_CUDA_ROPE_FOLD=0); norm and RoPE blocks: wide (off: \
         THAW_CUDA_WIDE_NORM=0); greedy sampling: device argmax (off: \
         THAW_CUDA_DEVICE_ARGMAX=0); products of few rows: small-batch GEMV (off: \
         THAW_CUDA_GEMV=0); LoRA of q/k/v and gate/up: one launch pair over slices (off: \
         THAW_CUDA_LORA_SLICES=0); decode attention: occupancy split, keys in flight (off: \
         THAW_CUDA_ATTN_OCCUPANCY=0); products: cuBLASLt, bias in its epilogue (off: \
         THAW_CUDA_CUBLASLT=0); activations: q/k/v, gate/up and SwiGLU in 16 bits (off: \
         THAW_CUDA_BF16_ACT=0); prefill attention: tensor-core prefill (THAW_CUDA_PREFILL_FA=0); \
         LoRA of few rows: a shrink and an expand launch (THAW_CUDA_LORA_SMALL=0)"
    );
    let zero: Vec<(&str, &str)> = NINE.iter().map(|s| (s.env, "0")).collect();
    assert_eq!(
        nine(&zero, 128).unwrap().to_string(),
        "q/k/v and gate/up products: per-module (THAW_CUDA_GROUP_GEMM=0); RoPE: separate \
         (THAW_CUDA_ROPE_FOLD=0); norm and RoPE blocks: one block of 256 per row \
         (THAW_CUDA_WIDE_NORM=0); greedy sampling: logits copied, argmax on the host \
         (THAW_CUDA_DEVICE_ARGMAX=0); products of few rows: cast + cuBLAS (THAW_CUDA_GEMV=0); \
         LoRA of q/k/v and gate/up: a launch pair per module (THAW_CUDA_LORA_SLICES=0); \
         decode attention: as THAW_CUDA_ATTN_IMPL picks (THAW_CUDA_ATTN_OCCUPANCY=0); \
         products: cublasGemmEx + add_bias (THAW_CUDA_CUBLASLT=0); activations: f32 \
         (THAW_CUDA_BF16_ACT=0); prefill attention: tensor-core prefill (THAW_CUDA_PREFILL_FA=0); \
         LoRA of few rows: a shrink and an expand launch (THAW_CUDA_LORA_SMALL=0)"
    );
    // One off, the rest on: only its entry names the classic kernel.
    let p = nine(&[(GEMV_ENV, "0")], 128).unwrap();
    let line = p.to_string();
    assert!(
        line.contains("products of few rows: cast + cuBLAS (THAW_CUDA_GEMV=0);")
            && line.contains("products: cuBLASLt, bias in its epilogue (off:"),
        "{line}"
    );
}

#[test]
fn the_occupancy_decode_takes_the_split_kernels_head_dims_and_a_floor() {
    // Heads past flash-decoding's 256: unset falls back, asked for is an error that says what
    // to set.
    assert!(matches!(
        nine(&[], 512).unwrap().attn_occupancy,
        Choice::Fallback(_)
    ));
    let e = nine(&[(ATTN_OCCUPANCY_ENV, "1")], 512).unwrap_err();
    assert!(
        e.contains("THAW_CUDA_ATTN_OCCUPANCY=0") && e.contains("512"),
        "{e}"
    );
    assert!(nine(&[(ATTN_OCCUPANCY_ENV, "1")], 256)
        .unwrap()
        .attn_occupancy
        .is_new());
    // The floor: 32 unless THAW_CUDA_SPLIT_MIN_CHUNK sets one.
    assert_eq!(occupancy_floor(None), Ok(OCC_MIN_CHUNK));
    assert_eq!(occupancy_floor(Some(" auto ")), Ok(OCC_MIN_CHUNK));
    assert_eq!(occupancy_floor(Some("")), Ok(OCC_MIN_CHUNK));
    assert_eq!(occupancy_floor(Some("8")), Ok(8));
    let e = occupancy_floor(Some("0")).unwrap_err();
    assert!(e.contains(SPLIT_MIN_CHUNK_ENV), "{e}");
}

proptest! {
    /// Whatever the value, one of the nine is new unless turned off or unserved (then unset
    /// falls back and an explicit on errs), and every value it does not take is an error that
    /// names it.
    #[test]
    fn one_of_the_nine_is_new_unless_off_or_unserved(v in "[a-zA-Z0-9 ]{0,6}", hd in 1usize..=300) {
        for sw in NINE {
            let why = match sw.env {
                ROPE_FOLD_ENV => rope_fold_unserved(hd),
                ATTN_OCCUPANCY_ENV => split_unserved(hd),
                _ => None,
            };
            match sw.choose(&v, why.clone()) {
                Ok(c) => {
                    let ask = sw.parse(&v).unwrap();
                    prop_assert_eq!(c.is_new(), ask != Ask::Off && why.is_none());
                    prop_assert_eq!(
                        matches!(c, Choice::Fallback(_)),
                        ask == Ask::Default && why.is_some()
                    );
                }
                Err(e) => {
                    prop_assert!(e.contains(sw.env));
                    prop_assert!(sw.parse(&v).is_err() || why.is_some());
                }
            }
        }
    }
}

#[test]
fn wide_blocks_hold_their_row() {
    // Llama-7B's hidden size: one float4 per thread of 1024.
    assert_eq!(wide_norm_block(4096), Some(1024));
    // Small rows take whole warps; the widest kept in registers is 4 float4 × 1024 threads.
    assert_eq!(wide_norm_block(64), Some(32));
    assert_eq!(wide_norm_block(8192), Some(1024));
    assert_eq!(wide_norm_block(16384), Some(1024));
    assert_eq!(wide_norm_block(16388), None);
    assert_eq!(wide_norm_block(4098), None, "not a multiple of 4");
    assert_eq!(wide_norm_block(0), None);
    assert_eq!(wide_rope_block(1), 32);
    assert_eq!(wide_rope_block(32 * 64), 1024);
    assert_eq!(wide_rope_block(8 * 32 + 2 * 32), 320);
}

proptest! {
    /// Where served, the block is whole warps, within the hardware's limit, and its threads
    /// with their registers hold every float4 of the row.
    #[test]
    fn a_served_wide_norm_block_covers_the_row(d in 1usize..40_000) {
        match wide_norm_block(d) {
            Some(t) => {
                let t = t as usize;
                prop_assert!(d.is_multiple_of(4) && t.is_multiple_of(32) && t <= shape::WIDE_MAX_THREADS);
                prop_assert!(d / 4 <= t * shape::WIDE_VPT);
            }
            None => prop_assert!(!d.is_multiple_of(4) || d / 4 > shape::WIDE_MAX_THREADS * shape::WIDE_VPT),
        }
    }
}

#[test]
fn a_group_is_one_product_only_for_few_rows() {
    // Decode batches, CUDA graph buckets up to 128, a short prefill chunk: one product.
    for rows in [1, 8, 32, 64, GROUP_GEMM_MAX_ROWS] {
        assert!(group_as_one_product(rows), "{rows}");
    }
    // A prefill of many rows: a product per module (no split copy of a compute-bound product).
    for rows in [GROUP_GEMM_MAX_ROWS + 1, 512, 2048] {
        assert!(!group_as_one_product(rows), "{rows}");
    }
}

#[test]
fn the_split_chunk_defaults_and_parses_positive_counts() {
    for v in [None, Some(""), Some(" "), Some("auto"), Some("AUTO")] {
        assert_eq!(split_min_chunk(v), Ok(MIN_CHUNK), "{v:?}");
    }
    assert_eq!(split_min_chunk(Some("32")), Ok(32));
    assert_eq!(split_min_chunk(Some(" 4 ")), Ok(4));
    for bad in ["0", "-3", "1.5", "many"] {
        let e = split_min_chunk(Some(bad)).unwrap_err();
        assert!(
            e.contains(SPLIT_MIN_CHUNK_ENV) && e.contains("positive"),
            "{bad}: {e}"
        );
    }
}

/// Decode shapes of Llama-7B (q/k/v/o, gate/up, down, the LM head) and a small model's.
const GEMV_SHAPES: [(usize, usize); 5] = [
    (4096, 4096),
    (4096, 11008),
    (11008, 4096),
    (4096, 32000),
    (576, 1536),
];

#[test]
fn the_gemv_serves_decode_shapes_of_16_bit_weights_with_the_switch_on() {
    for (d_in, d_out) in GEMV_SHAPES {
        for dt in [DType::Bf16, DType::F16] {
            for rows in 1..=shape::GEMV_MAX_ROWS {
                assert!(gemv_serves(true, dt, rows, d_in, d_out, 256, 4096));
                assert!(!gemv_serves(false, dt, rows, d_in, d_out, 256, 4096));
            }
            let over = shape::GEMV_MAX_ROWS + 1;
            assert!(!gemv_serves(true, dt, over, d_in, d_out, 256, 4096));
            assert!(!gemv_serves(true, dt, 0, d_in, d_out, 256, 4096));
        }
        assert!(!gemv_serves(true, DType::F32, 1, d_in, d_out, 256, 4096));
    }
    // A tail of d_in / 8 that is not a multiple of a warp's 32 lanes: served.
    assert!(gemv_serves(true, DType::Bf16, 3, 1000, 77, 0, 0));
}

/// The crossover measured on an H200 (`cuda-h100.md` §9, `cuda_bench --gemv`): the GEMV's
/// speed-up over cast + cuBLAS by (d_in, d_out, rows). It must serve every entry above 1.0 at
/// up to 4 rows and none below it.
const GEMV_MEASURED: [(usize, usize, usize, f64); 24] = [
    (4096, 4096, 1, 1.76),
    (4096, 4096, 2, 1.52),
    (4096, 4096, 4, 1.36),
    (4096, 4096, 8, 0.69),
    (4096, 11008, 1, 1.17),
    (4096, 11008, 2, 1.11),
    (4096, 11008, 4, 0.89),
    (4096, 11008, 8, 0.45),
    (11008, 4096, 1, 1.15),
    (11008, 4096, 2, 1.07),
    (11008, 4096, 4, 0.81),
    (11008, 4096, 8, 0.32),
    (4096, 32000, 1, 1.11),
    (4096, 32000, 2, 1.07),
    (4096, 32000, 4, 0.95),
    (4096, 32000, 8, 0.40),
    (576, 1536, 1, 1.83),
    (576, 1536, 2, 1.79),
    (576, 1536, 4, 1.60),
    (576, 1536, 8, 1.27),
    (1536, 576, 1, 1.94),
    (1536, 576, 2, 1.81),
    (1536, 576, 4, 1.59),
    (1536, 576, 8, 1.02),
];

#[test]
fn the_gemv_pays_where_it_beat_cublas_on_the_h200() {
    for (d_in, d_out, rows, speed_up) in GEMV_MEASURED {
        let pays = gemv_pays(rows, d_in, d_out);
        if rows <= GEMV_ROWS_SMALL {
            assert_eq!(
                pays,
                speed_up > 1.0,
                "{d_in}->{d_out} at {rows} rows: {speed_up}x"
            );
        } else {
            // Past 4 rows only the small model's products won, by 1.02–1.27×: cuBLAS serves
            // them all rather than tune a third limit on two shapes.
            assert!(!pays, "{d_in}->{d_out} at {rows} rows");
        }
    }
    // Llama-7B at batch 8: every product back on cuBLAS, the regression of cuda-h100.md §9
    // (13.08 ms a step with the GEMV against 8.46 ms without).
    for (d_in, d_out) in GEMV_SHAPES {
        assert!(!gemv_pays(8, d_in, d_out));
        assert!(gemv_pays(1, d_in, d_out) && gemv_pays(2, d_in, d_out));
    }
}

proptest! {
    /// `gemv_pays` counts weights, so it is symmetric; it never takes more rows than the
    /// kernel, nor zero; and fewer rows or fewer weights never turn it off.
    #[test]
    fn gemv_pays_is_monotone_and_within_the_kernel(
        rows in 0usize..20,
        d_in in 0usize..40_000,
        d_out in 0usize..40_000,
    ) {
        let pays = gemv_pays(rows, d_in, d_out);
        prop_assert_eq!(pays, gemv_pays(rows, d_out, d_in));
        if pays {
            prop_assert!((1..=shape::GEMV_MAX_ROWS).contains(&rows));
            if rows > 1 {
                prop_assert!(gemv_pays(rows - 1, d_in, d_out));
            }
            prop_assert!(gemv_pays(rows, d_in / 2, d_out));
        }
    }
}

#[test]
fn the_gemv_refuses_what_its_16_byte_loads_cannot_read() {
    // d_in not a multiple of 8: rows after the first start off 16-byte alignment.
    for d_in in [4, 12, 1001, 4100] {
        assert!(!gemv_serves(true, DType::Bf16, 1, d_in, 64, 0, 0), "{d_in}");
    }
    // Buffers off 16-byte alignment (a view at an odd offset).
    assert!(!gemv_serves(true, DType::F16, 1, 64, 64, 8, 0));
    assert!(!gemv_serves(true, DType::F16, 1, 64, 64, 0, 4));
    assert!(!gemv_serves(true, DType::F16, 1, 0, 64, 0, 0));
    assert!(!gemv_serves(true, DType::F16, 1, 64, 0, 0, 0));
    assert!(!gemv_serves(true, DType::F16, 1, 1 << 31, 8, 0, 0));
}

#[test]
fn the_gemv_grid_covers_every_output_once_per_warp() {
    assert_eq!(gemv_grid(4096, 1), 512);
    assert_eq!(gemv_grid(4096, 8), 256);
    assert_eq!(gemv_grid(576, 1), 72);
    assert_eq!(gemv_grid(1, 1), 1);
    assert_eq!(gemv_grid(0, 4), 1);
    assert_eq!(
        gemv_outs_per_warp(shape::GEMV_FEW_ROWS),
        shape::GEMV_OUTS_FEW
    );
    assert_eq!(
        gemv_outs_per_warp(shape::GEMV_FEW_ROWS + 1),
        shape::GEMV_OUTS_MANY
    );
    for (_, d_out) in GEMV_SHAPES {
        for rows in 1..=shape::GEMV_MAX_ROWS {
            let per_block = (shape::GEMV_WARPS * gemv_outs_per_warp(rows)) as usize;
            let g = gemv_grid(d_out, rows) as usize;
            assert!(
                g * per_block >= d_out && (g - 1) * per_block < d_out,
                "{d_out} x {rows}"
            );
        }
    }
}

proptest! {
    /// The GEMV runs only where every condition of its kernel holds, whatever the shape.
    #[test]
    fn gemv_serves_only_what_its_kernel_takes(
        on in any::<bool>(),
        dt in prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::F16)],
        rows in 0usize..20,
        d_in in 0usize..20_000,
        d_out in 0usize..40_000,
        w in 0u64..1 << 20,
        x in 0u64..1 << 20,
    ) {
        let served = gemv_serves(on, dt, rows, d_in, d_out, w, x);
        let kernel_takes = dt != DType::F32
            && (1..=shape::GEMV_MAX_ROWS).contains(&rows)
            && d_in > 0 && d_in % 8 == 0 && d_out > 0
            && w % 16 == 0 && x % 16 == 0;
        prop_assert_eq!(served, on && kernel_takes);
        let g = gemv_grid(d_out, rows) as usize;
        let per_block = (shape::GEMV_WARPS * gemv_outs_per_warp(rows)) as usize;
        prop_assert!(g >= 1 && g * per_block >= d_out);
    }
}

/// The FlashAttention-2-style prefill: opt-in (classic unless `1`), served at the tensor-core
/// prefill's head dims, an error that says what to set where asked for and not served.
#[test]
fn the_fa_prefill_is_opt_in_and_serves_the_tensor_core_head_dims() {
    for hd in [32, 64, 128] {
        assert_eq!(prefill_fa_unserved(hd), None);
        assert_eq!(nine(&[], hd).unwrap().prefill_fa, Choice::Classic);
        assert_eq!(
            nine(&[(PREFILL_FA_ENV, "1")], hd).unwrap().prefill_fa,
            Choice::New
        );
    }
    let e = nine(&[(PREFILL_FA_ENV, "1")], 96).unwrap_err();
    assert!(
        e.contains("THAW_CUDA_PREFILL_FA=0") && e.contains("96"),
        "{e}"
    );
    assert_eq!(nine(&[], 96).unwrap().prefill_fa, Choice::Classic);
    let p = nine(&[(PREFILL_FA_ENV, "1")], 128).unwrap();
    assert!(
        p.to_string()
            .contains("; prefill attention: FlashAttention-2-style prefill"),
        "{p}"
    );
    // It moves only its own choice: the nine stay at their defaults.
    assert_eq!(
        OptInPlan {
            prefill_fa: Choice::Classic,
            ..p
        },
        nine_new()
    );
}

/// The one-launch small-batch LoRA: opt-in (classic unless `1`), moving only its own choice.
#[test]
fn the_one_launch_small_lora_is_opt_in() {
    assert_eq!(nine(&[], 128).unwrap().lora_small, Choice::Classic);
    let p = nine(&[(LORA_SMALL_ENV, "1")], 128).unwrap();
    assert_eq!(p.lora_small, Choice::New);
    assert!(
        p.to_string()
            .contains("; LoRA of few rows: shrink and expand in one launch"),
        "{p}"
    );
    assert_eq!(
        OptInPlan {
            lora_small: Choice::Classic,
            ..p
        },
        nine_new()
    );
    let e = nine(&[(LORA_SMALL_ENV, "fast")], 128).unwrap_err();
    assert!(e.contains(LORA_SMALL_ENV), "{e}");
}
