//! The tiled AVX-512F attention (`attention_tiled.rs`) against the portable path
//! (`attend_rows`): bit for bit, at any shape, window and chunking; and against the dense f64
//! oracle within `attention_tests`' tolerance (`1e-5` of the output RMS: f32 roundings of a
//! `d`-term dot, a softmax and a weighted sum over ≤ 80 keys are ~1e-6, while a wrong key, head,
//! mask or position errs by O(1)). Where the CPU lacks AVX-512F the tiled kernel is never
//! chosen and the tests say so and return.
use proptest::prelude::*;

use super::tests::{dense_ref, Case};
use super::tiled::{rows_pad, tile_tokens, Tiled, MAX_SCORES, SUM_START};
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

/// A path over one [`Seq`] given [`paged_attention`]'s signature.
macro_rules! with_paged_signature {
    ($(#[$doc:meta])* $name:ident, $attend:expr) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        fn $name(
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
            $attend(&s, out, scratch);
        }
    };
}

with_paged_signature!(
    /// The portable path alone.
    portable,
    attend_rows
);
with_paged_signature!(
    /// The tiled kernel alone (the caller checked [`Tiled::enabled`]).
    tiled,
    |s: &Seq<'_>, out: &mut [f32], scratch: &mut Vec<f32>| Tiled::enabled()
        .expect("tiled attention checked on")
        .attend(s, out, scratch)
);

with_paged_signature!(
    /// The row-lane tile alone, even where the key-lane path would take the call.
    row_lanes,
    |s: &Seq<'_>, out: &mut [f32], scratch: &mut Vec<f32>| Tiled::enabled()
        .expect("tiled attention checked on")
        .attend_row_lanes(s, out, scratch)
);

fn have_tiled() -> bool {
    let on = Tiled::enabled().is_some();
    if !on {
        eprintln!("no AVX-512F here (or switched off): tiled attention not tested");
    }
    on
}

#[test]
fn sum_start_is_iterator_sum() {
    // The portable path's sums (`Iterator::sum` over f32) start from this value; the tiled
    // kernel's must too for its bits to be the portable path's.
    let start: f32 = std::iter::empty::<f32>().sum();
    assert_eq!(start.to_bits(), SUM_START.to_bits());
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
    /// dense f64 oracle within `TOL` and the portable path bit for bit, and every chunking
    /// (chunk 1 is decode) gives its one-shot result bit for bit.
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
        prop_assert!(
            port.iter().zip(&one_shot).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ctx}: tiled differs from the portable path"
        );
        let chunked = c.run_with(&mut r, chunk, window, tiled);
        prop_assert!(
            chunked.iter().zip(&one_shot).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ctx}: chunks of {chunk} differ from one shot"
        );
    }
}

#[test]
fn tiled_equals_portable_at_smollm2_shapes() {
    if !have_tiled() {
        return;
    }
    // SmolLM2-135M: 9 query heads over 3 kv heads of 64, 16-position blocks; a 128-token
    // prompt in one chunk and then in chunks of 48 and 1, a 4-token window too.
    let mut r = rng(7);
    let c = Case::new(&mut r, 130, 9, 3, 64, 16);
    for window in [None, Some(4)] {
        let port = c.run_with(&mut r, 130, window, portable);
        for chunk in [130, 48, 1] {
            let via = c.run_with(&mut r, chunk, window, paged_attention);
            let direct = c.run_with(&mut r, chunk, window, tiled);
            assert_eq!(via, direct, "dispatch, chunk {chunk}, window {window:?}");
            assert_eq!(
                direct, port,
                "tiled vs portable, chunk {chunk}, window {window:?}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Decode and short chunks (query rows ≤ `keys::MAX_ROWS`: the key-lane path) against the
    /// row-lane tile and the portable path, bit for bit, at GQA shapes, head sizes that do
    /// and do not fill 16 lanes or 8-term dot steps, block sizes and windows.
    #[test]
    fn key_lanes_equal_row_lanes_and_portable(
        heads in prop::sample::select(vec![(1usize, 1usize), (3, 3), (6, 2), (9, 3), (8, 1), (16, 4)]),
        d in prop::sample::select(vec![1usize, 5, 16, 20, 64, 72]),
        bs in prop::sample::select(vec![1usize, 4, 16]),
        seq in 1usize..90,
        window in prop::option::of(1usize..40),
        seed in any::<u64>(),
    ) {
        if !have_tiled() {
            return Ok(());
        }
        let (n_heads, nkv) = heads;
        let group = n_heads / nkv;
        let chunk = (super::keys::MAX_ROWS / group).max(1);
        prop_assert!(super::keys::fits(chunk * group, seq), "the key-lane path takes chunks of {chunk}");
        let mut r = rng(seed);
        let c = Case::new(&mut r, seq, n_heads, nkv, d, bs);
        let ctx = format!("heads {n_heads}/{nkv} d {d} bs {bs} seq {seq} window {window:?}");
        let port = c.run_with(&mut r, seq, window, portable);
        for ch in [1, chunk] {
            let keys = c.run_with(&mut r, ch, window, tiled);
            let rows = c.run_with(&mut r, ch, window, row_lanes);
            prop_assert!(
                keys.iter().zip(&rows).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ctx}: key lanes differ from row lanes in chunks of {ch}"
            );
            prop_assert!(
                keys.iter().zip(&port).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ctx}: key lanes differ from the portable path in chunks of {ch}"
            );
        }
    }
}
