//! The tiled AVX-512F attention (`attention_tiled.rs`) against the portable path
//! (`attend_rows`) and the dense f64 oracle, and its per-query bits against any chunking.
//!
//! Tolerances: both paths are a `d`-term dot product, a softmax over ≤ 80 keys and a weighted
//! sum of as many value rows, in f32 with different summation orders and `exp`s (≤ 2 ulp
//! each): ~1e-6 of the output RMS; `1e-5` (as `attention_tests`) leaves margin, while a wrong
//! key, head, mask or position errs by O(1). Where the CPU lacks AVX-512F the tiled kernel is
//! never chosen and the tests say so and return.
use proptest::prelude::*;

use super::tests::{dense_ref, Case};
use super::tiled::{exp_nonpositive, rows_pad, tile_tokens, Tiled, MAX_SCORES};
use super::*;
use crate::cpu::testutil::{assert_close, rng};

const TOL: f64 = 1e-5;

#[allow(clippy::too_many_arguments)]
fn seq<'a>(
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    layout: KvLayout,
    table: &'a [u32],
    start_pos: usize,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
) -> Seq<'a> {
    Seq {
        q,
        k,
        v,
        layout,
        table,
        start_pos,
        n_heads,
        scale,
        window,
    }
}

/// The portable path alone, with [`paged_attention`]'s signature.
#[allow(clippy::too_many_arguments)]
fn portable(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: KvLayout,
    table: &[u32],
    start_pos: usize,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let s = seq(q, k, v, layout, table, start_pos, n_heads, scale, window);
    attend_rows(&s, out, scratch);
}

/// The tiled kernel alone (the caller checked [`Tiled::enabled`]).
#[allow(clippy::too_many_arguments)]
fn tiled(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    layout: KvLayout,
    table: &[u32],
    start_pos: usize,
    n_heads: usize,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let s = seq(q, k, v, layout, table, start_pos, n_heads, scale, window);
    Tiled::enabled()
        .expect("tiled attention checked on")
        .attend(&s, out, scratch);
}

fn have_tiled() -> bool {
    let on = Tiled::enabled().is_some();
    if !on {
        eprintln!("no AVX-512F here (or switched off): tiled attention not tested");
    }
    on
}

/// f64 relative error of `got` against `f64::exp(x)`, in f32 ulps of the true value.
fn ulps(got: f32, x: f32) -> f64 {
    let want = (x as f64).exp();
    (got as f64 - want).abs() / (want * f32::EPSILON as f64)
}

#[test]
fn exp_within_two_ulp_over_the_score_range() {
    if !have_tiled() {
        return;
    }
    // Every 997th f32 bit pattern from -87.33 to 0 (about 1.1 million values), then the edges.
    let lo = (-87.336f32).to_bits();
    let mut xs: Vec<f32> = (0x8000_0000u32..=lo)
        .step_by(997)
        .map(f32::from_bits)
        .collect();
    xs.extend([
        0.0,
        -0.0,
        -1e-30,
        -0.5,
        -0.346_573_6,
        -0.346_573_6 - 1e-7,
        -87.33,
    ]);
    let mut worst = 0.0f64;
    for c in xs.chunks(16) {
        let mut lanes = [0.0f32; 16];
        lanes[..c.len()].copy_from_slice(c);
        let mut got = [0.0f32; 16];
        // SAFETY: `have_tiled` found AVX-512F; 16-lane loads and stores of 16-float arrays.
        unsafe {
            let e = exp_nonpositive(std::arch::x86_64::_mm512_loadu_ps(lanes.as_ptr()));
            std::arch::x86_64::_mm512_storeu_ps(got.as_mut_ptr(), e);
        }
        for (&x, &g) in c.iter().zip(&got) {
            let u = ulps(g, x);
            assert!(
                u <= 2.0,
                "exp({x:e}) = {g:e}: {u:.2} ulp from {:e}",
                (x as f64).exp()
            );
            worst = worst.max(u);
        }
    }
    // Below f32's normal range, -inf and NaN: exactly +0 (a masked score's weight).
    let specials = [
        -87.4f32,
        -100.0,
        -1e30,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
    ];
    let mut lanes = [0.0f32; 16];
    lanes[..specials.len()].copy_from_slice(&specials);
    let mut got = [1.0f32; 16];
    // SAFETY: as above.
    unsafe {
        let e = exp_nonpositive(std::arch::x86_64::_mm512_loadu_ps(lanes.as_ptr()));
        std::arch::x86_64::_mm512_storeu_ps(got.as_mut_ptr(), e);
    }
    for (x, g) in specials.iter().zip(&got) {
        assert_eq!(g.to_bits(), 0, "exp({x}) = {g}, want +0");
    }
    eprintln!("exp_nonpositive: worst {worst:.3} ulp");
}

#[test]
fn tile_tokens_bound_the_score_block() {
    for group in [1, 3, 4, 7, 16, 48, 64] {
        for (tokens, end, window) in [
            (1, 1, None),
            (128, 128, None),
            (128, 40_000, None),
            (4096, 200_000, None),
            (4096, 200_000, Some(4096)),
            (7, 1_000_000, Some(10)),
        ] {
            let tq = tile_tokens(group, tokens, end, window);
            assert!(
                (1..=tokens).contains(&tq),
                "group {group}: {tq} tokens of {tokens}"
            );
            assert!(tq * group <= 48 || tq == 1, "group {group}: {tq} tokens");
            let span = window.map_or(end, |w| (w + tq - 1).min(end));
            assert!(
                tq == 1 || rows_pad(tq * group) * span <= MAX_SCORES,
                "group {group}, end {end}, window {window:?}: {tq} tokens"
            );
        }
    }
    // Short contexts take whole 48-row tiles.
    assert_eq!(tile_tokens(3, 128, 128, None), 16);
    assert_eq!(tile_tokens(4, 128, 128, None), 12);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random GQA shapes (1 to 64 query heads per kv head: one to four 16-lane row vectors
    /// and several passes of 48 rows), head sizes that do and do not fill 16-lane vectors or
    /// 64-lane passes, block sizes, windows and prefill chunks: the tiled kernel matches the
    /// dense f64 oracle and the portable path within `TOL`, and every chunking (chunk 1 is
    /// decode) gives its one-shot result bit for bit.
    #[test]
    fn tiled_matches_portable_and_oracle(
        heads in prop::sample::select(vec![(1usize, 1usize), (2, 2), (3, 1), (9, 3), (8, 2), (20, 1), (64, 1)]),
        d in prop::sample::select(vec![1usize, 8, 16, 20, 64, 72, 128]),
        bs in prop::sample::select(vec![1usize, 3, 4, 16]),
        seq in 1usize..70,
        window in prop::option::of(1usize..40),
        chunk in 1usize..40,
        seed in any::<u64>(),
    ) {
        if !have_tiled() {
            return Ok(());
        }
        let (n_heads, nkv) = heads;
        let mut r = rng(seed);
        let c = Case::new(&mut r, seq, n_heads, nkv, d, bs);
        let one_shot = c.run_with(&mut r, seq, window, tiled);
        let ctx = format!("heads {n_heads}/{nkv} d {d} bs {bs} seq {seq} window {window:?}");
        let want = dense_ref(&c.q, &c.k, &c.v, 0, n_heads, nkv, d, window);
        assert_close(&ctx, &one_shot, &want, TOL);
        let port = c.run_with(&mut r, seq, window, portable);
        let port64: Vec<f64> = port.iter().map(|&x| x as f64).collect();
        assert_close(&format!("{ctx} vs portable"), &one_shot, &port64, TOL);
        let chunked = c.run_with(&mut r, chunk, window, tiled);
        prop_assert!(
            chunked.iter().zip(&one_shot).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ctx}: chunks of {chunk} differ from one shot"
        );
    }
}

#[test]
fn dispatch_takes_the_tiled_kernel_where_available() {
    if !have_tiled() {
        return;
    }
    // `paged_attention` and the tiled kernel agree bit for bit; the portable path differs in
    // rounding somewhere over a 9/3-head, 64-wide prompt (so the dispatch check can fail).
    let mut r = rng(7);
    let c = Case::new(&mut r, 50, 9, 3, 64, 16);
    let via = c.run_with(&mut r, 50, None, paged_attention);
    let direct = c.run_with(&mut r, 50, None, tiled);
    let port = c.run_with(&mut r, 50, None, portable);
    assert_eq!(via, direct);
    assert_ne!(
        via, port,
        "portable and tiled agreed bit for bit: is the dispatch live?"
    );
}
