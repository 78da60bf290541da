//! One conformance suite for the pool and its workers, instantiated for each wait strategy.

mod common;

use std::sync::atomic::Ordering;

use common::*;
use thaw_cpu_lora::{CpuLoraError, LoraJob};
use thaw_ipc::*;

/// q, k, v of adapters 0 (f32), 1 (f16), 2 (bf16) on three contiguous segments of one step.
fn mixed_step(f: &mut Fixture, layer: u32) {
    let x = f.fill_input(0, 0..40, 256);
    let segs = [(0usize, 0u32..13), (1, 13..30), (2, 30..40)];
    let jobs: Vec<LoraJob> = segs
        .iter()
        .map(|(ai, rows)| LoraJob {
            adapter: f.handles[*ai],
            layer: LayerIdx(layer),
            modules: qkv(),
            input: 0,
            rows: rows.clone(),
        })
        .collect();
    let t = f.pool.submit(&jobs).unwrap();
    let rep = f.pool.wait(t, Fixture::deadline()).unwrap();
    assert_eq!(rep.rows_by_workers, 40 * 3);
    assert_eq!(rep.rows_recovered, 0);
    for ((ai, rows), job) in segs.iter().zip(&jobs) {
        let xs = &x[rows.start as usize * 256..rows.end as usize * 256];
        f.check_job(*ai, job, xs);
    }
}

fn each_dtype_matches_sgmv(wait: WaitStrategy) {
    let mut f = Fixture::new(config(2, wait), &standard_specs(), 1);
    for layer in [0, 1, 0] {
        mixed_step(&mut f, layer);
    }
}

fn narrow_input_is_packed(wait: WaitStrategy) {
    // o has d_in 192 < the exchange stride 256: the worker packs x rows.
    let mut f = Fixture::new(config(2, wait), &standard_specs(), 2);
    let x = f.fill_input(1, 5..29, 192);
    let job = LoraJob {
        adapter: f.handles[1],
        layer: LayerIdx(1),
        modules: ModuleMask::EMPTY.with(Module::O),
        input: 1,
        rows: 5..29,
    };
    let t = f.pool.submit(std::slice::from_ref(&job)).unwrap();
    f.pool.wait(t, Fixture::deadline()).unwrap();
    f.check_job(1, &job, &x);
}

fn device_trigger(wait: WaitStrategy) {
    let mut f = Fixture::new(config(2, wait), &standard_specs(), 3);
    let x = f.fill_input(0, 0..17, 256);
    let job = LoraJob {
        adapter: f.handles[2],
        layer: LayerIdx(0),
        modules: [Module::Q, Module::V].into_iter().collect(),
        input: 0,
        rows: 0..17,
    };
    assert!(matches!(
        f.pool.submit_device(std::slice::from_ref(&job)),
        Err(CpuLoraError::NotArmed)
    ));
    f.pool.arm();
    let step = f.pool.submit_device(std::slice::from_ref(&job)).unwrap();
    assert_eq!(step.seq_offset, f.pool.layout().seq);
    // Pose as the device's copy-and-signal kernel: a plain store, no wake.
    std::thread::sleep(std::time::Duration::from_millis(5));
    f.pool
        .exchange()
        .seq_word()
        .store(step.seq.0, Ordering::SeqCst);
    f.pool.wait(step.ticket, Fixture::deadline()).unwrap();
    f.pool.disarm();
    f.check_job(2, &job, &x);
    // The host trigger still works after disarming.
    mixed_step(&mut f, 1);
}

fn api_errors(wait: WaitStrategy) {
    let mut f = Fixture::new(config(1, wait), &standard_specs(), 4);
    let job = |rows: std::ops::Range<u32>, h: AdapterHandle, layer: u32| LoraJob {
        adapter: h,
        layer: LayerIdx(layer),
        modules: qkv(),
        input: 0,
        rows,
    };
    let h = f.handles[0];
    let err = f.pool.submit(&[job(0..65, h, 0)]).unwrap_err();
    assert!(
        matches!(err, CpuLoraError::InvalidJob { index: 0, .. }),
        "{err}"
    );
    let err = f
        .pool
        .submit(&[job(0..4, h, 0), job(4..8, h, 7)])
        .unwrap_err();
    assert!(
        matches!(err, CpuLoraError::InvalidJob { index: 1, .. }),
        "{err}"
    );
    let gone = AdapterHandle {
        id: AdapterId(999),
        ..h
    };
    assert!(f.pool.submit(&[job(0..4, gone, 0)]).is_err());
    f.fill_input(0, 0..8, 256);
    let t = f.pool.submit(&[job(0..8, h, 0)]).unwrap();
    assert!(matches!(
        f.pool.submit(&[job(0..8, h, 0)]),
        Err(CpuLoraError::StepInFlight)
    ));
    f.pool.wait(t, Fixture::deadline()).unwrap();
    // An empty step completes too.
    let t = f.pool.submit(&[]).unwrap();
    f.pool.wait(t, Fixture::deadline()).unwrap();
}

fn profile_is_measured(wait: WaitStrategy) {
    let mut f = Fixture::new(config(2, wait), &standard_specs(), 5);
    let key = thaw_cpu_lora::ShapeKey {
        rank: 16,
        d_in: 256,
        d_out: 256,
        dtype: DType::F32,
    };
    for w in 0..2 {
        let r = f.pool.profile().rows_per_ms(w, key);
        assert!(r.is_finite() && r > 0.0, "worker {w}: {r}");
    }
    mixed_step(&mut f, 0);
    for w in 0..2 {
        assert!(f.pool.profile().gflops(w) > 0.0);
    }
}

macro_rules! conformance {
    ($name:ident, $wait:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn each_dtype_matches_sgmv() {
                super::each_dtype_matches_sgmv($wait);
            }

            #[test]
            fn narrow_input_is_packed() {
                super::narrow_input_is_packed($wait);
            }

            #[test]
            fn device_trigger() {
                super::device_trigger($wait);
            }

            #[test]
            fn api_errors() {
                super::api_errors($wait);
            }

            #[test]
            fn profile_is_measured() {
                super::profile_is_measured($wait);
            }
        }
    };
}

conformance!(spin, WaitStrategy::spin());
conformance!(spin_then_futex, WaitStrategy::spin_then_futex());
