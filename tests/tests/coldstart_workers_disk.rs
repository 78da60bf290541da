//! CPU assist from the disk tier (issue 27): an adapter registered from its memory-mapped
//! safetensors file is assisted by worker processes that read each layer from the file (a
//! host-store file entry) while the copy streams it. The tokens are the cached oracle's, and a
//! worker SIGKILLed in the middle of such an assist — the engine then computes its rows from
//! the file itself — changes none of them.
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thaw_cpu_lora::{LoraPool, PoolConfig};
use thaw_ipc::HostStore;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::residency::LinkModel;
use thaw_runtime::sampling::SamplingParams;
use thaw_server::coldstart::{self, calibrate, ColdStartPolicy, DriverConfig, Request, StartTier};
use thaw_server::gen::WeightDtype;
use thaw_tests::TestModel;

/// One worker (all of a step's rows go to it), started with the fault-injection directory:
/// while `<dir>/stall-0` exists it stops after writing some Δ of its first job of a step and
/// announces it with `<dir>/stalled-0-<pid>`.
fn stalling_pool(fault_dir: &Path) -> LoraPool {
    LoraPool::new(
        PoolConfig {
            cores: Some(vec![0]),
            pin: false,
            program: Some(PathBuf::from(env!("CARGO_BIN_EXE_thaw-test-worker"))),
            leading_args: vec![],
            calibration: vec![],
            env: vec![(
                OsString::from(thaw_cpu_lora::worker::FAULT_DIR_ENV),
                fault_dir.as_os_str().to_owned(),
            )],
            ..Default::default()
        },
        HostStore::create(64 << 20, 64).expect("host store"),
    )
    .expect("worker pool starts")
}

/// Stalls worker 0 in its next assisted step, then SIGKILLs it there (mid-assist, some of its
/// Δ written, the rest not) and lets its replacement run. Returns the victim's pid.
fn kill_worker_mid_assist(fault_dir: PathBuf) -> std::thread::JoinHandle<u32> {
    let stall = fault_dir.join("stall-0");
    std::fs::write(&stall, b"").unwrap();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(120);
        let pid = loop {
            let stalled = std::fs::read_dir(&fault_dir).unwrap().find_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                name.strip_prefix("stalled-0-")?.parse::<u32>().ok()
            });
            if let Some(pid) = stalled {
                break pid;
            }
            assert!(
                Instant::now() < deadline,
                "worker 0 never stalled mid-assist"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        // SIGKILL is pending before the stalled worker's sleep returns: it never sees this.
        std::fs::remove_file(&stall).unwrap();
        pid
    })
}

/// Greedy tokens of `prompt` under adapter `a`, one request alone.
fn greedy(e: &mut Engine<CpuBackend>, seq: u64, a: AdapterId, prompt: &[u32]) -> Vec<u32> {
    thaw_tests::greedy_alone(e, SeqId(seq), a, prompt, 8)
}

/// Adapters of every stored dtype on all seven modules, registered straight from their files:
/// the workers' host-store entry names the file (a few hundred bytes, no copy of the
/// weights), they compute every layer that has not landed from the file's bytes, a worker
/// SIGKILLed mid-assist is stood in for from the same file, and every greedy token is the
/// cached oracle's; once the adapter has landed its entry is gone.
#[test]
fn a_worker_killed_mid_assist_from_the_disk_tier_keeps_every_greedy_token() {
    let tm = TestModel::llama(73);
    let cfg = tm.model.config.clone();
    let all = ["q", "k", "v", "o", "gate", "up", "down"];
    let dirs: Vec<PathBuf> = [WeightDtype::Bf16, WeightDtype::F16, WeightDtype::F32]
        .into_iter()
        .enumerate()
        .map(|(i, dt)| tm.adapter_dir_as(16, &all, 940 + i as u64, Some(dt)))
        .collect();
    let prompt: Vec<u32> = (0..40u32)
        .map(|t| 3 + (t * 29) % (cfg.vocab_size as u32 - 3))
        .collect();
    let mut oracle = Engine::new(
        CpuBackend::new(&cfg),
        tm.model.clone(),
        EngineConfig::default(),
    )
    .unwrap();
    let want: Vec<Vec<u32>> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let a = Arc::new(LoraAdapter::load(d, &cfg).unwrap());
            oracle.register_adapter(AdapterId(i as u32), a).unwrap();
            greedy(&mut oracle, i as u64, AdapterId(i as u32), &prompt)
        })
        .collect();

    // Each adapter takes about 3 s on the link: every step below finds it streaming.
    let bytes = LoraAdapter::load(&dirs[0], &cfg).unwrap().size_bytes() as f64;
    let mut e = thaw_tests::cpu_engine_slow_link(tm.model.clone(), bytes, 3.0);
    let faults = tempfile::tempdir().unwrap();
    e.attach_pool(stalling_pool(faults.path())).unwrap();
    for (i, dir) in dirs.iter().enumerate() {
        let id = AdapterId(i as u32);
        let mapped = Arc::new(LoraAdapter::map(dir, &cfg).unwrap());
        e.register_adapter_streaming(id, mapped).unwrap();
        assert!(e.adapter_is_mapped(id));
        {
            let store = e.pool().unwrap().store();
            let (handle, extent) = store
                .live_extents()
                .into_iter()
                .find(|(h, _)| h.id.0 == i as u64)
                .expect("the adapter has a host-store entry");
            assert!(store.lease(handle).unwrap().is_file(), "adapter {i}");
            assert!(
                extent.end - extent.start < 8192,
                "{extent:?}: weights were copied"
            );
        }
        let killer = (i == 0).then(|| kill_worker_mid_assist(faults.path().to_path_buf()));
        let assisted = e.rows_assisted();
        assert_eq!(
            greedy(&mut e, 100 + i as u64, id, &prompt),
            want[i],
            "adapter {i} assisted from its file"
        );
        assert!(
            e.rows_assisted() > assisted,
            "adapter {i}: nothing assisted"
        );
        if let Some(k) = killer {
            let victim = k.join().expect("killer thread");
            let pool = e.pool().unwrap();
            assert!(pool.workers().all(|w| w.pid != Some(victim)));
            assert!(
                pool.workers().any(|w| w.restarts > 0),
                "no worker respawned"
            );
        }
    }
    // The loader's copy replaces the mapped one; the tokens stay the oracle's.
    let owned = Arc::new(LoraAdapter::load(&dirs[1], &cfg).unwrap());
    e.adopt_host_copy(AdapterId(1), owned).unwrap();
    assert!(!e.adapter_is_mapped(AdapterId(1)));
    assert_eq!(greedy(&mut e, 200, AdapterId(1), &prompt), want[1]);
    // Landed: every file entry is released.
    let deadline = Instant::now() + Duration::from_secs(60);
    while (0..3).any(|i| !e.adapter_resident(AdapterId(i))) {
        assert!(Instant::now() < deadline, "the adapters never landed");
        std::thread::sleep(Duration::from_millis(5));
    }
    e.release_landed();
    assert_eq!(e.adapters_in_store(), 0);
    assert_eq!(greedy(&mut e, 300, AdapterId(2), &prompt), want[2]);
    e.detach_pool().unwrap().shutdown();
}

/// The cold-start driver with every adapter on disk: under `cpu-assist` with a worker, each
/// is registered from its file when its first request arrives and assisted at once; with the
/// worker SIGKILLed mid-assist, every request's greedy tokens are `cached`'s.
#[test]
fn disk_tier_cpu_assist_through_the_driver_matches_cached() {
    let tm = TestModel::llama(79);
    let vocab = tm.model.config.vocab_size as u32;
    let adapters: Vec<(PathBuf, StartTier)> = [
        (16, &["q", "k", "v", "o"][..]),
        (32, &["gate", "up", "down"][..]),
    ]
    .iter()
    .enumerate()
    .map(|(i, (r, t))| {
        (
            tm.adapter_dir_as(*r, t, 960 + i as u64, Some(WeightDtype::Bf16)),
            StartTier::Disk,
        )
    })
    .collect();
    let requests: Vec<Request> = (0..6)
        .map(|i| Request {
            arrival: Duration::from_millis(3 * i as u64),
            prompt: (0..(20 + 3 * i) as u32)
                .map(|t| 3 + (t * 17 + i as u32 * 5) % (vocab - 3))
                .collect(),
            max_tokens: 5,
            adapter: Some(i % 2),
            sampling: SamplingParams::greedy(),
        })
        .collect();
    let run = |policy: ColdStartPolicy, pool: Option<LoraPool>| {
        let link = LinkModel {
            gbps: 0.002,
            latency_us: 50.0,
        };
        let backend = CpuBackend::new(&tm.model.config).with_link(link);
        let mut e = Engine::new(backend, tm.model.clone(), EngineConfig::default()).unwrap();
        if let Some(p) = pool {
            e.attach_pool(p).unwrap();
        }
        let mut cost = calibrate(&mut e).unwrap();
        assert_eq!(cost.assist_reads_disk, e.pool().is_some());
        let cfg = DriverConfig {
            policy,
            max_chunk: 16,
            max_batch_tokens: 256,
            loader_threads: 2,
        };
        let r = coldstart::run(&mut e, &adapters, &requests, &cfg, &mut cost);
        (r, e.detach_pool())
    };
    let (oracle, _) = run(ColdStartPolicy::Cached, None);
    let faults = tempfile::tempdir().unwrap();
    let pool = stalling_pool(faults.path());
    let killer = kill_worker_mid_assist(faults.path().to_path_buf());
    let (r, pool) = run(ColdStartPolicy::CpuAssist, Some(pool));
    let victim = killer.join().expect("killer thread");
    assert!(r.rows_assisted > 0, "nothing was assisted");
    assert!(r.steps.iter().any(|s| s.cold), "no cold step");
    for (i, (a, o)) in r.outcomes.iter().zip(&oracle.outcomes).enumerate() {
        assert_eq!(a.error, None, "request {i}");
        assert_eq!(a.tokens, o.tokens, "request {i}: tokens differ from cached");
    }
    let mut pool = pool.unwrap();
    pool.health_check().unwrap();
    assert!(pool.workers().all(|w| w.pid != Some(victim)));
    pool.shutdown();
}
