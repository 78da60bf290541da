//! Faults on purpose: workers killed mid-job, stuck, or dead between steps. Every step still
//! yields the oracle's Δ for every row, and the lost worker is respawned and serves again.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use thaw_cpu_lora::{LoraJob, PoolConfig, SlotState, Ticket};
use thaw_ipc::*;

fn fault_config(dir: &Path, wait: WaitStrategy) -> PoolConfig {
    PoolConfig {
        env: vec![(thaw_cpu_lora::worker::FAULT_DIR_ENV.into(), dir.into())],
        min_chunk_rows: 1,
        ..config(2, wait)
    }
}

fn big_job(f: &Fixture) -> LoraJob {
    LoraJob {
        adapter: f.handles[1],
        layer: LayerIdx(1),
        modules: qkv(),
        input: 0,
        rows: 0..48,
    }
}

/// Waits for `<dir>/stalled-<w>-<pid>` and returns the pid.
fn stalled_pid(dir: &Path, w: u32) -> u32 {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        for e in std::fs::read_dir(dir).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if let Some(pid) = name.strip_prefix(&format!("stalled-{w}-")) {
                return pid.parse().unwrap();
            }
        }
        assert!(Instant::now() < until, "worker {w} never stalled");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn pid_alive(pid: u32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None).is_ok()
}

/// Runs normal steps, each checked against the oracle, until worker `w` has computed rows in
/// one of them (at least 5 steps, at most 40) and fails if it never does. Not "in every step":
/// on a loaded 2-core machine a respawned worker's first measurements can be pessimistic (it
/// was preempted while timing itself) and the planner rightly gives it no rows until
/// `Profile::forgive` (×0.7 for each step it sat idle with rows to spare) brings it back; 40
/// steps forgive a 10⁶× misestimate.
fn serves_again(f: &mut Fixture, w: WorkerId) {
    f.pool.wait_ready(Duration::from_secs(20)).unwrap();
    let info = f.pool.workers().nth(w.0 as usize).unwrap();
    assert_eq!(info.state, SlotState::Ready);
    assert!(info.restarts >= 1);
    let mut served = 0;
    for step in 0..40 {
        let x = f.fill_input(0, 0..48, 256);
        let job = big_job(f);
        let t = f.pool.submit(std::slice::from_ref(&job)).unwrap();
        let rep = f.pool.wait(t, Fixture::deadline()).unwrap();
        assert_eq!(rep.rows_recovered, 0);
        f.check_job(1, &job, &x);
        served += usize::from(rep.workers.contains(w));
        if served > 0 && step >= 4 {
            return;
        }
    }
    panic!("respawned worker {w:?} got no rows in 40 steps");
}

/// Fills input 0 and submits [`big_job`] until worker `w` is assigned rows (at most 40
/// steps), completing and checking against the oracle each step where it got none; returns
/// the step in flight, its input and job. Each fault below needs `w` to take part in the step:
/// the split is profile-guided, and on a loaded machine `w`'s start-up calibration (a few
/// microseconds of work, so one preemption makes it look many times slower) can give it no
/// rows until `Profile::forgive` brings it back — the same as for a respawned worker.
fn submit_with_rows_for(f: &mut Fixture, w: WorkerId) -> (Ticket, Vec<f32>, LoraJob) {
    for _ in 0..40 {
        let x = f.fill_input(0, 0..48, 256);
        let job = big_job(f);
        let t = f.pool.submit(std::slice::from_ref(&job)).unwrap();
        if f.pool.last_assignments().iter().any(|a| a.worker == w) {
            return (t, x, job);
        }
        f.pool.wait(t, Fixture::deadline()).unwrap();
        f.check_job(1, &job, &x);
    }
    panic!("worker {w:?} got no rows in 40 steps");
}

fn kill_mid_job(wait: WaitStrategy) {
    let dir = tempfile::tempdir().unwrap();
    let mut f = Fixture::new(fault_config(dir.path(), wait), &standard_specs(), 21);
    std::fs::write(dir.path().join("stall-0"), b"").unwrap();
    let (t, x, job) = submit_with_rows_for(&mut f, WorkerId(0));
    // Worker 0 has written part of its Δ and stopped before reporting: kill -9 it there.
    let pid = stalled_pid(dir.path(), 0);
    assert_eq!(f.pool.workers().next().unwrap().pid, Some(pid));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    std::fs::remove_file(dir.path().join("stall-0")).unwrap();
    let rep = f.pool.wait(t, Fixture::deadline()).unwrap();
    assert!(rep.lost.contains(WorkerId(0)), "{rep:?}");
    assert!(rep.respawned.contains(WorkerId(0)), "{rep:?}");
    assert!(rep.rows_recovered > 0);
    assert_eq!(rep.rows_recovered + rep.rows_by_workers, 48 * 3);
    assert!(f.pool.last_assignments().iter().any(|a| a.recovered));
    f.check_job(1, &job, &x);
    assert!(!pid_alive(pid), "killed worker was not reaped");
    serves_again(&mut f, WorkerId(0));
}

fn stuck_worker_by_heartbeat(wait: WaitStrategy) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = PoolConfig {
        heartbeat_timeout: Duration::from_millis(200),
        ..fault_config(dir.path(), wait)
    };
    let mut f = Fixture::new(cfg, &standard_specs(), 22);
    std::fs::write(dir.path().join("stall-1"), b"").unwrap();
    let (t, x, job) = submit_with_rows_for(&mut f, WorkerId(1));
    let t0 = Instant::now();
    let rep = f
        .pool
        .wait(t, Instant::now() + Duration::from_secs(60))
        .unwrap();
    std::fs::remove_file(dir.path().join("stall-1")).unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "stuck worker not detected by heartbeat"
    );
    assert!(rep.lost.contains(WorkerId(1)), "{rep:?}");
    f.check_job(1, &job, &x);
    serves_again(&mut f, WorkerId(1));
}

fn stuck_worker_by_deadline(wait: WaitStrategy) {
    let dir = tempfile::tempdir().unwrap();
    let mut f = Fixture::new(fault_config(dir.path(), wait), &standard_specs(), 23);
    std::fs::write(dir.path().join("stall-0"), b"").unwrap();
    let (t, x, job) = submit_with_rows_for(&mut f, WorkerId(0));
    let rep = f
        .pool
        .wait(t, Instant::now() + Duration::from_millis(100))
        .unwrap();
    std::fs::remove_file(dir.path().join("stall-0")).unwrap();
    assert!(rep.lost.contains(WorkerId(0)), "{rep:?}");
    f.check_job(1, &job, &x);
    serves_again(&mut f, WorkerId(0));
}

fn dead_between_steps(wait: WaitStrategy) {
    let mut f = Fixture::new(config(2, wait), &standard_specs(), 24);
    let pid = f.pool.workers().nth(1).unwrap().pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    // The next submit notices, respawns, and the step is still complete and correct.
    let x = f.fill_input(0, 0..48, 256);
    let job = big_job(&f);
    let t = f.pool.submit(std::slice::from_ref(&job)).unwrap();
    f.pool.wait(t, Fixture::deadline()).unwrap();
    f.check_job(1, &job, &x);
    assert_ne!(f.pool.workers().nth(1).unwrap().pid, Some(pid));
    serves_again(&mut f, WorkerId(1));
}

fn engine_computes_when_no_worker_is_left(wait: WaitStrategy) {
    let cfg = PoolConfig {
        max_restarts: 0,
        ..config(1, wait)
    };
    let mut f = Fixture::new(cfg, &standard_specs(), 25);
    let pid = f.pool.workers().next().unwrap().pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    for _ in 0..3 {
        let x = f.fill_input(0, 0..48, 256);
        let job = big_job(&f);
        let t = f.pool.submit(std::slice::from_ref(&job)).unwrap();
        let rep = f.pool.wait(t, Fixture::deadline()).unwrap();
        assert_eq!(rep.rows_recovered, 48 * 3, "{rep:?}");
        f.check_job(1, &job, &x);
    }
    assert_eq!(f.pool.workers().next().unwrap().state, SlotState::Disabled);
}

macro_rules! faults {
    ($name:ident, $wait:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn kill_mid_job() {
                super::kill_mid_job($wait);
            }

            #[test]
            fn stuck_worker_by_heartbeat() {
                super::stuck_worker_by_heartbeat($wait);
            }

            #[test]
            fn stuck_worker_by_deadline() {
                super::stuck_worker_by_deadline($wait);
            }

            #[test]
            fn dead_between_steps() {
                super::dead_between_steps($wait);
            }

            #[test]
            fn engine_computes_when_no_worker_is_left() {
                super::engine_computes_when_no_worker_is_left($wait);
            }
        }
    };
}

faults!(spin, WaitStrategy::spin());
faults!(spin_then_futex, WaitStrategy::spin_then_futex());
