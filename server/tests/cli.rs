//! The `thaw` executable as a user runs it: generate a model and adapters, generate text with
//! and without an adapter, and refuse bad input with an error that says what to do.
//!
//! Being an integration test of `thaw-server`, this also makes `cargo test --workspace` build
//! `target/<profile>/thaw` with the workspace's features, which the benchmark smoke tests
//! (`benches/tests/bench_quick.rs`) spawn.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn thaw(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thaw"))
        .args(args)
        .output()
        .expect("spawn thaw")
}

fn ok(args: &[&str]) -> String {
    let out = thaw(args);
    assert!(
        out.status.success(),
        "thaw {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn failed(args: &[&str]) -> String {
    let out = thaw(args);
    assert!(!out.status.success(), "thaw {args:?} should have failed");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The generated tiny model and its two adapters (rank 8 and 16).
fn tiny(dir: &Path) -> (PathBuf, Vec<PathBuf>) {
    let (model, adapters) = (dir.join("model"), dir.join("adapters"));
    ok(&["gen-model", "--preset", "tiny", "--out", s(&model)]);
    ok(&[
        "gen-adapters",
        "--model",
        s(&model),
        "--count",
        "2",
        "--ranks",
        "8,16",
        "--out",
        s(&adapters),
    ]);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&adapters)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    (model, dirs)
}

#[test]
fn generated_model_and_adapters_generate_text() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, adapters) = tiny(tmp.path());
    for file in ["config.json", "tokenizer.json"] {
        assert!(model.join(file).is_file(), "gen-model wrote no {file}");
    }
    assert_eq!(adapters.len(), 2, "{adapters:?}");
    for dir in &adapters {
        let config: serde_json::Value = serde_json::from_slice(
            &std::fs::read(dir.join("adapter_config.json")).expect("adapter_config.json"),
        )
        .unwrap();
        assert_eq!(config["peft_type"], "LORA", "{config}");
        assert!(dir.join("adapter_model.safetensors").is_file());
    }
    let generate = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            s(&model),
            "--max-tokens",
            "8",
            "--ignore-eos",
        ];
        args.extend_from_slice(extra);
        ok(&args)
    };
    let base = generate(&["--no-adapter"]);
    let lora = generate(&["--adapter", s(&adapters[1])]);
    assert!(!base.trim().is_empty(), "no text generated");
    // Greedy decoding is deterministic: the same command prints the same text.
    assert_eq!(base, generate(&["--no-adapter"]));
    assert_eq!(lora, generate(&["--adapter", s(&adapters[1])]));
}

#[test]
fn bad_input_is_refused_with_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-model");
    let err = failed(&["generate", "--model", s(&missing)]);
    assert!(err.contains("no-such-model"), "error names no path:\n{err}");

    let (model, adapters) = tiny(tmp.path());
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", "--model", s(&model), "--port", "0"];
        args.extend_from_slice(extra);
        failed(&args)
    };
    let err = serve(&["--lora-modules", "missing-equals-sign"]);
    assert!(
        err.contains("name=path"),
        "error does not show the form:\n{err}"
    );

    let big = format!("big={}", s(&adapters[1]));
    let err = serve(&["--max-lora-rank", "8", "--lora-modules", &big]);
    assert!(
        err.contains("rank") && err.contains("--max-lora-rank"),
        "error does not point at --max-lora-rank:\n{err}"
    );
}

#[test]
fn logs_to_a_file_carry_no_colour_codes() {
    use std::io::Read;
    use std::process::Stdio;
    let tmp = tempfile::tempdir().unwrap();
    let (model, _) = tiny(tmp.path());
    let log = tmp.path().join("serve.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_thaw"))
        .args(["serve", "--model", s(&model), "--port", "0"])
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn thaw serve");
    // The start-up line is logged before the server listens; wait for it, then stop the server.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut text = String::new();
    while !text.contains("INFO") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
        text.clear();
        std::fs::File::open(&log)
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(text.contains("INFO"), "serve logged nothing:\n{text}");
    assert!(
        !text.contains('\u{1b}'),
        "ANSI escape codes in a log written to a file:\n{text:?}"
    );
}
