//! After the pool is dropped: no worker process is alive (all reaped, no zombie), no
//! `/memfd:thaw-*` fd is open in this process, and nothing was created in `/dev/shm`.
//! Alone in its test binary so no other test's segments are open meanwhile.

mod common;

use common::*;
use thaw_cpu_lora::LoraJob;
use thaw_ipc::*;

fn thaw_memfds() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .filter(|p| p.starts_with("/memfd:thaw-"))
        .collect()
}

fn shm_entries() -> Vec<String> {
    match std::fs::read_dir("/dev/shm") {
        Ok(d) => d
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => vec![],
    }
}

fn pid_exists(pid: u32) -> bool {
    // kill(pid, 0) succeeds for a zombie too, so also check /proc.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None).is_ok()
        || std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn nothing_outlives_the_pool() {
    let shm_before = shm_entries();
    assert!(thaw_memfds().is_empty());
    let mut f = Fixture::new(
        config(2, WaitStrategy::spin_then_futex()),
        &standard_specs(),
        31,
    );
    let pids: Vec<u32> = f.pool.workers().filter_map(|w| w.pid).collect();
    assert_eq!(pids.len(), 2);
    let x = f.fill_input(0, 0..16, 256);
    let job = LoraJob {
        adapter: f.handles[0],
        layer: LayerIdx(0),
        modules: qkv(),
        input: 0,
        rows: 0..16,
    };
    let t = f.pool.submit(std::slice::from_ref(&job)).unwrap();
    f.pool.wait(t, Fixture::deadline()).unwrap();
    f.check_job(0, &job, &x);
    let open = thaw_memfds();
    assert!(open.iter().any(|p| p.contains("exchange")), "{open:?}");
    assert!(open.iter().any(|p| p.contains("host-store")), "{open:?}");
    assert!(open.iter().any(|p| p.contains("lora-stats")), "{open:?}");
    assert!(pids.iter().all(|&p| pid_exists(p)));
    // Kill one so drop also has a dead-but-unreaped child to collect.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0] as i32),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    drop(f);
    for p in &pids {
        assert!(!pid_exists(*p), "worker {p} outlived the pool");
    }
    assert_eq!(thaw_memfds(), Vec::<String>::new());
    assert_eq!(shm_entries(), shm_before, "/dev/shm changed");
}
