//! CPU assist through real worker processes: same tokens as the cached oracle, and a worker
//! killed mid-assist costs time, never correctness.
use std::path::PathBuf;
use std::time::Duration;

use thaw_cpu_lora::{LoraPool, PoolConfig};
use thaw_ipc::HostStore;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig};
use thaw_runtime::residency::LinkModel;
use thaw_runtime::sampling::SamplingParams;
use thaw_server::coldstart::{
    self, calibrate, ColdStartPolicy, DriverConfig, Request, RunReport, StartTier,
};
use thaw_tests::TestModel;

fn pool(workers: usize) -> LoraPool {
    let store = HostStore::create(64 << 20, 64).expect("host store");
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
            tm.adapter_dir(*r, t, 900 + i as u64),
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

#[test]
fn worker_assisted_tokens_equal_cached() {
    let (tm, adapters) = setup();
    let (oracle, _) = run(&tm, &adapters, ColdStartPolicy::Cached, None, |_| {});
    let (assisted, pool) = run(
        &tm,
        &adapters,
        ColdStartPolicy::CpuAssist,
        Some(pool(2)),
        |_| {},
    );
    assert!(assisted.rows_assisted > 0, "the workers computed nothing");
    for (i, (a, o)) in assisted.outcomes.iter().zip(&oracle.outcomes).enumerate() {
        assert_eq!(a.error, None);
        assert_eq!(
            a.tokens, o.tokens,
            "request {i}: worker-assisted tokens differ from cached"
        );
    }
    let mut pool = pool.unwrap();
    pool.shutdown();
}

#[test]
fn killing_a_worker_mid_assist_keeps_every_token_right() {
    let (tm, adapters) = setup();
    let (oracle, _) = run(&tm, &adapters, ColdStartPolicy::Cached, None, |_| {});
    let mut victim = None;
    let (r, pool) = run(
        &tm,
        &adapters,
        ColdStartPolicy::CpuAssist,
        Some(pool(2)),
        |p| {
            let pid = p.workers().find_map(|w| w.pid).expect("a worker runs");
            victim = Some(pid);
            // Kill it a few milliseconds into the run, while cold layers are being assisted.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(15));
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            });
        },
    );
    for (i, (a, o)) in r.outcomes.iter().zip(&oracle.outcomes).enumerate() {
        assert_eq!(a.error, None, "request {i} failed");
        assert_eq!(
            a.tokens, o.tokens,
            "request {i}: tokens differ after a worker was killed"
        );
    }
    let mut pool = pool.unwrap();
    pool.health_check().unwrap();
    let victim = victim.unwrap();
    assert!(
        pool.workers().all(|w| w.pid != Some(victim)),
        "the killed worker is still listed"
    );
    assert!(
        pool.workers().any(|w| w.restarts > 0),
        "no worker was respawned"
    );
    pool.shutdown();
}
