//! Cold-start policies: every policy produces the same tokens; faults cost only the faulty
//! adapter's requests.
use std::path::PathBuf;
use std::time::Duration;

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig};
use thaw_runtime::residency::LinkModel;
use thaw_runtime::sampling::SamplingParams;
use thaw_server::coldstart::{
    self, calibrate, ColdStartPolicy, DriverConfig, Request, RunReport, StartTier,
};
use thaw_tests::TestModel;

struct Setup {
    tm: TestModel,
    adapters: Vec<(PathBuf, StartTier)>,
}

/// Six adapters: two resident, two streaming from the start, two on disk.
fn setup(seed: u64) -> Setup {
    let tm = TestModel::llama(seed);
    let specs: [(usize, &[&str]); 6] = [
        (8, &["q", "v"]),
        (16, &["q", "k", "v", "o"]),
        (32, &["q", "k", "v", "o", "gate", "up", "down"]),
        (64, &["o", "down"]),
        (16, &["gate", "up"]),
        (8, &["q", "k", "v", "o", "gate", "up", "down"]),
    ];
    let tiers = [
        StartTier::Device,
        StartTier::Host,
        StartTier::Streaming,
        StartTier::Streaming,
        StartTier::Disk,
        StartTier::Disk,
    ];
    let adapters = specs
        .iter()
        .zip(tiers)
        .enumerate()
        .map(|(i, ((r, t), tier))| (tm.adapter_dir(*r, t, 500 + i as u64), tier))
        .collect();
    Setup { tm, adapters }
}

fn requests(seed: u64, n: usize, spacing: Duration, vocab: usize) -> Vec<Request> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|i| Request {
            arrival: spacing * i as u32,
            prompt: (0..rng.random_range(4..40))
                .map(|_| rng.random_range(3..vocab as u32))
                .collect(),
            max_tokens: rng.random_range(3..10),
            adapter: [None, Some(0), Some(2), Some(4), Some(1), Some(3), Some(5)][i % 7],
            sampling: if i % 2 == 0 {
                SamplingParams::greedy()
            } else {
                SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    top_p: 0.95,
                    seed: Some(77 + i as u64),
                    top_logprobs: 0,
                    logprobs: false,
                }
            },
        })
        .collect()
}

fn run_policy(
    s: &Setup,
    reqs: &[Request],
    policy: ColdStartPolicy,
    link: LinkModel,
    max_chunk: usize,
) -> RunReport {
    let backend = CpuBackend::new(&s.tm.model.config).with_link(link);
    let mut engine = Engine::new(backend, s.tm.model.clone(), EngineConfig::default()).unwrap();
    let mut cost = calibrate(&mut engine).unwrap();
    coldstart::run(
        &mut engine,
        &s.adapters,
        reqs,
        &DriverConfig {
            policy,
            max_chunk,
            max_batch_tokens: 256,
            loader_threads: 2,
        },
        &mut cost,
    )
}

fn same_tokens_every_policy(s: &Setup, reqs: &[Request], link: LinkModel, chunk: usize) {
    let oracle = run_policy(s, reqs, ColdStartPolicy::Cached, link, chunk);
    assert!(oracle.outcomes.iter().all(|o| o.error.is_none()));
    for policy in [
        ColdStartPolicy::OnDemand,
        ColdStartPolicy::CpuAssist,
        ColdStartPolicy::Auto,
    ] {
        let r = run_policy(s, reqs, policy, link, chunk);
        for (i, (got, want)) in r.outcomes.iter().zip(&oracle.outcomes).enumerate() {
            assert_eq!(got.error, None, "{policy}: request {i} failed");
            assert_eq!(
                got.tokens, want.tokens,
                "{policy}: request {i} (adapter {:?}) differs from cached",
                reqs[i].adapter
            );
            assert_eq!(got.tokens.len(), reqs[i].max_tokens);
        }
        if policy == ColdStartPolicy::OnDemand {
            assert_eq!(r.rows_assisted, 0, "on-demand never computes on the CPU");
        }
    }
}

#[test]
fn every_policy_produces_the_same_tokens() {
    let s = setup(31);
    let reqs = requests(
        1,
        14,
        Duration::from_millis(3),
        s.tm.model.config.vocab_size,
    );
    // 20 MB/s: an adapter takes tens of milliseconds to land, so requests run while it streams.
    let link = LinkModel {
        gbps: 0.02,
        latency_us: 50.0,
    };
    same_tokens_every_policy(&s, &reqs, link, 8);
    // CPU assist really ran on this link.
    let r = run_policy(&s, &reqs, ColdStartPolicy::CpuAssist, link, 8);
    assert!(r.rows_assisted > 0, "no row was assisted on a slow link");
}

/// `auto` on the CPU backend with a slow emulated link (2 MB/s, a PCIe link shared by many
/// loads): the measured model predicts the copy slower than the CPU's prefill, so it assists,
/// and the tokens are the cached run's.
#[test]
fn auto_assists_on_a_slow_emulated_link() {
    let s = setup(33);
    let reqs = requests(
        3,
        14,
        Duration::from_millis(2),
        s.tm.model.config.vocab_size,
    );
    let link = LinkModel {
        gbps: 0.002,
        latency_us: 50.0,
    };
    let oracle = run_policy(&s, &reqs, ColdStartPolicy::Cached, link, 8);
    let r = run_policy(&s, &reqs, ColdStartPolicy::Auto, link, 8);
    assert!(r.rows_assisted > 0, "auto never assisted on a 2 MB/s link");
    assert!(
        !r.predictions.is_empty(),
        "auto chose assist without a prediction"
    );
    for (i, (got, want)) in r.outcomes.iter().zip(&oracle.outcomes).enumerate() {
        assert_eq!(got.error, None, "request {i} failed");
        assert_eq!(got.tokens, want.tokens, "request {i} differs from cached");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4, ..ProptestConfig::default() })]
    /// Arrival times, chunk sizes and link speeds do not change any request's tokens.
    #[test]
    fn policies_agree_across_arrivals_chunks_and_links(
        seed in 0u64..1000,
        spacing_us in 0u64..4000,
        chunk in 1usize..24,
        gbps in 0.005f64..2.0,
    ) {
        let s = setup(40 + seed % 3);
        let reqs = requests(seed, 8, Duration::from_micros(spacing_us), s.tm.model.config.vocab_size);
        let link = LinkModel { gbps, latency_us: 20.0 };
        same_tokens_every_policy(&s, &reqs, link, chunk);
    }
}

/// Adapter files that vanish or are corrupted after registration fail only their requests.
#[test]
fn broken_adapter_files_fail_only_their_requests() {
    let s = setup(32);
    // Adapter 4 (disk tier): weights truncated; adapter 5 (disk tier): directory removed.
    let st = s.adapters[4].0.join("adapter_model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 3]).unwrap();
    std::fs::remove_dir_all(&s.adapters[5].0).unwrap();
    let reqs = requests(
        2,
        14,
        Duration::from_millis(1),
        s.tm.model.config.vocab_size,
    );
    let link = LinkModel {
        gbps: 0.05,
        latency_us: 20.0,
    };
    for policy in ColdStartPolicy::ALL {
        if policy == ColdStartPolicy::Cached {
            continue; // the oracle loads everything before serving
        }
        let r = run_policy(&s, &reqs, policy, link, 8);
        for (i, (req, o)) in reqs.iter().zip(&r.outcomes).enumerate() {
            match req.adapter {
                Some(4) => {
                    let e = o
                        .error
                        .as_deref()
                        .unwrap_or_else(|| panic!("{policy}: request {i} should fail"));
                    assert!(e.contains("safetensors"), "{policy}: unclear error: {e}");
                }
                Some(5) => {
                    let e = o
                        .error
                        .as_deref()
                        .unwrap_or_else(|| panic!("{policy}: request {i} should fail"));
                    assert!(e.contains("does not exist"), "{policy}: unclear error: {e}");
                }
                _ => {
                    assert_eq!(o.error, None, "{policy}: healthy request {i} failed");
                    assert_eq!(o.tokens.len(), req.max_tokens);
                }
            }
        }
    }
}

/// An adapter streamed over a slow emulated link has not landed right after registering;
/// `wait_adapters_landed` returns once every layer has (and no sooner), and times out with an
/// error that names the adapter while one is still streaming.
#[test]
fn wait_adapters_landed_waits_for_every_layer() {
    let s = setup(11);
    let a = std::sync::Arc::new(
        thaw_runtime::adapter::LoraAdapter::load(&s.adapters[2].0, &s.tm.model.config).unwrap(),
    );
    // 8 MB/s: the rank-32 all-projection adapter takes tens of milliseconds to land.
    let link = LinkModel {
        gbps: 0.008,
        latency_us: 50.0,
    };
    let backend = CpuBackend::new(&s.tm.model.config).with_link(link);
    let mut e = Engine::new(backend, s.tm.model.clone(), EngineConfig::default()).unwrap();
    let id = thaw_runtime::ids::AdapterId(3);
    e.register_adapter_streaming(id, a).unwrap();
    assert!(
        !e.adapter_resident(id),
        "landed before the link could carry it"
    );
    let err = e.wait_adapters_landed(Duration::ZERO).unwrap_err();
    assert!(err.to_string().contains("did not all land"), "{err}");
    e.wait_adapters_landed(Duration::from_secs(30)).unwrap();
    assert!(e.adapter_resident(id));
    let (landed, layers) = e.adapter_landed(id).unwrap();
    assert_eq!(landed, layers);
}
