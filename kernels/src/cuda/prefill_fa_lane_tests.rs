//! `attention_prefill_fa.cu` replayed lane by lane on the CPU (review h29rev): each warp's
//! registers as the kernel holds them — Q's A fragments, the ldmatrix / ldmatrix.trans B
//! fragments at the kernel's addresses, the m16n8k16 products gathered and scattered through the
//! PTX fragment layouts, the mask at `key = c0 + 8n + 2c + (e & 1)` of row `g + 8 (e >> 1)`, the
//! quad shuffles, the exp2 online softmax with its -inf guard, P packed from the S accumulators —
//! over the kernel's key walk, skips and mask choices (its own expressions, not the plan's), then
//! compared with the CPU oracle. A wrong register index, lane formula or mask shows here as a
//! wrong output; bf16 rounding of Q and P bounds the error (1e-2 normwise, DESIGN §9).
// The loops index registers as the kernel's `#pragma unroll` loops do, on purpose.
#![allow(clippy::needless_range_loop)]
use super::*;
use proptest::prelude::*;

// bf16 round to nearest even, as `fa_pack` / `cvt.rn.bf16x2.f32`.
use crate::cuda::tile_oracle::bf16_round as r16;

/// One mma register: two 16-bit values, low half first.
type Reg = [f32; 2];

/// `ldmatrix.x4` (`trans` for `.trans`): lanes 8i .. 8i + 7 give the (row, column) of matrix
/// i's rows (`addr`); lane 4g + c gets, per matrix, (g, 2c), (g, 2c + 1), or transposed
/// (2c, g), (2c + 1, g).
fn ldsm4(tile: &[Vec<f32>], addr: impl Fn(usize) -> (usize, usize), trans: bool) -> Vec<[Reg; 4]> {
    (0..32)
        .map(|lane| {
            let (g, c) = (lane / 4, lane % 4);
            std::array::from_fn(|i| {
                let at = |r: usize, j: usize| {
                    let (row, col) = addr(8 * i + r);
                    tile[row][col + j]
                };
                if trans {
                    [at(2 * c, g), at(2 * c + 1, g)]
                } else {
                    [at(g, 2 * c), at(g, 2 * c + 1)]
                }
            })
        })
        .collect()
}

/// `mma.m16n8k16.row.col` on the warp: `d[lane] += A · B` with A from `a[lane]` (reg0 (g, 2c),
/// reg1 (g + 8, 2c), reg2 (g, 2c + 8), reg3 (g + 8, 2c + 8)), B from `b[lane]` (reg0 k 2c, reg1
/// k 2c + 8, column g), C / D as (g, 2c..), (g + 8, 2c..).
fn mma(d: &mut [[f32; 4]], a: &[[Reg; 4]], b: &[[Reg; 2]]) {
    let (mut am, mut bm) = ([[0.0f32; 16]; 16], [[0.0f32; 8]; 16]);
    for lane in 0..32 {
        let (g, c) = (lane / 4, lane % 4);
        for j in 0..2 {
            am[g][2 * c + j] = a[lane][0][j];
            am[g + 8][2 * c + j] = a[lane][1][j];
            am[g][2 * c + 8 + j] = a[lane][2][j];
            am[g + 8][2 * c + 8 + j] = a[lane][3][j];
            bm[2 * c + j][g] = b[lane][0][j];
            bm[2 * c + 8 + j][g] = b[lane][1][j];
        }
    }
    let dot = |r: usize, n: usize| (0..16).map(|k| am[r][k] * bm[k][n]).sum::<f32>();
    for (lane, dl) in d.iter_mut().enumerate() {
        let (g, c) = (lane / 4, lane % 4);
        for j in 0..2 {
            dl[j] += dot(g, 2 * c + j);
            dl[2 + j] += dot(g + 8, 2 * c + j);
        }
    }
}

/// One query head's tile (`nq` rows at `pos0 ..`) as the kernel computes it, over a contiguous
/// cache `k`, `v` of `[pos0 + nq, d]` (paging: prefill_fa_emu_tests.rs).
fn kernel_tile(
    q: &[f32],
    (k, v): (&[f32], &[f32]),
    d: usize,
    pos0: usize,
    window: usize,
    scale: f32,
) -> Vec<f32> {
    const L2E: f32 = std::f32::consts::LOG2_E;
    let nq = q.len() / d;
    let last = pos0 + nq - 1;
    let first = |pos: usize| {
        if window > 0 {
            (pos + 1).saturating_sub(window)
        } else {
            0
        }
    };
    let lo = first(pos0);
    let n_kt = (last - lo) / KEY_TILE + 1;
    let mut out = vec![f32::NAN; nq * d];
    for r0 in (0..Q_TILE).step_by(16) {
        // Per lane: Q fragments, O, and the FaRows of rows g, g + 8.
        let row_ok = |lane: usize, i: usize| r0 + lane / 4 + 8 * i < nq;
        let qf: Vec<Vec<[Reg; 4]>> = (0..d / 16)
            .map(|kk| {
                (0..32)
                    .map(|lane| {
                        let (g, c) = (lane / 4, lane % 4);
                        std::array::from_fn(|j| {
                            let (i, col) = (j & 1, kk * 16 + 2 * c + 8 * (j >> 1));
                            let qi = r0 + g + 8 * i;
                            let x = |e| {
                                if row_ok(lane, i) {
                                    q[qi * d + col + e]
                                } else {
                                    0.0
                                }
                            };
                            [r16(x(0) * scale), r16(x(1) * scale)]
                        })
                    })
                    .collect()
            })
            .collect();
        let mut o = vec![vec![[0.0f32; 4]; 32]; d / 8];
        let (mut m, mut l) = ([[f32::NEG_INFINITY; 2]; 32], [[0.0f32; 2]; 32]);
        let rl = (r0 + 15).min(nq.saturating_sub(1));
        let (w_any, w_hi, w_lo, w_lo_max) =
            (r0 < nq, pos0 + rl, first(pos0 + r0), first(pos0 + rl));
        for it in 0..n_kt {
            let c0 = lo + it * KEY_TILE;
            let c1 = c0 + KEY_TILE - 1;
            if !(w_any && c0 <= w_hi && c1 >= w_lo) {
                continue;
            }
            let masked = c1 > pos0 + r0 || c0 < w_lo_max || r0 + 16 > nq;
            // The stage: keys past `last` zero-filled.
            let tile = |src: &[f32]| -> Vec<Vec<f32>> {
                (0..KEY_TILE)
                    .map(|kk| {
                        (0..d)
                            .map(|j| {
                                if c0 + kk <= last {
                                    src[(c0 + kk) * d + j]
                                } else {
                                    0.0
                                }
                            })
                            .collect()
                    })
                    .collect()
            };
            let (ks, vs) = (tile(k), tile(v));
            let mut s = vec![vec![[0.0f32; 4]; 32]; KEY_TILE / 8];
            for kk in 0..d / 16 {
                for np in 0..KEY_TILE / 16 {
                    let b = ldsm4(&ks, |l| k_ldsm(l, np, kk), false);
                    let b01: Vec<[Reg; 2]> = b.iter().map(|r| [r[0], r[1]]).collect();
                    let b23: Vec<[Reg; 2]> = b.iter().map(|r| [r[2], r[3]]).collect();
                    mma(&mut s[2 * np], &qf[kk], &b01);
                    mma(&mut s[2 * np + 1], &qf[kk], &b23);
                }
            }
            let mut mt = [[f32::NEG_INFINITY; 2]; 32];
            for lane in 0..32 {
                let c = lane % 4;
                for (n, sn) in s.iter_mut().enumerate() {
                    for e in 0..4 {
                        let i = e >> 1;
                        if masked {
                            let key = c0 + n * 8 + 2 * c + (e & 1);
                            let pos = pos0 + r0 + lane / 4 + 8 * i;
                            let ok = row_ok(lane, i) && key <= pos && key >= first(pos);
                            if !ok {
                                sn[lane][e] = f32::NEG_INFINITY;
                            }
                        }
                        mt[lane][i] = mt[lane][i].max(sn[lane][e]);
                    }
                }
            }
            // The quad's max (shuffles over lane bits 0 and 1), corr and the new running max.
            let mut ml = [[0.0f32; 2]; 32];
            let mut corr = [[0.0f32; 2]; 32];
            for lane in 0..32 {
                for i in 0..2 {
                    let quad = (0..4)
                        .map(|x| mt[(lane & !3) | x][i])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let mn = m[lane][i].max(quad);
                    corr[lane][i] = if mn == f32::NEG_INFINITY {
                        1.0
                    } else {
                        ((m[lane][i] - mn) * L2E).exp2()
                    };
                    ml[lane][i] = mn * L2E;
                    m[lane][i] = mn;
                    l[lane][i] *= corr[lane][i];
                }
            }
            for sn in s.iter_mut() {
                for lane in 0..32 {
                    for e in 0..4 {
                        let i = e >> 1;
                        let mut p = sn[lane][e].mul_add(L2E, -ml[lane][i]).exp2();
                        if masked && sn[lane][e] == f32::NEG_INFINITY {
                            p = 0.0;
                        }
                        sn[lane][e] = p;
                        l[lane][i] += p;
                    }
                }
            }
            for on in o.iter_mut() {
                for lane in 0..32 {
                    for e in 0..4 {
                        on[lane][e] *= corr[lane][e >> 1];
                    }
                }
            }
            for kk in 0..KEY_TILE / 16 {
                let pa: Vec<[Reg; 4]> = (0..32)
                    .map(|lane| {
                        let p = |n: usize, e: usize| [r16(s[n][lane][e]), r16(s[n][lane][e + 1])];
                        [
                            p(2 * kk, 0),
                            p(2 * kk, 2),
                            p(2 * kk + 1, 0),
                            p(2 * kk + 1, 2),
                        ]
                    })
                    .collect();
                for dp in 0..d / 16 {
                    let b = ldsm4(&vs, |l| v_ldsm(l, kk, dp), true);
                    let b01: Vec<[Reg; 2]> = b.iter().map(|r| [r[0], r[1]]).collect();
                    let b23: Vec<[Reg; 2]> = b.iter().map(|r| [r[2], r[3]]).collect();
                    mma(&mut o[2 * dp], &pa, &b01);
                    mma(&mut o[2 * dp + 1], &pa, &b23);
                }
            }
        }
        // The quad's row sums, then out = O / l for rows in the tile.
        for lane in 0..32 {
            let (g, c) = (lane / 4, lane % 4);
            for i in 0..2 {
                if !row_ok(lane, i) {
                    continue;
                }
                let sum: f32 = (0..4).map(|x| l[(lane & !3) | x][i]).sum();
                let qi = r0 + g + 8 * i;
                for (n, on) in o.iter().enumerate() {
                    out[qi * d + n * 8 + 2 * c] = on[lane][2 * i] / sum;
                    out[qi * d + n * 8 + 2 * c + 1] = on[lane][2 * i + 1] / sum;
                }
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The lane-level replay is within the bf16 tolerance of the oracle, for causal tiles that
    /// continue a prefix, partial tiles, sliding windows (each edge case of the mask choice).
    #[test]
    fn the_lane_replay_matches_the_oracle(
        pos0 in prop_oneof![0usize..20, 50usize..140],
        nq in prop_oneof![1usize..20, 40usize..=Q_TILE],
        window in prop::sample::select(vec![0usize, 1, 16, 64, 65, 90]),
        d in prop::sample::select(HEAD_DIMS.to_vec()),
        seed in 0u64..1_000,
    ) {
        let t = crate::cuda::tile_oracle::Tile::random(seed, pos0, nq, d);
        let got = kernel_tile(&t.q, (&t.k, &t.v), d, pos0, window, t.scale);
        prop_assert!(got.iter().all(|x| x.is_finite()), "every row stored, no NaN");
        let e = t.error(&got, window);
        prop_assert!(e <= 1e-2, "rel err {}", e);
    }
}
