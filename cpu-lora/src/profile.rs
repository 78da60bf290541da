//! Profiling-guided parallelisation (CaraServe §4.2, done per step): each worker's speed
//! per (rank, shape, dtype), measured at start-up through the real IPC path and refreshed
//! after every step (EWMA over the compute time the worker itself measured), and the split
//! of a step's rows across workers that equalises their predicted finish times.

use std::ops::Range;

use thaw_ipc::DType;

use crate::kernel::{flops, LoraProblem};

/// What a worker's speed is keyed by: one module's adapter shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShapeKey {
    /// Adapter rank.
    pub rank: u32,
    /// Input features.
    pub d_in: u32,
    /// Output features.
    pub d_out: u32,
    /// Stored dtype of the weights.
    pub dtype: DType,
}

impl ShapeKey {
    /// Flops per row (`2 · rank · (d_in + d_out)`).
    pub fn flops_per_row(&self) -> f64 {
        flops(&LoraProblem {
            rows: 1,
            d_in: self.d_in as usize,
            d_out: self.d_out as usize,
            rank: self.rank as usize,
            scale: 1.0,
        })
    }
}

/// Keys remembered per worker (least recently updated replaced first).
const KEYS: usize = 64;
/// Flop rate assumed before any measurement (flops per ns = GFLOP/s).
const DEFAULT_GFLOPS: f64 = 4.0;

#[derive(Debug, Clone)]
struct WorkerProfile {
    /// Flops per ns over everything measured (EWMA): the estimate for unseen shapes.
    gflops: f64,
    measured: bool,
    /// (key, ns per row, last update tick).
    keys: Vec<(ShapeKey, f64, u64)>,
}

/// Per-worker speed model. Plain data: unit- and property-testable without processes.
#[derive(Debug, Clone)]
pub struct Profile {
    workers: Vec<WorkerProfile>,
    alpha: f64,
    tick: u64,
}

impl Profile {
    /// A profile of `workers` workers, all assumed equally fast; `alpha` is the EWMA weight
    /// of a new measurement (0..=1).
    pub fn new(workers: usize, alpha: f64) -> Self {
        let w = WorkerProfile {
            gflops: DEFAULT_GFLOPS,
            measured: false,
            keys: Vec::with_capacity(KEYS),
        };
        Self {
            workers: vec![w; workers],
            alpha: alpha.clamp(0.0, 1.0),
            tick: 0,
        }
    }

    /// Predicted ns per row of `key` on worker `w`.
    pub fn ns_per_row(&self, w: usize, key: ShapeKey) -> f64 {
        let p = &self.workers[w];
        match p.keys.iter().find(|k| k.0 == key) {
            Some(k) => k.1,
            None => key.flops_per_row() / p.gflops,
        }
    }

    /// Measured or estimated rows per millisecond of `key` on worker `w`.
    pub fn rows_per_ms(&self, w: usize, key: ShapeKey) -> f64 {
        1e6 / self.ns_per_row(w, key)
    }

    /// Worker `w`'s flop rate (GFLOP/s) over its measurements.
    pub fn gflops(&self, w: usize) -> f64 {
        self.workers[w].gflops
    }

    /// Feeds one step of worker `w`: it computed `usage` ((key, rows) pairs) in
    /// `measured_ns`. The time is attributed to the keys in proportion to their predicted
    /// cost, and each key's ns/row moves toward the measurement by `alpha` (the first
    /// measurement of a key replaces its estimate).
    pub fn observe(&mut self, w: usize, usage: &[(ShapeKey, u32)], measured_ns: u64) {
        let predicted: f64 = usage
            .iter()
            .map(|&(k, r)| self.ns_per_row(w, k) * f64::from(r))
            .sum();
        let work: f64 = usage
            .iter()
            .map(|&(k, r)| k.flops_per_row() * f64::from(r))
            .sum();
        if predicted <= 0.0 || measured_ns == 0 || work <= 0.0 {
            return;
        }
        let ratio = measured_ns as f64 / predicted;
        self.tick += 1;
        let (alpha, tick) = (self.alpha, self.tick);
        for &(key, rows) in usage {
            if rows == 0 {
                continue;
            }
            let est = self.ns_per_row(w, key);
            let p = &mut self.workers[w];
            match p.keys.iter_mut().find(|k| k.0 == key) {
                Some(k) => {
                    k.1 = est * (1.0 - alpha + alpha * ratio);
                    k.2 = tick;
                }
                None => {
                    let entry = (key, est * ratio, tick);
                    if p.keys.len() < KEYS {
                        p.keys.push(entry);
                    } else if let Some(old) = p.keys.iter_mut().min_by_key(|k| k.2) {
                        *old = entry;
                    }
                }
            }
        }
        let p = &mut self.workers[w];
        let rate = work / measured_ns as f64;
        p.gflops = if p.measured {
            p.gflops * (1.0 - alpha) + rate * alpha
        } else {
            rate
        };
        p.measured = true;
    }
}

impl Profile {
    /// Makes worker `w` look `factor` (< 1) times cheaper: called for a worker that got no
    /// rows although the step had enough for everyone, so a pessimistic estimate (a noisy
    /// calibration, a since-finished neighbour) cannot starve it of the measurements that
    /// would correct it.
    pub fn forgive(&mut self, w: usize, factor: f64) {
        let p = &mut self.workers[w];
        for k in &mut p.keys {
            k.1 *= factor;
        }
        p.gflops /= factor;
    }
}

/// Splits `rows` of one job across candidate workers so that their predicted finish times
/// (current `loads` in ns plus rows × `cost` ns/row) are as equal as possible, with no chunk
/// below `min_chunk` rows (unless the whole job is smaller) and at most `max_chunks` chunks.
/// Calls `emit(candidate, rows)` for each non-empty chunk, in candidate order, covering
/// `rows` exactly once, and adds the chunks' cost to `loads`. At most 64 candidates; no
/// allocation.
pub fn split_rows(
    rows: Range<u32>,
    cost: &[f64],
    loads: &mut [f64],
    min_chunk: u32,
    max_chunks: usize,
    mut emit: impl FnMut(usize, Range<u32>),
) {
    let n = cost.len().min(loads.len()).min(64);
    let total = rows.end.saturating_sub(rows.start);
    if n == 0 || total == 0 {
        return;
    }
    // Candidates still allowed a chunk; the smallest chunk is dropped until the limits hold.
    let mut active = [false; 64];
    active[..n].iter_mut().for_each(|a| *a = true);
    let mut shares = [0u32; 64];
    let max_chunks = max_chunks.clamp(1, n);
    loop {
        water_fill(total, cost, loads, &active[..n], &mut shares[..n]);
        let used = shares[..n].iter().filter(|&&s| s > 0).count();
        let smallest = (0..n)
            .filter(|&c| shares[c] > 0)
            .min_by_key(|&c| shares[c])
            .expect("total > 0 gives someone rows");
        if used > 1 && (shares[smallest] < min_chunk || used > max_chunks) {
            active[smallest] = false;
            continue;
        }
        break;
    }
    let mut start = rows.start;
    for c in 0..n {
        if shares[c] > 0 {
            emit(c, start..start + shares[c]);
            loads[c] += f64::from(shares[c]) * cost[c];
            start += shares[c];
        }
    }
    debug_assert_eq!(start, rows.end);
}

/// Integer shares of `total` over the `active` candidates equalising `loads + share·cost`.
fn water_fill(total: u32, cost: &[f64], loads: &[f64], active: &[bool], shares: &mut [u32]) {
    let n = active.len();
    let mut order = [0usize; 64];
    let mut m = 0;
    for c in (0..n).filter(|&c| active[c]) {
        order[m] = c;
        m += 1;
    }
    let order = &mut order[..m];
    order.sort_by(|&a, &b| loads[a].total_cmp(&loads[b]));
    let inv = |c: usize| 1.0 / cost[c].max(1e-9);
    // Level T with the first k candidates filled: Σ (T − L)/cost = total.
    let (mut num, mut den, mut level) = (f64::from(total), 0.0, 0.0);
    for k in 0..m {
        let c = order[k];
        num += loads[c] * inv(c);
        den += inv(c);
        level = num / den;
        if k + 1 == m || level <= loads[order[k + 1]] {
            break;
        }
    }
    shares.iter_mut().for_each(|s| *s = 0);
    let mut frac = [0.0f64; 64];
    let mut given = 0u32;
    for &c in order.iter() {
        let s = ((level - loads[c]) * inv(c)).max(0.0);
        let whole = (s.floor() as u32).min(total - given);
        shares[c] = whole;
        frac[c] = s - f64::from(whole);
        given += whole;
    }
    // Hand out the rounding remainder by largest fraction (ties: least loaded, then lowest
    // index — `order` is a stable sort by load).
    while given < total {
        let mut c = order[0];
        for &d in order.iter().skip(1) {
            if frac[d] > frac[c] {
                c = d;
            }
        }
        shares[c] += 1;
        frac[c] = f64::NEG_INFINITY;
        given += 1;
        if order.iter().all(|&c| frac[c] == f64::NEG_INFINITY) {
            order.iter().for_each(|&c| frac[c] = 0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(rank: u32) -> ShapeKey {
        ShapeKey {
            rank,
            d_in: 4096,
            d_out: 4096,
            dtype: DType::F32,
        }
    }

    #[test]
    fn faster_worker_gets_more_rows() {
        let mut loads = [0.0, 0.0];
        let mut got = vec![];
        split_rows(0..30, &[1.0, 2.0], &mut loads, 1, 8, |c, r| {
            got.push((c, r))
        });
        assert_eq!(got, vec![(0, 0..20), (1, 20..30)]);
        assert_eq!(loads, [20.0, 20.0]);
    }

    #[test]
    fn small_jobs_go_to_the_least_loaded_worker() {
        let mut loads = [0.0, 0.0];
        let mut got = vec![];
        for j in 0..4 {
            split_rows(j..j + 1, &[1.0, 1.0], &mut loads, 4, 8, |c, r| {
                got.push((c, r))
            });
        }
        let per: Vec<usize> = got.iter().map(|g| g.0).collect();
        assert_eq!(per, vec![0, 1, 0, 1]);
    }

    #[test]
    fn forgiven_worker_gets_rows_again() {
        let mut p = Profile::new(2, 0.2);
        let k = key(16);
        p.observe(0, &[(k, 100)], 100_000);
        p.observe(1, &[(k, 100)], 10_000_000); // a bad calibration: 100× slower
        let mut rounds = 0;
        loop {
            let cost = [p.ns_per_row(0, k), p.ns_per_row(1, k)];
            let mut loads = [0.0, 0.0];
            let mut got = [0u32; 2];
            split_rows(0..64, &cost, &mut loads, 4, 8, |c, r| {
                got[c] += r.len() as u32
            });
            if got[1] > 0 {
                break;
            }
            p.forgive(1, 0.7);
            rounds += 1;
            assert!(rounds < 20);
        }
    }

    #[test]
    fn observe_moves_toward_measurement() {
        let mut p = Profile::new(2, 0.5);
        let k = key(64);
        p.observe(0, &[(k, 100)], 1_000_000); // 10 µs/row: first sample replaces
        assert!((p.ns_per_row(0, k) - 10_000.0).abs() < 1e-6);
        p.observe(0, &[(k, 100)], 2_000_000); // 20 µs/row, alpha 0.5 → 15
        assert!((p.ns_per_row(0, k) - 15_000.0).abs() < 1e-6);
        assert!((p.rows_per_ms(0, k) - 1e6 / 15_000.0).abs() < 1e-9);
        // Unseen shapes scale with flops from the measured rate.
        assert!(p.ns_per_row(0, key(128)) > p.ns_per_row(0, key(16)));
    }

    proptest! {
        /// Every row of a job lands in exactly one chunk; chunk count and sizes obey the
        /// limits; loads grow by exactly the assigned cost.
        #[test]
        fn split_covers_rows_exactly_once(
            start in 0u32..64, len in 0u32..300,
            cost in proptest::collection::vec(0.1f64..10.0, 1..6),
            load0 in proptest::collection::vec(0.0f64..500.0, 6),
            min_chunk in 1u32..9, max_chunks in 1usize..7,
        ) {
            let n = cost.len();
            let mut loads = load0[..n].to_vec();
            let before = loads.clone();
            let mut next = start;
            let mut chunks = 0;
            let mut seen = vec![false; n];
            split_rows(start..start + len, &cost, &mut loads, min_chunk, max_chunks, |c, r| {
                assert_eq!(r.start, next);
                assert!(r.end > r.start);
                assert!(!seen[c]);
                seen[c] = true;
                next = r.end;
                chunks += 1;
            });
            prop_assert_eq!(next, start + len);
            prop_assert!(chunks <= max_chunks.max(1));
            if len >= min_chunk && chunks > 1 {
                // No chunk below min_chunk when the job could be given to one worker.
                for c in 0..n {
                    let rows = ((loads[c] - before[c]) / cost[c]).round() as u32;
                    prop_assert!(rows == 0 || rows >= min_chunk);
                }
            }
        }
    }
}
