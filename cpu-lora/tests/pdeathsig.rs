//! Workers die with their server even when it is SIGKILLed (PR_SET_PDEATHSIG): this test
//! re-runs its own binary as a "server" that starts a pool, prints the worker pids and
//! waits to be killed.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use thaw_ipc::WaitStrategy;

const HELPER: &str = "THAW_TEST_PDEATHSIG_SERVER";

#[test]
fn server_helper() {
    if std::env::var_os(HELPER).is_none() {
        return; // only does something when run as the helper process
    }
    let f = Fixture::new(
        config(2, WaitStrategy::spin_then_futex()),
        &standard_specs(),
        41,
    );
    let pids: Vec<String> = f
        .pool
        .workers()
        .filter_map(|w| w.pid)
        .map(|p| p.to_string())
        .collect();
    println!("PIDS {}", pids.join(" "));
    std::thread::sleep(Duration::from_secs(60));
}

fn gone(pid: i32) -> bool {
    // Our grandchildren are reparented to init (or a subreaper) and reaped there.
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
        || std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.split_whitespace().nth(2) == Some("Z"))
            .unwrap_or(true)
}

#[test]
fn workers_die_when_the_server_is_killed() {
    let mut server = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "server_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER, "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = server.stdout.take().unwrap();
    let mut pids = vec![];
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        // libtest may print "test server_helper ... " on the same line first.
        if let Some((_, rest)) = line.split_once("PIDS ") {
            pids = rest.split(' ').map(|p| p.parse::<i32>().unwrap()).collect();
            break;
        }
    }
    assert_eq!(pids.len(), 2, "helper did not report worker pids");
    assert!(pids.iter().all(|&p| !gone(p)));
    server.kill().unwrap(); // SIGKILL: no destructor runs in the server
    server.wait().unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while !pids.iter().all(|&p| gone(p)) {
        assert!(
            Instant::now() < until,
            "workers {pids:?} outlived their server"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
