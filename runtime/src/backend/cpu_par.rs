//! The CPU backend's compute threads: a persistent pool that splits one op over the cores
//! the CPU LoRA workers leave idle.
//!
//! The engine thread always does a share itself; `threads - 1` helper threads (spawned once,
//! pinned one per core after the engine's) take the others. When an adapter is cold the
//! workers spin on their cores, so the engine drops to one thread ([`ComputePool::set_active`])
//! and the helpers sleep: no core is ever asked to run a helper and a worker at once.
//!
//! Every split gives each part a disjoint output range and computes each output element with
//! the same arithmetic as the one-thread path, so results do not depend on the thread count.
use std::ops::Range;
use std::sync::Mutex;

use super::cpu_pool::Pool;
use crate::error::{Result, RuntimeError};

/// Most parts one op splits into (the pool's threads are capped to it).
const MAX_PARTS: usize = 32;

/// One part's work, taken by the thread that runs the part.
type Slot<T> = Mutex<Option<T>>;

/// How many compute threads a CPU backend uses, and whether to pin its helpers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuThreads {
    /// Threads including the engine's own (1 = single-threaded).
    pub threads: usize,
    /// Pin helper `i` to the `(i+1)`-th core of the process's affinity set (the engine
    /// thread keeps the first, as `thaw serve` pins it).
    pub pin: bool,
    /// Fewest multiply-adds (or attention score terms) worth handing to another thread;
    /// below it, waking a helper costs more than it saves. Tests set 1 to split every op.
    pub min_part_work: usize,
}

impl Default for CpuThreads {
    /// One thread per core this process may run on.
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            pin: true,
            min_part_work: 1 << 16,
        }
    }
}

impl CpuThreads {
    /// `threads` threads, unpinned, otherwise the defaults.
    pub fn unpinned(threads: usize) -> Self {
        Self {
            threads,
            pin: false,
            ..Self::default()
        }
    }
}

/// A fixed set of compute threads.
pub struct ComputePool {
    pool: Option<Pool>,
    max: usize,
    active: usize,
    min_part_work: usize,
}

impl std::fmt::Debug for ComputePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputePool")
            .field("max", &self.max)
            .field("active", &self.active)
            .finish()
    }
}

impl ComputePool {
    /// Spawns `cfg.threads - 1` helpers (none for one thread).
    pub fn new(cfg: CpuThreads) -> Result<Self> {
        let max = cfg.threads.max(1);
        if max == 1 {
            return Ok(Self::serial());
        }
        let min_part_work = cfg.min_part_work.max(1);
        let cores = if cfg.pin {
            core_affinity::get_core_ids().unwrap_or_default()
        } else {
            Vec::new()
        };
        let max = max.min(MAX_PARTS);
        let pool = Pool::new(max - 1, move |i| {
            // Helper i runs beside the engine thread (core 0 of the set), never on it.
            if cores.len() > 1 {
                core_affinity::set_for_current(cores[i % cores.len()]);
            }
        })
        .map_err(|e| {
            RuntimeError::Backend(format!(
                "cannot start {max} CPU compute threads ({e}); pass fewer threads"
            ))
        })?;
        Ok(Self {
            pool: Some(pool),
            max,
            active: max,
            min_part_work,
        })
    }

    /// The engine thread alone.
    pub fn serial() -> Self {
        Self {
            pool: None,
            max: 1,
            active: 1,
            min_part_work: usize::MAX,
        }
    }

    /// Threads ops split over now.
    pub fn active(&self) -> usize {
        self.active
    }

    /// Threads the pool has.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Splits later ops over `n` threads (clamped to `1..=max`): 1 while CPU LoRA workers
    /// compute on the other cores.
    pub fn set_active(&mut self, n: usize) {
        self.active = n.clamp(1, self.max);
        if self.active == 1 {
            if let Some(p) = &self.pool {
                p.park();
            }
        }
    }

    /// Parts to split `work` (multiply-adds or the like) into: each at least the pool's
    /// `min_part_work`, at most one per active thread.
    pub fn parts(&self, work: usize) -> usize {
        (work / self.min_part_work).clamp(1, self.active)
    }

    /// Runs `f(range, chunk)` for `parts` contiguous ranges covering `0..units` (sizes
    /// differ by at most `align`; starts are multiples of `align`), where `chunk` is
    /// `out[range.start * unit_len .. range.end * unit_len]`. Part 0 runs on the calling
    /// thread.
    pub fn split_mut<T: Send>(
        &self,
        units: usize,
        align: usize,
        parts: usize,
        out: &mut [T],
        unit_len: usize,
        f: impl Fn(Range<usize>, &mut [T]) + Sync,
    ) {
        let parts = parts.clamp(1, self.active);
        let pool = match &self.pool {
            Some(p) if parts > 1 => p,
            _ => return f(0..units, &mut out[..units * unit_len]),
        };
        let slots: [Slot<(Range<usize>, &mut [T])>; MAX_PARTS] =
            std::array::from_fn(|_| Mutex::new(None));
        let mut rest = &mut out[..units * unit_len];
        let mut n = 0;
        for (slot, r) in slots.iter().zip(ranges(units, align, parts)) {
            let (chunk, tail) = std::mem::take(&mut rest).split_at_mut(r.len() * unit_len);
            rest = tail;
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some((r, chunk));
            n += 1;
        }
        pool.run(n, &|p| {
            let part = slots[p].lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some((r, chunk)) = part {
                f(r, chunk);
            }
        });
    }

    /// Runs `f(g, chunk, state)` for each group `g`, where `chunk` is
    /// `out[bounds[g]..bounds[g + 1]]` and `state` is `states[g]` (one exclusive scratch per
    /// group); group 0 runs on the calling thread.
    pub fn groups_mut<T: Send, S: Send>(
        &self,
        out: &mut [T],
        bounds: &[usize],
        states: &mut [S],
        f: impl Fn(usize, &mut [T], &mut S) + Sync,
    ) {
        let groups = bounds.len().saturating_sub(1);
        assert!(states.len() >= groups, "groups_mut: a state per group");
        assert!(
            groups <= MAX_PARTS,
            "groups_mut: {groups} groups, at most {MAX_PARTS}"
        );
        if groups == 0 {
            return;
        }
        let pool = match &self.pool {
            Some(p) if groups > 1 && self.active > 1 => p,
            _ => {
                for g in 0..groups {
                    f(g, &mut out[bounds[g]..bounds[g + 1]], &mut states[g]);
                }
                return;
            }
        };
        let slots: [Slot<(&mut [T], &mut S)>; MAX_PARTS] =
            std::array::from_fn(|_| Mutex::new(None));
        let mut rest = &mut out[bounds[0]..bounds[groups]];
        for (g, (slot, st)) in slots.iter().zip(states[..groups].iter_mut()).enumerate() {
            let (chunk, tail) = std::mem::take(&mut rest).split_at_mut(bounds[g + 1] - bounds[g]);
            rest = tail;
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some((chunk, st));
        }
        let threads = pool.threads().min(self.active);
        pool.run(groups.min(threads), &|p| {
            // Part p takes groups p, p + threads, … (groups ≤ active threads in practice).
            for g in (p..groups).step_by(threads) {
                let item = slots[g].lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some((chunk, st)) = item {
                    f(g, chunk, st);
                }
            }
        });
    }
}

/// Rows per part above which a product splits by rows (each part a GEMM of its own rows)
/// rather than by output columns (see the kernel crate's note: column parts read and pack
/// only their share of the weight; both splits keep every part on the whole product's path,
/// so results match the one-thread path).
const ROW_SPLIT_MIN: usize = thaw_kernels::cpu::ROW_SPLIT_MIN;

/// `y[m, n] = x[m, k] · Wᵀ` split over the pool. `part(x_rows, m, cols, out)` computes output
/// columns `cols` for the `m` rows of `x_rows` into the packed `[m, cols.len()]` `out`.
/// Many rows split by rows; few rows by columns (for `m > 1` through `scratch`, then
/// scattered into `y`).
pub fn linear_split(
    pool: &ComputePool,
    scratch: &mut Vec<f32>,
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    y: &mut [f32],
    part: impl Fn(&[f32], usize, Range<usize>, &mut [f32]) + Sync,
) {
    let parts = pool.parts(m * k * n);
    if parts == 1 {
        return part(x, m, 0..n, y);
    }
    if m / parts > ROW_SPLIT_MIN {
        return pool.split_mut(m, 1, parts, y, n, |rows, out| {
            part(&x[rows.start * k..rows.end * k], rows.len(), 0..n, out)
        });
    }
    // Columns in multiples of 16 keep each part's rows of W cache-line aligned.
    const ALIGN: usize = 16;
    if m == 1 {
        return pool.split_mut(n, ALIGN, parts, y, 1, |cols, out| part(x, 1, cols, out));
    }
    if scratch.len() < m * n {
        scratch.resize(m * n, 0.0);
    }
    pool.split_mut(n, ALIGN, parts, scratch, m, |cols, out| {
        part(x, m, cols, out)
    });
    for cols in ranges(n, ALIGN, parts) {
        let packed = &scratch[cols.start * m..cols.end * m];
        for (i, src) in packed.chunks_exact(cols.len().max(1)).enumerate() {
            y[i * n + cols.start..i * n + cols.end].copy_from_slice(src);
        }
    }
}

/// `parts` contiguous ranges covering `0..units`, starts aligned to `align`, near-equal.
pub fn ranges(units: usize, align: usize, parts: usize) -> impl Iterator<Item = Range<usize>> {
    let align = align.max(1);
    let blocks = units.div_ceil(align);
    let parts = parts.clamp(1, blocks.max(1));
    (0..parts).map(move |p| {
        let lo = (blocks * p / parts * align).min(units);
        let hi = (blocks * (p + 1) / parts * align).min(units);
        lo..hi
    })
}

/// Splits `costs` (in order) into at most `parts` contiguous groups of similar total cost,
/// writing the `groups + 1` boundaries into `bounds` (first 0, last `costs.len()`).
pub fn balance(
    costs: impl ExactSizeIterator<Item = u64> + Clone,
    parts: usize,
    bounds: &mut Vec<usize>,
) {
    bounds.clear();
    bounds.push(0);
    let n = costs.len();
    let total: u64 = costs.clone().sum();
    let parts = parts.clamp(1, n.max(1)) as u64;
    let mut acc = 0u64;
    let mut next = 1u64;
    for (i, c) in costs.enumerate() {
        acc += c;
        // Close a group once it reaches its share of the total (keep ≥ 1 item per group).
        if next < parts && acc * parts >= total * next && i + 1 < n {
            bounds.push(i + 1);
            next += 1;
        }
    }
    if n > 0 {
        bounds.push(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The ranges tile `0..units` in order, aligned, with no gaps or overlaps.
        #[test]
        fn ranges_tile_exactly(units in 0usize..5000, align in 1usize..64, parts in 1usize..9) {
            let mut at = 0;
            for r in ranges(units, align, parts) {
                prop_assert_eq!(r.start, at);
                prop_assert!(r.start % align == 0 || r.start == units);
                at = r.end;
            }
            prop_assert_eq!(at, units);
        }

        /// Groups are contiguous, non-empty, at most `parts`, and cover every item once.
        #[test]
        fn balance_covers_every_item_once(costs in proptest::collection::vec(0u64..1000, 0..40), parts in 1usize..6) {
            let mut b = Vec::new();
            balance(costs.iter().copied(), parts, &mut b);
            if costs.is_empty() {
                prop_assert_eq!(b, vec![0]);
            } else {
                prop_assert_eq!(b[0], 0);
                prop_assert_eq!(*b.last().unwrap(), costs.len());
                prop_assert!(b.len() - 1 <= parts);
                prop_assert!(b.windows(2).all(|w| w[0] < w[1]));
            }
        }
    }

    /// Every element is written by exactly one part, whatever the thread count.
    #[test]
    fn split_mut_writes_each_unit_once() {
        for threads in [1, 2, 3] {
            let pool = ComputePool::new(CpuThreads::unpinned(threads)).unwrap();
            let (units, unit_len) = (1000, 3);
            let mut out = vec![0u32; units * unit_len];
            pool.split_mut(units, 8, threads, &mut out, unit_len, |r, chunk| {
                assert_eq!(chunk.len(), r.len() * unit_len);
                for (i, c) in chunk.iter_mut().enumerate() {
                    *c += (r.start * unit_len + i) as u32 + 1;
                }
            });
            let want: Vec<u32> = (1..=(units * unit_len) as u32).collect();
            assert_eq!(out, want, "{threads} threads");
        }
    }

    /// Split products equal the one-thread product bit for bit, for decode (1 row), small
    /// batches and prompt chunks up to `ROW_SPLIT_MIN` rows a part (column split + scatter,
    /// packed GEMM per column range above 16 rows) and the largest (row split), at 2 and 3
    /// threads.
    #[test]
    fn linear_split_matches_one_thread_bitwise() {
        use thaw_kernels::cpu::{linear, GemmShape};
        let mut rnd = crate::backend::test_values(7);
        for threads in [2, 3] {
            let pool = ComputePool::new(CpuThreads {
                min_part_work: 1,
                ..CpuThreads::unpinned(threads)
            })
            .unwrap();
            let mut scratch = Vec::new();
            for (m, k, n) in [
                (1, 64, 100),
                (5, 33, 70),
                (16, 64, 48),
                (17, 40, 31),
                (70, 96, 130),
                (200, 24, 40),
                (400, 16, 24),
            ] {
                let (x, w) = (rnd(m * k), rnd(n * k));
                let mut want = vec![0.0; m * n];
                linear(&x, &w, &mut want, GemmShape { m, k, n }, false);
                let mut got = vec![f32::NAN; m * n];
                linear_split(
                    &pool,
                    &mut scratch,
                    &x,
                    (m, k, n),
                    &mut got,
                    |x, m, c, o| {
                        let s = GemmShape { m, k, n: c.len() };
                        linear(x, &w[c.start * k..c.end * k], o, s, false);
                    },
                );
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{threads} threads, shape {m}x{k}x{n}");
            }
        }
    }

    #[test]
    fn set_active_clamps() {
        let mut pool = ComputePool::new(CpuThreads {
            min_part_work: 4,
            ..CpuThreads::unpinned(2)
        })
        .unwrap();
        pool.set_active(0);
        assert_eq!(pool.active(), 1);
        assert_eq!(pool.parts(100), 1);
        pool.set_active(9);
        assert_eq!(pool.active(), 2);
        assert_eq!(pool.parts(10), 2);
        assert_eq!(pool.parts(3), 1);
    }
}
