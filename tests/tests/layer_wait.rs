//! Layer-wise start without CPU assist (`on-demand`, issue 27): a request whose adapter is
//! still streaming runs in the step, the forward waiting for each layer to land before it
//! computes it on the device. Same tokens as the cached oracle, nothing computed on the CPU,
//! and the step started before the adapter had landed (it waited for layers).
use std::sync::Arc;
use std::time::Duration;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig, UnlandedLayers};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_tests::TestModel;

#[test]
fn a_request_runs_while_its_adapter_streams_and_waits_for_each_layer() {
    let tm = TestModel::llama(71);
    let cfg = tm.model.config.clone();
    let adapters: Vec<Arc<LoraAdapter>> = (0..2)
        .map(|i| tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 1300 + i))
        .collect();
    let prompt: Vec<u32> = (0..24u32)
        .map(|t| 3 + (t * 41) % (cfg.vocab_size as u32 - 3))
        .collect();
    let greedy = |e: &mut thaw_tests::CpuEngine, seq: u64, a: u32| {
        thaw_tests::greedy_alone(e, SeqId(seq), AdapterId(a), &prompt, usize::MAX)
    };
    let mut oracle = Engine::new(
        CpuBackend::new(&cfg),
        tm.model.clone(),
        EngineConfig::default(),
    )
    .unwrap();
    for (i, a) in adapters.iter().enumerate() {
        oracle
            .register_adapter(AdapterId(i as u32), a.clone())
            .unwrap();
    }
    oracle
        .wait_adapters_landed(Duration::from_secs(60))
        .unwrap();
    let want: Vec<Vec<u32>> = (0..2)
        .map(|i| greedy(&mut oracle, 10 + i, i as u32))
        .collect();

    // Each adapter takes about 200 ms on the link: the first step finds it streaming.
    let bytes = adapters[0].size_bytes() as f64;
    let mut e = thaw_tests::cpu_engine_slow_link(tm.model.clone(), bytes, 0.2);
    e.set_unlanded_layers(UnlandedLayers::Wait);
    for (i, a) in adapters.iter().enumerate() {
        let id = AdapterId(i as u32);
        let waited = e.layer_wait();
        e.register_adapter_streaming(id, a.clone()).unwrap();
        let (landed, layers) = e.adapter_landed(id).unwrap();
        assert!(
            landed < layers,
            "adapter {i} still streaming at the first step"
        );
        assert_eq!(
            greedy(&mut e, 100 + i as u64, i as u32),
            want[i],
            "adapter {i}"
        );
        assert_eq!(e.rows_assisted(), 0, "no row computed on the CPU");
        assert!(
            e.layer_wait() > waited,
            "adapter {i}: the first step waited for its layers"
        );
        assert!(e.adapter_resident(id));
    }
}
