//! Smoke runs of the CPU LoRA benchmarks' `--quick` modes, so they do not rot. They spawn
//! worker processes from the `thaw-bench` binary itself, hence an integration test.

use std::process::Command;

fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_thaw-bench"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "thaw-bench {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn lora_ipc_quick() {
    let t = run(&["lora-ipc", "--quick", "--workers", "2"]);
    assert!(t.contains("IPC p50"), "{t}");
    for mode in ["shm spin", "shm futex", "socket"] {
        assert!(t.contains(mode), "{t}");
    }
}

#[test]
fn lora_scaling_quick() {
    let t = run(&["lora-scaling", "--quick", "--workers", "2"]);
    assert!(t.contains("threads p50 ms"), "{t}");
    assert!(t.contains("Fig. 18 left"), "{t}");
}
