//! The CPU twin of flash-decoding's two passes (`cuda/attention_split.cu`, issue 29): one
//! query's attention over a contiguous range of keys as a *partial* softmax — running max `m`,
//! sum `l = Σ e^(s - m)` and unnormalised `acc = Σ e^(s - m) · v` — and the log-sum-exp merge of
//! such partials into the full softmax-weighted sum:
//!
//! `M = max_s m_s`, `out = Σ_s e^(m_s - M) · acc_s / Σ_s e^(m_s - M) · l_s`,
//!
//! skipping empty partials (`m = -inf`). [`partial_softmax`] is what one split block computes
//! (its keys in order, online), [`merge_partials`] what `attn_decode_reduce` computes. The
//! property tests check that any cut of a context into partitions, and the cut
//! [`DecodeSplit::plan`](crate::cuda::decode_plan::DecodeSplit::plan) makes, merge to what
//! [`paged_attention`](super::paged_attention) (the CPU oracle) returns.

/// One partition's softmax state.
#[derive(Clone, Debug, PartialEq)]
pub struct SoftmaxPartial {
    /// The largest score seen; `-inf` when the partition is empty.
    pub m: f32,
    /// `Σ e^(s - m)`.
    pub l: f32,
    /// `Σ e^(s - m) · v`, `head_dim` values.
    pub acc: Vec<f32>,
}

/// The partial softmax of query `q` (`head_dim` values, unscaled) over `keys` and `values`
/// (`[n, head_dim]` each, the partition's rows in order), scores `scale · q · k`, accumulated
/// online as the split kernel does.
pub fn partial_softmax(q: &[f32], keys: &[f32], values: &[f32], scale: f32) -> SoftmaxPartial {
    let d = q.len();
    assert!(d > 0, "partial_softmax: empty query");
    assert_eq!(
        keys.len(),
        values.len(),
        "partial_softmax: keys and values differ"
    );
    assert_eq!(keys.len() % d, 0, "partial_softmax: keys are not [n, {d}]");
    let mut p = SoftmaxPartial {
        m: f32::NEG_INFINITY,
        l: 0.0,
        acc: vec![0.0; d],
    };
    for (k, v) in keys.chunks_exact(d).zip(values.chunks_exact(d)) {
        let s = scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>();
        let m_new = p.m.max(s);
        let (corr, pe) = ((p.m - m_new).exp(), (s - m_new).exp());
        p.l = p.l * corr + pe;
        for (a, &x) in p.acc.iter_mut().zip(v) {
            *a = *a * corr + pe * x;
        }
        p.m = m_new;
    }
    p
}

/// `out = Σ_s e^(m_s - M) · acc_s / Σ_s e^(m_s - M) · l_s` over the non-empty `parts`.
///
/// # Panics
/// If every partial is empty (no key at all: the softmax is undefined), or `out` and a
/// partial's `acc` differ in length.
pub fn merge_partials(parts: &[SoftmaxPartial], out: &mut [f32]) {
    let mx = parts.iter().map(|p| p.m).fold(f32::NEG_INFINITY, f32::max);
    assert!(
        mx > f32::NEG_INFINITY,
        "merge_partials: every partition is empty"
    );
    out.fill(0.0);
    let mut denom = 0.0f32;
    for p in parts.iter().filter(|p| p.m > f32::NEG_INFINITY) {
        assert_eq!(p.acc.len(), out.len(), "merge_partials: head_dim differs");
        let w = (p.m - mx).exp();
        denom += p.l * w;
        for (o, &a) in out.iter_mut().zip(&p.acc) {
            *o += a * w;
        }
    }
    let inv = 1.0 / denom;
    out.iter_mut().for_each(|o| *o *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{rand_vec, rng};
    use crate::cpu::{paged_attention, KvLayout};
    use crate::cuda::decode_plan::DecodeSplit;
    use proptest::prelude::*;

    /// Normwise relative error allowed: DESIGN §9's f32 tolerance (same math, another summation
    /// order).
    const TOL: f32 = 1e-4;

    /// The CPU oracle: one query at position n - 1 attending to all n keys of a contiguous
    /// one-block cache.
    fn oracle(q: &[f32], keys: &[f32], values: &[f32], scale: f32) -> Vec<f32> {
        let d = q.len();
        let n = keys.len() / d;
        let layout = KvLayout {
            block_size: n,
            num_kv_heads: 1,
            head_dim: d,
        };
        let mut out = vec![0.0; d];
        paged_attention(
            q,
            keys,
            values,
            layout,
            &[0],
            n - 1,
            1,
            scale,
            None,
            &mut out,
            &mut Vec::new(),
        );
        out
    }

    /// Merges the partials of `keys` cut at `cuts` (sorted, in 0..=n; repeated cuts make
    /// empty partitions).
    fn split_merge(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        scale: f32,
        cuts: &[usize],
    ) -> Vec<f32> {
        let d = q.len();
        let n = keys.len() / d;
        let mut bounds = vec![0];
        bounds.extend(cuts.iter().map(|&c| c.min(n)));
        bounds.push(n);
        bounds.sort_unstable();
        let parts: Vec<SoftmaxPartial> = bounds
            .windows(2)
            .map(|w| {
                partial_softmax(
                    q,
                    &keys[w[0] * d..w[1] * d],
                    &values[w[0] * d..w[1] * d],
                    scale,
                )
            })
            .collect();
        let mut out = vec![0.0; d];
        merge_partials(&parts, &mut out);
        out
    }

    fn max_rel_err(got: &[f32], want: &[f32]) -> f32 {
        let norm = want.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-30);
        let diff = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            .sqrt();
        diff / norm
    }

    #[test]
    fn an_empty_partition_is_skipped_and_all_empty_is_refused() {
        let mut r = rng(3);
        let (d, n) = (8, 5);
        let q = rand_vec(&mut r, d, 1.0);
        let k = rand_vec(&mut r, n * d, 1.0);
        let v = rand_vec(&mut r, n * d, 1.0);
        let empty = partial_softmax(&q, &[], &[], 0.5);
        assert_eq!(empty.m, f32::NEG_INFINITY);
        assert_eq!((empty.l, empty.acc.iter().sum::<f32>()), (0.0, 0.0));
        let got = split_merge(&q, &k, &v, 0.5, &[0, 2, 2, 5]);
        let e = max_rel_err(&got, &oracle(&q, &k, &v, 0.5));
        assert!(e <= TOL, "rel err {e}");
    }

    #[test]
    #[should_panic(expected = "every partition is empty")]
    fn a_merge_of_no_keys_is_refused() {
        let empty = partial_softmax(&[1.0; 4], &[], &[], 0.5);
        merge_partials(&[empty.clone(), empty], &mut [0.0; 4]);
    }

    #[test]
    fn large_scores_do_not_overflow() {
        // Scores near 80 overflow e^s in f32; the running max keeps every exponent ≤ 0.
        let d = 4;
        let q = vec![10.0; d];
        let k: Vec<f32> = (0..6 * d).map(|i| 2.0 + (i % 3) as f32 * 0.1).collect();
        let v: Vec<f32> = (0..6 * d).map(|i| i as f32).collect();
        let got = split_merge(&q, &k, &v, 1.0, &[1, 4]);
        assert!(got.iter().all(|x| x.is_finite()));
        let e = max_rel_err(&got, &oracle(&q, &k, &v, 1.0));
        assert!(e <= TOL, "rel err {e}");
    }

    proptest! {
        #[test]
        fn any_partition_merges_to_the_oracle(
            n in 1usize..300,
            d in prop::sample::select(vec![4usize, 16, 64, 128]),
            cuts in prop::collection::vec(0usize..300, 0..12),
            amp in 0.1f32..4.0,
            seed in 0u64..1_000,
        ) {
            let mut r = rng(seed);
            let q = rand_vec(&mut r, d, amp);
            let k = rand_vec(&mut r, n * d, amp);
            let v = rand_vec(&mut r, n * d, 1.0);
            let scale = 1.0 / (d as f32).sqrt();
            let got = split_merge(&q, &k, &v, scale, &cuts);
            let e = max_rel_err(&got, &oracle(&q, &k, &v, scale));
            prop_assert!(e <= TOL, "rel err {} over {} cuts", e, cuts.len());
        }

        /// The cut the decode planner makes (split s covers [s · chunk, (s + 1) · chunk) of the
        /// longest context; a shorter context leaves its last splits empty) merges to the oracle
        /// for every context of the step.
        #[test]
        fn the_planned_split_merges_to_the_oracle(
            max_ctx in 1usize..2_000,
            shorter in 0usize..2_000,
            pairs in 1usize..256,
            sms in 1usize..160,
            min_chunk in 1usize..512,
            seed in 0u64..1_000,
        ) {
            let plan = DecodeSplit::plan(max_ctx, pairs, sms, min_chunk);
            let d = 16;
            let mut r = rng(seed);
            for n in [max_ctx, 1 + shorter % max_ctx] {
                let q = rand_vec(&mut r, d, 1.0);
                let k = rand_vec(&mut r, n * d, 1.0);
                let v = rand_vec(&mut r, n * d, 1.0);
                let cuts: Vec<usize> = (1..plan.splits).map(|s| s * plan.chunk).collect();
                let got = split_merge(&q, &k, &v, 0.25, &cuts);
                let e = max_rel_err(&got, &oracle(&q, &k, &v, 0.25));
                prop_assert!(e <= TOL, "rel err {} with {:?}", e, plan);
            }
        }
    }
}
