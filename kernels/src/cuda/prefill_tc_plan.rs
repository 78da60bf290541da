//! Launch geometry of `attention_prefill_tc.cu` (issue 29), prefill attention on the tensor
//! cores, as pure functions: which (KV dtype, head_dim) it serves, the query tile the step
//! metadata must be cut into, its grid and its static shared memory.
//!
//! The kernel multiplies 16-bit operands (`mma.sync.m16n8k16`, bf16 or f16, f32 accumulators),
//! so it serves a bf16 or f16 KV cache; an f32 cache keeps `attention.cu`'s f32 kernel (rounding
//! its queries and keys to 16 bits would break the f32 parity tolerance). Its head_dim is a
//! template parameter: 32 (small test models), 64 and 128 (Llama, Mistral, Qwen) are
//! compiled; any other keeps the classic kernel.
use super::registry::{shape, DType};

/// `THAW_TC_WARPS`: warps per block, 16 query rows each.
pub const WARPS: usize = 4;
/// `THAW_TC_Q`: query rows per block (the prefill tile the metadata is cut into).
pub const Q_TILE: usize = 16 * WARPS;
/// `THAW_TC_KC`: keys staged in shared memory per step of the key loop.
pub const KEY_TILE: usize = 32;
/// `THAW_TC_PAD`: 16-bit elements of padding per shared-memory row (bank-conflict-free
/// fragment loads).
pub const PAD: usize = 8;
/// Head dims with a compiled instantiation.
pub const HEAD_DIMS: [usize; 3] = [32, 64, 128];
/// The static shared memory a block may declare (sm_80 and sm_90, no opt-in).
pub const STATIC_SMEM_LIMIT: usize = 48 * 1024;

/// The entry point for a cache of `kv` with heads of `head_dim`, or `None` when the tensor-core
/// kernel does not serve it (the classic prefill runs).
pub fn entry_point(kv: DType, head_dim: usize) -> Option<String> {
    let s = match kv {
        DType::Bf16 | DType::F16 => kv.suffix(),
        DType::F32 => return None,
    };
    HEAD_DIMS
        .contains(&head_dim)
        .then(|| format!("attn_prefill_tc{head_dim}_{s}"))
}

/// Rows per prefill tile in the step metadata: [`Q_TILE`] when the tensor-core kernel runs,
/// else `attention.cu`'s [`shape::PREFILL_Q`].
pub fn tile_rows(tensor_cores: bool) -> usize {
    if tensor_cores {
        Q_TILE
    } else {
        shape::PREFILL_Q
    }
}

/// Static shared memory of one block, bytes: the query tile and the key tile as
/// `[row][head_dim + PAD]`, the value tile transposed as `[head_dim][KEY_TILE + PAD]`, 2 bytes
/// each.
pub fn smem_bytes(head_dim: usize) -> usize {
    2 * ((Q_TILE + KEY_TILE) * (head_dim + PAD) + head_dim * (KEY_TILE + PAD))
}

/// f32 registers of one thread's accumulators: the output tile (16 × head_dim per warp) and one
/// key tile's scores (16 × KEY_TILE), in the m16n8 C layout (4 per n8 tile).
pub fn accumulator_regs(head_dim: usize) -> usize {
    4 * (head_dim / 8) + 4 * (KEY_TILE / 8)
}

/// The grid of one launch: (tiles, query heads); [`WARPS`] · 32 threads a block.
pub fn grid(n_tiles: usize, n_heads: usize) -> (u32, u32, u32) {
    (n_tiles as u32, n_heads as u32, 1)
}

/// The first key of every key tile one block walks for a tile of `nq` query rows at positions
/// `pos0 ..` (the kernel's loop): from the first row's first attended key (0, or
/// `pos0 + 1 - window` with a sliding window) to the last row's position, [`KEY_TILE`] apart.
pub fn key_tiles(pos0: usize, nq: usize, window: usize) -> impl Iterator<Item = usize> {
    let lo = first_key(pos0, window);
    (lo..pos0 + nq).step_by(KEY_TILE)
}

/// Whether warp `warp` of a tile skips the key tile starting at `c0` (the kernel's
/// warp-uniform test): it has no row, or none of its rows attends to a key of that tile.
pub fn warp_skips(pos0: usize, nq: usize, window: usize, warp: usize, c0: usize) -> bool {
    let r0 = 16 * warp;
    if r0 >= nq {
        return true;
    }
    let hi = (pos0 + r0 + 15).min(pos0 + nq - 1);
    c0 > hi || c0 + KEY_TILE - 1 < first_key(pos0 + r0, window)
}

/// The first key a query at `pos` attends to.
fn first_key(pos: usize, window: usize) -> usize {
    if window > 0 {
        (pos + 1).saturating_sub(window)
    } else {
        0
    }
}

/// Multiply-add work of causal prefill attention for `n` query rows continuing a prefix of
/// `start` positions, per head: Σ_t (start + t + 1) keys, each a head_dim dot product (Q·Kᵀ)
/// and a head_dim axpy (P·V), 2 flops per multiply-add. What the benchmark divides by.
pub fn causal_flops(start: usize, n: usize, n_heads: usize, head_dim: usize) -> f64 {
    let keys: f64 = (0..n).map(|t| (start + t + 1) as f64).sum();
    4.0 * keys * head_dim as f64 * n_heads as f64
}

#[cfg(test)]
mod tests {
    use super::super::registry::{ATTENTION_PREFILL_TC, KERNELS};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_constants_are_the_sources_defines() {
        let define = |name| super::super::registry::define(ATTENTION_PREFILL_TC.source, name);
        assert_eq!(define("THAW_TC_WARPS"), WARPS as u64);
        assert_eq!(define("THAW_TC_Q"), Q_TILE as u64);
        assert_eq!(define("THAW_TC_KC"), KEY_TILE as u64);
        assert_eq!(define("THAW_TC_PAD"), PAD as u64);
    }

    #[test]
    fn every_served_shape_has_a_listed_entry_point() {
        let listed: Vec<&str> = KERNELS
            .iter()
            .flat_map(|k| k.entry_points.iter().copied())
            .collect();
        for kv in DType::ALL {
            for hd in [16, 32, 64, 80, 96, 128, 256] {
                match entry_point(kv, hd) {
                    Some(e) => {
                        assert!(kv != DType::F32 && HEAD_DIMS.contains(&hd));
                        assert!(listed.contains(&e.as_str()), "{e} is not in the registry");
                    }
                    None => assert!(kv == DType::F32 || !HEAD_DIMS.contains(&hd)),
                }
            }
        }
        assert_eq!(
            entry_point(DType::Bf16, 128).as_deref(),
            Some("attn_prefill_tc128_bf16")
        );
        assert_eq!(entry_point(DType::F32, 128), None);
        assert_eq!(entry_point(DType::F16, 256), None);
    }

    #[test]
    fn tiles_and_shared_memory_fit_the_hardware() {
        // Warps own 16-row mma tiles; keys go 16 at a time through the P·V mma, 8 per S tile.
        assert_eq!(Q_TILE % 16, 0);
        assert_eq!(KEY_TILE % 16, 0);
        // The metadata's tiles fit the block, and are never smaller than the classic ones.
        assert!(tile_rows(true) <= Q_TILE && tile_rows(true) >= shape::PREFILL_Q);
        assert_eq!(tile_rows(false), shape::PREFILL_Q);
        for hd in HEAD_DIMS {
            assert_eq!(hd % 16, 0, "the QKᵀ mma steps head_dim by 16");
            // 16-byte staging loads: rows of 8 elements, padded rows stay 16-byte aligned.
            assert_eq!(hd % 8, 0);
            assert_eq!((hd + PAD) * 2 % 16, 0);
            assert!(
                smem_bytes(hd) <= STATIC_SMEM_LIMIT,
                "head_dim {hd}: {} bytes",
                smem_bytes(hd)
            );
            // Room for several blocks per SM (228 KiB on sm_90, 164 KiB on sm_80).
            assert!(smem_bytes(hd) * 4 <= 164 * 1024);
            // Accumulators leave registers for the query fragments (4 · head_dim / 16) and
            // addressing under the 255 a thread may use.
            assert!(accumulator_regs(hd) + hd / 4 <= 128);
        }
        assert_eq!(smem_bytes(128), 36_352);
        assert_eq!(smem_bytes(64), 18_944);
        assert_eq!(smem_bytes(32), 10_240);
        assert_eq!(grid(5, 32), (5, 32, 1));
    }

    /// The shared-memory bank (32 banks of 4 bytes) of a byte offset.
    fn bank(byte: usize) -> usize {
        (byte / 4) % 32
    }

    /// The kernel's shared-memory accesses are free of bank conflicts: each warp's mma fragment
    /// loads (lane 4g + c reads 4 bytes at row g, column 2c of a qs / ks / vt tile) touch 32
    /// distinct banks, and each quarter-warp's 16-byte K staging stores (8 consecutive keys,
    /// one column chunk) cover 32 distinct banks.
    #[test]
    fn shared_memory_accesses_are_bank_conflict_free() {
        assert_eq!(
            KEY_TILE, 32,
            "one staging column chunk per warp of 32 lanes"
        );
        for hd in HEAD_DIMS {
            let (row, vrow) = ((hd + PAD) * 2, (KEY_TILE + PAD) * 2);
            for stride in [row, vrow] {
                let banks: std::collections::HashSet<usize> = (0..32)
                    .map(|lane| bank((lane / 4) * stride + 4 * (lane % 4)))
                    .collect();
                assert_eq!(
                    banks.len(),
                    32,
                    "head_dim {hd}: fragment loads, stride {stride}"
                );
            }
            for kk0 in (0..KEY_TILE).step_by(8) {
                let banks: std::collections::HashSet<usize> = (kk0..kk0 + 8)
                    .flat_map(|kk| (0..16).step_by(4).map(move |b| bank(kk * row + b)))
                    .collect();
                assert_eq!(banks.len(), 32, "head_dim {hd}: K stores of keys {kk0}..");
            }
        }
    }

    #[test]
    fn flops_count_the_causal_triangle() {
        // 2 rows at positions 0, 1: 1 + 2 keys · 4 · head_dim.
        assert_eq!(causal_flops(0, 2, 1, 8), 3.0 * 4.0 * 8.0);
        // A chunk after a prefix of 10: keys 11 + 12.
        assert_eq!(causal_flops(10, 2, 2, 8), 23.0 * 4.0 * 8.0 * 2.0);
    }

    use crate::cuda::tile_oracle::{bf16_round, normalise, online_step};

    /// The kernel's arithmetic on the CPU for one query head: the tile's queries scaled and
    /// rounded to bf16, the key loop of [`key_tiles`] with [`warp_skips`], S in f32, the online
    /// softmax per key tile, P rounded to bf16 before P·V, f32 accumulators. Keys and values
    /// `[pos0 + nq, d]` are already bf16 values (the cache).
    fn emulate(
        q: &[f32],
        (k, v): (&[f32], &[f32]),
        d: usize,
        (pos0, window): (usize, usize),
        scale: f32,
    ) -> Vec<f32> {
        let nq = q.len() / d;
        let qs: Vec<f32> = q.iter().map(|x| bf16_round(x * scale)).collect();
        let mut out = vec![0.0; q.len()];
        let mut m = vec![f32::NEG_INFINITY; nq];
        let mut l = vec![0.0f32; nq];
        for c0 in key_tiles(pos0, nq, window) {
            for qi in 0..nq {
                if warp_skips(pos0, nq, window, qi / 16, c0) {
                    continue;
                }
                let pos = pos0 + qi;
                let s: Vec<f32> = (c0..c0 + KEY_TILE)
                    .map(|key| {
                        if key > pos || key < first_key(pos, window) {
                            return f32::NEG_INFINITY;
                        }
                        let kr = &k[key * d..(key + 1) * d];
                        qs[qi * d..(qi + 1) * d]
                            .iter()
                            .zip(kr)
                            .map(|(a, b)| a * b)
                            .sum()
                    })
                    .collect();
                let o = &mut out[qi * d..(qi + 1) * d];
                online_step(&s, (&mut m[qi], &mut l[qi]), o, v, c0);
            }
        }
        normalise(&mut out, &l, d);
        out
    }

    proptest! {
        /// The kernel's algorithm, emulated on the CPU with its roundings, is within DESIGN §9's
        /// bf16 tolerance (1e-2 normwise) of the CPU oracle on the same bf16 cache.
        #[test]
        fn the_tile_algorithm_matches_the_oracle_within_bf16_tolerance(
            pos0 in 0usize..200,
            nq in 1usize..=Q_TILE,
            window in prop::sample::select(vec![0usize, 7, 40]),
            d in prop::sample::select(HEAD_DIMS.to_vec()),
            seed in 0u64..1_000,
        ) {
            let t = crate::cuda::tile_oracle::Tile::random(seed, pos0, nq, d);
            let got = emulate(&t.q, (&t.k, &t.v), d, (pos0, window), t.scale);
            let e = t.error(&got, window);
            prop_assert!(e <= 1e-2, "rel err {}", e);
        }

        /// Every (query row, attended key) pair of a tile lies in exactly one key tile the
        /// block walks, and the row's warp does not skip that tile; a warp skips only tiles
        /// none of its rows attends to.
        #[test]
        fn the_key_loop_covers_every_attended_key_once(
            pos0 in 0usize..300,
            nq in 1usize..=Q_TILE,
            window in prop::sample::select(vec![0usize, 1, 7, 31, 32, 33, 100]),
        ) {
            let tiles: Vec<usize> = key_tiles(pos0, nq, window).collect();
            for qi in 0..nq {
                let pos = pos0 + qi;
                let warp = qi / 16;
                for key in first_key(pos, window)..=pos {
                    let walked: Vec<usize> = tiles
                        .iter()
                        .copied()
                        .filter(|&c0| c0 <= key && key < c0 + KEY_TILE)
                        .collect();
                    prop_assert_eq!(walked.len(), 1, "row {} key {}", qi, key);
                    prop_assert!(!warp_skips(pos0, nq, window, warp, walked[0]));
                }
            }
            for &c0 in &tiles {
                for warp in 0..WARPS {
                    let attends = (16 * warp..(16 * warp + 16).min(nq)).any(|qi| {
                        let pos = pos0 + qi;
                        (c0..c0 + KEY_TILE).any(|k| k >= first_key(pos, window) && k <= pos)
                    });
                    prop_assert_eq!(warp_skips(pos0, nq, window, warp, c0), !attends);
                }
            }
        }

        #[test]
        fn fresh_prompts_cost_about_half_the_square(
            n in 1usize..4096,
            heads in 1usize..64,
        ) {
            let f = causal_flops(0, n, heads, 128);
            let square = 4.0 * (n * n) as f64 * 128.0 * heads as f64;
            prop_assert!(f >= square / 2.0 && f <= square);
        }
    }
}
