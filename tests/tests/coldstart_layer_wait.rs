//! The engine-level cold-start driver applies the server's gate: an `on-demand` miss whose
//! layers land faster than the forward reaches them starts in the step, before its adapter has
//! fully landed, waiting for its layers in the forward (and computes what the all-resident run
//! computes); over a slow link it holds until the copy is done. Never a row on the CPU. And it
//! serves disk misses from their mapped files by the server's own choice, under every policy.
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig};
use thaw_runtime::residency::LinkModel;
use thaw_runtime::sampling::SamplingParams;
use thaw_server::coldstart::{
    self, calibrate, in_step, layer_stall, ColdStartPolicy, DriverConfig, InFlight, Request,
    RunReport, StartTier, MAX_STALL_SHARE,
};
use thaw_tests::TestModel;

const PROMPT: usize = 160;

/// The two tests calibrate the engine's step time and then compare it with a link's: one at a
/// time, so that neither measures the other's steps.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

struct Setup {
    tm: TestModel,
    adapters: Vec<(PathBuf, StartTier)>,
    requests: Vec<Request>,
}

/// Four adapters in host memory (their copy starts when their request arrives), one greedy
/// request each, 5 ms apart, each prompt in one chunk.
fn setup(seed: u64) -> Setup {
    let tm = TestModel::llama(seed);
    let vocab = tm.model.config.vocab_size as u32;
    let adapters = (0..4)
        .map(|i| {
            let dir = tm.adapter_dir(8, &["q", "v"], 700 + seed + i as u64);
            (dir, StartTier::Host)
        })
        .collect();
    let requests = (0..4)
        .map(|i| Request {
            arrival: Duration::from_millis(5 * i as u64),
            prompt: (0..PROMPT as u32)
                .map(|t| 3 + (t * 13 + i as u32 * 7) % (vocab - 3))
                .collect(),
            max_tokens: 6,
            adapter: Some(i),
            sampling: SamplingParams::greedy(),
        })
        .collect();
    Setup {
        tm,
        adapters,
        requests,
    }
}

/// Runs `policy` over `link`, printing what the layer gate would say of a request of the run
/// on an adapter with no layer landed and nothing ahead on the link, from the calibrated model
/// (the driver refines the model with every step it measures).
fn run(s: &Setup, policy: ColdStartPolicy, link: LinkModel) -> RunReport {
    let backend = CpuBackend::new(&s.tm.model.config).with_link(link);
    let mut e = Engine::new(backend, s.tm.model.clone(), EngineConfig::default()).unwrap();
    let mut cost = calibrate(&mut e).unwrap();
    let bytes = std::fs::metadata(s.adapters[0].0.join("adapter_model.safetensors"))
        .unwrap()
        .len();
    let layers = s.tm.model.config.num_layers;
    let a = InFlight::of(bytes, (0, layers), 0, false);
    let gate = in_step(&cost, a, PROMPT);
    let step = cost.layer_time(PROMPT) * layers as f64;
    eprintln!(
        "{policy} over {} GB/s: stall {:.1} µs of a {:.1} µs step (bound {:.0}%): {gate:?}",
        link.gbps,
        layer_stall(&cost, a, PROMPT) * 1e6,
        step * 1e6,
        MAX_STALL_SHARE * 100.0
    );
    let cfg = DriverConfig {
        policy,
        max_chunk: 256,
        max_batch_tokens: 512,
        loader_threads: 1,
    };
    coldstart::run(&mut e, &s.adapters, &s.requests, &cfg, &mut cost)
}

/// Every request of `r` completed with the tokens of the same request of `oracle`.
fn tokens_match(r: &RunReport, oracle: &RunReport) {
    for (i, (got, want)) in r.outcomes.iter().zip(&oracle.outcomes).enumerate() {
        assert_eq!(got.error, None, "request {i} failed");
        assert_eq!(got.tokens.len(), 6, "request {i}");
        assert_eq!(got.tokens, want.tokens, "request {i} differs from cached");
    }
}

fn same_tokens(r: &RunReport, oracle: &RunReport) {
    tokens_match(r, oracle);
    assert_eq!(
        r.rows_assisted, 0,
        "waiting for layers never computes on the CPU"
    );
}

/// Over a fast emulated link (1 GB/s: a layer's copy far shorter than the forward's layer) the gate
/// lets each miss run at once: its prefill starts before its adapter has every layer on the
/// device (a copy that starts only when the request arrives), and the tokens are the cached
/// run's.
#[test]
fn on_demand_starts_a_miss_before_its_adapter_landed_over_a_fast_link() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = setup(1);
    // A layer of an adapter copies in ~16 µs; the step computes a layer in about a millisecond.
    let link = LinkModel {
        gbps: 1.0,
        latency_us: 1.0,
    };
    let oracle = run(&s, ColdStartPolicy::Cached, link);
    let r = run(&s, ColdStartPolicy::OnDemand, link);
    same_tokens(&r, &oracle);
    for (i, o) in r.outcomes.iter().enumerate() {
        assert!(o.missed, "request {i}: its adapter was copied on arrival");
        assert!(!o.held, "request {i} was held on a fast link: {o:?}");
    }
    // Each copy starts when its request arrives and the request is planned in the same pass
    // of the loop: at least one of the four (on a loaded VM, a copy may still finish before the
    // plan) starts before its adapter landed, waiting for its layers in the forward.
    let early: Vec<_> = r
        .outcomes
        .iter()
        .filter(|o| o.layer_wait && o.started.unwrap() <= o.landed.unwrap())
        .collect();
    eprintln!(
        "{} of 4 misses started before their adapter landed",
        early.len()
    );
    assert!(!early.is_empty(), "no miss started before it landed: {r:?}");
}

/// Over a slow emulated link (100 kB/s: each layer's copy takes ~160 ms, the forward's layer
/// about a millisecond) waiting in the step would stall it far past the bound: every miss holds
/// until its adapter has landed, and computes what the cached run computes.
#[test]
fn on_demand_holds_a_miss_over_a_slow_link() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let s = setup(2);
    // A layer copies in ~160 ms, over a hundred times the step's layer.
    let link = LinkModel {
        gbps: 0.0001,
        latency_us: 50.0,
    };
    let oracle = run(&s, ColdStartPolicy::Cached, link);
    let r = run(&s, ColdStartPolicy::OnDemand, link);
    same_tokens(&r, &oracle);
    for (i, o) in r.outcomes.iter().enumerate() {
        assert!(o.held, "request {i} was not held: {o:?}");
        assert!(!o.layer_wait, "request {i} waited in the step: {o:?}");
        assert!(
            o.started.unwrap() >= o.landed.unwrap(),
            "request {i} started before its adapter landed: {o:?}"
        );
    }
}

/// The driver serves a disk miss from its mapped file as the server does, by the same choice
/// ([`ColdStartPolicy::serves_disk_miss_from_file`]), with no CPU workers too: every adapter
/// starts on disk and is registered from its file on its first request (its layers then read
/// layer by layer by the upload pipeline), and every policy computes the cached run's tokens.
/// `cached`, the oracle, makes every adapter resident before the run: it has no disk miss.
#[test]
fn every_policy_serves_a_disk_miss_from_its_file() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut s = setup(3);
    for a in &mut s.adapters {
        a.1 = StartTier::Disk;
    }
    let link = LinkModel {
        gbps: 1.0,
        latency_us: 1.0,
    };
    let oracle = run(&s, ColdStartPolicy::Cached, link);
    assert_eq!(
        oracle.disk_maps, 0,
        "the oracle starts with every adapter resident"
    );
    assert!(oracle.outcomes.iter().all(|o| !o.missed), "{oracle:?}");
    for policy in ColdStartPolicy::ALL {
        assert!(policy.serves_disk_miss_from_file(), "{policy}");
        if policy == ColdStartPolicy::Cached {
            continue;
        }
        let r = run(&s, policy, link);
        tokens_match(&r, &oracle);
        assert_eq!(
            r.disk_maps,
            s.adapters.len() as u64,
            "{policy}: every disk adapter registered from its file on its first request"
        );
        assert!(r.outcomes.iter().all(|o| o.missed), "{policy}: {r:?}");
    }
}
