//! Test fixture shared by the tensor-core prefill plans' emulations (`prefill_tc_plan`,
//! `prefill_fa_plan` and its lane-level replay): one query tile of one head against a cache of
//! bf16 values, the CPU oracle's answer (`cpu::paged_attention`) and the normwise error DESIGN §9
//! bounds, and the online-softmax step both kernels take per key tile ([`online_step`]). Each
//! emulation computes its own scores (its key tiles, masks and skips); this holds the rest.
use rand::{Rng, SeedableRng};

/// bf16 round to nearest even (the kernels' `from_f32` / `cvt.rn.bf16x2.f32` on finite values).
pub(crate) fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// `nq` query rows at positions `pos0 ..` of one head of `d` values, after a prefix of `pos0`
/// positions: q in f32 (the kernels round it after scaling), K and V rounded to bf16 (the
/// cache's values), one sequence in one page.
pub(crate) struct Tile {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub d: usize,
    pub pos0: usize,
    pub nq: usize,
    pub scale: f32,
}

impl Tile {
    /// A random tile from `seed`: q and K in ±1.5, V in ±1, scale 1/√d.
    pub(crate) fn random(seed: u64, pos0: usize, nq: usize, d: usize) -> Self {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = pos0 + nq;
        let mut rv = |len: usize, amp: f32, round: bool| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    let x = r.random_range(-amp..amp);
                    if round {
                        bf16_round(x)
                    } else {
                        x
                    }
                })
                .collect()
        };
        let q = rv(nq * d, 1.5, false);
        let k = rv(n * d, 1.5, true);
        let v = rv(n * d, 1.0, true);
        Self {
            q,
            k,
            v,
            d,
            pos0,
            nq,
            scale: 1.0 / (d as f32).sqrt(),
        }
    }

    /// The CPU oracle's output for the tile (`window` 0: none).
    pub(crate) fn oracle(&self, window: usize) -> Vec<f32> {
        let layout = crate::cpu::KvLayout {
            block_size: self.pos0 + self.nq,
            num_kv_heads: 1,
            head_dim: self.d,
        };
        let mut want = vec![0.0; self.nq * self.d];
        crate::cpu::paged_attention(
            &self.q,
            &self.k,
            &self.v,
            layout,
            &[0],
            self.pos0,
            1,
            self.scale,
            (window > 0).then_some(window),
            &mut want,
            &mut Vec::new(),
        );
        want
    }

    /// `got`'s normwise relative error against the oracle (DESIGN §9's bf16 bound is 1e-2).
    pub(crate) fn error(&self, got: &[f32], window: usize) -> f32 {
        let want = self.oracle(window);
        let num: f32 = got.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f32 = want.iter().map(|b| b * b).sum();
        (num / den).sqrt()
    }
}

/// One key tile's online-softmax step for one query row, as both tensor-core kernels take it:
/// `s` the row's scores for keys `c0 ..` (−∞ where masked), `m` and `l` its running max and
/// sum, `o` its unnormalised output; P rounded to bf16 before P·V (the mma's operand), the sum
/// and the rescale in f32. Keys past `v`'s rows (zero-filled in the kernel) add nothing.
pub(crate) fn online_step(
    s: &[f32],
    (m, l): (&mut f32, &mut f32),
    o: &mut [f32],
    v: &[f32],
    c0: usize,
) {
    let d = o.len();
    let n = v.len() / d;
    let mn = s.iter().copied().fold(*m, f32::max);
    // A row that has seen no key yet keeps its zeros (−∞ − −∞ would be NaN).
    let corr = if mn == f32::NEG_INFINITY {
        1.0
    } else {
        (*m - mn).exp()
    };
    *m = mn;
    *l *= corr;
    o.iter_mut().for_each(|x| *x *= corr);
    for (j, &sj) in s.iter().enumerate() {
        if sj == f32::NEG_INFINITY || c0 + j >= n {
            continue;
        }
        let p = (sj - mn).exp();
        *l += p;
        let pb = bf16_round(p);
        o.iter_mut()
            .zip(&v[(c0 + j) * d..][..d])
            .for_each(|(x, &y)| *x += pb * y);
    }
}

/// Each row of `out` (`d` values) divided by its row sum `l`: the kernels' final store.
pub(crate) fn normalise(out: &mut [f32], l: &[f32], d: usize) {
    for (o, &li) in out.chunks_exact_mut(d).zip(l) {
        o.iter_mut().for_each(|x| *x /= li);
    }
}
