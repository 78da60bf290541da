//! Start-up calibration: every worker computes the same number of rows of a synthetic
//! adapter, all at once (so shared memory bandwidth is contended as in real steps), through
//! the real exchange; the times the workers measure seed the profile.

use std::time::{Duration, Instant};

use thaw_ipc::{
    AdapterId, DType, Generation, Job, LayerIdx, LayerModuleWeights, Module, ModuleMask, WorkerId,
    WorkerMask,
};

use crate::pool::LoraPool;
use crate::procs::SlotState;
use crate::profile::ShapeKey;
use crate::CpuLoraError;

/// One shape to measure at start-up (clamped to the exchange's capacities).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CalibrationShape {
    /// Adapter rank.
    pub rank: u32,
    /// Hidden size (`d_in` = `d_out`).
    pub hidden: u32,
    /// Rows per worker.
    pub rows: u32,
}

impl CalibrationShape {
    /// Ranks 16 and 64 at hidden 4096, 16 rows per worker.
    pub fn defaults() -> Vec<Self> {
        [16, 64]
            .map(|rank| Self {
                rank,
                hidden: 4096,
                rows: 16,
            })
            .to_vec()
    }
}

/// Id of the synthetic adapter (never a real adapter's).
const CALIBRATION_ID: AdapterId = AdapterId(u64::MAX);
/// Steps per shape; the first warms the workers' scratch and is not recorded.
const REPEATS: usize = 3;

/// Measures every shape on every ready worker and feeds the profile.
pub(crate) fn run(pool: &mut LoraPool, shapes: &[CalibrationShape]) -> Result<(), CpuLoraError> {
    let workers: Vec<WorkerId> = pool
        .workers()
        .filter(|w| w.state == SlotState::Ready)
        .map(|w| w.id)
        .collect();
    if workers.is_empty() {
        return Ok(());
    }
    let c = *pool.exchange().config();
    for (i, s) in shapes.iter().enumerate() {
        let d = s.hidden.min(c.max_d_in).min(c.max_d_out).max(1);
        let rows = s.rows.min(c.max_rows / workers.len() as u32);
        if rows == 0 || s.rank == 0 {
            continue;
        }
        let (a, b) = weights(s.rank, d);
        let w = LayerModuleWeights {
            layer: LayerIdx(0),
            module: Module::Q,
            rank: s.rank,
            scale: 0.5,
            dtype: DType::F32,
            a_bytes: bytemuck::cast_slice(&a),
            b_bytes: bytemuck::cast_slice(&b),
        };
        let generation = Generation(i as u64);
        let handle = match pool.store_mut().insert(CALIBRATION_ID, generation, &[w]) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "skipping CPU LoRA calibration shape {s:?}");
                continue;
            }
        };
        let total = rows * workers.len() as u32;
        let stride = c.max_d_in as usize;
        for (r, row) in pool
            .input_mut(0, 0..total)?
            .chunks_exact_mut(stride)
            .enumerate()
        {
            for (k, v) in row.iter_mut().enumerate() {
                *v = ((r * 31 + k * 7) % 97) as f32 / 97.0 - 0.5;
            }
        }
        let jobs: Vec<Job> = workers
            .iter()
            .enumerate()
            .map(|(k, &wid)| Job {
                adapter: handle,
                layer: LayerIdx(0),
                modules: ModuleMask::EMPTY.with(Module::Q),
                worker: wid,
                input: 0,
                row_start: k as u32 * rows,
                row_count: rows,
                rank: s.rank,
                scale: 0.5,
                dtype: DType::F32.code(),
                _pad: 0,
            })
            .collect();
        let mask = workers
            .iter()
            .fold(WorkerMask::default(), |m, &w| m.with(w));
        let key = ShapeKey {
            rank: s.rank,
            d_in: d,
            d_out: d,
            dtype: DType::F32,
        };
        let result = measure(pool, &jobs, mask, key, rows);
        pool.store_mut().remove(handle);
        result?;
    }
    Ok(())
}

fn measure(
    pool: &mut LoraPool,
    jobs: &[Job],
    mask: WorkerMask,
    key: ShapeKey,
    rows: u32,
) -> Result<(), CpuLoraError> {
    let timeout = Duration::from_secs(10);
    for rep in 0..REPEATS {
        let seq = pool.next_seq();
        let strategy = pool.wait_strategy();
        let ex = pool.exchange_mut();
        ex.set_jobs(jobs)?;
        ex.post_step(seq)?;
        if ex
            .wait_results(seq, mask, strategy, Instant::now() + timeout)
            .is_err()
        {
            // The step stays in flight; the pool is dropped by the caller, reaping workers.
            return Err(CpuLoraError::Calibration(timeout));
        }
        if rep == 0 {
            continue;
        }
        for w in mask.iter() {
            let st = pool.stats().read(w);
            if st.seq == seq && st.failed == 0 {
                pool.profile_mut()
                    .observe(w.0 as usize, &[(key, rows)], st.compute_ns);
            }
        }
    }
    Ok(())
}

/// Deterministic, non-constant weights: A `[rank, d]`, B `[d, rank]`.
fn weights(rank: u32, d: u32) -> (Vec<f32>, Vec<f32>) {
    let n = rank as usize * d as usize;
    let f = |i: usize, m: usize| ((i * m) % 101) as f32 / 101.0 - 0.5;
    (
        (0..n).map(|i| f(i, 13)).collect(),
        (0..n).map(|i| f(i, 17)).collect(),
    )
}
