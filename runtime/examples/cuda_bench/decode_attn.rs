//! Paged decode attention of one Llama-3-8B layer (32 query heads, 8 KV heads of 128, bf16
//! cache, 16-position blocks): `attention.cu`'s one block per (row, head) against
//! flash-decoding (`attention_split.cu`, issue 29; default chunks and 32-position chunks) and
//! the occupancy-planned decode with keys in flight (`attention_split_ilp.cu`,
//! the default; `THAW_CUDA_ATTN_OCCUPANCY=0` for flash-decoding), over context lengths and batch sizes.
//! GB/s counts the K and V bytes the rows attend to (each KV head's once) over the kernel time.
use thaw_kernels::cpu::KvLayout;
use thaw_kernels::cuda::decode_plan::OCC_MIN_CHUNK;
use thaw_runtime::backend::cuda::{AttnImpl, CudaBackend, CudaConfig};
use thaw_runtime::backend::{Backend, SeqSlice, StepLayout};

use super::{fill, model_config, time_us, Res};

pub fn decode_attn_table(smoke: bool, peak: f64) -> Res<()> {
    let c = model_config(1)?;
    let mut g = CudaBackend::new(&c, &CudaConfig::default())?;
    let layout = KvLayout {
        block_size: 16,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
    };
    let ctxs: &[usize] = if smoke {
        &[512]
    } else {
        &[130, 512, 2048, 8192]
    };
    let batches: &[usize] = if smoke { &[1] } else { &[1, 8, 32] };
    println!("\n## Decode attention, one layer (32 q / 8 kv heads of 128, bf16 KV; median of 20)");
    println!("(impl: Classic = attention.cu, THAW_CUDA_ATTN_IMPL=classic; Split = flash-decoding, THAW_CUDA_ATTN_OCCUPANCY=0, which runs Classic's kernel where its plan makes one split; Split/32 = THAW_CUDA_SPLIT_MIN_CHUNK=32; Occupancy = the default, floor 32)");
    println!("| impl | batch | context | µs | GB/s | % of copy peak |\n|---|---|---|---|---|---|");
    let (qw, kw) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    for &ctx in ctxs {
        for &batch in batches {
            let per_seq = ctx.div_ceil(layout.block_size);
            let mut kv = g.alloc_kv_layer(layout, batch * per_seq)?;
            let mut step = StepLayout::default();
            for b in 0..batch {
                let b0 = step.block_tables.len();
                step.block_tables
                    .extend((b * per_seq..(b + 1) * per_seq).map(|x| x as u32));
                step.seqs.push(SeqSlice {
                    rows: b..b + 1,
                    start_pos: ctx - 1,
                    blocks: b0..b0 + per_seq,
                });
                step.token_ids.push(1);
                step.positions.push(ctx - 1);
            }
            let q = g.upload_f32(&fill(batch * qw, 5))?;
            let k = g.upload_f32(&fill(batch * kw, 6))?;
            let v = g.upload_f32(&fill(batch * kw, 7))?;
            let mut out = g.alloc(batch * qw)?;
            let variants = [
                ("Classic", AttnImpl::Classic, None),
                ("Split", AttnImpl::SPLIT, None),
                ("Split/32", AttnImpl::Split { min_chunk: 32 }, None),
                ("Occupancy", AttnImpl::Classic, Some(OCC_MIN_CHUNK)),
            ];
            for (name, imp, occupancy) in variants {
                g.set_attn_impl(imp)?;
                g.set_attn_occupancy(occupancy)?;
                // A new step: the warm-up call uploads the metadata, the timed calls reuse it.
                g.begin_step();
                let us = time_us(&mut g, 20, |g| {
                    g.attention(&q, &k, &v, &mut kv, &step, &mut out);
                })?;
                let bytes = batch * ctx * kw * 2 * 2;
                let gbs = bytes as f64 / us / 1e3;
                println!(
                    "| {name} | {batch} | {ctx} | {us:.1} | {gbs:.0} | {:.0}% |",
                    gbs / peak * 100.0
                );
            }
        }
    }
    Ok(())
}
