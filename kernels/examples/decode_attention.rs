//! Times one decode step's attention at SmolLM2-135M's shape (9 query heads over 3 kv heads of
//! 64, 16-position blocks): 16 sequences × 30 layers, one query token each over a context of
//! `CTX` positions. Run it with `THAW_KEY_LANES=0` (row-lane tile), `THAW_TILED_ATTENTION=0`
//! (portable path) or neither (key lanes) to compare the paths in one build:
//!
//! With `cold` as a third argument every layer reads its own cache (as the engine's 30 layers
//! do: 2 × 59 MB at ctx 160, from memory rather than from the caches), else all layers share
//! one (in L2/L3):
//!
//! `cargo run --release -p thaw-kernels --example decode_attention [CTX] [REPS] [cold]`
use thaw_kernels::cpu::{paged_attention, KvLayout};

fn main() {
    let mut args = std::env::args().skip(1);
    let ctx: usize = args.next().map_or(160, |s| s.parse().expect("CTX"));
    let reps: usize = args.next().map_or(20, |s| s.parse().expect("REPS"));
    let cold = args.next().is_some_and(|s| s == "cold");
    let (n_heads, d, seqs, layers) = (9, 64, 16, 30);
    let layout = KvLayout {
        block_size: 16,
        num_kv_heads: 3,
        head_dim: d,
    };
    let blocks = ctx.div_ceil(16);
    // Each sequence's own cache (as a layer's cache holds every sequence's blocks).
    let len = seqs * blocks * layout.block_len();
    let caches = if cold { layers } else { 1 };
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let k: Vec<Vec<f32>> = (0..caches)
        .map(|_| (0..len).map(|_| next()).collect())
        .collect();
    let v: Vec<Vec<f32>> = (0..caches)
        .map(|_| (0..len).map(|_| next()).collect())
        .collect();
    let q: Vec<f32> = (0..seqs * n_heads * d).map(|_| next() * 4.0).collect();
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| (0..blocks).map(|b| (s * blocks + b) as u32).collect())
        .collect();
    let mut out = vec![0.0f32; n_heads * d];
    let mut scratch = Vec::new();
    let scale = 1.0 / (d as f32).sqrt();
    let mut check = 0.0f64;
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = thaw_ipc::thread_cpu_time();
        for l in 0..layers {
            for (s, table) in tables.iter().enumerate() {
                paged_attention(
                    &q[s * n_heads * d..(s + 1) * n_heads * d],
                    &k[l % caches],
                    &v[l % caches],
                    layout,
                    table,
                    ctx - 1,
                    n_heads,
                    scale,
                    None,
                    &mut out,
                    &mut scratch,
                );
                check += out[0] as f64;
            }
        }
        best = best.min((thaw_ipc::thread_cpu_time() - t).as_secs_f64());
    }
    println!(
        "decode attention, 16 seqs × 30 layers, ctx {ctx}{}: best of {reps} {:.3} ms of this thread's CPU time per step (checksum {check:.6})",
        if cold { ", a cache per layer" } else { "" },
        best * 1e3
    );
}
