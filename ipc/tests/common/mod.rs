//! Helpers for multi-process tests: the test binary re-executes itself with a role in an
//! environment variable; the `child_entry` test of each file runs that role (and is a no-op
//! in a normal test run).

#![allow(dead_code)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use thaw_ipc::Segment;

/// Environment variable naming the child's role.
pub const ROLE_VAR: &str = "THAW_IPC_TEST_ROLE";

/// Spawns this test binary running only `child_entry` in role `role`, with `segments`
/// inherited (each under its env var) and extra env vars.
pub fn spawn_child(role: &str, segments: &[(&Segment, &str)], env: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args([
        "child_entry",
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ])
    .env(ROLE_VAR, role)
    .stdin(Stdio::null());
    for (seg, var) in segments {
        seg.inherit_into(&mut cmd, var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child test process")
}

/// Waits for `child` to exit (killing it after `limit`) and asserts it succeeded.
pub fn expect_success(mut child: Child, limit: Duration) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            assert!(status.success(), "child failed: {status}");
            return;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The role this process was started in, if it is a child.
pub fn role() -> Option<String> {
    std::env::var(ROLE_VAR).ok()
}

/// A deterministic byte pattern for (adapter id, generation, layer, module, which, index).
pub fn pattern(id: u64, generation: u64, layer: u32, module: usize, which: u8, i: usize) -> u8 {
    let mut x = id
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(generation.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(u64::from(layer) << 40)
        .wrapping_add((module as u64) << 32)
        .wrapping_add(u64::from(which) << 48)
        .wrapping_add(i as u64);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    (x >> 29) as u8
}
