//! The CUDA side of CPU assist on hardware (DESIGN §4): the fused export writes the chosen rows
//! into the mapped exchange and only then publishes the step's sequence word; the merge makes
//! the *stream* wait (`cuStreamWaitValue32`) until every involved worker has published its
//! result, and only then adds the deltas. Skips without a GPU unless `THAW_REQUIRE_GPU=1`.
#![cfg(feature = "cuda")]

use std::sync::atomic::Ordering;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_ipc::{Exchange, ExchangeConfig, StepSeq, WorkerId, WORKER_RESULT};
use thaw_runtime::adapter::LoraModule;
use thaw_runtime::backend::cuda::{CudaBackend, CudaConfig, DType};
use thaw_tests::{gpu_or_skip, TestModel};

const D: usize = 64;
const MAX_D: u32 = 96;

fn f32_at(ex: &Exchange, off: usize) -> f32 {
    f32::from_bits(ex.segment().atomic_u32(off).load(Ordering::Acquire))
}

#[test]
fn fused_export_then_stream_waited_merge() {
    if !gpu_or_skip() {
        return;
    }
    let m = TestModel::llama(3).model;
    let mut g = CudaBackend::new(
        &m.config,
        &CudaConfig {
            weight_dtype: DType::F32,
            kv_dtype: DType::F32,
            ..Default::default()
        },
    )
    .expect("CUDA backend");
    let ex = Exchange::create(ExchangeConfig {
        max_workers: 2,
        max_rows: 8,
        max_d_in: MAX_D,
        max_d_out: MAX_D,
        ..Default::default()
    })
    .unwrap();
    let l = *ex.layout();
    let result = |w: usize| ex.segment().atomic_u32(l.workers + w * 64 + WORKER_RESULT);
    let mapped = g.map_exchange(&ex).expect("register the exchange");
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let rows = 10;
    let x: Vec<f32> = (0..rows * D).map(|_| rng.random_range(-2.0..2.0)).collect();
    let xg = g.upload_f32(&x).unwrap();
    let sel = [7usize, 2, 9, 0];

    // Export into input 1; the sequence word goes 0 → 5 only with the rows.
    ex.seq_word().store(0, Ordering::SeqCst);
    g.export_rows_fused(&mapped, &xg, D, &sel, 1, StepSeq(5))
        .unwrap();
    g.synchronize().unwrap();
    assert_eq!(ex.seq_word().load(Ordering::Acquire), 5);
    let input = l.inputs + l.input_stride;
    for (i, &r) in sel.iter().enumerate() {
        for j in 0..D {
            let got = f32_at(&ex, input + (i * MAX_D as usize + j) * 4);
            assert_eq!(got, x[r * D + j], "exported row {i} (x row {r}) col {j}");
        }
    }

    // Merge waits for both workers' result words ≥ 6.
    result(0).store(5, Ordering::SeqCst);
    result(1).store(5, Ordering::SeqCst);
    let y0: Vec<f32> = (0..rows * D).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut yg = g.upload_f32(&y0).unwrap();
    g.synchronize().unwrap();
    g.merge_deltas_waited(
        &mapped,
        &mut yg,
        D,
        LoraModule::V,
        &sel,
        StepSeq(6),
        &[WorkerId(0), WorkerId(1)],
    )
    .unwrap();
    let done = g.stream().record_event(None).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !done.is_complete(),
        "the merge ran before any worker finished"
    );
    // The "workers" write their deltas, then publish; one at a time.
    let delta: Vec<f32> = (0..sel.len() * D)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let out = l.outputs + LoraModule::V.index() * l.output_stride;
    for i in 0..sel.len() {
        for j in 0..D {
            ex.segment()
                .atomic_u32(out + (i * MAX_D as usize + j) * 4)
                .store(delta[i * D + j].to_bits(), Ordering::Release);
        }
    }
    result(0).store(6, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !done.is_complete(),
        "the merge ran before worker 1 finished"
    );
    result(1).store(7, Ordering::SeqCst);
    done.synchronize().unwrap();
    let y = g.download_f32(&yg, rows * D).unwrap();
    let mut want = y0.clone();
    for (i, &r) in sel.iter().enumerate() {
        for j in 0..D {
            want[r * D + j] += delta[i * D + j];
        }
    }
    assert_eq!(
        y, want,
        "y = y0 + deltas on the selected rows, unchanged elsewhere"
    );
    g.check().unwrap();
    drop(mapped);
}

/// The engine's assist path on CUDA with real worker processes (issue 27 item 5): the pool's
/// exchange is mapped, so a cold layer's rows leave the device by the fused export and its
/// deltas come back behind stream waits; greedy tokens equal those of resident adapters.
/// (Whether a layer is still cold at a step's start depends on the link; the count is printed.)
#[test]
fn engine_assists_through_the_mapped_exchange() {
    use std::path::PathBuf;
    use thaw_cpu_lora::{LoraPool, PoolConfig};
    use thaw_ipc::HostStore;
    use thaw_runtime::engine::{Engine, EngineConfig, PlanItem, SequenceParams, StepPlan};
    use thaw_runtime::ids::{AdapterId, SeqId};

    if !gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(7);
    let adapters = [
        tm.adapter(8, &["q", "v"], 70),
        tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 71),
    ];
    let vocab = tm.model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|i| {
            (0..9 + 6 * i)
                .map(|t| 3 + (t * 37 + i * 11) % (vocab - 3))
                .collect()
        })
        .collect();
    let who = [Some(0u32), Some(1), None];
    let backend = || {
        CudaBackend::new(
            &tm.model.config,
            &CudaConfig {
                weight_dtype: DType::F32,
                kv_dtype: DType::F32,
                ..Default::default()
            },
        )
        .expect("CUDA backend")
    };
    let greedy = |e: &mut Engine<CudaBackend>| -> Vec<Vec<u32>> {
        for (i, (a, p)) in who.iter().zip(&prompts).enumerate() {
            e.add_sequence(
                SeqId(i as u64),
                SequenceParams {
                    prompt: p.clone(),
                    adapter: a.map(AdapterId),
                    max_new_tokens: 5,
                    ..Default::default()
                },
            )
            .unwrap();
        }
        let mut out = vec![Vec::new(); who.len()];
        for s in 0..5 {
            let plan = StepPlan {
                items: (0..who.len())
                    .map(|i| PlanItem {
                        seq: SeqId(i as u64),
                        num_tokens: if s == 0 { prompts[i].len() } else { 1 },
                    })
                    .collect(),
                return_logits: false,
            };
            for o in e.step(&plan).unwrap() {
                out[o.seq.0 as usize].push(o.token.id);
            }
        }
        out
    };
    let mut resident = Engine::new(backend(), tm.model.clone(), EngineConfig::default()).unwrap();
    for (i, a) in adapters.iter().enumerate() {
        resident
            .register_adapter(AdapterId(i as u32), a.clone())
            .unwrap();
    }
    resident
        .wait_adapters_landed(Duration::from_secs(60))
        .unwrap();
    let want = greedy(&mut resident);

    let pool = LoraPool::new(
        PoolConfig {
            cores: Some(vec![0, 1]),
            pin: false,
            // On the GPU machine the test runs from `gpu-bin/` (benches/gpu/build.sh), far from
            // the target dir cargo compiled into it: run.sh names the worker shipped beside it.
            program: Some(
                std::env::var_os("THAW_TEST_WORKER")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_thaw-test-worker"))),
            ),
            leading_args: vec![],
            calibration: vec![],
            ..Default::default()
        },
        HostStore::create(64 << 20, 64).expect("host store"),
    )
    .expect("worker pool starts");
    let mut assisted = Engine::new(backend(), tm.model.clone(), EngineConfig::default()).unwrap();
    assisted.attach_pool(pool).unwrap();
    for (i, a) in adapters.iter().enumerate() {
        assisted
            .register_adapter_streaming(AdapterId(i as u32), a.clone())
            .unwrap();
    }
    let got = greedy(&mut assisted);
    println!(
        "rows CPU-assisted through the mapped exchange: {}",
        assisted.rows_assisted()
    );
    assert_eq!(got, want, "assisted and resident greedy tokens differ");
    drop(assisted.detach_pool());
}
