//! Launch geometry of `attention_prefill_fa.cu` (issue 29, opt-in with `THAW_CUDA_PREFILL_FA=1`),
//! the FlashAttention-2-style prefill attention on the tensor cores, as pure functions: which
//! (KV dtype, head_dim) it serves, how many query heads of a GQA group one block serves, its
//! grid, its dynamic shared memory, and the key walk each warp does (which tiles it skips, which
//! it masks).
//!
//! It serves what [`prefill_tc_plan`] serves (a bf16 or f16 cache, head_dim 32, 64 or 128) and
//! reads the same step metadata: tiles of [`Q_TILE`] query rows, the tensor-core kernel's.
//! A block serves one tile for [`FaPlan::heads_per_block`] query heads of one KV head, so each
//! K/V tile it stages serves all of them; [`ROW_WARPS`] warps per head, 16 rows each
//! ([`HeadSharing`] says how many: the backend's [`HeadSharing::Auto`], or one / the most for
//! benchmarks and tests).
use super::prefill_tc_plan;
use super::registry::DType;

/// `THAW_FA_KC`: keys per shared-memory stage (two stages, K and V each).
pub const KEY_TILE: usize = 64;
/// `THAW_FA_PAD`: 16-bit elements of padding per shared row (conflict-free ldmatrix).
pub const PAD: usize = 8;
/// `THAW_FA_Q`: query rows per tile: the tensor-core kernel's, so both read one metadata.
pub const Q_TILE: usize = prefill_tc_plan::Q_TILE;
/// `THAW_FA_ROW_WARPS`: warps per query head (16 rows of the tile each).
pub const ROW_WARPS: usize = Q_TILE / 16;
/// `THAW_FA_MAX_WARPS`: the most warps a block runs (its `__launch_bounds__`): two query heads
/// a block. Four heads (16 warps) would cap a thread at 128 registers, under the head_dim-128
/// kernel's ~180 (the output tile, the Q fragments and a key tile's scores live in registers).
pub const MAX_WARPS: usize = 8;
/// Head dims with a compiled instantiation (the tensor-core kernel's).
pub const HEAD_DIMS: [usize; 3] = prefill_tc_plan::HEAD_DIMS;
/// Dynamic shared memory a block may use without raising the function's limit.
pub const DEFAULT_SMEM_LIMIT: usize = 48 * 1024;
/// The most dynamic shared memory a block may opt into on the oldest device served (sm_80,
/// A100: 163 KiB; sm_90 allows 227 KiB).
pub const MAX_SMEM_SM80: usize = 163 * 1024;
/// Blocks a launch should have before two query heads share a block: about two per SM of an
/// H100 (132 SMs). Under it (short prompts) a block serves one head, so the grid keeps twice
/// the blocks to spread over the SMs; K/V traffic matters less than idle SMs there.
pub const MIN_SHARED_BLOCKS: usize = 264;

/// The entry point for a cache of `kv` with heads of `head_dim`, or `None` when the kernel does
/// not serve it (the tensor-core kernel's rule: a 16-bit cache, a compiled head_dim).
pub fn entry_point(kv: DType, head_dim: usize) -> Option<String> {
    prefill_tc_plan::entry_point(kv, head_dim).map(|tc| tc.replace("_tc", "_fa"))
}

/// Dynamic shared memory of one block, bytes: two stages of a K and a V tile, each
/// `[KEY_TILE][head_dim + PAD]` 16-bit values. Independent of the heads a block serves.
pub fn smem_bytes(head_dim: usize) -> usize {
    2 * 2 * KEY_TILE * (head_dim + PAD) * 2
}

/// Whether the host must raise `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` before a
/// launch (head_dim 128: 69,632 bytes).
pub fn needs_smem_opt_in(head_dim: usize) -> bool {
    smem_bytes(head_dim) > DEFAULT_SMEM_LIMIT
}

/// One launch's shape.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FaPlan {
    /// Query heads one block serves (of one KV head): a divisor of the GQA group.
    pub heads_per_block: usize,
    /// Threads per block: [`ROW_WARPS`] warps per head.
    pub threads: u32,
    /// (tiles, KV heads · group / heads_per_block, 1).
    pub grid: (u32, u32, u32),
    /// Dynamic shared memory, bytes ([`smem_bytes`]).
    pub smem: u32,
}

/// How many query heads of a GQA group one block serves.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum HeadSharing {
    /// The most that divide the group and fit [`MAX_WARPS`], while the grid keeps
    /// [`MIN_SHARED_BLOCKS`] blocks (else one): what the backend runs.
    #[default]
    Auto,
    /// One head a block: no K/V tile shared between heads (benchmarks compare against it).
    One,
    /// The most that divide the group and fit [`MAX_WARPS`], however small the grid (tests:
    /// the shared path at any prompt length).
    Most,
}

/// What one prefill attention launch must serve.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FaLaunch {
    pub head_dim: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads (GQA: `n_heads` is a multiple).
    pub n_kv_heads: usize,
    /// Metadata tiles of at most [`Q_TILE`] query rows.
    pub n_tiles: usize,
    pub sharing: HeadSharing,
}

/// The shape of launch `l`, or `None` where the kernel declines (a head_dim without an
/// instantiation, a head count the KV heads do not divide, nothing to do): the tensor-core
/// kernel then runs. Any group size works: one that only 1 divides (7, 5) runs one head a
/// block.
pub fn plan(l: &FaLaunch) -> Option<FaPlan> {
    if !HEAD_DIMS.contains(&l.head_dim)
        || l.n_kv_heads == 0
        || l.n_tiles == 0
        || !l.n_heads.is_multiple_of(l.n_kv_heads)
    {
        return None;
    }
    let group = l.n_heads / l.n_kv_heads;
    let wide = |d: usize| l.n_tiles * l.n_heads / d >= MIN_SHARED_BLOCKS;
    let hpb = (1..=MAX_WARPS / ROW_WARPS)
        .rev()
        .find(|&d| {
            group.is_multiple_of(d)
                && match l.sharing {
                    HeadSharing::Auto => d == 1 || wide(d),
                    HeadSharing::One => d == 1,
                    HeadSharing::Most => true,
                }
        })
        .unwrap_or(1);
    Some(FaPlan {
        heads_per_block: hpb,
        threads: (32 * ROW_WARPS * hpb) as u32,
        grid: (l.n_tiles as u32, (l.n_heads / hpb) as u32, 1),
        smem: smem_bytes(l.head_dim) as u32,
    })
}

/// The query head and the tile's first row warp `warp` of block row `block_y` serves (the
/// kernel's mapping), for a GQA `group` and `hpb` heads a block.
pub fn warp_rows(group: usize, hpb: usize, block_y: usize, warp: usize) -> (usize, usize) {
    let chunks = group / hpb;
    let head = (block_y / chunks) * group + (block_y % chunks) * hpb + warp / ROW_WARPS;
    (head, 16 * (warp % ROW_WARPS))
}

/// The first key of every key tile a block walks for a tile of `nq` rows at positions
/// `pos0 ..`: from the first row's first attended key to the last row's position.
pub fn key_tiles(pos0: usize, nq: usize, window: usize) -> impl Iterator<Item = usize> {
    (first_key(pos0, window)..pos0 + nq).step_by(KEY_TILE)
}

/// Whether the warp whose first row is `r0` skips the key tile at `c0` (the kernel's
/// warp-uniform test): it has no row, or none of its rows attends to a key of the tile.
pub fn warp_skips(pos0: usize, nq: usize, window: usize, r0: usize, c0: usize) -> bool {
    if r0 >= nq {
        return true;
    }
    let hi = pos0 + (r0 + 15).min(nq - 1);
    c0 > hi || c0 + KEY_TILE - 1 < first_key(pos0 + r0, window)
}

/// Whether that warp masks the tile (else it takes every key of it for each of its 16 rows):
/// a key past its first row's position (causal, and the zero-filled keys past the tile's last
/// position), a key before its last row's window start, or rows past the tile.
pub fn warp_masks(pos0: usize, nq: usize, window: usize, r0: usize, c0: usize) -> bool {
    let rl = (r0 + 15).min(nq - 1);
    c0 + KEY_TILE - 1 > pos0 + r0 || c0 < first_key(pos0 + rl, window) || r0 + 16 > nq
}

/// The (key row, head_dim column) of the shared K tile that lane `lane` addresses in the
/// kernel's `ldmatrix.x4` for keys `16 np ..` and head_dim values `16 kk ..` (`krow`): lanes
/// `8i .. 8i + 7` give the rows of matrix i, (keys +0 | +8) × (values +0 | +8) as i / 2, i % 2,
/// so registers 0, 1 are the mma B fragment of score tile 2np and 2, 3 that of 2np + 1.
pub fn k_ldsm(lane: usize, np: usize, kk: usize) -> (usize, usize) {
    let (mi, mr) = (lane >> 3, lane & 7);
    (np * 16 + ((mi >> 1) << 3) + mr, kk * 16 + ((mi & 1) << 3))
}

/// The (key row, head_dim column) of the shared V tile that lane `lane` addresses in the
/// kernel's `ldmatrix.x4.trans` for keys `16 kk ..` and head_dim values `16 dp ..` (`vrow`):
/// (keys +0 | +8) × (values +0 | +8) as i % 2, i / 2, so registers 0, 1 are the B fragment of
/// output tile 2dp and 2, 3 that of 2dp + 1.
pub fn v_ldsm(lane: usize, kk: usize, dp: usize) -> (usize, usize) {
    let (mi, mr) = (lane >> 3, lane & 7);
    (kk * 16 + ((mi & 1) << 3) + mr, dp * 16 + ((mi >> 1) << 3))
}

/// The first key a query at `pos` attends to.
fn first_key(pos: usize, window: usize) -> usize {
    if window > 0 {
        (pos + 1).saturating_sub(window)
    } else {
        0
    }
}

#[cfg(test)]
#[path = "prefill_fa_plan_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "prefill_fa_emu_tests.rs"]
mod emu_tests;

#[cfg(test)]
#[path = "prefill_fa_lane_tests.rs"]
mod lane_tests;
