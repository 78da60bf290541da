//! Helpers shared by the tests that run an engine with real CPU LoRA worker processes.
use std::path::PathBuf;
use std::sync::Arc;

use thaw_cpu_lora::{LoraPool, PoolConfig};
use thaw_ipc::HostStore;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::residency::LinkModel;
use thaw_tests::TestModel;

/// A pool of `workers` test workers (`thaw-test-worker`, unpinned) over `store`.
pub fn pool_with(workers: usize, store: HostStore) -> LoraPool {
    LoraPool::new(
        PoolConfig {
            cores: Some((0..workers).collect()),
            pin: false,
            program: Some(PathBuf::from(env!("CARGO_BIN_EXE_thaw-test-worker"))),
            leading_args: vec![],
            calibration: vec![],
            ..Default::default()
        },
        store,
    )
    .expect("worker pool starts")
}

/// Greedy tokens of `prompt` under adapter `a`, one request alone, prefill then decode.
pub fn greedy(e: &mut Engine<CpuBackend>, seq: u64, a: AdapterId, prompt: &[u32]) -> Vec<u32> {
    thaw_tests::greedy_alone(e, SeqId(seq), a, prompt, usize::MAX)
}

/// The cached oracle's greedy tokens of `prompt` under `adapter` (every layer on the device).
#[allow(dead_code)] // not every test binary including this module uses it
pub fn cached_greedy(tm: &TestModel, adapter: &Arc<LoraAdapter>, prompt: &[u32]) -> Vec<u32> {
    let cfg = &tm.model.config;
    let mut e = Engine::new(
        CpuBackend::new(cfg),
        tm.model.clone(),
        EngineConfig::default(),
    )
    .expect("oracle engine");
    e.register_adapter(AdapterId(0), adapter.clone())
        .expect("oracle adapter");
    greedy(&mut e, 1, AdapterId(0), prompt)
}

/// An engine whose emulated link moves `bytes` in about `secs`, with `pool` attached.
#[allow(dead_code)] // not every test binary including this module uses it
pub fn streaming_engine(
    tm: &TestModel,
    bytes: usize,
    secs: f64,
    pool: LoraPool,
) -> Engine<CpuBackend> {
    let link = LinkModel {
        gbps: bytes as f64 / secs / 1e9,
        latency_us: 50.0,
    };
    let backend = CpuBackend::new(&tm.model.config).with_link(link);
    let mut e = Engine::new(backend, tm.model.clone(), EngineConfig::default()).expect("engine");
    e.attach_pool(pool).expect("pool attaches");
    e
}
