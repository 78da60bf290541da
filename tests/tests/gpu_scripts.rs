//! The GPU lease scripts (`benches/gpu/lease.sh` and the run.sh / attn29.sh / tables.py /
//! peer29.py it calls) through their dry run (`lease.sh --dry-run`, `benches/gpu/dryrun.py`),
//! with this build's executables: a GPU lease is short and rare, so a misspelt flag, a test
//! filter matching nothing, an unknown `THAW_CUDA_` switch or a Python error must fail here,
//! not on the device.
//!
//! The executables are the CPU build's: `thaw` and `thaw-bench` (their clap parsers check the
//! scripts' subcommands and flags), `thaw-test-worker`, and the `cuda_parity` / `cuda_exchange`
//! test executables when this build made them. Built without `--features cuda` those list no
//! test, so the dry run (told `cuda 0` by BUILD, as `build.sh --cpu` writes it) reads their
//! tests from `tests/tests/cuda_parity.rs` and its `#[path]` modules; `cuda_bench` (built only
//! with cuda) is checked against its `FLAGS` list in `runtime/examples/cuda_bench/main.rs`.
//! Needs bash and python3 (as `.ci/run` does).
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use thaw_tests::http::{thaw_binary, workspace_binary};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The newest `deps/<name>-<hash>` test executable of this build, if cargo built it.
fn test_executable(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    let prefix = format!("{name}-");
    std::fs::read_dir(deps)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| {
            let f = e.file_name().to_string_lossy().into_owned();
            f.strip_prefix(&prefix)
                .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .max()
        .map(|(_, p)| p)
}

/// A gpu-bin/ as `benches/gpu/build.sh --cpu` lays it out, of links to this build's files.
fn cpu_gpu_bin(dir: &Path) {
    let link = |name: &str, target: &Path| {
        std::os::unix::fs::symlink(target, dir.join(name)).expect("link an executable");
    };
    link("thaw", &thaw_binary());
    link("thaw-bench", &workspace_binary("thaw-bench", "thaw-bench"));
    link(
        "thaw-test-worker",
        Path::new(env!("CARGO_BIN_EXE_thaw-test-worker")),
    );
    for name in ["cuda_parity", "cuda_exchange"] {
        if let Some(p) = test_executable(name) {
            link(name, &p);
        }
    }
    std::fs::write(
        dir.join("BUILD"),
        "commit test\nbuilt by tests/tests/gpu_scripts.rs\ncuda 0, profile dev\n",
    )
    .expect("write BUILD");
}

/// `python3 benches/gpu/dryrun.py --bin BIN --out TMP/out ARGS`.
fn dry_run<S: AsRef<OsStr>>(bin: &Path, tmp: &Path, args: &[S]) -> Output {
    Command::new("python3")
        .arg(repo().join("benches/gpu/dryrun.py"))
        .arg("--bin")
        .arg(bin)
        .arg("--out")
        .arg(tmp.join("out"))
        .args(args)
        .output()
        .expect("run python3 benches/gpu/dryrun.py")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn lease_parts_a_b_and_c_pass_the_dry_run() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("gpu-bin");
    std::fs::create_dir(&bin).unwrap();
    cpu_gpu_bin(&bin);
    // The parts at once: each is a few seconds of shims and --help parses.
    let children: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|part| {
            let child = Command::new("bash")
                .arg(repo().join("benches/gpu/lease.sh"))
                .args(["--dry-run", "--bin"])
                .arg(&bin)
                .arg("--out")
                .arg(tmp.path().join(format!("out-{part}")))
                .args(["--part", part])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("run bash benches/gpu/lease.sh --dry-run");
            (part, child)
        })
        .collect();
    for (part, child) in children {
        let o = child.wait_with_output().unwrap();
        let t = text(&o);
        assert!(
            o.status.success() && t.contains("dry run: OK"),
            "lease.sh --part {part} --dry-run:\n{t}"
        );
        // Both passes ran, and the worst case was summed within the part's limit.
        assert!(t.contains("fast: ") && t.contains("worst: "), "{t}");
        let exes = match *part {
            "a" => "cuda_parity",
            "b" => "cuda_bench thaw thaw-bench",
            _ => "thaw thaw-bench",
        };
        assert!(t.contains(&format!("executables called: {exes}")), "{t}");
    }
}

/// The scripts copied with one mistake of each kind the dry run is for: every one must be
/// named in its report, and the run must fail.
#[test]
fn the_dry_run_names_each_mistake_in_the_scripts() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("gpu-bin");
    std::fs::create_dir(&bin).unwrap();
    cpu_gpu_bin(&bin);
    // tmp/benches/gpu holds the edited copies; the scripts find the peer as ../peers.
    let gpu = tmp.path().join("benches/gpu");
    std::fs::create_dir_all(gpu.join("testdata")).unwrap();
    std::os::unix::fs::symlink(
        repo().join("benches/peers"),
        tmp.path().join("benches/peers"),
    )
    .unwrap();
    let src = repo().join("benches/gpu");
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, gpu.join(p.file_name().unwrap())).unwrap();
        }
    }
    std::fs::copy(
        src.join("testdata/load.json"),
        gpu.join("testdata/load.json"),
    )
    .unwrap();
    let edit = |file: &str, from: &str, to: &str| {
        let path = gpu.join(file);
        let s = std::fs::read_to_string(&path).unwrap();
        assert!(
            s.contains(from),
            "{file} no longer contains `{from}`: update this test"
        );
        std::fs::write(&path, s.replacen(from, to, 1)).unwrap();
    };
    // A misspelt thaw-bench flag (the op-profile step), a filter matching no test, a switch
    // the runtime does not know, a value a switch does not take, a cuda_bench flag it does not
    // take, an executable build.sh does not ship and a knob no script reads.
    edit(
        "attn29.sh",
        "--decode-steps 4 --op-profile",
        "--decode-stepz 4 --op-profile",
    );
    edit("lease.sh", "--nocapture opt_in", "--nocapture opt_inn");
    edit("attn29.sh", "THAW_CUDA_FUSED=1", "THAW_CUDA_FUSD=1");
    edit(
        "attn29.sh",
        "THAW_CUDA_LORA_IMPL=punica",
        "THAW_CUDA_LORA_IMPL=punika",
    );
    edit(
        "attn29.sh",
        "table --lora-slices lora-slices",
        "table --lora-slice lora-slices",
    );
    edit(
        "attn29.sh",
        "\"$BIN/thaw\" gen-model",
        "\"$BIN/thaw2\" gen-model",
    );
    edit("lease.sh", "THAW_GPU_29_OP_S=60", "THAW_GPU_29_OPS_S=60");
    // --part all in the fast pass only: every step runs, in a few seconds.
    let o = dry_run(
        &bin,
        tmp.path(),
        &[
            OsStr::new("--part"),
            OsStr::new("all"),
            OsStr::new("--modes"),
            OsStr::new("fast"),
            OsStr::new("--scripts"),
            gpu.as_os_str(),
            OsStr::new("--root"),
            repo().as_os_str(),
        ],
    );
    let t = text(&o);
    assert!(
        !o.status.success(),
        "the dry run passed edited scripts:\n{t}"
    );
    for needle in [
        "--decode-stepz",
        "filter `opt_inn` matches no test of cuda_parity",
        "THAW_CUDA_FUSD=1 is not a switch of runtime/src/backend/kernel_select.rs",
        "THAW_CUDA_LORA_IMPL=punika is not a value it takes",
        "cuda_bench does not take --lora-slice",
        "calls $BIN/thaw2, which build.sh does not ship",
        "sets THAW_GPU_29_OPS_S, which no script",
    ] {
        assert!(
            t.lines()
                .any(|l| l.starts_with("FAIL: ") && l.contains(needle)),
            "no FAIL line names `{needle}`:\n{t}"
        );
    }
    // The untouched parts of the scripts still pass: only the seven mistakes are reported
    // (the unknown switch also fails the static check of the scripts' text).
    let fails = t.lines().filter(|l| l.starts_with("FAIL: ")).count();
    assert!(fails <= 9, "{fails} FAIL lines for 7 mistakes:\n{t}");
}

/// The worst case (every step running to its timeout) is summed against the part's limit:
/// a limit under it fails the dry run, saying by how much.
#[test]
fn the_dry_run_fails_a_part_whose_timeouts_overrun_its_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("gpu-bin");
    std::fs::create_dir(&bin).unwrap();
    cpu_gpu_bin(&bin);
    let o = dry_run(
        &bin,
        tmp.path(),
        &["--part", "b", "--modes", "worst", "--limit", "200"],
    );
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("with every step running to its timeout the lease takes")
            && t.contains("over its 200 s"),
        "{t}"
    );
}
