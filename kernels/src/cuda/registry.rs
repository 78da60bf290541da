//! The one list of Thaw's CUDA kernels: each source file, embedded with `include_str!`, and the
//! `extern "C"` entry points it defines. The CUDA backend compiles from here (through
//! `KernelCache` with the `cuda` feature) and the NVRTC CI test
//! (`kernels/tests/nvrtc_compile.rs`) compiles every entry of [`KERNELS`] for sm_80 and sm_90 and
//! checks that each listed entry point exists — a name here that a source does not define, or a
//! source that does not compile, fails CI.

/// Prepended to every source: 16-bit float storage types and conversions, warp/block
/// reductions, the device `LoraSlot` descriptor. Keeps sources free of `#include`.
pub const PRELUDE: &str = include_str!("common.cuh");

/// Weight / cache element types a kernel family is instantiated for; the entry point name
/// carries it as a suffix (`rms_norm_bf16`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    Bf16,
    F16,
}

impl DType {
    pub const ALL: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

    /// The entry point suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }
}

/// One CUDA C source and the entry points it defines.
#[derive(Copy, Clone, Debug)]
pub struct KernelSource {
    /// Short name, also the NVRTC program name (`<name>.cu`).
    pub name: &'static str,
    /// The source without the prelude.
    pub source: &'static str,
    /// `extern "C"` kernels it defines, by their full (suffixed) names.
    pub entry_points: &'static [&'static str],
}

impl KernelSource {
    /// Prelude + source: what NVRTC compiles.
    pub fn full_source(&self) -> String {
        format!("{PRELUDE}\n#line 1 \"{}.cu\"\n{}", self.name, self.source)
    }
}

macro_rules! dtypes {
    ($($base:literal),* $(,)?) => {
        &[$(concat!($base, "_f32"), concat!($base, "_bf16"), concat!($base, "_f16")),*]
    };
}

/// Elementwise kernels and row copies.
pub const ELEMENTWISE: KernelSource = KernelSource {
    name: "elementwise",
    source: include_str!("elementwise.cu"),
    entry_points: &[
        "embed_gather_f32",
        "embed_gather_bf16",
        "embed_gather_f16",
        "add_bias_f32",
        "add_bias_bf16",
        "add_bias_f16",
        "cast_f32_to_bf16",
        "cast_f32_to_f16",
        "residual_add_f32",
        "swiglu_f32",
        "gather_rows_f32",
        "swiglu_x16_bf16",
        "swiglu_x16_f16",
    ],
};

/// RMSNorm, and residual add + RMSNorm fused, optionally with its output's 16-bit copy (issue 29;
/// the default, `THAW_CUDA_FUSED=0` off).
pub const NORM: KernelSource = KernelSource {
    name: "norm",
    source: include_str!("norm.cu"),
    entry_points: dtypes!("rms_norm", "add_rms_norm"),
};

/// Rotary embedding.
pub const ROPE: KernelSource = KernelSource {
    name: "rope",
    source: include_str!("rope.cu"),
    entry_points: &["rope_f32"],
};

/// Paged KV writes, decode and prefill attention.
pub const ATTENTION: KernelSource = KernelSource {
    name: "attention",
    source: include_str!("attention.cu"),
    entry_points: &[
        "write_kv_f32",
        "write_kv_bf16",
        "write_kv_f16",
        "attn_decode_f32",
        "attn_decode_bf16",
        "attn_decode_f16",
        "attn_prefill_f32",
        "attn_prefill_bf16",
        "attn_prefill_f16",
        // THAW_CUDA_BF16_ACT: the output in the weight dtype, per (KV dtype, weight dtype).
        "attn_decode_f32_out_bf16",
        "attn_decode_f32_out_f16",
        "attn_decode_bf16_out_bf16",
        "attn_decode_bf16_out_f16",
        "attn_decode_f16_out_bf16",
        "attn_decode_f16_out_f16",
        "attn_prefill_f32_out_bf16",
        "attn_prefill_f32_out_f16",
        "attn_prefill_bf16_out_bf16",
        "attn_prefill_bf16_out_f16",
        "attn_prefill_f16_out_bf16",
        "attn_prefill_f16_out_f16",
    ],
};

/// Flash-decoding: paged decode attention split across blocks, then a reduce (issue 29).
/// The CUDA backend's default decode attention; `THAW_CUDA_ATTN_IMPL=classic` runs
/// `attention.cu`'s instead.
pub const ATTENTION_SPLIT: KernelSource = KernelSource {
    name: "attention_split",
    source: include_str!("attention_split.cu"),
    entry_points: &[
        "attn_decode_split_f32",
        "attn_decode_split_bf16",
        "attn_decode_split_f16",
        "attn_decode_reduce",
        // THAW_CUDA_BF16_ACT: the merged output in the weight dtype (the split pass is f32).
        "attn_decode_reduce_out_bf16",
        "attn_decode_reduce_out_f16",
    ],
};

/// Flash-decoding with 4 keys' loads in flight a warp and the occupancy split plan (issue 29;
/// a default, off with `THAW_CUDA_ATTN_OCCUPANCY=0`); [`ATTENTION_SPLIT`]'s reduce merges it.
pub const ATTENTION_SPLIT_ILP: KernelSource = KernelSource {
    name: "attention_split_ilp",
    source: include_str!("attention_split_ilp.cu"),
    entry_points: &[
        "attn_decode_split_ilp_f32",
        "attn_decode_split_ilp_bf16",
        "attn_decode_split_ilp_f16",
        // THAW_CUDA_BF16_ACT: a one-split row's output in the weight dtype.
        "attn_decode_split_ilp_f32_out_bf16",
        "attn_decode_split_ilp_f32_out_f16",
        "attn_decode_split_ilp_bf16_out_bf16",
        "attn_decode_split_ilp_bf16_out_f16",
        "attn_decode_split_ilp_f16_out_bf16",
        "attn_decode_split_ilp_f16_out_f16",
    ],
};

/// Prefill attention on the tensor cores (issue 29): mma.sync on a bf16 or f16 cache, head_dim
/// 32, 64 or 128 ([`super::prefill_tc_plan`]), compute capability 8.0 and up. The CUDA
/// backend's default prefill attention where it serves the shape (`attention.cu`'s elsewhere);
/// `THAW_CUDA_TC_PREFILL=0` turns it off.
pub const ATTENTION_PREFILL_TC: KernelSource = KernelSource {
    name: "attention_prefill_tc",
    source: concat!(
        include_str!("mma16.cuh"),
        "\n",
        include_str!("attention_prefill_tc.cu")
    ),
    entry_points: &[
        "attn_prefill_tc32_bf16",
        "attn_prefill_tc64_bf16",
        "attn_prefill_tc128_bf16",
        "attn_prefill_tc32_f16",
        "attn_prefill_tc64_f16",
        "attn_prefill_tc128_f16",
        // THAW_CUDA_BF16_ACT: the output in the weight dtype where it is the cache's.
        "attn_prefill_tc32_bf16_out_bf16",
        "attn_prefill_tc64_bf16_out_bf16",
        "attn_prefill_tc128_bf16_out_bf16",
        "attn_prefill_tc32_f16_out_f16",
        "attn_prefill_tc64_f16_out_f16",
        "attn_prefill_tc128_f16_out_f16",
    ],
};

/// Prefill attention on the tensor cores, FlashAttention-2 style (issue 29, opt-in with
/// `THAW_CUDA_PREFILL_FA=1`): what [`ATTENTION_PREFILL_TC`] computes, with GQA heads sharing
/// K/V tiles, cp.async double buffering and ldmatrix fragments ([`super::prefill_fa_plan`]);
/// compute capability 8.0 and up. Runs wherever the tensor-core prefill runs.
pub const ATTENTION_PREFILL_FA: KernelSource = KernelSource {
    name: "attention_prefill_fa",
    source: concat!(
        include_str!("mma16.cuh"),
        "\n",
        include_str!("attention_prefill_fa.cu")
    ),
    entry_points: &[
        "attn_prefill_fa32_bf16",
        "attn_prefill_fa64_bf16",
        "attn_prefill_fa128_bf16",
        "attn_prefill_fa32_f16",
        "attn_prefill_fa64_f16",
        "attn_prefill_fa128_f16",
        // THAW_CUDA_BF16_ACT: the output in the weight dtype where it is the cache's.
        "attn_prefill_fa32_bf16_out_bf16",
        "attn_prefill_fa64_bf16_out_bf16",
        "attn_prefill_fa128_bf16_out_bf16",
        "attn_prefill_fa32_f16_out_f16",
        "attn_prefill_fa64_f16_out_f16",
        "attn_prefill_fa128_f16_out_f16",
    ],
};

/// SGMV / BGMV shrink and expand.
pub const LORA: KernelSource = KernelSource {
    name: "lora",
    source: include_str!("lora.cu"),
    entry_points: dtypes!("sgmv_shrink", "sgmv_expand", "bgmv_shrink", "bgmv_expand"),
};

/// SGMV / BGMV in Punica's shape: split-K shrink with 16-byte weight loads, expand that sums
/// the splits (issue 29). The CUDA backend's default; `THAW_CUDA_LORA_IMPL=classic` runs
/// `lora.cu`'s instead.
pub const LORA_PUNICA: KernelSource = KernelSource {
    name: "lora_punica",
    source: include_str!("lora_punica.cu"),
    entry_points: dtypes!(
        "punica_sgmv_shrink",
        "punica_sgmv_expand",
        "punica_bgmv_shrink",
        "punica_bgmv_expand"
    ),
};

/// Fused export (copy + signal) and merge of CPU deltas.
pub const EXCHANGE: KernelSource = KernelSource {
    name: "exchange",
    source: include_str!("exchange.cu"),
    entry_points: &["export_rows", "merge_deltas"],
};

/// Issue 29's wide elementwise kernels (defaults, each off where `THAW_CUDA_WIDE_NORM`,
/// `THAW_CUDA_ROPE_FOLD` or `THAW_CUDA_GROUP_GEMM` is 0): RMSNorm and add + RMSNorm with a wide
/// block per row, RoPE with a thread per (head, pair), RoPE folded into the paged-cache KV write
/// (KV dtype suffix), and the split of a grouped product's output.
pub const WIDE: KernelSource = KernelSource {
    name: "wide",
    source: concat!(
        include_str!("rope_fold.cuh"),
        "\n#line 1 \"wide.cu\"\n",
        include_str!("wide.cu")
    ),
    entry_points: &[
        "rms_norm_wide_f32",
        "rms_norm_wide_bf16",
        "rms_norm_wide_f16",
        "add_rms_norm_wide_f32",
        "add_rms_norm_wide_bf16",
        "add_rms_norm_wide_f16",
        "rope_wide_f32",
        "write_kv_rope_f32",
        "write_kv_rope_bf16",
        "write_kv_rope_f16",
        "split_cols3_f32",
    ],
};

/// Greedy sampling on the device (issue 29; a default, off with `THAW_CUDA_DEVICE_ARGMAX=0`):
/// the index of each row's largest logit by the host's rule (`sampling::argmax`), so a step
/// whose rows are all greedy copies token ids to the host instead of logits.
pub const ARGMAX: KernelSource = KernelSource {
    name: "argmax",
    source: include_str!("argmax.cu"),
    entry_points: &["argmax_rows_f32"],
};

/// Issue 29's small-batch GEMV (a default, off with `THAW_CUDA_GEMV=0`): y = x · Wᵀ for at
/// most [`shape::GEMV_MAX_ROWS`] rows of f32 activations read directly (no cast kernel) against
/// 16-bit weights, 16-byte weight loads, f32 accumulation.
pub const GEMV: KernelSource = KernelSource {
    name: "gemv",
    source: include_str!("gemv.cu"),
    entry_points: &[
        "gemv_few_bf16",
        "gemv_many_bf16",
        "gemv_few_f16",
        "gemv_many_f16",
    ],
};

/// Issue 29's multi-slice SGMV / BGMV (a default, off with `THAW_CUDA_LORA_SLICES=0`): the
/// modules sharing one input (q/k/v, gate/up) as one shrink and one expand launch, a grid factor
/// over the slices. Compiled after `lora_punica.cu`'s device functions (its entry points left
/// out), whose block code every slice runs.
pub const LORA_SLICES: KernelSource = KernelSource {
    name: "lora_slices",
    source: concat!(
        "#define PUNICA_DEVICE_ONLY\n",
        include_str!("lora_punica.cu"),
        "\n",
        include_str!("lora_slices.cu")
    ),
    entry_points: dtypes!(
        "slices_sgmv_shrink",
        "slices_sgmv_expand",
        "slices_bgmv_shrink",
        "slices_bgmv_expand"
    ),
};

/// Issue 29's opt-in small-batch LoRA in one launch (off unless `THAW_CUDA_LORA_SMALL` is 1;
/// where [`lora_small_plan`](super::lora_small_plan) serves the call): every block recomputes
/// the shrink for its rows, then expands its tile of columns. Compiled after `lora_punica.cu`'s
/// device functions (its entry points left out), whose loads and expand it runs.
pub const LORA_SMALL: KernelSource = KernelSource {
    name: "lora_fused_small",
    source: concat!(
        "#define PUNICA_DEVICE_ONLY\n",
        include_str!("lora_punica.cu"),
        "\n",
        include_str!("lora_fused_small.cu")
    ),
    entry_points: dtypes!("lora_small_sgmv", "lora_small_bgmv"),
};

/// Issue 29's 16-bit MLP activations (a default, off with `THAW_CUDA_BF16_ACT=0`): SwiGLU
/// over the 16-bit gate and up outputs of the GEMMs, writing down's 16-bit input (and, where
/// asked, an f32 copy for down's LoRA).
pub const ACT16: KernelSource = KernelSource {
    name: "act16",
    source: include_str!("act16.cu"),
    entry_points: &["swiglu16_bf16", "swiglu16_f16"],
};

/// Issue 29's 16-bit residual stream (a default with `THAW_CUDA_BF16_ACT`, runtime
/// `residual16_plan`): embed, add + RMSNorm, the last add and the final gather over the
/// hidden state stored in the weight dtype.
pub const RESIDUAL16: KernelSource = KernelSource {
    name: "residual16",
    source: include_str!("residual16.cu"),
    entry_points: &[
        "embed16_bf16",
        "embed16_f16",
        "rms_norm_h16_bf16",
        "rms_norm_h16_f16",
        "add_rms_norm_h16_bf16",
        "add_rms_norm_h16_f16",
        "residual_add_h16_bf16",
        "residual_add_h16_f16",
        "gather_rows_h16_bf16",
        "gather_rows_h16_f16",
    ],
};

/// Issue 29's 16-bit attention input (a default, off with `THAW_CUDA_BF16_ACT=0`): RoPE of the
/// 16-bit q/k/v products, the rotated q in f32 and K/V into the paged cache; suffixed by the
/// weight dtype, then the KV dtype (`qkv_rope16_bf16_f16`). Compiled after `rope_fold.cuh`, the
/// RoPE helpers it shares with `wide.cu`.
pub const ATTN16: KernelSource = KernelSource {
    name: "attn16",
    source: concat!(
        include_str!("rope_fold.cuh"),
        "\n#line 1 \"attn16.cu\"\n",
        include_str!("attn16.cu")
    ),
    entry_points: &[
        "qkv_rope16_bf16_f32",
        "qkv_rope16_f16_f32",
        "qkv_rope16_bf16_bf16",
        "qkv_rope16_f16_bf16",
        "qkv_rope16_bf16_f16",
        "qkv_rope16_f16_f16",
    ],
};

/// Every kernel source Thaw compiles.
pub const KERNELS: &[KernelSource] = &[
    ELEMENTWISE,
    NORM,
    ROPE,
    ATTENTION,
    ATTENTION_SPLIT,
    ATTENTION_PREFILL_TC,
    ATTENTION_PREFILL_FA,
    LORA,
    LORA_PUNICA,
    EXCHANGE,
    WIDE,
    ARGMAX,
    GEMV,
    LORA_SLICES,
    LORA_SMALL,
    ATTENTION_SPLIT_ILP,
    ACT16,
    RESIDUAL16,
    ATTN16,
];

/// Launch-shape constants the sources `#define`; the host launches with these.
pub mod shape {
    /// `THAW_ATTN_WARPS`: warps per attention block.
    pub const ATTN_WARPS: u32 = 4;
    /// `THAW_PREFILL_Q`: query rows per prefill tile.
    pub const PREFILL_Q: usize = 16;
    /// `THAW_MAX_HEAD_DIM`.
    pub const MAX_HEAD_DIM: usize = 256;
    /// `THAW_LORA_WARPS`: warps per shrink block (they split d_in for one rank).
    pub const LORA_WARPS: u32 = 8;
    /// `THAW_LORA_ROWS`: rows of one SGMV segment per block.
    pub const LORA_ROWS: u32 = 4;
    /// `THAW_LORA_EXPAND_THREADS`: output columns per expand block.
    pub const LORA_EXPAND_THREADS: u32 = 256;
    /// `THAW_MAX_LORA_RANK`.
    pub const MAX_LORA_RANK: usize = 256;
    /// `THAW_SPLIT_WARPS`: warps per flash-decoding block (`attention_split.cu`).
    pub const SPLIT_WARPS: u32 = 4;
    /// `THAW_SPLIT_MAX_HEAD_DIM`.
    pub const SPLIT_MAX_HEAD_DIM: usize = 256;
    /// `THAW_ILP_WARPS`: warps per block of `attention_split_ilp.cu` (as `THAW_ATTN_WARPS`, so
    /// one split walks the same keys in the same warps as `attention.cu`'s decode).
    pub const SPLIT_ILP_WARPS: u32 = 4;
    /// `PUNICA_THREADS`: threads of every `lora_punica.cu` block.
    pub const PUNICA_THREADS: u32 = 256;
    /// `PUNICA_ROWS`: rows of one segment per block.
    pub const PUNICA_ROWS: u32 = 4;
    /// `PUNICA_RANK_TILE`: ranks per shrink block.
    pub const PUNICA_RANK_TILE: u32 = 16;
    /// `PUNICA_K_CHUNK`: the largest d_in chunk one shrink block stages (split-K).
    pub const PUNICA_K_CHUNK: usize = 1024;
    /// `PUNICA_EXPAND_COLS`: output columns per expand block.
    pub const PUNICA_EXPAND_COLS: u32 = 256;
    /// `PUNICA_MAX_RANK`.
    pub const PUNICA_MAX_RANK: usize = 256;
    /// `PUNICA_MAX_SLICES`: the most modules one `lora_slices.cu` launch takes.
    pub const PUNICA_MAX_SLICES: usize = 3;
    /// `THAW_WIDE_VPT`: float4 a thread of `wide.cu`'s norms keeps in registers.
    pub const WIDE_VPT: usize = 4;
    /// Threads of the widest `wide.cu` block (the hardware's limit).
    pub const WIDE_MAX_THREADS: usize = 1024;
    /// `THAW_ROPE_MAX_HALF`: pairs per head `wide.cu`'s RoPE stages (`MAX_HEAD_DIM / 2`).
    pub const ROPE_MAX_HALF: usize = 128;
    /// `THAW_ARGMAX_THREADS`: threads of `argmax.cu`'s block (one block per row).
    pub const ARGMAX_THREADS: u32 = 512;
    /// `GEMV_MAX_ROWS`: the most rows one `gemv.cu` launch takes.
    pub const GEMV_MAX_ROWS: usize = 8;
    /// `GEMV_WARPS`: warps of every `gemv.cu` block.
    pub const GEMV_WARPS: u32 = 4;
    /// `GEMV_FEW_ROWS`: rows up to this run `gemv_few_T`, more `gemv_many_T`.
    pub const GEMV_FEW_ROWS: usize = 2;
    /// `GEMV_OUTS_FEW`: outputs (rows of W) a `gemv_few_T` warp computes at a time.
    pub const GEMV_OUTS_FEW: u32 = 2;
    /// `GEMV_OUTS_MANY`: outputs a `gemv_many_T` warp computes at a time.
    pub const GEMV_OUTS_MANY: u32 = 4;
}

/// Finds the source that defines `entry`.
pub fn source_of(entry: &str) -> Option<&'static KernelSource> {
    KERNELS.iter().find(|k| k.entry_points.contains(&entry))
}

/// A compute capability, e.g. 9.0 for H100/H200.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuArch {
    pub major: u32,
    pub minor: u32,
}

impl GpuArch {
    /// A100.
    pub const SM80: GpuArch = GpuArch { major: 8, minor: 0 };
    /// H100 / H200.
    pub const SM90: GpuArch = GpuArch { major: 9, minor: 0 };

    /// `80`, `90`.
    pub fn number(self) -> u32 {
        self.major * 10 + self.minor
    }
}

/// What NVRTC emits: PTX for the virtual architecture (`compute_XX`, JIT-compiled by the
/// driver) or a CUBIN for the real one (`sm_XX`, runs through ptxas, loads without JIT).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    Ptx,
    Cubin,
}

/// The NVRTC options every Thaw kernel is compiled with — shared by the runtime cache and the
/// CI test so CI checks exactly what runs. `--fmad=true` and no fast-math: `expf`, `rsqrtf` and
/// `sincos` stay IEEE-accurate, which the parity tolerances assume.
pub fn nvrtc_options(arch: GpuArch, target: Target) -> Vec<String> {
    let arch = match target {
        Target::Ptx => format!("--gpu-architecture=compute_{}", arch.number()),
        Target::Cubin => format!("--gpu-architecture=sm_{}", arch.number()),
    };
    vec![
        arch,
        "--std=c++17".into(),
        "--device-as-default-execution-space".into(),
        "--fmad=true".into(),
    ]
}

/// The value of `#define NAME value` in `src` (tests: host constants against the sources).
#[cfg(test)]
pub(crate) fn define(src: &str, name: &str) -> u64 {
    src.lines()
        .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
        .unwrap_or_else(|| panic!("#define {name} not found"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("#define {name}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_are_unique_and_defined_in_their_source() {
        let mut seen = std::collections::HashSet::new();
        for k in KERNELS {
            for e in k.entry_points {
                assert!(seen.insert(*e), "entry point {e} listed twice");
                let (base, _) = e.rsplit_once('_').unwrap_or((e, ""));
                assert!(
                    k.source.contains(e) || k.source.contains(base) || prefill_entry(k, e),
                    "{e} not found in {}.cu",
                    k.name
                );
            }
        }
        assert_eq!(source_of("sgmv_shrink_bf16").map(|k| k.name), Some("lora"));
    }

    /// Whether `e` is one of the names `mma16.cuh`'s `THAW_PREFILL_ENTRIES(IMPL, BOUND, PREFIX)`
    /// pastes, invoked in `k`'s source: PREFIX followed by a suffix the macro pastes to it.
    fn prefill_entry(k: &KernelSource, e: &str) -> bool {
        const MACRO: &str = include_str!("mma16.cuh");
        k.source.lines().any(|l| {
            let Some(args) = l.strip_prefix("THAW_PREFILL_ENTRIES(") else {
                return false;
            };
            let prefix = args
                .trim_end_matches(')')
                .rsplit(',')
                .next()
                .unwrap_or("")
                .trim();
            e.strip_prefix(prefix).is_some_and(|suffix| {
                !suffix.is_empty() && MACRO.contains(&format!("PREFIX##{suffix})"))
            })
        })
    }

    #[test]
    fn the_prefill_families_list_each_name_their_macro_pastes() {
        for k in [ATTENTION_PREFILL_TC, ATTENTION_PREFILL_FA] {
            assert_eq!(k.entry_points.len(), 12, "{}", k.name);
            for e in k.entry_points {
                assert!(prefill_entry(&k, e), "{e} in {}", k.name);
            }
            assert!(!prefill_entry(&k, "attn_prefill_tc48_bf16"));
        }
    }

    /// The host launches with `shape`'s constants: each must equal the source's `#define`.
    #[test]
    fn shape_constants_match_the_sources_defines() {
        let p = LORA_PUNICA.source;
        assert_eq!(define(p, "PUNICA_THREADS"), shape::PUNICA_THREADS as u64);
        assert_eq!(define(p, "PUNICA_ROWS"), shape::PUNICA_ROWS as u64);
        assert_eq!(
            define(p, "PUNICA_RANK_TILE"),
            shape::PUNICA_RANK_TILE as u64
        );
        assert_eq!(define(p, "PUNICA_K_CHUNK"), shape::PUNICA_K_CHUNK as u64);
        assert_eq!(
            define(p, "PUNICA_EXPAND_COLS"),
            shape::PUNICA_EXPAND_COLS as u64
        );
        assert_eq!(define(p, "PUNICA_MAX_RANK"), shape::PUNICA_MAX_RANK as u64);
        let s = LORA_SLICES.source;
        assert_eq!(
            define(s, "PUNICA_MAX_SLICES"),
            shape::PUNICA_MAX_SLICES as u64
        );
        assert!(s.starts_with("#define PUNICA_DEVICE_ONLY\n") && s.contains(p));
        let f = LORA_SMALL.source;
        assert!(f.starts_with("#define PUNICA_DEVICE_ONLY\n") && f.contains(p));
        let a = ATTENTION_SPLIT.source;
        assert_eq!(define(a, "THAW_SPLIT_WARPS"), shape::SPLIT_WARPS as u64);
        assert_eq!(
            define(a, "THAW_SPLIT_MAX_HEAD_DIM"),
            shape::SPLIT_MAX_HEAD_DIM as u64
        );
        let ilp = ATTENTION_SPLIT_ILP.source;
        assert_eq!(define(ilp, "THAW_ILP_WARPS"), shape::SPLIT_ILP_WARPS as u64);
        assert_eq!(shape::SPLIT_ILP_WARPS, shape::ATTN_WARPS);
        assert_eq!(
            define(ilp, "THAW_ILP_MAX_HEAD_DIM"),
            shape::SPLIT_MAX_HEAD_DIM as u64
        );
        let w = WIDE.source;
        assert_eq!(define(w, "THAW_WIDE_VPT"), shape::WIDE_VPT as u64);
        assert_eq!(define(w, "THAW_ROPE_MAX_HALF"), shape::ROPE_MAX_HALF as u64);
        assert_eq!(shape::ROPE_MAX_HALF * 2, shape::MAX_HEAD_DIM);
        // attn16.cu stages the same table, from the same header.
        let a16 = ATTN16.source;
        assert_eq!(
            define(a16, "THAW_ROPE_MAX_HALF"),
            shape::ROPE_MAX_HALF as u64
        );
        assert!(a16.contains("__launch_bounds__(1024)") && w.contains("__launch_bounds__(1024)"));
        let g = GEMV.source;
        assert_eq!(define(g, "GEMV_MAX_ROWS"), shape::GEMV_MAX_ROWS as u64);
        assert_eq!(define(g, "GEMV_WARPS"), shape::GEMV_WARPS as u64);
        assert_eq!(define(g, "GEMV_FEW_ROWS"), shape::GEMV_FEW_ROWS as u64);
        assert_eq!(define(g, "GEMV_OUTS_FEW"), shape::GEMV_OUTS_FEW as u64);
        assert_eq!(define(g, "GEMV_OUTS_MANY"), shape::GEMV_OUTS_MANY as u64);
        let l = LORA.source;
        assert_eq!(define(l, "THAW_LORA_WARPS"), shape::LORA_WARPS as u64);
        assert_eq!(define(l, "THAW_LORA_ROWS"), shape::LORA_ROWS as u64);
        assert_eq!(define(l, "THAW_MAX_LORA_RANK"), shape::MAX_LORA_RANK as u64);
        let g = ARGMAX.source;
        assert_eq!(
            define(g, "THAW_ARGMAX_THREADS"),
            shape::ARGMAX_THREADS as u64
        );
        // Whole warps, at most 32 of them (one warp reduces the warps' bests).
        assert!(shape::ARGMAX_THREADS.is_multiple_of(32) && shape::ARGMAX_THREADS <= 1024);
    }

    #[test]
    fn sources_need_no_headers() {
        let includes = |s: &str| s.lines().any(|l| l.trim_start().starts_with("#include"));
        for k in KERNELS {
            assert!(!includes(k.source), "{}.cu includes a header", k.name);
        }
        assert!(!includes(PRELUDE));
    }
}
