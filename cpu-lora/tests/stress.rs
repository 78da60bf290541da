//! Many sequential steps of varied shapes, ranks, dtypes, row counts and adapter mixes:
//! every (module, row) of every step is assigned exactly once and its Δ equals the oracle.

mod common;

use common::*;
use rand::Rng;
use thaw_cpu_lora::LoraJob;
use thaw_ipc::*;

fn stress(wait: WaitStrategy, steps: usize, seed: u64) {
    let mut f = Fixture::new(config(2, wait), &standard_specs(), seed);
    let all = [Module::Q, Module::K, Module::V, Module::O];
    for step in 0..steps {
        // Segments of random adapters over random row counts (some decode-sized).
        let n_rows: u32 = if f.rng.random_bool(0.3) {
            f.rng.random_range(1..5)
        } else {
            f.rng.random_range(5..=MAX_ROWS)
        };
        let layer = f.rng.random_range(0..2);
        let mut cuts = vec![0, n_rows];
        for _ in 0..f.rng.random_range(0..4) {
            cuts.push(f.rng.random_range(0..=n_rows));
        }
        cuts.sort_unstable();
        cuts.dedup();
        // Input 0 at width 256 (q, k, v); input 1 at width 192 (o).
        let x0 = f.fill_input(0, 0..n_rows, 256);
        let x1 = f.fill_input(1, 0..n_rows, 192);
        let mut jobs = vec![];
        let mut owners = vec![];
        for w in cuts.windows(2) {
            let ai = f.rng.random_range(0..3);
            let mut qkv = ModuleMask::EMPTY;
            for m in &all[..3] {
                if f.rng.random_bool(0.6) {
                    qkv = qkv.with(*m);
                }
            }
            if qkv.0 == 0 {
                qkv = qkv.with(Module::V);
            }
            let rows = w[0]..w[1];
            jobs.push(LoraJob {
                adapter: f.handles[ai],
                layer: LayerIdx(layer),
                modules: qkv,
                input: 0,
                rows: rows.clone(),
            });
            owners.push((ai, 0));
            if f.rng.random_bool(0.5) {
                jobs.push(LoraJob {
                    adapter: f.handles[ai],
                    layer: LayerIdx(layer),
                    modules: ModuleMask::EMPTY.with(Module::O),
                    input: 1,
                    rows,
                });
                owners.push((ai, 1));
            }
        }
        let t = f.pool.submit(&jobs).unwrap();
        let rep = f.pool.wait(t, Fixture::deadline()).unwrap();

        // Exactly once: per (job, row) one assignment; per (module, row) one job.
        let mut marker = vec![[0u8; 7]; n_rows as usize];
        for a in f.pool.last_assignments() {
            assert!(!a.recovered);
            for r in a.rows.clone() {
                for m in jobs[a.job as usize].modules.iter() {
                    marker[r as usize][m.index()] += 1;
                }
            }
        }
        let mut expected = 0u32;
        for j in &jobs {
            for r in j.rows.clone() {
                for m in j.modules.iter() {
                    assert_eq!(
                        marker[r as usize][m.index()],
                        1,
                        "step {step}: row {r} {m:?}"
                    );
                    expected += 1;
                }
            }
        }
        let assigned: u32 = marker.iter().flatten().map(|&c| u32::from(c)).sum();
        assert_eq!(
            assigned, expected,
            "step {step}: rows computed more than once"
        );
        assert_eq!(rep.rows_by_workers, expected, "step {step}");

        for (job, &(ai, input)) in jobs.iter().zip(&owners) {
            let (x, d) = if input == 0 { (&x0, 256) } else { (&x1, 192) };
            let xs = &x[job.rows.start as usize * d..job.rows.end as usize * d];
            f.check_job(ai, job, xs);
        }
    }
}

#[test]
fn many_varied_steps_spin() {
    stress(WaitStrategy::spin(), 150, 11);
}

#[test]
fn many_varied_steps_spin_then_futex() {
    stress(WaitStrategy::spin_then_futex(), 150, 12);
}
