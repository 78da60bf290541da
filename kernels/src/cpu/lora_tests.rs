use super::*;
use crate::cpu::gemm::linear;
use crate::cpu::testutil::{assert_close, rand_vec, rng};
use proptest::prelude::*;
use rand_chacha::ChaCha8Rng;

struct Adapter {
    a: Vec<f32>,
    b: Vec<f32>,
    rank: usize,
    scale: f32,
}

impl Adapter {
    fn new(r: &mut ChaCha8Rng, rank: usize, d_in: usize, d_out: usize) -> Self {
        Self {
            a: rand_vec(r, rank * d_in, 1.0 / (d_in as f32).sqrt()),
            b: rand_vec(r, d_out * rank, 1.0),
            rank,
            // lora_alpha / r with lora_alpha = 16, like a typical PEFT config.
            scale: 16.0 / rank as f32,
        }
    }

    fn as_ref(&self) -> LoraRef<'_> {
        LoraRef {
            a: &self.a,
            b: &self.b,
            rank: self.rank,
            scale: self.scale,
        }
    }
}

/// Per-row f64 reference: `y0 + scale · B · (A · x_r)` for rows with an adapter.
fn naive(
    x: &[f32],
    y0: &[f32],
    idx: &[Option<u32>],
    ads: &[Adapter],
    d_in: usize,
    d_out: usize,
) -> Vec<f64> {
    let mut y: Vec<f64> = y0.iter().map(|&v| v as f64).collect();
    for (r, i) in idx.iter().enumerate() {
        let Some(i) = i else { continue };
        let l = &ads[*i as usize];
        let xr = &x[r * d_in..(r + 1) * d_in];
        let t: Vec<f64> = (0..l.rank)
            .map(|p| {
                (0..d_in)
                    .map(|c| l.a[p * d_in + c] as f64 * xr[c] as f64)
                    .sum()
            })
            .collect();
        for o in 0..d_out {
            let dot: f64 = (0..l.rank).map(|p| l.b[o * l.rank + p] as f64 * t[p]).sum();
            y[r * d_out + o] += l.scale as f64 * dot;
        }
    }
    y
}

/// Segments (for SGMV) for the rows that have an adapter.
fn segments<'a>(idx: &[Option<u32>], ads: &'a [Adapter]) -> Vec<LoraSegment<'a>> {
    runs(idx)
        .filter_map(|(rows, i)| {
            i.map(|i| LoraSegment {
                rows,
                lora: ads[i as usize].as_ref(),
            })
        })
        .collect()
}

fn run_both(
    x: &[f32],
    y0: &[f32],
    idx: &[Option<u32>],
    ads: &[Adapter],
    d_in: usize,
    d_out: usize,
) -> (Vec<f32>, Vec<f32>) {
    let refs: Vec<LoraRef<'_>> = ads.iter().map(Adapter::as_ref).collect();
    let max_rank = idx
        .iter()
        .flatten()
        .map(|&i| ads[i as usize].rank)
        .max()
        .unwrap_or(0);
    let mut scratch = Vec::new();
    let mut ys = y0.to_vec();
    sgmv(x, d_in, &segments(idx, ads), &mut ys, d_out, &mut scratch);
    let mut yb = y0.to_vec();
    bgmv(x, d_in, idx, &refs, max_rank, &mut yb, d_out, &mut scratch);
    (ys, yb)
}

// Tolerance: two chained f32 GEMMs (k = d_in ≤ 96, then k = rank ≤ 128) vs f64: a few 1e-7
// relative to the output RMS typically; 1e-5 leaves margin, a wrong adapter, row or scale is O(1).
const TOL: f64 = 1e-5;

#[test]
fn sgmv_bgmv_naive_and_merged_agree() {
    let mut r = rng(50);
    let (d_in, d_out) = (96, 80);
    let ads: Vec<Adapter> = [8, 16, 24, 64, 128, 32]
        .iter()
        .map(|&k| Adapter::new(&mut r, k, d_in, d_out))
        .collect();
    // Mixed segments, rows without an adapter, an adapter reused in two segments, 1-row segments.
    let mut idx = Vec::new();
    for (n, i) in [
        (5, Some(0)),
        (2, None),
        (8, Some(3)),
        (1, Some(1)),
        (14, Some(4)),
        (3, None),
    ]
    .into_iter()
    .chain([(7, Some(2)), (1, Some(0)), (4, Some(5)), (2, Some(4))])
    {
        idx.extend(std::iter::repeat_n(i, n));
    }
    let rows = idx.len();
    let x = rand_vec(&mut r, rows * d_in, 1.0);
    let y0 = rand_vec(&mut r, rows * d_out, 1.0);
    let want = naive(&x, &y0, &idx, &ads, d_in, d_out);
    let (ys, yb) = run_both(&x, &y0, &idx, &ads, d_in, d_out);
    let es = assert_close("sgmv vs naive", &ys, &want, TOL);
    let eb = assert_close("bgmv vs naive", &yb, &want, TOL);
    eprintln!("worst normalised error: sgmv {es:.2e}, bgmv {eb:.2e}");
    for (r, i) in idx.iter().enumerate() {
        if i.is_none() {
            let row = r * d_out..(r + 1) * d_out;
            assert_eq!(&ys[row.clone()], &y0[row.clone()], "row {r} has no adapter");
            assert_eq!(&yb[row.clone()], &y0[row], "row {r} has no adapter");
        }
    }

    // Merged-weight oracle, per row: x·(W + scale·B·A)ᵀ − x·Wᵀ is the row's delta.
    let w = rand_vec(&mut r, d_out * d_in, 0.2);
    let shape = GemmShape {
        m: 1,
        k: d_in,
        n: d_out,
    };
    let mut merged_delta = vec![0.0f32; rows * d_out];
    for (row, i) in idx.iter().enumerate() {
        let Some(i) = i else { continue };
        let mut wm = w.clone();
        merge_lora_into(&mut wm, ads[*i as usize].as_ref(), d_in, d_out);
        let xr = &x[row * d_in..(row + 1) * d_in];
        let (mut base, mut merged) = (vec![0.0; d_out], vec![0.0; d_out]);
        linear(xr, &w, &mut base, shape, false);
        linear(xr, &wm, &mut merged, shape, false);
        for o in 0..d_out {
            merged_delta[row * d_out + o] = merged[o] - base[o];
        }
    }
    let zeros = vec![0.0f32; rows * d_out];
    let want_delta = naive(&x, &zeros, &idx, &ads, d_in, d_out);
    // The subtraction cancels |x·Wᵀ| (~1.1 RMS here) to get deltas of ~1.3 RMS; each f32 GEMM
    // output carries ~1e-7 of |x·Wᵀ|, so 1e-5 still holds with margin.
    let em = assert_close("merged oracle", &merged_delta, &want_delta, TOL);
    eprintln!("merged oracle worst normalised error {em:.2e}");
}

#[test]
fn shrink_layouts_are_packed_and_padded() {
    let mut r = rng(51);
    let (d_in, d_out) = (12, 10);
    let ads: Vec<Adapter> = [3, 5]
        .iter()
        .map(|&k| Adapter::new(&mut r, k, d_in, d_out))
        .collect();
    let idx = [Some(1), Some(1), None, Some(0), Some(1)];
    let x = rand_vec(&mut r, idx.len() * d_in, 1.0);
    let refs: Vec<LoraRef<'_>> = ads.iter().map(Adapter::as_ref).collect();

    let segs = segments(&idx, &ads);
    assert_eq!(sgmv_scratch_len(&segs), 2 * 5 + 3 + 5);
    let mut v = vec![f32::NAN; sgmv_scratch_len(&segs)];
    sgmv_shrink(&x, d_in, &segs, &mut v);
    let mut vb = vec![f32::NAN; idx.len() * 6];
    bgmv_shrink(&x, d_in, &idx, &refs, 6, &mut vb);

    let dot = |row: usize, l: &Adapter, p: usize| -> f32 {
        (0..d_in)
            .map(|c| l.a[p * d_in + c] * x[row * d_in + c])
            .sum()
    };
    // Packed: rows 0,1 (rank 5) at 0..10, row 3 (rank 3) at 10..13, row 4 (rank 5) at 13..18.
    let mut off = 0;
    for (row, l) in [(0, &ads[1]), (1, &ads[1]), (3, &ads[0]), (4, &ads[1])] {
        for p in 0..l.rank {
            assert!((v[off + p] - dot(row, l, p)).abs() < 1e-5);
            assert!((vb[row * 6 + p] - dot(row, l, p)).abs() < 1e-5);
        }
        assert!(
            vb[row * 6 + l.rank..(row + 1) * 6]
                .iter()
                .all(|&e| e == 0.0),
            "padding"
        );
        off += l.rank;
    }
    assert!(
        vb[2 * 6..3 * 6].iter().all(|&e| e == 0.0),
        "row without adapter"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// SGMV and BGMV agree with each other and the naive reference for any segmentation.
    #[test]
    fn sgmv_equals_bgmv_over_random_segmentations(
        runs_spec in prop::collection::vec((1usize..6, prop::option::of(0u32..4)), 1..9),
        seed in any::<u64>(),
    ) {
        let mut r = rng(seed);
        let (d_in, d_out) = (24, 20);
        let ads: Vec<Adapter> =
            [1, 3, 8, 16].iter().map(|&k| Adapter::new(&mut r, k, d_in, d_out)).collect();
        let idx: Vec<Option<u32>> =
            runs_spec.iter().flat_map(|&(n, i)| std::iter::repeat_n(i, n)).collect();
        let x = rand_vec(&mut r, idx.len() * d_in, 1.0);
        let y0 = rand_vec(&mut r, idx.len() * d_out, 1.0);
        let (ys, yb) = run_both(&x, &y0, &idx, &ads, d_in, d_out);
        let want = naive(&x, &y0, &idx, &ads, d_in, d_out);
        assert_close("sgmv", &ys, &want, TOL);
        assert_close("bgmv", &yb, &want, TOL);
        let yb64: Vec<f64> = yb.iter().map(|&e| e as f64).collect();
        assert_close("sgmv vs bgmv", &ys, &yb64, TOL);
    }
}
