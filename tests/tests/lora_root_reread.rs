//! A runtime-loaded adapter under `--lora-root` is re-read from disk (after the memory manager
//! dropped its host copy) through the same confinement as its first load: once its directory
//! is swapped for a link out of the root, the request that needs it gets a clear error — not
//! a hang, not a leaked lease — and the server keeps serving.
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use thaw_tests::http::{get, metric, post, ServeFixture, SocketServer};

/// The tier `/v1/models` reports for adapter `name`.
fn tier(addr: std::net::SocketAddr, name: &str) -> String {
    let models = get(addr, "/v1/models").json();
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == name)
        .and_then(|m| m["tier"].as_str())
        .unwrap_or_else(|| panic!("no adapter `{name}` in {models}"))
        .to_string()
}

fn complete(addr: std::net::SocketAddr, model: &str) -> (u16, Value) {
    let r = post(
        addr,
        "/v1/completions",
        &json!({"model": model, "prompt": "hi", "max_tokens": 2}),
    );
    (r.status, r.json())
}

/// Requests the start-up adapters until `name` has left host memory too (a device budget of a
/// few adapters beside the KV, one host slot: the others used after it push it out).
fn push_to_disk(addr: std::net::SocketAddr, fx: &ServeFixture, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    for (other, _) in fx.adapters.iter().cycle() {
        if tier(addr, name) == "disk" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "`{name}` still in tier {}",
            tier(addr, name)
        );
        let (status, body) = complete(addr, other);
        assert_eq!(status, 200, "{body}");
    }
}

#[test]
fn rereads_under_lora_root_refuse_a_directory_swapped_for_a_link() {
    let fx = ServeFixture::new(&[8; 4]);
    let root = fx.dir.path().join("copies");
    let victim = fx.copy_adapter(0, "victim");
    let server = SocketServer::start(thaw_server::serve::ServeConfig {
        lora_root: Some(root.clone()),
        // 24 pages of 16 KiB: one sequence's KV (16 pages at --max-model-len 256) and room
        // for a rank-8 adapter (8 pages) or two: every other adapter used evicts the victim.
        device_memory_bytes: (24 * 16) << 10,
        max_cpu_loras: 1,
        ..fx.config()
    });
    let addr = server.addr;
    let r = post(
        addr,
        "/v1/load_lora_adapter",
        &json!({"lora_name": "victim", "lora_path": "victim"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());

    // Evicted to disk and read back through the confined path: served.
    push_to_disk(addr, &fx, "victim");
    let (status, body) = complete(addr, "victim");
    assert_eq!(
        status, 200,
        "confined re-read of an untouched adapter: {body}"
    );

    // Evicted again, then its directory replaced by a link to an adapter of the same size
    // outside the root (an unconfined read would accept it).
    push_to_disk(addr, &fx, "victim");
    std::fs::rename(&victim, fx.dir.path().join("moved-victim")).unwrap();
    std::os::unix::fs::symlink(&fx.adapters[1].1, &victim).unwrap();
    let t = Instant::now();
    let (status, body) = complete(addr, "victim");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(status, 503, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("no longer inside the server's --lora-root"),
        "{msg}"
    );
    assert!(msg.contains("<lora-root>/victim"), "{msg}");
    assert!(
        !msg.contains(&*fx.dir.path().to_string_lossy()),
        "the root's location leaked: {msg}"
    );
    // Asked again: the same refusal (no cached copy from the link slipped in).
    let (status, body) = complete(addr, "victim");
    assert_eq!(status, 503, "{body}");

    // Nothing leaked, and the other adapters and the base model still serve.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = get(addr, "/metrics").text();
        let leases = metric(&m, "thaw_adapter_leases").expect("thaw_adapter_leases");
        let kv = metric(&m, "thaw_kv_cache_used_blocks").expect("thaw_kv_cache_used_blocks");
        if leases == 0.0 && kv == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "leases {leases}, KV blocks {kv}");
        std::thread::sleep(Duration::from_millis(100));
    }
    for model in ["base", fx.adapters[2].0.as_str()] {
        let (status, body) = complete(addr, model);
        assert_eq!(status, 200, "{model}: {body}");
    }
    assert_ne!(tier(addr, "victim"), "host", "a refused read never lands");
}
