use super::*;
use crate::cpu::testutil::{assert_close, rand_vec, rng};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// Dense causal GQA attention in f64 over contiguous `k`, `v` (`[seq, nkv, d]`); `q` holds the
/// queries for positions `start ..`.
#[allow(clippy::too_many_arguments)]
pub(super) fn dense_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    start: usize,
    n_heads: usize,
    nkv: usize,
    d: usize,
    window: Option<usize>,
) -> Vec<f64> {
    let tokens = q.len() / (n_heads * d);
    let group = n_heads / nkv;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0f64; q.len()];
    for t in 0..tokens {
        let pos = start + t;
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        for h in 0..n_heads {
            let kvh = h / group;
            let qh = &q[(t * n_heads + h) * d..][..d];
            let s: Vec<f64> = (lo..=pos)
                .map(|j| {
                    let kj = &k[(j * nkv + kvh) * d..][..d];
                    scale
                        * qh.iter()
                            .zip(kj)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                })
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (j, p) in (lo..=pos).zip(&e) {
                let vj = &v[(j * nkv + kvh) * d..][..d];
                for i in 0..d {
                    out[(t * n_heads + h) * d + i] += p / z * vj[i] as f64;
                }
            }
        }
    }
    out
}

/// [`paged_attention`]'s signature.
pub(super) type Attend = fn(
    &[f32],
    &[f32],
    &[f32],
    KvLayout,
    &[u32],
    usize,
    usize,
    f32,
    Option<usize>,
    &mut [f32],
    &mut Vec<f32>,
);

pub(super) struct Case {
    pub seq: usize,
    pub n_heads: usize,
    pub layout: KvLayout,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    table: Vec<u32>,
    num_blocks: usize,
}

impl Case {
    pub(super) fn new(
        r: &mut ChaCha8Rng,
        seq: usize,
        n_heads: usize,
        nkv: usize,
        d: usize,
        bs: usize,
    ) -> Self {
        let layout = KvLayout {
            block_size: bs,
            num_kv_heads: nkv,
            head_dim: d,
        };
        let needed = seq.div_ceil(bs);
        // Spare blocks that stay filled with garbage: reading them would show up as an error.
        let num_blocks = needed + 3;
        let mut perm: Vec<u32> = (0..num_blocks as u32).collect();
        perm.shuffle(r);
        perm.truncate(needed);
        Self {
            seq,
            n_heads,
            layout,
            q: rand_vec(r, seq * n_heads * d, 1.5),
            k: rand_vec(r, seq * nkv * d, 1.5),
            v: rand_vec(r, seq * nkv * d, 1.0),
            table: perm,
            num_blocks,
        }
    }

    fn garbage_cache(&self, r: &mut ChaCha8Rng) -> (Vec<f32>, Vec<f32>) {
        let n = self.num_blocks * self.layout.block_len();
        (rand_vec(r, n, 100.0), rand_vec(r, n, 100.0))
    }

    /// Runs the sequence in prefill chunks of `chunk` tokens, writing each chunk's K/V first.
    fn run_chunked(&self, r: &mut ChaCha8Rng, chunk: usize, window: Option<usize>) -> Vec<f32> {
        self.run_with(r, chunk, window, paged_attention)
    }

    /// [`Self::run_chunked`] through `attend` (a function with [`paged_attention`]'s
    /// signature).
    pub(super) fn run_with(
        &self,
        r: &mut ChaCha8Rng,
        chunk: usize,
        window: Option<usize>,
        attend: Attend,
    ) -> Vec<f32> {
        let (mut kc, mut vc) = self.garbage_cache(r);
        let (qt, kt) = (self.n_heads * self.layout.head_dim, self.layout.token_len());
        let mut out = vec![f32::NAN; self.q.len()];
        let mut scratch = Vec::new();
        let scale = 1.0 / (self.layout.head_dim as f32).sqrt();
        let mut start = 0;
        while start < self.seq {
            let end = (start + chunk).min(self.seq);
            let (k, v) = (&self.k[start * kt..end * kt], &self.v[start * kt..end * kt]);
            write_kv(&mut kc, &mut vc, self.layout, &self.table, start, k, v);
            attend(
                &self.q[start * qt..end * qt],
                &kc,
                &vc,
                self.layout,
                &self.table,
                start,
                self.n_heads,
                scale,
                window,
                &mut out[start * qt..end * qt],
                &mut scratch,
            );
            start = end;
        }
        out
    }
}

// Tolerance: scores and the weighted sum of ≤ 40 values are each a few f32 roundings plus a
// d-term dot product (d ≤ 20): ~1e-6 relative to the output RMS; 1e-5 leaves margin while a
// wrong block, head or position gives O(1) errors.
const TOL: f64 = 1e-5;

#[test]
fn shuffled_paged_matches_dense_across_gqa_and_windows() {
    let mut r = rng(40);
    for (n_heads, nkv) in [(4, 4), (8, 4), (8, 2)] {
        for window in [None, Some(1), Some(5), Some(64)] {
            for (d, bs) in [(16, 4), (20, 5)] {
                let c = Case::new(&mut r, 37, n_heads, nkv, d, bs);
                let got = c.run_chunked(&mut r, c.seq, window);
                let want = dense_ref(&c.q, &c.k, &c.v, 0, n_heads, nkv, d, window);
                let ctx = format!("heads {n_heads}/{nkv} window {window:?} d {d} bs {bs}");
                assert_close(&ctx, &got, &want, TOL);
            }
        }
    }
}

#[test]
fn chunked_prefill_and_decode_equal_one_shot() {
    let mut r = rng(41);
    for (n_heads, nkv, window) in [(4, 4, None), (8, 4, Some(6)), (8, 2, None)] {
        let c = Case::new(&mut r, 29, n_heads, nkv, 24, 4);
        let one_shot = c.run_chunked(&mut r, c.seq, window);
        // Chunk 1 is pure decode; 3 and 7 straddle block boundaries at different phases.
        for chunk in [1, 3, 7] {
            let got = c.run_chunked(&mut r, chunk, window);
            // Each query's computation does not depend on its chunk, so results are bit-exact.
            assert_eq!(
                got, one_shot,
                "chunk {chunk}, heads {n_heads}/{nkv}, window {window:?}"
            );
        }
        let want = dense_ref(&c.q, &c.k, &c.v, 0, n_heads, nkv, 24, window);
        assert_close("one shot", &one_shot, &want, TOL);
    }
}

#[test]
fn write_kv_places_rows_by_block_table() {
    let mut r = rng(42);
    let c = Case::new(&mut r, 11, 2, 2, 3, 4);
    let (mut kc, mut vc) = c.garbage_cache(&mut r);
    write_kv(&mut kc, &mut vc, c.layout, &c.table, 0, &c.k, &c.v);
    let tl = c.layout.token_len();
    for pos in 0..c.seq {
        let off = (c.table[pos / 4] as usize * 4 + pos % 4) * tl;
        assert_eq!(&kc[off..off + tl], &c.k[pos * tl..(pos + 1) * tl]);
        assert_eq!(&vc[off..off + tl], &c.v[pos * tl..(pos + 1) * tl]);
    }
}

#[test]
fn scratch_is_reused_once_warm() {
    let mut r = rng(43);
    let c = Case::new(&mut r, 16, 4, 2, 8, 4);
    let (mut kc, mut vc) = c.garbage_cache(&mut r);
    write_kv(&mut kc, &mut vc, c.layout, &c.table, 0, &c.k, &c.v);
    let mut scratch = Vec::new();
    let mut out = vec![0.0; c.q.len()];
    let run = |out: &mut [f32], scratch: &mut Vec<f32>| {
        paged_attention(
            &c.q, &kc, &vc, c.layout, &c.table, 0, 4, 0.3, None, out, scratch,
        )
    };
    run(&mut out, &mut scratch);
    let (ptr, cap) = (scratch.as_ptr(), scratch.capacity());
    run(&mut out, &mut scratch);
    assert_eq!((scratch.as_ptr(), scratch.capacity()), (ptr, cap));
}
