//! Which of the CUDA backend's issue-29 kernels run, as pure functions of the environment
//! variables' values and of the shape the backend serves, so the rules are unit-tested on the
//! CPU (the `cuda` module only loads what [`KernelPlan::resolve`] and [`OptInPlan::resolve`]
//! picked).
//!
//! All thirteen are on by default, each with the variable that turns it off. The first four
//! ([`KernelPlan`]) were verified on an H200 (the whole parity suite with them on, and
//! `thaw-bench gpu` on llama-7b-shape):
//!
//! | kernel | variable | off |
//! | --- | --- | --- |
//! | flash-decoding (`attention_split.cu`) | [`ATTN_IMPL_ENV`] | `classic` |
//! | prefill attention on the tensor cores (`attention_prefill_tc.cu`) | [`TC_PREFILL_ENV`] | `0` |
//! | Punica-shaped SGMV / BGMV (`lora_punica.cu`) | [`LORA_IMPL_ENV`] | `classic` |
//! | fused add + RMSNorm and SwiGLU + cast | [`FUSED_ENV`] | `0` |
//!
//! The other nine ([`OptInPlan`], named for when they were opt-in) became defaults once a GPU
//! parity run proved them (session 24, H200: `cuda_parity`'s `opt_in` tests with all nine on,
//! engines on against off with identical greedy tokens but at near ties, each kernel's own
//! tests; the whole model decoded at 5.04 ms a token at batch 1 against 7.91 ms without them,
//! `benches/results/cuda-h100.md` §9). `0` turns each back to the kernel it replaced, which
//! `benches/gpu/lease.sh` keeps proving (`cuda_parity opt_in` with all nine `0`):
//!
//! | kernel | variable | off |
//! | --- | --- | --- |
//! | q/k/v (and gate/up) as one product over one weight matrix | [`GROUP_GEMM_ENV`] | `0` |
//! | RoPE of q and k inside the paged-cache KV write | [`ROPE_FOLD_ENV`] | `0` |
//! | RMSNorm, add + RMSNorm, RoPE with one wide block per row | [`WIDE_ENV`] | `0` |
//! | greedy token ids on the device, copied instead of the logits | [`DEVICE_ARGMAX_ENV`] | `0` |
//! | products of few rows as a GEMV over f32 activations (no cast, no cuBLAS): every product at 1–2 rows, q/k/v/o-sized ones at 3–4 ([`gemv_pays`]) | [`GEMV_ENV`] | `0` |
//! | q/k/v (and gate/up) LoRA as one shrink + one expand launch over slices | [`LORA_SLICES_ENV`] | `0` |
//! | decode attention split to fill the GPU, 4 keys' loads in flight a warp (`attention_split_ilp.cu`) | [`ATTN_OCCUPANCY_ENV`] | `0` |
//! | products through cuBLASLt, the bias in its epilogue (`lt_plan`) | [`CUBLASLT_ENV`] | `0` |
//! | q/k/v and gate/up outputs and SwiGLU in 16 bits, f32 accumulation (`act16.cu`, `attn16.cu`; [`super::act16_plan`], [`super::attn16_plan`]); the residual stream between layers in 16 bits (`residual16.cu`, [`super::residual16_plan`]) | [`ACT16_ENV`] | `0` |
//!
//! Unset, empty or `auto`: the new kernel where it serves the backend's shape, the classic one
//! (with the reason, logged once) where it does not — e.g. the tensor-core prefill with an f32
//! KV cache, a head_dim other than 32/64/128, or a device below compute capability 8.0; RoPE
//! folding with an odd head_dim; the occupancy decode with heads past flash-decoding's 256.
//! Several of the nine also decide per product or per step (the GEMV where it pays and its
//! kernel takes the shape, 16-bit activations where [`super::act16_plan`] says so, 16-bit
//! weights for both): the switch only loads them. An explicit `split` / `1` / `punica` that
//! cannot be served is an error that says what to set. The CPU backend, the numeric oracle,
//! keeps f32 throughout: it emulates the 16-bit activations only when a test asks
//! ([`CpuBackend::set_act16`](super::cpu::CpuBackend::set_act16)).
//!
//! Two more are opt-in, off unless `1`, until a GPU parity run proves them (they sit in
//! [`OptInPlan`] beside the nine):
//!
//! | kernel | variable | on |
//! | --- | --- | --- |
//! | prefill attention FlashAttention-2 style where the tensor-core prefill runs (`attention_prefill_fa.cu`, [`prefill_fa_plan`]) | [`PREFILL_FA_ENV`] | `1` |
//! | LoRA of few rows and small rank as ONE launch, shrink and expand fused (`lora_fused_small.cu`, [`lora_small_plan`](thaw_kernels::cuda::lora_small_plan)) | [`LORA_SMALL_ENV`] | `1` |
use std::fmt;

use thaw_kernels::cuda::decode_plan::{MIN_CHUNK, OCC_MIN_CHUNK};
use thaw_kernels::cuda::registry::{shape, DType, GpuArch};
use thaw_kernels::cuda::{prefill_fa_plan, prefill_tc_plan, punica_plan};

/// Picks the decode attention: `split` (flash-decoding, the default) or `classic`.
pub const ATTN_IMPL_ENV: &str = "THAW_CUDA_ATTN_IMPL";
/// Prefill attention on the tensor cores: `1` (the default where served) or `0`.
pub const TC_PREFILL_ENV: &str = "THAW_CUDA_TC_PREFILL";
/// Picks the SGMV / BGMV kernels: `punica` (the default) or `classic`.
pub const LORA_IMPL_ENV: &str = "THAW_CUDA_LORA_IMPL";
/// Fused add + RMSNorm and SwiGLU + cast: `1` (the default) or `0`.
pub const FUSED_ENV: &str = "THAW_CUDA_FUSED";
/// q/k/v (and gate/up) as one product over weights placed as one matrix at load: `1` (the
/// default) or `0`.
pub const GROUP_GEMM_ENV: &str = "THAW_CUDA_GROUP_GEMM";
/// RoPE of q and k inside the kernel that writes K/V to the paged cache: `1` (the default where
/// served: [`rope_fold_unserved`]) or `0`.
pub const ROPE_FOLD_ENV: &str = "THAW_CUDA_ROPE_FOLD";
/// RMSNorm, add + RMSNorm and RoPE with a wide block per row (float4 loads, one pass in
/// registers): `1` (the default) or `0`.
pub const WIDE_ENV: &str = "THAW_CUDA_WIDE_NORM";
/// Greedy sampling on the device: a step whose rows are all greedy copies one token id per
/// row instead of its logits (`argmax.cu`): `1` (the default) or `0`.
pub const DEVICE_ARGMAX_ENV: &str = "THAW_CUDA_DEVICE_ARGMAX";

/// The shortest context chunk flash-decoding makes, in positions (default [`MIN_CHUNK`]): see
/// [`split_min_chunk`].
pub const SPLIT_MIN_CHUNK_ENV: &str = "THAW_CUDA_SPLIT_MIN_CHUNK";

/// Flash-decoding's shortest chunk from [`SPLIT_MIN_CHUNK_ENV`]'s value (`None`, empty or
/// `auto`: [`MIN_CHUNK`]). With the default, a context under 2 · 256 positions is one split,
/// so at batch 1 a 130-token decode runs `attention.cu`'s kernel on `n_heads` blocks (32 on
/// Llama-7B, for 132 SMs), each warp walking ~33 keys one dependent load after another
/// (`cuda-h100.md` §8: 46 µs a layer). A smaller chunk (32 or 64) splits such contexts across
/// more blocks, at the cost of the reduce launch; the results differ from one split only in
/// the order of the softmax's f32 sums (the parity suite runs 4-position chunks). A value
/// that is not a positive integer is an error that says what to set.
pub fn split_min_chunk(value: Option<&str>) -> Result<usize, String> {
    let v = value.map(str::trim).unwrap_or_default();
    if v.is_empty() || v.eq_ignore_ascii_case("auto") {
        return Ok(MIN_CHUNK);
    }
    match v.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "{SPLIT_MIN_CHUNK_ENV}={v:?} is not a positive number of positions; set it to e.g. \
             32, or unset it for the default of {MIN_CHUNK}"
        )),
    }
}

/// Products of few rows against 16-bit weights through `gemv.cu` (f32 activations read
/// directly) instead of a cast and cuBLAS, where it pays ([`gemv_pays`]): `1` (the default)
/// or `0`.
pub const GEMV_ENV: &str = "THAW_CUDA_GEMV";

/// The LoRA of modules sharing one input (q/k/v, gate/up) as one shrink and one expand launch
/// over slices (`lora_slices.cu`; with Punica's kernels only): `1` (the default) or `0`.
pub const LORA_SLICES_ENV: &str = "THAW_CUDA_LORA_SLICES";

/// SGMV / BGMV calls of few rows and small rank (where
/// [`lora_small_plan::plan`](thaw_kernels::cuda::lora_small_plan::plan) serves them; with
/// Punica's kernels only) as one launch of `lora_fused_small.cu`, each block recomputing the
/// shrink for its rows, instead of a shrink and an expand launch: `1` or `0` (the default until
/// a GPU parity run proves it).
pub const LORA_SMALL_ENV: &str = "THAW_CUDA_LORA_SMALL";

/// Decode attention through `attention_split_ilp.cu`: the split count planned to give the
/// GPU about two blocks per SM ([`occupancy_splits`](thaw_kernels::cuda::decode_plan::occupancy_splits),
/// chunks of at least [`occupancy_floor`] positions), each warp with 4 keys' K/V loads in
/// flight: `1` (the default where served: [`split_unserved`]) or `0`. On, it replaces both
/// flash-decoding and `attention.cu`'s decode, in eager steps and in CUDA graphs (a split count
/// fixed per captured bucket, each row using the splits its context allows).
pub const ATTN_OCCUPANCY_ENV: &str = "THAW_CUDA_ATTN_OCCUPANCY";

/// Products through cuBLASLt (`cublasLtMatmul`, bf16/f16 in, f32 compute) with a cached
/// heuristic algorithm per shape bucket and the bias added by its epilogue instead of a separate
/// `add_bias` launch ([`lt_plan`](super::lt_plan)): `1` (the default) or `0`. The small-batch
/// GEMV ([`GEMV_ENV`]) keeps the products it serves.
pub const CUBLASLT_ENV: &str = "THAW_CUDA_CUBLASLT";

/// The MLP's gate and up products stored in the weights' 16-bit type (cuBLAS, f32
/// accumulation) and SwiGLU over them writing down's 16-bit input (`act16.cu`), where
/// [`act16_plan`](super::act16_plan::act16_plan) serves the step; the attention's q/k/v
/// products likewise, RoPE'd from 16 bits into the KV cache (`attn16.cu`), where
/// [`attn16_plan`](super::attn16_plan::attn16_plan) serves it; and the residual stream
/// between layers stored in that type ([`residual16_plan`](super::residual16_plan)): `1`
/// (the default; it acts only on 16-bit weights) or `0`. The CPU backend keeps f32 whatever
/// this says.
pub const ACT16_ENV: &str = "THAW_CUDA_BF16_ACT";

/// Prefill attention through `attention_prefill_fa.cu` wherever the tensor-core prefill runs:
/// GQA heads sharing K/V tiles, cp.async double buffering, ldmatrix fragments
/// ([`prefill_fa_plan`]; a shape its plan declines keeps the tensor-core kernel): `1` or `0`
/// (the default until a GPU parity run proves it).
pub const PREFILL_FA_ENV: &str = "THAW_CUDA_PREFILL_FA";

/// The occupancy plan's shortest chunk from [`SPLIT_MIN_CHUNK_ENV`]'s value: unset, empty or
/// `auto`: [`OCC_MIN_CHUNK`] (32 positions); a positive integer sets it (as for the fixed plan,
/// whose default is 256); anything else is [`split_min_chunk`]'s error.
pub fn occupancy_floor(value: Option<&str>) -> Result<usize, String> {
    let v = value.map(str::trim).unwrap_or_default();
    if v.is_empty() || v.eq_ignore_ascii_case("auto") {
        return Ok(OCC_MIN_CHUNK);
    }
    split_min_chunk(Some(v))
}

/// Which kernels run the CUDA backend's decode attention.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AttnImpl {
    /// `attention.cu`: one block per (row, head).
    Classic,
    /// `attention_split.cu`: flash-decoding, no chunk under `min_chunk` positions (tests set
    /// it small to split short contexts).
    Split { min_chunk: usize },
}

impl AttnImpl {
    /// Flash-decoding with the default chunking.
    pub const SPLIT: AttnImpl = AttnImpl::Split {
        min_chunk: MIN_CHUNK,
    };
}

/// Which kernels launch the CUDA backend's SGMV / BGMV.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LoraImpl {
    /// `lora.cu`: one block per (segment, rank) for the shrink, no split-K.
    Classic,
    /// `lora_punica.cu`. `max_k_chunk` caps the shrink's K chunk (elements) below the kernel's
    /// staging limit; tests set it small to exercise split-K on small models.
    Punica { max_k_chunk: usize },
}

impl LoraImpl {
    /// Punica's kernels with the default K chunking.
    pub const PUNICA: LoraImpl = LoraImpl::Punica {
        max_k_chunk: shape::PUNICA_K_CHUNK,
    };
}

/// What a variable's value asks for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Ask {
    /// Unset, empty or `auto`: the new kernel where it serves the shape.
    Default,
    /// The classic kernel.
    Off,
    /// The new kernel, or an error where it cannot serve the shape.
    On,
}

/// One switch: its variable, the values that turn it on and off, and what the new kernel is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Switch {
    pub env: &'static str,
    /// The value an error tells the user to set for the new kernel (`split`, `1`, `punica`).
    pub on: &'static str,
    /// The value that turns it off (`classic`, `0`).
    pub off: &'static str,
    /// The new kernel, in words.
    pub new: &'static str,
    /// The classic kernel, in words.
    pub classic: &'static str,
    /// Whether unset (or `auto`) picks the new kernel: true for every switch since the nine of
    /// [`OptInPlan`] were proven (a new kernel may start false until a GPU parity run proves
    /// it, as they did).
    pub default_new: bool,
}

/// Flash-decoding.
pub const ATTN: Switch = Switch {
    env: ATTN_IMPL_ENV,
    on: "split",
    off: "classic",
    new: "flash-decoding",
    classic: "classic",
    default_new: true,
};
/// The tensor-core prefill.
pub const TC_PREFILL: Switch = Switch {
    env: TC_PREFILL_ENV,
    on: "1",
    off: "0",
    new: "tensor-core prefill",
    classic: "classic",
    default_new: true,
};
/// Punica's SGMV / BGMV.
pub const LORA: Switch = Switch {
    env: LORA_IMPL_ENV,
    on: "punica",
    off: "classic",
    new: "punica",
    classic: "classic",
    default_new: true,
};
/// The fused elementwise kernels.
pub const FUSED: Switch = Switch {
    env: FUSED_ENV,
    on: "1",
    off: "0",
    new: "fused",
    classic: "unfused",
    default_new: true,
};

/// One product per layer for q/k/v and one for gate/up.
pub const GROUP_GEMM: Switch = Switch {
    env: GROUP_GEMM_ENV,
    on: "1",
    off: "0",
    new: "grouped",
    classic: "per-module",
    default_new: true,
};
/// RoPE folded into the KV write.
pub const ROPE_FOLD: Switch = Switch {
    env: ROPE_FOLD_ENV,
    on: "1",
    off: "0",
    new: "folded into the KV write",
    classic: "separate",
    default_new: true,
};
/// The wide norm and RoPE kernels.
pub const WIDE: Switch = Switch {
    env: WIDE_ENV,
    on: "1",
    off: "0",
    new: "wide",
    classic: "one block of 256 per row",
    default_new: true,
};
/// Greedy token ids on the device.
pub const DEVICE_ARGMAX: Switch = Switch {
    env: DEVICE_ARGMAX_ENV,
    on: "1",
    off: "0",
    new: "device argmax",
    classic: "logits copied, argmax on the host",
    default_new: true,
};

/// The small-batch GEMV.
pub const GEMV: Switch = Switch {
    env: GEMV_ENV,
    on: "1",
    off: "0",
    new: "small-batch GEMV",
    classic: "cast + cuBLAS",
    default_new: true,
};

/// The multi-slice LoRA launches.
pub const LORA_SLICES: Switch = Switch {
    env: LORA_SLICES_ENV,
    on: "1",
    off: "0",
    new: "one launch pair over slices",
    classic: "a launch pair per module",
    default_new: true,
};

/// The one-launch small-batch LoRA.
pub const LORA_SMALL: Switch = Switch {
    env: LORA_SMALL_ENV,
    on: "1",
    off: "0",
    new: "shrink and expand in one launch",
    classic: "a shrink and an expand launch",
    default_new: false,
};

/// Products through cuBLASLt with its bias epilogue.
pub const CUBLASLT: Switch = Switch {
    env: CUBLASLT_ENV,
    on: "1",
    off: "0",
    new: "cuBLASLt, bias in its epilogue",
    classic: "cublasGemmEx + add_bias",
    default_new: true,
};

/// The occupancy-planned decode attention with keys in flight.
pub const ATTN_OCCUPANCY: Switch = Switch {
    env: ATTN_OCCUPANCY_ENV,
    on: "1",
    off: "0",
    new: "occupancy split, keys in flight",
    classic: "as THAW_CUDA_ATTN_IMPL picks",
    default_new: true,
};

/// 16-bit activations (q/k/v, gate/up, SwiGLU).
pub const ACT16: Switch = Switch {
    env: ACT16_ENV,
    on: "1",
    off: "0",
    new: "q/k/v, gate/up and SwiGLU in 16 bits",
    classic: "f32",
    default_new: true,
};

/// The FlashAttention-2-style prefill in place of the tensor-core one.
pub const PREFILL_FA: Switch = Switch {
    env: PREFILL_FA_ENV,
    on: "1",
    off: "0",
    new: "FlashAttention-2-style prefill",
    classic: "tensor-core prefill",
    default_new: false,
};

const ON_OFF: [&str; 2] = ["1", "0"];

impl Switch {
    /// The values a user may set, as an error lists them.
    fn values(&self) -> String {
        let names: &[&str] = if self.on == ON_OFF[0] {
            &ON_OFF
        } else {
            &[self.on, self.off]
        };
        let list: Vec<String> = names.iter().map(|v| format!("\"{v}\"")).collect();
        format!("{}, or \"auto\" / unset for the default", list.join(", "))
    }

    /// Parses the variable's value. Named switches take their two names (`split` also as
    /// `flash-decoding`); on/off ones take 1/true/on/yes and 0/false/off/no. Case and
    /// surrounding blanks are ignored.
    pub fn parse(&self, value: &str) -> Result<Ask, String> {
        let v = value.trim().to_ascii_lowercase();
        let on_off = self.on == ON_OFF[0];
        let ask = match v.as_str() {
            "" | "auto" => Ask::Default,
            "1" | "true" | "on" | "yes" if on_off => Ask::On,
            "0" | "false" | "off" | "no" if on_off => Ask::Off,
            "flash-decoding" if self.env == ATTN_IMPL_ENV => Ask::On,
            s if !on_off && s == self.on => Ask::On,
            s if !on_off && s == self.off => Ask::Off,
            _ => {
                return Err(format!(
                    "{}={value:?} is not a value it takes; use {}",
                    self.env,
                    self.values()
                ))
            }
        };
        Ok(ask)
    }

    /// What runs for `ask` when `unserved` says why the new kernel cannot serve this backend's
    /// shape (None: it can).
    pub fn resolve(&self, ask: Ask, unserved: Option<String>) -> Result<Choice, String> {
        match (ask, unserved) {
            (Ask::Off, _) => Ok(Choice::Classic),
            (Ask::Default, _) if !self.default_new => Ok(Choice::Classic),
            (Ask::Default | Ask::On, None) => Ok(Choice::New),
            (Ask::Default, Some(why)) => Ok(Choice::Fallback(why)),
            (Ask::On, Some(why)) => Err(format!(
                "{env}={on} asks for the {new} kernels, but {why}; set {env}={off} (or leave it \
                 unset: the {classic} kernels then run where the {new} ones cannot)",
                env = self.env,
                on = self.on,
                off = self.off,
                new = self.new,
                classic = self.classic,
            )),
        }
    }

    /// [`Switch::parse`] then [`Switch::resolve`].
    pub fn choose(&self, value: &str, unserved: Option<String>) -> Result<Choice, String> {
        self.resolve(self.parse(value)?, unserved)
    }
}

/// What one switch resolved to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The new kernel.
    New,
    /// The classic kernel, asked for.
    Classic,
    /// The classic kernel because the default's new one does not serve the shape (why).
    Fallback(String),
}

impl Choice {
    /// Whether the new kernel runs.
    pub fn is_new(&self) -> bool {
        matches!(self, Choice::New)
    }
}

/// Why flash-decoding cannot serve heads of `head_dim`, if it cannot.
pub fn split_unserved(head_dim: usize) -> Option<String> {
    (head_dim > shape::SPLIT_MAX_HEAD_DIM).then(|| {
        format!(
            "they take head_dim up to {} and this model's is {head_dim}",
            shape::SPLIT_MAX_HEAD_DIM
        )
    })
}

/// Why the tensor-core prefill cannot serve a `kv` cache with heads of `head_dim` on a device
/// of compute capability `arch`, if it cannot: it multiplies 16-bit operands with
/// `mma.sync.m16n8k16` (compute capability 8.0 and up) and has instantiations for
/// [`prefill_tc_plan::HEAD_DIMS`].
pub fn tc_prefill_unserved(kv: DType, head_dim: usize, arch: GpuArch) -> Option<String> {
    if arch < GpuArch::SM80 {
        return Some(format!(
            "they need compute capability 8.0 or newer (bf16/f16 mma.sync) and this device is \
             {}.{}",
            arch.major, arch.minor
        ));
    }
    if kv == DType::F32 {
        return Some("they need a bf16 or f16 KV cache and this one is f32".into());
    }
    if !prefill_tc_plan::HEAD_DIMS.contains(&head_dim) {
        return Some(format!(
            "they serve head_dim {:?} and this model's is {head_dim}",
            prefill_tc_plan::HEAD_DIMS
        ));
    }
    debug_assert!(prefill_tc_plan::entry_point(kv, head_dim).is_some());
    None
}

/// The largest LoRA input width Punica's split-K shrink takes.
pub const PUNICA_MAX_D_IN: usize = punica_plan::MAX_SPLITS * shape::PUNICA_K_CHUNK;

/// Why Punica's kernels cannot serve LoRA inputs up to `max_d_in` wide, if they cannot.
pub fn punica_unserved(max_d_in: usize) -> Option<String> {
    (max_d_in > PUNICA_MAX_D_IN).then(|| {
        format!(
            "this model's widest LoRA input ({max_d_in}) is above their limit of {PUNICA_MAX_D_IN}"
        )
    })
}

/// What decides whether a kernel serves a backend.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ServedShape {
    pub kv: DType,
    pub head_dim: usize,
    /// The widest LoRA projection input (hidden, q_dim or intermediate size).
    pub max_lora_d_in: usize,
    /// The device's compute capability.
    pub arch: GpuArch,
}

/// The four choices, resolved once when a backend is created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelPlan {
    pub attn: Choice,
    pub tc_prefill: Choice,
    pub lora: Choice,
    pub fused: Choice,
}

impl KernelPlan {
    /// Resolves every switch from `var` (an environment lookup: `None` = unset) for `s`. The
    /// first error names its variable and what to set.
    pub fn resolve(var: impl Fn(&str) -> Option<String>, s: &ServedShape) -> Result<Self, String> {
        let value = |env: &str| var(env).unwrap_or_default();
        Ok(Self {
            attn: ATTN.choose(&value(ATTN.env), split_unserved(s.head_dim))?,
            tc_prefill: TC_PREFILL.choose(
                &value(TC_PREFILL.env),
                tc_prefill_unserved(s.kv, s.head_dim, s.arch),
            )?,
            lora: LORA.choose(&value(LORA.env), punica_unserved(s.max_lora_d_in))?,
            fused: FUSED.choose(&value(FUSED.env), None)?,
        })
    }
}

/// Why the FlashAttention-2-style prefill cannot serve heads of `head_dim`, if it cannot (it
/// also runs only where the tensor-core prefill does: a 16-bit cache on sm_80+, resolved when
/// the backend loads it).
pub fn prefill_fa_unserved(head_dim: usize) -> Option<String> {
    (!prefill_fa_plan::HEAD_DIMS.contains(&head_dim)).then(|| {
        format!(
            "it serves head_dim {:?} and this model's is {head_dim}",
            prefill_fa_plan::HEAD_DIMS
        )
    })
}

/// Why RoPE cannot be folded into the KV write for heads of `head_dim`, if it cannot: the
/// kernel stages one head's angles (`head_dim / 2`) in shared memory sized for the attention
/// kernels' largest head, and rotates pairs (an even `head_dim`).
pub fn rope_fold_unserved(head_dim: usize) -> Option<String> {
    if !head_dim.is_multiple_of(2) || head_dim > shape::MAX_HEAD_DIM {
        return Some(format!(
            "it takes an even head_dim up to {} and this model's is {head_dim}",
            shape::MAX_HEAD_DIM
        ));
    }
    None
}

/// Threads of the block `wide.cu`'s RMSNorm kernels launch per row of `d` values, or None where
/// they do not serve it (the classic kernel runs): float4 loads need `d % 4 == 0`, and a row
/// is kept in registers, at most [`shape::WIDE_VPT`] float4 a thread of at most
/// [`shape::WIDE_MAX_THREADS`].
pub fn wide_norm_block(d: usize) -> Option<u32> {
    if d == 0 || !d.is_multiple_of(4) {
        return None;
    }
    let d4 = d / 4;
    let threads = d4.next_multiple_of(32).min(shape::WIDE_MAX_THREADS);
    (d4 <= threads * shape::WIDE_VPT).then_some(threads as u32)
}

/// Threads of the block `wide.cu`'s RoPE kernels launch per token for `pairs` (head, pair)
/// rotations: one thread each, in whole warps, at most [`shape::WIDE_MAX_THREADS`] (they loop
/// past it).
pub fn wide_rope_block(pairs: usize) -> u32 {
    pairs
        .next_multiple_of(32)
        .clamp(32, shape::WIDE_MAX_THREADS) as u32
}

/// Most rows a group of projections (q/k/v, gate/up) runs as one product with
/// `THAW_CUDA_GROUP_GEMM` on (the default). The product writes `[rows, Σ d_out]` that a kernel then splits into
/// the modules' buffers: at decode's few rows that copy is small against the weights it saves
/// re-reading launches and tails for, but it grows with the rows while a many-row product is
/// compute-bound already (a 2048-row q/k/v of Llama-7B would copy 200 MB for no gain). Past
/// this, the group casts its input once and runs a product per module.
pub const GROUP_GEMM_MAX_ROWS: usize = 128;

/// Whether a group placed as one matrix runs as one product for a step of `rows` rows.
pub fn group_as_one_product(rows: usize) -> bool {
    rows <= GROUP_GEMM_MAX_ROWS
}

/// Rows at which the GEMV beats cast + cuBLAS on every product: on an H200 (`cuda-h100.md` §9,
/// `cuda_bench --gemv`) it ran 1.07–1.94× at 1 and 2 rows over every shape of Llama-7B and a
/// small model, the LM head included.
pub const GEMV_ROWS_ANY: usize = 2;

/// Rows up to which the GEMV still beats cuBLAS on products of at most
/// [`GEMV_SMALL_WEIGHTS`] weights. The same table at 4 rows: 1.36× on 4096 → 4096 and 1.6× on
/// 576 ↔ 1536, where cuBLAS's tiles under-fill the SMs (39% and 3% of the copy peak), but 0.89×
/// on gate/up, 0.81× on down and 0.95× on the LM head, where cuBLAS streams at 57–86%; the GEMV
/// holds about 2.2 TB/s at 4 rows on every shape. At 8 rows it lost on every Llama-7B product
/// (0.32–0.69×), so past 4 rows cuBLAS serves all of them.
pub const GEMV_ROWS_SMALL: usize = 4;

/// The most weights (`d_in · d_out`) of a product the GEMV takes at 3 to [`GEMV_ROWS_SMALL`]
/// rows: Llama-7B's q/k/v/o (4096 × 4096), not its gate/up, down or LM head.
pub const GEMV_SMALL_WEIGHTS: usize = 4096 * 4096;

/// Whether the GEMV pays for a product of `rows` rows of `[d_out, d_in]` weights against the
/// cast and cuBLAS, by the measured crossover ([`GEMV_ROWS_ANY`], [`GEMV_ROWS_SMALL`]). Symmetric in
/// `d_in` and `d_out`: it counts the weights streamed, so gate/up and down agree.
pub fn gemv_pays(rows: usize, d_in: usize, d_out: usize) -> bool {
    (1..=GEMV_ROWS_ANY).contains(&rows)
        || ((1..=GEMV_ROWS_SMALL).contains(&rows)
            && d_in.saturating_mul(d_out) <= GEMV_SMALL_WEIGHTS)
}

/// Whether a product of `rows` rows, `[rows, d_in] · [d_out, d_in]ᵀ` over weights of `dtype`
/// at device address `w_addr` with its f32 input at `x_addr`, runs through `gemv.cu` with the
/// switch (`gemv_on`) on. The kernel takes 1 to [`shape::GEMV_MAX_ROWS`] rows of 16-bit
/// weights; it loads 8 weights (16 bytes) and 8 activations (two float4) at a time, so
/// `d_in % 8 == 0` and both buffers 16-byte aligned (every row then is). Of those, the backend
/// runs the products where it pays ([`gemv_pays`]), all of them only where benchmarks and
/// tests ask for every row count. Anything else, f32 weights included, takes the cast + cuBLAS
/// path, which serves every shape.
pub fn gemv_serves(
    gemv_on: bool,
    dtype: DType,
    rows: usize,
    d_in: usize,
    d_out: usize,
    w_addr: u64,
    x_addr: u64,
) -> bool {
    gemv_on
        && dtype != DType::F32
        && (1..=shape::GEMV_MAX_ROWS).contains(&rows)
        && d_in > 0
        && d_in.is_multiple_of(8)
        && d_out > 0
        // The kernel indexes with int rows of W and long offsets: d_out · d_in may exceed
        // i32 (a 128k vocabulary head), d_in and d_out alone may not.
        && i32::try_from(d_in).is_ok()
        && i32::try_from(d_out).is_ok()
        && w_addr.is_multiple_of(16)
        && x_addr.is_multiple_of(16)
}

/// Outputs (rows of W) one `gemv.cu` warp computes for a product of `rows` rows: the few-row
/// kernel's [`shape::GEMV_OUTS_FEW`] up to [`shape::GEMV_FEW_ROWS`] rows, the many-row
/// kernel's [`shape::GEMV_OUTS_MANY`] above (each x load then serves more outputs, which keeps
/// the L1 traffic of 8 f32 rows under the SM's limit).
pub fn gemv_outs_per_warp(rows: usize) -> u32 {
    if rows <= shape::GEMV_FEW_ROWS {
        shape::GEMV_OUTS_FEW
    } else {
        shape::GEMV_OUTS_MANY
    }
}

/// Blocks of a `gemv.cu` launch for `d_out` outputs of `rows` rows: one warp per
/// [`gemv_outs_per_warp`] outputs, [`shape::GEMV_WARPS`] warps a block. Small blocks (128
/// threads) that the hardware hands to whichever SM frees up, so a 4096-wide product at one row
/// (512 blocks) is resident at once on an H100's 132 SMs and an 11008-wide one has no long tail
/// wave. Narrow products cannot fill the SMs (576 outputs at one row: 72 blocks); the kernel
/// loops grid-stride, so any grid is correct.
pub fn gemv_grid(d_out: usize, rows: usize) -> u32 {
    let per_block = (shape::GEMV_WARPS * gemv_outs_per_warp(rows)) as usize;
    d_out.div_ceil(per_block).clamp(1, i32::MAX as usize) as u32
}

/// The nine switches that were opt-in until session 24's H200 parity run proved them, now on by
/// default like [`KernelPlan`]'s (`0` turns each off; the name is their history): resolved once
/// when a backend is created, logged beside [`KernelPlan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptInPlan {
    pub group_gemm: Choice,
    pub rope_fold: Choice,
    pub wide: Choice,
    pub device_argmax: Choice,
    pub gemv: Choice,
    pub lora_slices: Choice,
    pub attn_occupancy: Choice,
    pub cublaslt: Choice,
    pub act16: Choice,
    pub prefill_fa: Choice,
    pub lora_small: Choice,
}

impl OptInPlan {
    /// Resolves the nine switches from `var` for heads of `head_dim`: unset, each is new where
    /// served (RoPE folding and the occupancy decode fall back where the head_dim is not).
    pub fn resolve(var: impl Fn(&str) -> Option<String>, head_dim: usize) -> Result<Self, String> {
        let value = |env: &str| var(env).unwrap_or_default();
        Ok(Self {
            group_gemm: GROUP_GEMM.choose(&value(GROUP_GEMM.env), None)?,
            rope_fold: ROPE_FOLD.choose(&value(ROPE_FOLD.env), rope_fold_unserved(head_dim))?,
            wide: WIDE.choose(&value(WIDE.env), None)?,
            device_argmax: DEVICE_ARGMAX.choose(&value(DEVICE_ARGMAX.env), None)?,
            // Served or not per product (`gemv_serves`): the rest take cast + cuBLAS.
            gemv: GEMV.choose(&value(GEMV.env), None)?,
            // Runs where Punica's kernels do (per module otherwise: `lora_slices.rs`).
            lora_slices: LORA_SLICES.choose(&value(LORA_SLICES.env), None)?,
            attn_occupancy: ATTN_OCCUPANCY
                .choose(&value(ATTN_OCCUPANCY.env), split_unserved(head_dim))?,
            // Served for every product it is given (`lt_plan::plan` refuses only empty ones).
            cublaslt: CUBLASLT.choose(&value(CUBLASLT.env), None)?,
            // Served or not per step and layer (`act16_plan`): the rest run f32.
            act16: ACT16.choose(&value(ACT16.env), None)?,
            prefill_fa: PREFILL_FA.choose(&value(PREFILL_FA.env), prefill_fa_unserved(head_dim))?,
            // Served or not per call (`lora_small_plan`), with Punica's kernels only.
            lora_small: LORA_SMALL.choose(&value(LORA_SMALL.env), None)?,
        })
    }

    fn rows(&self) -> [(&'static str, Switch, &Choice); 11] {
        [
            ("q/k/v and gate/up products", GROUP_GEMM, &self.group_gemm),
            ("RoPE", ROPE_FOLD, &self.rope_fold),
            ("norm and RoPE blocks", WIDE, &self.wide),
            ("greedy sampling", DEVICE_ARGMAX, &self.device_argmax),
            ("products of few rows", GEMV, &self.gemv),
            ("LoRA of q/k/v and gate/up", LORA_SLICES, &self.lora_slices),
            ("decode attention", ATTN_OCCUPANCY, &self.attn_occupancy),
            ("products", CUBLASLT, &self.cublaslt),
            ("activations", ACT16, &self.act16),
            ("prefill attention", PREFILL_FA, &self.prefill_fa),
            ("LoRA of few rows", LORA_SMALL, &self.lora_small),
        ]
    }
}

/// Writes `rows` as `what: kernel; ...`.
fn plan_line(f: &mut fmt::Formatter<'_>, rows: &[(&str, Switch, &Choice)]) -> fmt::Result {
    for (i, (what, sw, c)) in rows.iter().enumerate() {
        if i > 0 {
            f.write_str("; ")?;
        }
        match c {
            Choice::New => write!(f, "{what}: {} (off: {}={})", sw.new, sw.env, sw.off)?,
            Choice::Classic => write!(f, "{what}: {} ({}={})", sw.classic, sw.env, sw.off)?,
            Choice::Fallback(why) => write!(
                f,
                "{what}: {} (the {} kernels do not serve this backend: {why})",
                sw.classic, sw.new
            )?,
        }
    }
    Ok(())
}

/// One line for the log: which of the nine kernels run, how to turn each off, and why one fell
/// back.
impl fmt::Display for OptInPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        plan_line(f, &self.rows())
    }
}

/// One line for the log: which kernels run, how to turn each off, and why a default fell back.
impl fmt::Display for KernelPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        plan_line(
            f,
            &[
                ("decode attention", ATTN, &self.attn),
                ("prefill attention", TC_PREFILL, &self.tc_prefill),
                ("LoRA", LORA, &self.lora),
                ("elementwise", FUSED, &self.fused),
            ],
        )
    }
}

#[cfg(test)]
#[path = "kernel_select_tests.rs"]
mod tests;
