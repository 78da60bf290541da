//! Paged KV cache writes and causal grouped-query attention over it.
//!
//! One layer's cache is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and likewise
//! for V. A sequence's block table maps logical block `i` (positions `i·block_size ..`) to a
//! physical block.

/// Geometry of one layer's paged K (or V) cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Token positions per block.
    pub block_size: usize,
    /// Key/value heads (fewer than query heads under GQA).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Elements in one block: `block_size · num_kv_heads · head_dim`.
    pub fn block_len(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Elements per token position: `num_kv_heads · head_dim`.
    pub fn token_len(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Offset in the cache of position `pos`'s `[num_kv_heads, head_dim]` row.
    fn token_offset(&self, block_table: &[u32], pos: usize) -> usize {
        let phys = block_table[pos / self.block_size] as usize;
        (phys * self.block_size + pos % self.block_size) * self.token_len()
    }
}

fn check_cache(op: &str, cache: &[f32], layout: KvLayout, block_table: &[u32], end: usize) {
    assert!(
        layout.block_size > 0 && layout.token_len() > 0,
        "{op}: empty layout {layout:?}"
    );
    assert_eq!(
        cache.len() % layout.block_len(),
        0,
        "{op}: cache of {} elements is not whole blocks of {layout:?}",
        cache.len()
    );
    assert!(
        block_table.len() * layout.block_size >= end,
        "{op}: block table of {} blocks × {} cannot hold positions up to {end}",
        block_table.len(),
        layout.block_size
    );
}

/// Writes `k`, `v` (`[tokens, num_kv_heads, head_dim]`) for positions `start_pos ..
/// start_pos + tokens` into the blocks named by `block_table` (logical block `i` → physical
/// block `block_table[i]`). Both caches are `[num_blocks, block_size, num_kv_heads, head_dim]`.
pub fn write_kv(
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    layout: KvLayout,
    block_table: &[u32],
    start_pos: usize,
    k: &[f32],
    v: &[f32],
) {
    let tl = layout.token_len();
    assert_eq!(
        k.len(),
        v.len(),
        "write_kv: k has {}, v has {}",
        k.len(),
        v.len()
    );
    assert_eq!(
        k.len() % tl.max(1),
        0,
        "write_kv: k is not [tokens, {layout:?}]"
    );
    assert_eq!(
        k_cache.len(),
        v_cache.len(),
        "write_kv: K and V caches differ in size"
    );
    let tokens = k.len() / tl;
    check_cache("write_kv", k_cache, layout, block_table, start_pos + tokens);
    for (t, (kt, vt)) in k.chunks_exact(tl).zip(v.chunks_exact(tl)).enumerate() {
        let off = layout.token_offset(block_table, start_pos + t);
        k_cache[off..off + tl].copy_from_slice(kt);
        v_cache[off..off + tl].copy_from_slice(vt);
    }
}

/// Dot product with eight independent accumulators so it vectorises.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out += p · v`.
#[inline]
fn axpy(out: &mut [f32], p: f32, v: &[f32]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o += p * x;
    }
}

/// Calls `f(pos, offset)` for every position in `lo..=hi`, walking the block table block by block
/// (one table lookup per block, not per position).
#[inline]
fn for_each_pos(
    layout: KvLayout,
    table: &[u32],
    lo: usize,
    hi: usize,
    mut f: impl FnMut(usize, usize),
) {
    let (bs, tl) = (layout.block_size, layout.token_len());
    let mut pos = lo;
    while pos <= hi {
        let blk = pos / bs;
        let end = ((blk + 1) * bs).min(hi + 1);
        let mut off = (table[blk] as usize * bs + pos % bs) * tl;
        for p in pos..end {
            f(p, off);
            off += tl;
        }
        pos = end;
    }
}

/// Causal GQA attention for one sequence over the paged cache, which must already hold
/// positions `0 .. start_pos + tokens`.
///
/// `q` is `[tokens, n_heads, head_dim]`; query `t` sits at position `start_pos + t` and attends
/// to positions `[lo, start_pos + t]` where `lo = 0`, or `pos + 1 - window` when
/// `sliding_window` is `Some(window)` (Mistral). `n_heads % num_kv_heads == 0`; head `h` uses
/// kv head `h / (n_heads / num_kv_heads)`. `out` is `[tokens, n_heads, head_dim]`; `scale` is
/// usually `1/sqrt(head_dim)`. Works for prefill chunks (`tokens > 1`, `start_pos > 0`) and
/// decode (`tokens == 1`); every query's result depends only on its own query, position and
/// keys, not on the chunk it comes in, bit for bit. `scratch` grows to what the call needs and
/// is reused (no allocation once warm).
///
/// With AVX-512F in use (the AVX2 level, `THAW_AVX512` and `THAW_TILED_ATTENTION` not `0`) a
/// tile of query rows passes each key and value row once (`attention_tiled.rs`); otherwise one
/// query token at a time (`attend_rows`). The two give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    layout: KvLayout,
    block_table: &[u32],
    start_pos: usize,
    n_heads: usize,
    scale: f32,
    sliding_window: Option<usize>,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let (d, nkv) = (layout.head_dim, layout.num_kv_heads);
    assert!(
        nkv > 0 && n_heads.is_multiple_of(nkv),
        "attention: {n_heads} heads over {nkv} kv heads"
    );
    assert_eq!(
        q.len() % (n_heads * d).max(1),
        0,
        "attention: q is not [tokens, {n_heads}, {d}]"
    );
    assert_eq!(
        out.len(),
        q.len(),
        "attention: out has {}, q has {}",
        out.len(),
        q.len()
    );
    assert_eq!(
        k_cache.len(),
        v_cache.len(),
        "attention: K and V caches differ in size"
    );
    assert_ne!(
        sliding_window,
        Some(0),
        "attention: sliding window of 0 attends to nothing"
    );
    if q.is_empty() {
        return;
    }
    let tokens = q.len() / (n_heads * d);
    check_cache(
        "attention",
        k_cache,
        layout,
        block_table,
        start_pos + tokens,
    );
    let seq = Seq {
        q,
        k: k_cache,
        v: v_cache,
        layout,
        table: block_table,
        start_pos,
        n_heads,
        scale,
        window: sliding_window,
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = tiled::Tiled::enabled() {
        return t.attend(&seq, out, scratch);
    }
    attend_rows(&seq, out, scratch);
}

/// One sequence's attention call, checked by [`paged_attention`]: `q` is `[tokens, n_heads,
/// head_dim]` for positions `start_pos ..`, and the cache holds positions `0 .. start_pos +
/// tokens`.
#[derive(Copy, Clone)]
struct Seq<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    layout: KvLayout,
    table: &'a [u32],
    start_pos: usize,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
}

impl Seq<'_> {
    fn tokens(&self) -> usize {
        self.q.len() / (self.n_heads * self.layout.head_dim)
    }

    /// Query heads per kv head.
    fn group(&self) -> usize {
        self.n_heads / self.layout.num_kv_heads
    }

    /// The first position the query at `pos` attends to.
    fn lo(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// The portable path (and the oracle of the tiled one): one query token at a time, the
/// scores of the query heads sharing a kv head computed together so each key and value row
/// is read once per group and token; softmax is two-pass over `scratch`, which grows to
/// `group · span` and is reused (no allocation once warm).
fn attend_rows(s: &Seq<'_>, out: &mut [f32], scratch: &mut Vec<f32>) {
    let (d, nkv, group) = (s.layout.head_dim, s.layout.num_kv_heads, s.group());
    let (tokens, n_heads, scale) = (s.tokens(), s.n_heads, s.scale);
    let (layout, block_table, k_cache, v_cache) = (s.layout, s.table, s.k, s.v);
    let max_span = s
        .window
        .map_or(s.start_pos + tokens, |w| w.min(s.start_pos + tokens));
    if scratch.len() < group * max_span {
        scratch.resize(group * max_span, 0.0);
    }

    for t in 0..tokens {
        let pos = s.start_pos + t;
        let lo = s.lo(pos);
        let span = pos + 1 - lo;
        let row = t * n_heads * d;
        for kvh in 0..nkv {
            let heads = row + kvh * group * d..row + (kvh + 1) * group * d;
            let qg = &s.q[heads.clone()];
            let og = &mut out[heads];
            let scores = &mut scratch[..group * span];
            // Pass 1: scores[g, j] = scale · q_g · k_j.
            for_each_pos(layout, block_table, lo, pos, |p, off| {
                let kr = &k_cache[off + kvh * d..off + (kvh + 1) * d];
                for (g, qh) in qg.chunks_exact(d).enumerate() {
                    scores[g * span + p - lo] = scale * dot(qh, kr);
                }
            });
            for s in scores.chunks_exact_mut(span) {
                softmax_unnormalised(s);
            }
            // Pass 2: out_g = Σ_j p[g, j] · v_j / Σ_j p[g, j].
            og.fill(0.0);
            for_each_pos(layout, block_table, lo, pos, |p, off| {
                let vr = &v_cache[off + kvh * d..off + (kvh + 1) * d];
                for (g, oh) in og.chunks_exact_mut(d).enumerate() {
                    axpy(oh, scores[g * span + p - lo], vr);
                }
            });
            for (g, oh) in og.chunks_exact_mut(d).enumerate() {
                let sum: f32 = scores[g * span..(g + 1) * span].iter().sum();
                let inv = 1.0 / sum;
                oh.iter_mut().for_each(|o| *o *= inv);
            }
        }
    }
}

/// `s ← exp(s - max(s))`; the caller divides by the sum (≥ 1, since the max maps to 1).
fn softmax_unnormalised(s: &mut [f32]) {
    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    s.iter_mut().for_each(|v| *v = super::expf::expf(*v - max));
}

#[cfg(target_arch = "x86_64")]
#[path = "attention_tiled.rs"]
mod tiled;

#[cfg(target_arch = "x86_64")]
#[path = "attention_keys.rs"]
mod keys;

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;

#[cfg(all(test, target_arch = "x86_64"))]
#[path = "attention_tiled_tests.rs"]
mod tiled_tests;
