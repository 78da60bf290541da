//! Lifecycle: SIGTERM with requests in flight (the real `thaw serve` process), and the drain
//! timeout aborting what is left with a clear reason (in-process).
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use thaw_tests::http::{
    post, read_head, send_request, sse_data, thaw_binary, ServeFixture, SocketServer,
};

#[test]
fn sigterm_drains_in_flight_requests_and_exits() {
    let fx = ServeFixture::new(&[8]);
    // Long enough to drain 8 × 250 tokens on a starved machine (well under a second when the
    // cores are free; a 4 s timeout aborted them when the test got ~10% of each core): this
    // test is about draining, and `drain_timeout_aborts_with_a_clear_reason` covers the
    // deadline. The server still has to exit by itself, within it.
    let timeout = 60.0;
    let mut child = Command::new(thaw_binary())
        .args([
            "serve",
            "--port",
            "0",
            "--served-model-name",
            "base",
            "--max-num-seqs",
            "2",
        ])
        .arg("--model")
        .arg(fx.model_dir())
        .arg("--lora-modules")
        .arg(format!(
            "{}={}",
            fx.adapters[0].0,
            fx.adapters[0].1.display()
        ))
        .args(["--shutdown-timeout", &timeout.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn thaw serve");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let addr: std::net::SocketAddr = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "server exited before its banner"
        );
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    // Eight long streams (two run, six wait: --max-num-seqs 2); SIGTERM once all are in.
    let body = json!({"model": "base", "prompt": "drain me", "max_tokens": 250,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let (head_tx, head_rx) = std::sync::mpsc::channel();
    let streams: Vec<_> = (0..8)
        .map(|_| {
            let (body, head_tx) = (body.clone(), head_tx.clone());
            std::thread::spawn(move || {
                let mut r =
                    BufReader::new(send_request(addr, "POST", "/v1/completions", Some(&body)));
                let (status, _) = read_head(&mut r);
                head_tx.send(()).unwrap();
                let mut text = String::new();
                let mut l = String::new();
                while r.read_line(&mut l).unwrap_or(0) > 0 {
                    text.push_str(&l);
                    l.clear();
                }
                (status, text, Instant::now())
            })
        })
        .collect();
    for _ in 0..8 {
        head_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("stream started");
    }
    let t0 = Instant::now();
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs_f64(timeout + 5.0),
            "the server outlived --shutdown-timeout + 5 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "thaw serve exited with {status}");
    let mut ended_after_sigterm = 0;
    for s in streams {
        let (code, text, ended) = s.join().unwrap();
        if ended > t0 {
            ended_after_sigterm += 1;
        }
        assert_eq!(code, 200);
        let data = sse_data(&text);
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
        let finish: serde_json::Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
        assert_eq!(
            finish["choices"][0]["finish_reason"], "length",
            "in-flight requests finish: {text}"
        );
    }
    assert!(
        ended_after_sigterm > 0,
        "no request was in flight at SIGTERM"
    );
    // Gone: nothing listens any more.
    assert!(std::net::TcpStream::connect(addr).is_err());
}

#[test]
fn drain_timeout_aborts_with_a_clear_reason() {
    let fx = ServeFixture::new(&[]);
    let mut cfg = fx.config();
    cfg.shutdown_timeout = Duration::ZERO;
    cfg.max_num_seqs = 1;
    let srv = SocketServer::start(cfg);
    let a = srv.addr;
    let body = json!({"model": "base", "prompt": "x", "max_tokens": 250, "ignore_eos": true, "stream": true}).to_string();
    let mut r = BufReader::new(send_request(a, "POST", "/v1/completions", Some(&body)));
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 200);
    let waiting = std::thread::spawn(move || {
        post(
            a,
            "/v1/completions",
            &json!({"model": "base", "prompt": "y", "max_tokens": 250, "ignore_eos": true}),
        )
    });
    std::thread::sleep(Duration::from_millis(50));
    drop(srv); // stop signal: the drain deadline is now
    let mut text = String::new();
    let mut l = String::new();
    while r.read_line(&mut l).unwrap_or(0) > 0 {
        text.push_str(&l);
        l.clear();
    }
    let data = sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let completed = data
        .iter()
        .any(|d| d.contains("\"finish_reason\":\"length\""));
    let aborted = data.iter().any(|d| d.contains("--shutdown-timeout"));
    assert!(
        completed || aborted,
        "the stream ends with a reason: {text}"
    );
    let w = waiting.join().unwrap();
    assert!(matches!(w.status, 200 | 503), "{}", w.text());
    if w.status == 503 {
        let m = w.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.contains("shut"), "{m}");
    }
}
