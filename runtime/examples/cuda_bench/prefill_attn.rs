//! Prefill attention of one Llama-3-8B layer (32 query heads, 8 KV heads of 128, bf16 cache,
//! 16-position blocks), one sequence: `attention.cu`'s f32 tiled prefill
//! (`THAW_CUDA_TC_PREFILL=0`) against the tensor-core kernel (`attention_prefill_tc.cu`, issue
//! 29, the default) and its FlashAttention-2-style replacement (`attention_prefill_fa.cu`,
//! `THAW_CUDA_PREFILL_FA=1`, and with one query head a block for what its GQA sharing gives; its
//! speed-up also against the tensor-core kernel), for fresh prompts of 128 and 2048 tokens and a 2048-token chunk after a
//! 2048-token prefix. The op timed is the backend's `attention` (K/V write + attention). TFLOP/s counts the causal
//! multiply-adds, Q·Kᵀ and P·V ([`prefill_tc_plan::causal_flops`]), over the op's time.
use thaw_kernels::cpu::KvLayout;
use thaw_kernels::cuda::prefill_fa_plan::HeadSharing;
use thaw_kernels::cuda::prefill_tc_plan;
use thaw_runtime::backend::cuda::{CudaBackend, CudaConfig};
use thaw_runtime::backend::{Backend, SeqSlice, StepLayout};

use super::{fill, model_config, time_us, Res};

pub fn prefill_attn_table(smoke: bool) -> Res<()> {
    let c = model_config(1)?;
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    let layout = KvLayout {
        block_size: 16,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
    };
    // (prefix already in the cache, rows of the chunk)
    let cases: &[(usize, usize)] = if smoke {
        &[(0, 128), (0, 2048)]
    } else {
        &[(0, 128), (0, 512), (0, 2048), (2048, 2048)]
    };
    let iters = if smoke { 5 } else { 20 };
    println!(
        "\n## Prefill attention, one layer (32 q / 8 kv heads of 128, bf16 KV, one sequence; median of {iters})"
    );
    println!("(kernel: classic = attention.cu, THAW_CUDA_TC_PREFILL=0; tensor cores = attention_prefill_tc.cu, the default; FA = attention_prefill_fa.cu, THAW_CUDA_PREFILL_FA=1)");
    println!(
        "| kernel | prefix | tokens | µs | TFLOP/s | speed-up | vs tensor cores |\n|---|---|---|---|---|---|---|"
    );
    let (qw, kw) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    for &(start, n) in cases {
        let blocks = (start + n).div_ceil(layout.block_size);
        let mut kv = g.alloc_kv_layer(layout, blocks)?;
        let step = StepLayout {
            token_ids: vec![1; n],
            positions: (start..start + n).collect(),
            seqs: vec![SeqSlice {
                rows: 0..n,
                start_pos: start,
                blocks: 0..blocks,
            }],
            block_tables: (0..blocks as u32).collect(),
            ..Default::default()
        };
        let q = g.upload_f32(&fill(n * qw, 5))?;
        let k = g.upload_f32(&fill(n * kw, 6))?;
        let v = g.upload_f32(&fill(n * kw, 7))?;
        let mut out = g.alloc(n * qw)?;
        let flops = prefill_tc_plan::causal_flops(start, n, c.num_heads, c.head_dim);
        let (mut base_us, mut tc_us) = (None, None);
        // The FA kernel with the backend's head sharing (two heads a block at these grids),
        // then with one head a block (no K/V tile shared), to show what the sharing gives.
        let kernels = [
            (false, None),
            (true, None),
            (true, Some(HeadSharing::Auto)),
            (true, Some(HeadSharing::One)),
        ];
        for (tc, fa) in kernels {
            let on = g.set_tc_prefill(tc)?;
            let fa_on = g.set_prefill_fa(fa.is_some())?;
            if let Some(sharing) = fa {
                g.set_prefill_fa_sharing(sharing);
            }
            let name = match (on, fa_on, fa) {
                (_, true, Some(HeadSharing::One)) => "tensor cores, FA, one head a block",
                (_, true, _) => "tensor cores, FA (THAW_CUDA_PREFILL_FA=1)",
                (true, false, _) => "tensor cores",
                (false, _, _) => "classic",
            };
            // set_tc_prefill starts a new step: the warm-up call uploads the metadata (cut to
            // the kernel's tile), the timed calls reuse it.
            let us = time_us(&mut g, iters, |g| {
                g.attention(&q, &k, &v, &mut kv, &step, &mut out);
            })?;
            let speedup = base_us.map_or("1.00×".to_string(), |b: f64| format!("{:.2}×", b / us));
            base_us.get_or_insert(us);
            let vs_tc = match (fa_on, tc_us) {
                (true, Some(t)) => format!("{:.2}×", t / us),
                _ => "".to_string(),
            };
            if on && !fa_on {
                tc_us = Some(us);
            }
            println!(
                "| {name} | {start} | {n} | {us:.1} | {:.1} | {speedup} | {vs_tc} |",
                flops / us / 1e6
            );
        }
    }
    g.set_prefill_fa(false)?;
    g.set_tc_prefill(false)?;
    Ok(())
}
