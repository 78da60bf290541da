//! Overload (issue 13, item 6): ten times more concurrent clients than the server can run and
//! queue get 429 with `Retry-After` from the bounded queue, the queue never grows past
//! --max-queued-requests, memory stays put, and afterwards the sustainable load is served in
//! full again. Its own test binary, so the process's memory is this test's alone.
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use serde_json::json;
use thaw_server::serve::ServeConfig;
use thaw_tests::http::{get, metric, post, ServeFixture, SocketServer};

const SEQS: usize = 2;
const QUEUE: usize = 4;
const TOKENS: usize = 48;

/// Resident set of this process, bytes (Linux; 0 elsewhere).
fn rss_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// `clients` threads released together, each sending `rounds` requests back to back;
/// returns (200s, 429s).
fn wave(addr: std::net::SocketAddr, clients: usize, rounds: usize) -> (usize, usize) {
    let ok = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(clients));
    let handles: Vec<_> = (0..clients)
        .map(|_| {
            let (ok, refused, start) = (ok.clone(), refused.clone(), start.clone());
            std::thread::spawn(move || {
                let body = json!({"model": "base", "prompt": "hi", "max_tokens": TOKENS,
                                  "ignore_eos": true});
                start.wait();
                for _ in 0..rounds {
                    let r = post(addr, "/v1/completions", &body);
                    match r.status {
                        200 => {
                            assert_eq!(r.json()["usage"]["completion_tokens"], TOKENS);
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        429 => {
                            let e = r.json()["error"].clone();
                            assert_eq!(e["code"], "queue_full", "{}", r.text());
                            let retry = r
                                .headers
                                .iter()
                                .find(|(k, _)| k == "retry-after")
                                .and_then(|(_, v)| v.parse::<u64>().ok());
                            assert!(retry.is_some_and(|s| s >= 1), "429 without Retry-After");
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                        s => panic!("overload answered {s}: {}", r.text()),
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("client thread");
    }
    (ok.load(Ordering::Relaxed), refused.load(Ordering::Relaxed))
}

#[test]
fn ten_times_overload_is_429_then_full_service() {
    let fx = ServeFixture::new(&[]);
    let srv = SocketServer::start(ServeConfig {
        max_num_seqs: SEQS,
        max_queued_requests: QUEUE,
        ..fx.config()
    });
    let a = srv.addr;
    // Sustainable: as many closed-loop clients as the server runs at once. Nobody is refused.
    assert_eq!(wave(a, SEQS, 3), (SEQS * 3, 0));
    let rss_before = rss_bytes();

    // Ten times what it can run and queue, all at once, each client retrying at once.
    let clients = 10 * (SEQS + QUEUE);
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut most = 0.0f64;
            while !stop.load(Ordering::Relaxed) {
                let m = get(a, "/metrics").text();
                most = most.max(metric(&m, "thaw_num_requests_waiting").unwrap_or(0.0));
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            most
        })
    };
    let (ok, refused) = wave(a, clients, 3);
    stop.store(true, Ordering::Relaxed);
    let most_waiting = watcher.join().unwrap();
    assert_eq!(ok + refused, clients * 3);
    assert!(refused > 0, "no 429 at 10x load ({ok} served)");
    assert!(ok >= SEQS, "the overload starved everyone");
    assert!(
        most_waiting <= QUEUE as f64,
        "the queue grew to {most_waiting}, past --max-queued-requests {QUEUE}"
    );

    // Back to the sustainable load: everything is served again, nothing left behind.
    assert_eq!(wave(a, SEQS, 3), (SEQS * 3, 0));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let m = get(a, "/metrics").text();
        let busy: Vec<&str> = [
            "thaw_num_requests_waiting",
            "thaw_num_requests_running",
            "thaw_kv_cache_used_blocks",
            "thaw_adapter_leases",
        ]
        .into_iter()
        .filter(|n| metric(&m, n) != Some(0.0))
        .collect();
        if busy.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{busy:?} not back to 0 after the overload:\n{m}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let grew = rss_bytes().saturating_sub(rss_before);
    assert!(
        grew < 64 << 20,
        "resident memory grew by {} MiB over {} refused requests",
        grew >> 20,
        refused
    );
}
