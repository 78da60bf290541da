use super::super::registry::{source_of, ATTENTION_PREFILL_FA};
use super::*;
use proptest::prelude::*;

#[test]
fn the_constants_are_the_sources_defines() {
    let define = |name| super::super::registry::define(ATTENTION_PREFILL_FA.source, name);
    assert_eq!(define("THAW_FA_KC"), KEY_TILE as u64);
    assert_eq!(define("THAW_FA_PAD"), PAD as u64);
    assert_eq!(define("THAW_FA_Q"), Q_TILE as u64);
    assert_eq!(define("THAW_FA_ROW_WARPS"), ROW_WARPS as u64);
    assert_eq!(define("THAW_FA_MAX_WARPS"), MAX_WARPS as u64);
    // The step metadata is cut once, for whichever tensor-core kernel runs.
    assert_eq!(Q_TILE, prefill_tc_plan::tile_rows(true));
}

#[test]
fn every_served_shape_has_a_registered_entry_point_and_its_16_bit_twin() {
    for kv in DType::ALL {
        for hd in [16, 32, 64, 80, 96, 128, 256] {
            let fa = entry_point(kv, hd);
            assert_eq!(fa.is_some(), prefill_tc_plan::entry_point(kv, hd).is_some());
            if let Some(e) = fa {
                let out = format!("{e}_out_{}", kv.suffix());
                for name in [&e, &out] {
                    assert_eq!(
                        source_of(name).map(|k| k.name),
                        Some("attention_prefill_fa"),
                        "{name}"
                    );
                }
            }
        }
    }
    assert_eq!(
        entry_point(DType::Bf16, 128).as_deref(),
        Some("attn_prefill_fa128_bf16")
    );
    assert_eq!(entry_point(DType::F32, 64), None);
}

#[test]
fn shared_memory_fits_and_only_head_dim_128_opts_in() {
    assert_eq!(smem_bytes(128), 69_632);
    assert_eq!(smem_bytes(64), 36_864);
    assert_eq!(smem_bytes(32), 20_480);
    for hd in HEAD_DIMS {
        assert!(smem_bytes(hd) <= MAX_SMEM_SM80, "head_dim {hd}");
        assert_eq!(needs_smem_opt_in(hd), hd == 128, "head_dim {hd}");
        // 16-byte cp.async chunks and ldmatrix rows: padded rows stay 16-byte aligned.
        assert_eq!((hd + PAD) * 2 % 16, 0);
        assert_eq!(hd % 16, 0, "the Q·Kᵀ mma steps head_dim by 16");
    }
    // Two blocks of the widest head a SM on sm_80 (164 KiB a SM).
    assert!(2 * smem_bytes(128) <= 164 * 1024);
    assert_eq!(KEY_TILE % 16, 0, "P·V takes keys 16 at a time");
}

/// The shared-memory bank (32 banks of 4 bytes) of a byte offset.
fn bank(byte: usize) -> usize {
    (byte / 4) % 32
}

/// An ldmatrix phase reads one 8×8 matrix: 8 rows of 16 bytes at the padded row stride. Each
/// must cover 32 distinct banks, wherever the matrix starts (a 16-byte column offset).
#[test]
fn ldmatrix_phases_are_bank_conflict_free() {
    for hd in HEAD_DIMS {
        let stride = (hd + PAD) * 2;
        for col16 in 0..hd / 8 {
            let banks: std::collections::HashSet<usize> = (0..8)
                .flat_map(|row| (0..4).map(move |w| bank(row * stride + col16 * 16 + 4 * w)))
                .collect();
            assert_eq!(banks.len(), 32, "head_dim {hd}, column chunk {col16}");
        }
    }
}

/// PTX's `ldmatrix.sync.aligned.m8n8.x4{.trans}.b16` on a tile: lanes 8i .. 8i + 7 give the
/// (row, column) where row r of matrix i starts (8 values along the row); register i of lane
/// 4g + c holds that matrix's elements (g, 2c), (g, 2c + 1), or with `.trans` (2c, g),
/// (2c + 1, g), the first in the low half. `addr` is the lane's address, `at` reads the tile.
fn ldmatrix(
    addr: impl Fn(usize) -> (usize, usize),
    at: impl Fn(usize, usize) -> u32,
    trans: bool,
) -> Vec<[(u32, u32); 4]> {
    (0..32)
        .map(|lane| {
            let (g, c) = (lane / 4, lane % 4);
            std::array::from_fn(|i| {
                let elem = |r: usize, j: usize| {
                    let (row, col) = addr(8 * i + r);
                    at(row, col + j)
                };
                if trans {
                    (elem(2 * c, g), elem(2 * c + 1, g))
                } else {
                    (elem(g, 2 * c), elem(g, 2 * c + 1))
                }
            })
        })
        .collect()
}

/// The kernel's ldmatrix addressing gives exactly the mma.m16n8k16 B fragments (lane 4g + c:
/// reg 0 = B[k 2c, 2c + 1][n g], reg 1 = B[k 2c + 8, 2c + 9][n g]) of Kᵀ for S = Q·Kᵀ
/// (B[k = value][n = key] = K[key][value]) and of V for P·V (B[k = key][n = value]), with K and
/// V both stored [key][value]: no transpose in shared memory.
#[test]
fn ldmatrix_addresses_give_the_mma_b_fragments() {
    // A tile whose every element names its own (row, column).
    let at = |row: usize, col: usize| (row * 1000 + col) as u32;
    for hd in HEAD_DIMS {
        for np in 0..KEY_TILE / 16 {
            for kk in 0..hd / 16 {
                let regs = ldmatrix(|l| k_ldsm(l, np, kk), at, false);
                for (lane, r) in regs.iter().enumerate() {
                    let (g, c) = (lane / 4, lane % 4);
                    // Score tile 2np + t: keys 16np + 8t + g; values 16kk + 2c (+8).
                    for t in 0..2 {
                        let key = np * 16 + 8 * t + g;
                        for h in 0..2 {
                            let d = kk * 16 + 8 * h + 2 * c;
                            assert_eq!(r[2 * t + h], (at(key, d), at(key, d + 1)), "K lane {lane}");
                        }
                    }
                }
            }
        }
        for kk in 0..KEY_TILE / 16 {
            for dp in 0..hd / 16 {
                let regs = ldmatrix(|l| v_ldsm(l, kk, dp), at, true);
                for (lane, r) in regs.iter().enumerate() {
                    let (g, c) = (lane / 4, lane % 4);
                    // Output tile 2dp + t: value 16dp + 8t + g; keys 16kk + 2c (+8).
                    for t in 0..2 {
                        let d = dp * 16 + 8 * t + g;
                        for h in 0..2 {
                            let key = kk * 16 + 8 * h + 2 * c;
                            assert_eq!(r[2 * t + h], (at(key, d), at(key + 1, d)), "V lane {lane}");
                        }
                    }
                }
            }
        }
        // Every address stays in the tile and is 16-byte aligned in the padded row.
        for lane in 0..32 {
            for (row, col) in [
                k_ldsm(lane, KEY_TILE / 16 - 1, hd / 16 - 1),
                v_ldsm(lane, KEY_TILE / 16 - 1, hd / 16 - 1),
            ] {
                assert!(row < KEY_TILE && col + 8 <= hd);
                assert_eq!((row * (hd + PAD) + col) * 2 % 16, 0);
            }
        }
    }
}

/// A launch of `n_tiles` tiles over `n_heads` / `n_kv` heads of `head_dim`, sharing `sharing`.
fn launch(head_dim: usize, (n_heads, n_kv): (usize, usize), n_tiles: usize) -> FaLaunch {
    FaLaunch {
        head_dim,
        n_heads,
        n_kv_heads: n_kv,
        n_tiles,
        sharing: HeadSharing::Auto,
    }
}

#[test]
fn plans_for_llama_shapes() {
    // Llama-7B-shape (32 / 8 heads of 128), 2048 tokens = 32 tiles: two heads a block.
    let p = plan(&launch(128, (32, 8), 32)).unwrap();
    assert_eq!(p.heads_per_block, 2);
    assert_eq!((p.threads, p.grid, p.smem), (256, (32, 16, 1), 69_632));
    // A short prompt (2 tiles): one head a block, twice the blocks, unless forced.
    assert_eq!(plan(&launch(128, (32, 8), 2)).unwrap().heads_per_block, 1);
    let most = FaLaunch {
        sharing: HeadSharing::Most,
        ..launch(128, (32, 8), 2)
    };
    assert_eq!(plan(&most).unwrap().heads_per_block, 2);
    let one = FaLaunch {
        sharing: HeadSharing::One,
        ..launch(128, (32, 8), 32)
    };
    assert_eq!(plan(&one).unwrap().heads_per_block, 1);
    // Groups of 1 and 7: one head a block.
    assert_eq!(plan(&launch(64, (32, 32), 100)).unwrap().heads_per_block, 1);
    assert_eq!(plan(&launch(64, (28, 4), 100)).unwrap().heads_per_block, 1);
    // Declined: no instantiation, heads the KV heads do not divide, no tile.
    assert_eq!(plan(&launch(96, (32, 8), 32)), None);
    assert_eq!(plan(&launch(128, (30, 8), 32)), None);
    assert_eq!(plan(&launch(128, (32, 8), 0)), None);
}

/// The kernel's key walk on the CPU for one query head, as the block runs it: the tiles of
/// [`key_tiles`], the warps' [`warp_skips`], masking only where [`warp_masks`] says (an
/// unmasked tile takes every key of it, so a wrong `warp_masks` shows as a wrong output), S in
/// f32 with queries scaled and rounded to bf16, the online softmax per tile, P rounded to bf16.
fn emulate(
    q: &[f32],
    (k, v): (&[f32], &[f32]),
    d: usize,
    (pos0, window): (usize, usize),
    scale: f32,
) -> Vec<f32> {
    let r16 = crate::cuda::tile_oracle::bf16_round;
    let nq = q.len() / d;
    let n = k.len() / d;
    let qs: Vec<f32> = q.iter().map(|x| r16(x * scale)).collect();
    let mut out = vec![0.0; q.len()];
    let (mut m, mut l) = (vec![f32::NEG_INFINITY; nq], vec![0.0f32; nq]);
    for c0 in key_tiles(pos0, nq, window) {
        for qi in 0..nq {
            let r0 = qi / 16 * 16;
            if warp_skips(pos0, nq, window, r0, c0) {
                continue;
            }
            let masks = warp_masks(pos0, nq, window, r0, c0);
            let pos = pos0 + qi;
            let s: Vec<f32> = (c0..c0 + KEY_TILE)
                .map(|key| {
                    if masks && (key > pos || key < first_key(pos, window)) {
                        return f32::NEG_INFINITY;
                    }
                    // Keys past the cache are zero-filled (the kernel's cp.async src-size 0).
                    let kr = if key < n {
                        &k[key * d..][..d]
                    } else {
                        &[0.0; 128][..d]
                    };
                    qs[qi * d..][..d].iter().zip(kr).map(|(a, b)| a * b).sum()
                })
                .collect();
            let o = &mut out[qi * d..][..d];
            crate::cuda::tile_oracle::online_step(&s, (&mut m[qi], &mut l[qi]), o, v, c0);
        }
    }
    crate::cuda::tile_oracle::normalise(&mut out, &l, d);
    out
}

proptest! {
    /// Every query head is served by exactly one (block row, warp group) of its own KV head,
    /// every row of the tile by one warp of it; blocks fit the kernel's launch bounds.
    #[test]
    fn every_head_and_row_is_served_once(
        n_kv in 1usize..9,
        group in prop::sample::select(vec![1usize, 2, 3, 4, 5, 6, 7, 8]),
        n_tiles in 1usize..80,
        hd in prop::sample::select(HEAD_DIMS.to_vec()),
        sharing in prop::sample::select(vec![HeadSharing::Auto, HeadSharing::One, HeadSharing::Most]),
    ) {
        prop_assert_eq!(MAX_WARPS / ROW_WARPS, 2, "the most heads a block serves");
        let n_heads = n_kv * group;
        let l = FaLaunch { sharing, ..launch(hd, (n_heads, n_kv), n_tiles) };
        let p = plan(&l).expect("served");
        let hpb = p.heads_per_block;
        prop_assert!(group.is_multiple_of(hpb));
        prop_assert_eq!(p.threads as usize, 32 * ROW_WARPS * hpb);
        prop_assert!(p.threads as usize <= 32 * MAX_WARPS);
        prop_assert_eq!(p.grid.0 as usize, n_tiles);
        // Sharing as asked: never with One, whenever the group allows with Most, and with Auto
        // only where the grid stays wide enough.
        let most = if group.is_multiple_of(2) { 2 } else { 1 };
        match sharing {
            HeadSharing::One => prop_assert_eq!(hpb, 1),
            HeadSharing::Most => prop_assert_eq!(hpb, most),
            HeadSharing::Auto => {
                let wide = n_tiles * n_heads / most >= MIN_SHARED_BLOCKS;
                prop_assert_eq!(hpb, if wide { most } else { 1 });
            }
        }
        let mut served = vec![0u32; n_heads * Q_TILE];
        for by in 0..p.grid.1 as usize {
            for w in 0..p.threads as usize / 32 {
                let (h, r0) = warp_rows(group, hpb, by, w);
                prop_assert!(h < n_heads);
                prop_assert_eq!(h / group, by / (group / hpb), "head {} reads its KV head", h);
                for r in r0..r0 + 16 {
                    served[h * Q_TILE + r] += 1;
                }
            }
        }
        prop_assert!(served.iter().all(|&s| s == 1));
    }

    /// Every (row, attended key) pair lies in exactly one walked tile that the row's warp does
    /// not skip; a warp skips only tiles none of its rows attends; a tile a warp does not mask
    /// holds only keys every one of its 16 rows attends (all of them in the tile's rows).
    #[test]
    fn the_key_walk_covers_every_attended_key_once_and_masks_where_needed(
        pos0 in 0usize..300,
        nq in 1usize..=Q_TILE,
        window in prop::sample::select(vec![0usize, 1, 7, 63, 64, 65, 100]),
    ) {
        let tiles: Vec<usize> = key_tiles(pos0, nq, window).collect();
        let attends = |qi: usize, key: usize| {
            qi < nq && key <= pos0 + qi && key >= first_key(pos0 + qi, window)
        };
        for qi in 0..nq {
            let r0 = qi / 16 * 16;
            for key in first_key(pos0 + qi, window)..=pos0 + qi {
                let walked: Vec<usize> =
                    tiles.iter().copied().filter(|&c0| c0 <= key && key < c0 + KEY_TILE).collect();
                prop_assert_eq!(walked.len(), 1, "row {} key {}", qi, key);
                prop_assert!(!warp_skips(pos0, nq, window, r0, walked[0]));
            }
        }
        for &c0 in &tiles {
            for r0 in (0..Q_TILE).step_by(16) {
                let any = (r0..r0 + 16).any(|qi| (c0..c0 + KEY_TILE).any(|k| attends(qi, k)));
                prop_assert_eq!(warp_skips(pos0, nq, window, r0, c0), !any);
                if !warp_skips(pos0, nq, window, r0, c0) && !warp_masks(pos0, nq, window, r0, c0) {
                    let all = (r0..r0 + 16).all(|qi| (c0..c0 + KEY_TILE).all(|k| attends(qi, k)));
                    prop_assert!(all, "unmasked tile {} of warp row {}", c0, r0);
                }
            }
        }
    }

    /// The kernel's algorithm, emulated with its roundings and its mask skipping, is within
    /// DESIGN §9's bf16 tolerance (1e-2 normwise) of the CPU oracle on the same bf16 cache.
    #[test]
    fn the_walk_matches_the_oracle_within_bf16_tolerance(
        pos0 in 0usize..200,
        nq in 1usize..=Q_TILE,
        window in prop::sample::select(vec![0usize, 7, 70]),
        d in prop::sample::select(HEAD_DIMS.to_vec()),
        seed in 0u64..1_000,
    ) {
        let t = crate::cuda::tile_oracle::Tile::random(seed, pos0, nq, d);
        let got = emulate(&t.q, (&t.k, &t.v), d, (pos0, window), t.scale);
        let e = t.error(&got, window);
        prop_assert!(e <= 1e-2, "rel err {}", e);
    }
}
