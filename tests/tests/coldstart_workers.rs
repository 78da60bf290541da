//! CPU assist through real worker processes: same tokens as the cached oracle, and a worker
//! killed mid-assist costs time, never correctness.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use thaw_cpu_lora::LoraPool;
use thaw_ipc::HostStore;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig};
use thaw_runtime::ids::AdapterId;
use thaw_runtime::residency::LinkModel;
use thaw_runtime::sampling::SamplingParams;
use thaw_server::coldstart::{
    self, calibrate, ColdStartPolicy, DriverConfig, Request, RunReport, StartTier,
};
use thaw_tests::TestModel;
use workers_support::{greedy, pool_with};

mod workers_support;

fn pool(workers: usize) -> LoraPool {
    pool_with(
        workers,
        HostStore::create(64 << 20, 64).expect("host store"),
    )
}

fn requests(vocab: usize) -> Vec<Request> {
    (0..10)
        .map(|i| Request {
            arrival: Duration::from_millis(2 * i as u64),
            prompt: (0..(12 + 5 * i) as u32)
                .map(|t| 3 + (t * 31 + i as u32 * 7) % (vocab as u32 - 3))
                .collect(),
            max_tokens: 6,
            adapter: Some(i % 4),
            sampling: if i % 3 == 0 {
                SamplingParams {
                    temperature: 0.7,
                    seed: Some(i as u64),
                    ..Default::default()
                }
            } else {
                SamplingParams::greedy()
            },
        })
        .collect()
}

fn run(
    tm: &TestModel,
    adapters: &[(PathBuf, StartTier)],
    policy: ColdStartPolicy,
    workers: Option<LoraPool>,
    during: impl FnOnce(&LoraPool),
) -> (RunReport, Option<LoraPool>) {
    // 4 MB/s: the adapters stream for most of the run, so the workers do real work.
    let link = LinkModel {
        gbps: 0.004,
        latency_us: 50.0,
    };
    let backend = CpuBackend::new(&tm.model.config).with_link(link);
    let mut e = Engine::new(backend, tm.model.clone(), EngineConfig::default()).unwrap();
    if let Some(p) = workers {
        e.attach_pool(p).unwrap();
    }
    if let Some(p) = e.pool() {
        during(p);
    }
    let mut cost = calibrate(&mut e).unwrap();
    let cfg = DriverConfig {
        policy,
        max_chunk: 16,
        max_batch_tokens: 256,
        loader_threads: 2,
    };
    let r = coldstart::run(
        &mut e,
        adapters,
        &requests(tm.model.config.vocab_size),
        &cfg,
        &mut cost,
    );
    (r, e.detach_pool())
}

fn setup() -> (TestModel, Vec<(PathBuf, StartTier)>) {
    setup_as(None)
}

/// The four adapters saved in `dtype` (`None`: the model's).
fn setup_as(
    dtype: Option<thaw_server::gen::WeightDtype>,
) -> (TestModel, Vec<(PathBuf, StartTier)>) {
    let tm = TestModel::llama(61);
    let adapters = [
        (16, &["q", "k", "v", "o"][..]),
        (32, &["q", "k", "v", "o", "gate", "up", "down"][..]),
        (8, &["gate", "up", "down"][..]),
        (64, &["q", "v"][..]),
    ]
    .iter()
    .enumerate()
    .map(|(i, (r, t))| {
        (
            tm.adapter_dir_as(*r, t, 900 + i as u64, dtype),
            if i % 2 == 0 {
                StartTier::Streaming
            } else {
                StartTier::Disk
            },
        )
    })
    .collect();
    (tm, adapters)
}

/// Runs the adapters once under `cached` (the oracle) and once assisted by two real workers,
/// and asserts the workers computed rows and every request got the oracle's tokens.
fn assert_worker_tokens_equal_cached(
    tm: &TestModel,
    adapters: &[(PathBuf, StartTier)],
    what: &str,
) {
    let (oracle, _) = run(tm, adapters, ColdStartPolicy::Cached, None, |_| {});
    let (assisted, pool) = run(
        tm,
        adapters,
        ColdStartPolicy::CpuAssist,
        Some(pool(2)),
        |_| {},
    );
    assert!(assisted.rows_assisted > 0, "the workers computed nothing");
    for (i, (a, o)) in assisted.outcomes.iter().zip(&oracle.outcomes).enumerate() {
        assert_eq!(a.error, None);
        assert_eq!(
            a.tokens, o.tokens,
            "request {i}: {what} worker-assisted tokens differ from cached"
        );
    }
    pool.expect("the assisted run had a pool").shutdown();
}

#[test]
fn worker_assisted_tokens_equal_cached() {
    let (tm, adapters) = setup();
    assert_worker_tokens_equal_cached(&tm, &adapters, "f32");
}

/// The workers compute from the host store's bytes in the adapters' stored dtype: bf16
/// adapters (2 bytes a weight in the store) give the cached oracle's tokens too.
#[test]
fn worker_assisted_tokens_equal_cached_for_bf16_adapters() {
    let (tm, adapters) = setup_as(Some(thaw_server::gen::WeightDtype::Bf16));
    let config = &tm.model.config;
    for (dir, _) in &adapters {
        let a = LoraAdapter::load(dir, config).unwrap();
        assert_eq!(a.dtype(), thaw_runtime::adapter::WeightDtype::Bf16);
    }
    assert_worker_tokens_equal_cached(&tm, &adapters, "bf16");
}

#[test]
fn killing_a_worker_mid_assist_keeps_every_token_right() {
    let (tm, adapters) = setup();
    let (oracle, _) = run(&tm, &adapters, ColdStartPolicy::Cached, None, |_| {});
    let mut victim = None;
    let mut killer = None;
    let (r, pool) = run(
        &tm,
        &adapters,
        ColdStartPolicy::CpuAssist,
        Some(pool(2)),
        |p| {
            let pid = p.workers().find_map(|w| w.pid).expect("a worker runs");
            victim = Some(pid);
            // Kill it a few milliseconds into the run, while cold layers are being assisted.
            killer = Some(std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(15));
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }));
        },
    );
    // On a loaded machine the killer can wake after the run ended: wait until the kill is
    // sent (a health check before it would find the victim alive).
    killer.expect("the pool ran").join().expect("killer thread");
    for (i, (a, o)) in r.outcomes.iter().zip(&oracle.outcomes).enumerate() {
        assert_eq!(a.error, None, "request {i} failed");
        assert_eq!(
            a.tokens, o.tokens,
            "request {i}: tokens differ after a worker was killed"
        );
    }
    let mut pool = pool.unwrap();
    let victim = victim.unwrap();
    // SIGKILL is delivered asynchronously: if it came after the run, the health check that
    // reaps and replaces the victim may need a few tries before the process has exited.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        pool.health_check().unwrap();
        if pool.workers().all(|w| w.pid != Some(victim)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the killed worker is still listed 30 s after its SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        pool.workers().any(|w| w.restarts > 0),
        "no worker was respawned"
    );
    pool.shutdown();
}

/// Waits (up to 60 s, for a loaded machine) until every layer of `a` has landed.
fn wait_landed(e: &Engine<CpuBackend>, a: AdapterId) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !e.adapter_resident(a) {
        assert!(
            std::time::Instant::now() < deadline,
            "adapter {a} never landed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A fully landed adapter gives its host-store slot back (the workers compute only layers
/// not on the device): a store with 2 index slots serves 5 adapters registered one after
/// another and all kept on the device (before, every registered adapter kept its slot and
/// the third insert failed), the workers assist while each streams, and the tokens are the
/// cached oracle's before the release, after it, and after an eviction and re-registration.
#[test]
fn landed_adapters_release_their_host_store_slots() {
    let tm = TestModel::llama(67);
    let cfg = tm.model.config.clone();
    let adapters: Vec<Arc<LoraAdapter>> = (0..5)
        .map(|i| tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 970 + i))
        .collect();
    let prompt: Vec<u32> = (0..24u32)
        .map(|t| 3 + (t * 37) % (cfg.vocab_size as u32 - 3))
        .collect();
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
    let want: Vec<Vec<u32>> = (0..adapters.len())
        .map(|i| greedy(&mut oracle, i as u64, AdapterId(i as u32), &prompt))
        .collect();
    // Each adapter takes about 200 ms on the link, so the first step finds it streaming.
    let bytes = adapters[0].size_bytes() as f64;
    let mut e = thaw_tests::cpu_engine_slow_link(tm.model.clone(), bytes, 0.2);
    e.attach_pool(pool_with(
        1,
        HostStore::create(64 << 20, 2).expect("host store"),
    ))
    .unwrap();
    let mut seq = 100;
    for (i, a) in adapters.iter().enumerate() {
        let id = AdapterId(i as u32);
        e.register_adapter_streaming(id, a.clone()).unwrap();
        assert_eq!(
            e.adapters_in_store(),
            1,
            "adapter {i}: the landed ones gave their slots back, the new one took one"
        );
        let assisted = e.rows_assisted();
        seq += 1;
        assert_eq!(
            greedy(&mut e, seq, id, &prompt),
            want[i],
            "adapter {i} streaming"
        );
        assert!(
            e.rows_assisted() > assisted,
            "adapter {i}: the workers computed nothing"
        );
        wait_landed(&e, id);
        seq += 1;
        assert_eq!(
            greedy(&mut e, seq, id, &prompt),
            want[i],
            "adapter {i} landed"
        );
        assert_eq!(e.adapters_in_store(), 0, "adapter {i} kept its slot");
        assert!(e.pool().unwrap().store().live_extents().is_empty());
    }
    assert!((0..5).all(|i| e.has_adapter(AdapterId(i))));
    // Evicted and registered again: a new slot, a new generation, the same tokens.
    e.unregister_adapter(AdapterId(0)).unwrap();
    e.register_adapter_streaming(AdapterId(0), adapters[0].clone())
        .unwrap();
    assert_eq!(e.adapters_in_store(), 1);
    assert_eq!(greedy(&mut e, 200, AdapterId(0), &prompt), want[0]);
    // Landed adapters used again (slots released) still give the oracle's tokens.
    for i in 1..5 {
        assert_eq!(
            greedy(&mut e, 300 + i, AdapterId(i as u32), &prompt),
            want[i as usize]
        );
    }
    e.detach_pool().unwrap().shutdown();
}
