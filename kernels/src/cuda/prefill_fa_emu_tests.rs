//! `attention_prefill_fa.cu`'s index arithmetic replayed on the CPU, line for line, thread by
//! thread (review h29rev): the cp.async staging (every chunk of a stage written once, inside the
//! dynamic shared memory the host passes, reading only the key's own 16-byte-aligned row of its
//! KV head in a paged cache), the double-buffer protocol (no stage refilled while a warp may read
//! it, every tile's copies landed before it is read, the last tile included), and the Q loads and
//! output stores (every (row, head, value) of a launch read and written exactly once, by the
//! block of its own KV head). The fragment layouts themselves are `prefill_fa_plan_tests.rs`'.
use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

/// 16-byte chunks (8 values) of one key's head row.
fn chunks16(hd: usize) -> usize {
    hd / 8
}

/// The kernel's `kv_offset`: the first element of position `pos`'s row in a paged cache.
fn kv_offset(table: &[u32], pos: usize, block_size: usize, token_len: usize) -> usize {
    (table[pos / block_size] as usize * block_size + pos % block_size) * token_len
}

/// One `stage(c0, st)` call of the whole block: for every thread, every cp.async it issues as
/// (shared element of the K copy, shared element of the V copy, global element or None when
/// zero-filled). Mirrors the lambda: `idx = threadIdx.x; idx < KC · HD/8; idx += blockDim.x`.
fn stage_copies(
    hd: usize,
    threads: usize,
    (c0, st, last): (usize, usize, usize),
    at: impl Fn(usize) -> usize,
) -> Vec<(usize, usize, Option<usize>)> {
    let ks = hd + PAD;
    let stage = 2 * KEY_TILE * ks;
    let mut out = Vec::new();
    for tid in 0..threads {
        let mut idx = tid;
        while idx < KEY_TILE * chunks16(hd) {
            let (kk, d8) = (idx / chunks16(hd), (idx % chunks16(hd)) * 8);
            let p = c0 + kk;
            let k_sh = st * stage + kk * ks + d8;
            let v_sh = k_sh + KEY_TILE * ks;
            out.push((k_sh, v_sh, (p <= last).then(|| at(p) + d8)));
            idx += threads;
        }
    }
    out
}

proptest! {
    /// Every 16-byte chunk of K and V of a stage is written exactly once per `stage` call
    /// (zero-filled past the tile's last position, so no stale value meets a zero P), inside the
    /// stage and inside `smem_bytes`; every global chunk read is 16-byte aligned, lies in the
    /// key's own row of the block's KV head (never across a page) and inside the cache.
    #[test]
    fn staging_writes_each_chunk_once_and_reads_only_the_keys_rows(
        hd in prop::sample::select(HEAD_DIMS.to_vec()),
        hpb in 1usize..=MAX_WARPS / ROW_WARPS,
        block_size in prop::sample::select(vec![1usize, 3, 8, 16, 32]),
        n_kv in 1usize..5,
        pos0 in 0usize..300,
        nq in 1usize..=Q_TILE,
        window in prop::sample::select(vec![0usize, 1, 17, 64, 65, 200]),
        seed in 0u64..1_000,
    ) {
        let threads = 32 * ROW_WARPS * hpb;
        let kvh = (seed as usize) % n_kv;
        let token_len = n_kv * hd;
        let last = pos0 + nq - 1;
        // A scattered block table covering positions 0 ..= last, pages in a larger pool.
        let pages = last / block_size + 1;
        let pool = 2 * pages + 3;
        let table: Vec<u32> = (0..pages).map(|i| ((i * 7 + seed as usize) % pool) as u32).collect();
        let cache_len = pool * block_size * token_len;
        let smem_elems = smem_bytes(hd) / 2;
        let stage_elems = 2 * KEY_TILE * (hd + PAD);
        let row_of = |p: usize| kv_offset(&table, p, block_size, token_len) + kvh * hd;
        for c0 in key_tiles(pos0, nq, window) {
            for st in 0..2 {
                let copies = stage_copies(hd, threads, (c0, st, last), row_of);
                let mut seen: HashMap<usize, u32> = HashMap::new();
                for (k_sh, v_sh, src) in copies {
                    for sh in [k_sh, v_sh] {
                        *seen.entry(sh).or_default() += 1;
                        prop_assert!(sh + 8 <= smem_elems && sh % 8 == 0);
                        prop_assert!(sh >= st * stage_elems && sh + 8 <= (st + 1) * stage_elems);
                    }
                    if let Some(g) = src {
                        prop_assert_eq!(g % 8, 0, "16-byte aligned source");
                        prop_assert!(g + 8 <= cache_len);
                        let key = (k_sh - st * stage_elems) / (hd + PAD);
                        let row = row_of(c0 + key);
                        prop_assert!(g >= row && g + 8 <= row + hd, "inside the key's head row");
                    }
                }
                // K and V: KEY_TILE rows of hd / 8 chunks each, once.
                prop_assert_eq!(seen.len(), 2 * KEY_TILE * chunks16(hd));
                prop_assert!(seen.values().all(|&n| n == 1));
            }
        }
    }
}

/// What the block does, in program order, as one thread sees it (the loop is block-uniform).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ev {
    /// cp.async of key tile `tile` into stage `stage`, then its commit.
    Issue {
        stage: usize,
        tile: usize,
    },
    /// `cp.async.wait_group n`.
    Wait(usize),
    Barrier,
    /// Some warps read stage `stage` as key tile `tile` (ldmatrix).
    Read {
        stage: usize,
        tile: usize,
    },
}

/// The kernel's key loop for `n_kt` tiles, transcribed.
fn kernel_trace(n_kt: usize) -> Vec<Ev> {
    let mut t = vec![Ev::Issue { stage: 0, tile: 0 }];
    for it in 0..n_kt {
        if it + 1 < n_kt {
            t.push(Ev::Issue {
                stage: (it + 1) & 1,
                tile: it + 1,
            });
            t.push(Ev::Wait(1));
        } else {
            t.push(Ev::Wait(0));
        }
        t.push(Ev::Barrier);
        t.push(Ev::Read {
            stage: it & 1,
            tile: it,
        });
        t.push(Ev::Barrier);
    }
    t
}

/// Every read finds its tile's group complete on every thread (waited, then a barrier) and no
/// copy of another tile in flight into the stage it reads; no copy is issued into a stage that
/// a warp may still be reading (a barrier between the last read of a stage and its refill); no
/// copy is left in flight when the block exits.
#[test]
fn the_double_buffer_never_reads_a_stage_in_flight_or_refills_one_being_read() {
    for n_kt in 1..=9 {
        let trace = kernel_trace(n_kt);
        // Groups in commit order: (stage, tile, waited by this thread, then seen by a barrier).
        let mut groups: Vec<(usize, usize, bool, bool)> = Vec::new();
        // Per stage: whether a read happened with no barrier after it yet.
        let mut read_open = [false; 2];
        let mut contents: [Option<usize>; 2] = [None; 2];
        let mut reads = Vec::new();
        for ev in trace {
            match ev {
                Ev::Issue { stage, tile } => {
                    assert!(
                        !read_open[stage],
                        "n_kt {n_kt}: refill of stage {stage} while read"
                    );
                    groups.push((stage, tile, false, false));
                    contents[stage] = Some(tile);
                }
                Ev::Wait(n) => {
                    let done = groups.len().saturating_sub(n);
                    groups.iter_mut().take(done).for_each(|g| g.2 = true);
                }
                Ev::Barrier => {
                    read_open = [false; 2];
                    groups.iter_mut().filter(|g| g.2).for_each(|g| g.3 = true);
                }
                Ev::Read { stage, tile } => {
                    assert_eq!(
                        contents[stage],
                        Some(tile),
                        "n_kt {n_kt}: stage holds another tile"
                    );
                    for &(s, t, _, visible) in &groups {
                        if s == stage {
                            // Every copy into this stage so far is this tile's or an older
                            // one's, and all of them landed and were fenced by a barrier.
                            assert!(t <= tile && visible, "n_kt {n_kt}: tile {t} in flight");
                        }
                    }
                    read_open[stage] = true;
                    reads.push(tile);
                }
            }
        }
        assert_eq!(
            reads,
            (0..n_kt).collect::<Vec<_>>(),
            "every tile read once, in order"
        );
        assert!(
            groups.iter().all(|g| g.2),
            "n_kt {n_kt}: a copy outlives the block"
        );
    }
}

proptest! {
    /// Over a whole launch (every tile, block row, warp, lane), every (row, query head, value)
    /// of the step's prefill rows is read from q exactly once and written to out exactly once;
    /// rows past a tile are neither read nor written; each warp's head belongs to the KV head
    /// whose K/V its block stages.
    #[test]
    fn q_and_out_cover_every_row_head_and_value_once(
        n_kv in 1usize..4,
        group in prop::sample::select(vec![1usize, 2, 3, 4, 6, 8]),
        hd in prop::sample::select(HEAD_DIMS.to_vec()),
        lens in prop::collection::vec(1usize..150, 1..4),
        sharing in prop::sample::select(vec![HeadSharing::One, HeadSharing::Most]),
    ) {
        let n_heads = n_kv * group;
        // The step's tiles: each prompt cut into Q_TILE-row tiles over consecutive rows.
        let mut tiles = Vec::new();
        let mut row0 = 0;
        for &len in &lens {
            for start in (0..len).step_by(Q_TILE) {
                tiles.push((row0 + start, (len - start).min(Q_TILE)));
            }
            row0 += len;
        }
        let rows = row0;
        let l = FaLaunch { head_dim: hd, n_heads, n_kv_heads: n_kv, n_tiles: tiles.len(), sharing };
        let p = plan(&l).expect("served");
        let mut q_reads = vec![0u8; rows * n_heads * hd];
        let mut writes = vec![0u8; rows * n_heads * hd];
        for bx in 0..p.grid.0 as usize {
            let t = tiles.len() - 1 - bx;
            let (row0, nq) = tiles[t];
            for by in 0..p.grid.1 as usize {
                let chunks = group / p.heads_per_block;
                let kvh = by / chunks;
                for warp in 0..p.threads as usize / 32 {
                    let (h, r0) = warp_rows(group, p.heads_per_block, by, warp);
                    prop_assert_eq!(h / group, kvh);
                    for lane in 0..32 {
                        let (g, c) = (lane >> 2, lane & 3);
                        for i in 0..2 {
                            let qi = r0 + g + 8 * i;
                            if qi >= nq {
                                continue;
                            }
                            let base = ((row0 + qi) * n_heads + h) * hd;
                            // Q: kk, j as the kernel's A-fragment loop (float2 loads).
                            for kk in 0..hd / 16 {
                                for j in (0..4).filter(|j| j & 1 == i) {
                                    let col = kk * 16 + 2 * c + 8 * (j >> 1);
                                    prop_assert_eq!((base + col) % 2, 0, "float2 alignment");
                                    q_reads[base + col] += 1;
                                    q_reads[base + col + 1] += 1;
                                }
                            }
                            // out: fa_store2 at n · 8 + 2c of row g + 8i.
                            for n in 0..hd / 8 {
                                writes[base + n * 8 + 2 * c] += 1;
                                writes[base + n * 8 + 2 * c + 1] += 1;
                            }
                        }
                    }
                }
            }
        }
        prop_assert!(q_reads.iter().all(|&n| n == 1), "every q element read once");
        prop_assert!(writes.iter().all(|&n| n == 1), "every out element written once");
    }
}
