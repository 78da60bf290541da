//! Segments of the wrong version, size or kind are refused on the worker's open path with an
//! error (never misread), and a pool whose workers cannot start reports it.

mod common;

use std::os::unix::fs::FileExt;
use std::process::Command;
use std::time::Duration;

use common::*;
use thaw_cpu_lora::stats::StatsSegment;
use thaw_cpu_lora::worker::{Worker, EXCHANGE_FD_ENV, STATS_FD_ENV, STORE_FD_ENV};
use thaw_cpu_lora::{CpuLoraError, LoraPool, PoolConfig, WaitMode};
use thaw_ipc::*;

fn small_exchange() -> Exchange {
    Exchange::create(ExchangeConfig {
        max_workers: 1,
        max_jobs: 4,
        max_inputs: 1,
        max_rows: 4,
        max_d_in: 8,
        max_d_out: 8,
    })
    .unwrap()
}

/// Runs the worker binary on the three segments; returns (success, stderr).
fn run_worker(ex: &Segment, store: &Segment, stats: &Segment) -> (bool, String) {
    let mut cmd = Command::new(worker_exe());
    cmd.args([
        "--worker-id",
        "0",
        "--reader-slot",
        "1",
        "--heartbeat-ms",
        "5",
    ]);
    ex.inherit_into(&mut cmd, EXCHANGE_FD_ENV);
    store.inherit_into(&mut cmd, STORE_FD_ENV);
    stats.inherit_into(&mut cmd, STATS_FD_ENV);
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Overwrites header bytes at `off` through a second fd (the memfd is sealed against
/// resizing, not writing).
fn poke(seg: &Segment, off: u64, bytes: &[u8]) {
    let f = std::fs::File::from(seg.try_clone_fd().unwrap());
    f.write_all_at(bytes, off).unwrap();
}

#[test]
fn worker_refuses_wrong_version() {
    let ex = small_exchange();
    let store = HostStore::create(1 << 20, 4).unwrap();
    let stats = StatsSegment::create(1).unwrap();
    poke(ex.segment(), 8, &(LAYOUT_VERSION + 1).to_le_bytes());
    let (ok, err) = run_worker(ex.segment(), store.segment(), stats.segment());
    assert!(!ok);
    assert!(err.contains("layout version"), "{err}");
}

#[test]
fn worker_refuses_wrong_size() {
    let ex = small_exchange();
    let store = HostStore::create(1 << 20, 4).unwrap();
    let stats = StatsSegment::create(1).unwrap();
    let real = store.segment().len() as u64;
    poke(store.segment(), 16, &(real + 4096).to_le_bytes());
    let (ok, err) = run_worker(ex.segment(), store.segment(), stats.segment());
    assert!(!ok);
    assert!(err.contains("bytes but the fd holds"), "{err}");
}

#[test]
fn worker_refuses_wrong_kind_and_foreign_stats() {
    let ex = small_exchange();
    let store = HostStore::create(1 << 20, 4).unwrap();
    let stats = StatsSegment::create(1).unwrap();
    // Store and exchange swapped.
    let (ok, err) = run_worker(store.segment(), ex.segment(), stats.segment());
    assert!(!ok && err.contains("layout kind"), "{err}");
    // A scratch segment that is not a stats segment.
    let scratch = Segment::create(SegmentKind::Scratch, "other", 4096).unwrap();
    let (ok, err) = run_worker(ex.segment(), store.segment(), &scratch);
    assert!(!ok && err.contains("stats segment"), "{err}");
    // In process, through the same open path.
    let open = |s: &Segment, k| Segment::open_fd(s.try_clone_fd().unwrap(), k).unwrap();
    let r = Worker::open(
        open(ex.segment(), SegmentKind::Exchange),
        open(store.segment(), SegmentKind::HostStore),
        open(&scratch, SegmentKind::Scratch),
        WorkerId(0),
        ReaderSlot(1),
        WaitMode::Futex,
        Duration::from_millis(5),
    );
    assert!(
        matches!(r, Err(CpuLoraError::Ipc(IpcError::CorruptHeader(_)))),
        "{r:?}"
    );
}

#[test]
fn worker_without_inherited_fds_fails_cleanly() {
    let out = Command::new(worker_exe())
        .args(["--worker-id", "0", "--reader-slot", "1"])
        .env_remove(EXCHANGE_FD_ENV)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no inherited segment fd"));
}

#[test]
fn pool_reports_workers_that_cannot_start() {
    let (store, ..) = store_with(&standard_specs(), 51);
    let cfg = PoolConfig {
        program: Some("/bin/false".into()),
        ..config(2, WaitStrategy::spin_then_futex())
    };
    let err = LoraPool::new(cfg, store).unwrap_err();
    assert!(matches!(err, CpuLoraError::WorkerStartup { .. }), "{err}");
    let (store, ..) = store_with(&standard_specs(), 52);
    let cfg = PoolConfig {
        cores: Some(vec![usize::MAX >> 1]),
        ..config(1, WaitStrategy::spin_then_futex())
    };
    let err = LoraPool::new(cfg, store).unwrap_err();
    assert!(matches!(err, CpuLoraError::WorkerStartup { .. }), "{err}");
}

#[test]
fn worker_refuses_a_core_outside_its_cpu_set() {
    let ex = small_exchange();
    let store = HostStore::create(1 << 20, 4).unwrap();
    let stats = StatsSegment::create(1).unwrap();
    let mut cmd = Command::new(worker_exe());
    cmd.args(["--worker-id", "0", "--reader-slot", "1", "--core", "100000"]);
    ex.segment().inherit_into(&mut cmd, EXCHANGE_FD_ENV);
    store.segment().inherit_into(&mut cmd, STORE_FD_ENV);
    stats.segment().inherit_into(&mut cmd, STATS_FD_ENV);
    let out = cmd.output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot pin"), "{err}");
}
