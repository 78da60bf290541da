//! A disk-tier adapter's file is read into host memory once (issue 27): the server's loader
//! reads it in place (mapped, every weight checked where it lies, no heap copy), the upload
//! pipeline encodes those pages into the arena once and every later load reuses the image,
//! the host tier counts what is resident (the arena images, not the mapped pages as heap), and
//! the CPU LoRA workers read the same file at every load (a file entry, no copy into their
//! store) — with every greedy token the oracle's, workers on or off.
//!
//! One test: it reads process-wide counters (bytes of adapter files copied into memory).
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use thaw_cpu_lora::LoraPool;
use thaw_ipc::HostStore;
use thaw_runtime::adapter::{file_bytes_copied, LoraAdapter};
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::Backend as _;
use thaw_runtime::engine::{Engine, EngineConfig};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_server::gen::WeightDtype;
use thaw_server::memory::loader::{FetchJob, Loader};
use thaw_server::memory::{AdapterMeta, Board, EvictionPolicy, MemoryConfig, MemoryManager};
use thaw_tests::TestModel;

mod workers_support;

fn greedy(e: &mut Engine<CpuBackend>, seq: u64, a: AdapterId, prompt: &[u32]) -> Vec<u32> {
    thaw_tests::greedy_alone(e, SeqId(seq), a, prompt, 8)
}

fn one_worker() -> LoraPool {
    workers_support::pool_with(1, HostStore::create(64 << 20, 64).expect("host store"))
}

/// Waits until the upload arena is idle and returns its usage.
fn arena_idle(e: &Engine<CpuBackend>) -> thaw_runtime::upload::ArenaUsage {
    let t = Instant::now();
    loop {
        let u = e.backend().upload_arena().expect("the pipeline is started");
        if u.idle {
            return u;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "{u:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_disk_adapter_is_read_into_host_memory_once() {
    let tm = TestModel::llama(97);
    let cfg = tm.model.config.clone();
    let all = ["q", "k", "v", "o", "gate", "up", "down"];
    let dirs: Vec<PathBuf> = [WeightDtype::Bf16, WeightDtype::F16, WeightDtype::F32]
        .into_iter()
        .enumerate()
        .map(|(i, dt)| tm.adapter_dir_as(16, &all, 990 + i as u64, Some(dt)))
        .collect();
    let file_len = |d: &PathBuf| {
        std::fs::metadata(d.join("adapter_model.safetensors"))
            .unwrap()
            .len()
    };

    // The server's loader reads each adapter as the CPU backend computes it (stored dtype).
    let copied = file_bytes_copied();
    let (tx, rx) = std::sync::mpsc::channel();
    let loader = Loader::start(cfg.clone(), 2, None, move |id, r| {
        let _ = tx.send((id, r));
    })
    .unwrap();
    for (i, d) in dirs.iter().enumerate() {
        assert!(loader.fetch(FetchJob {
            id: AdapterId(i as u32),
            path: d.clone(),
            root: None,
            bytes: None,
        }));
    }
    let mut host: Vec<Option<Arc<LoraAdapter>>> = vec![None; dirs.len()];
    for _ in 0..dirs.len() {
        let (id, r) = rx.recv_timeout(Duration::from_secs(60)).expect("a read");
        host[id.0 as usize] = Some(r.expect("the read succeeds").0);
    }
    drop(loader);
    let host: Vec<Arc<LoraAdapter>> = host.into_iter().map(Option::unwrap).collect();
    assert_eq!(
        file_bytes_copied() - copied,
        0,
        "no adapter file was copied into memory"
    );
    for a in &host {
        assert!(a.is_mapped() && a.is_verified() && a.file_source().is_some());
    }

    // The host tier: each adapter's image staged into the arena once; the tier's bytes are
    // those images (the mapped pages are the page cache's, not counted as heap).
    let mut e =
        thaw_tests::cpu_engine_slow_link(tm.model.clone(), host[0].size_bytes() as f64, 1.5);
    let mut mgr = MemoryManager::new(
        MemoryConfig {
            page_bytes: 1 << 20,
            total_pages: 64,
            policy: EvictionPolicy::Cost,
            max_loras: 4,
            max_streaming_adapters: None,
            host_max_adapters: 8,
            host_max_bytes: 1 << 30,
        },
        Arc::new(Board::default()),
    );
    let none = HashSet::new();
    for (i, a) in host.iter().enumerate() {
        let id = AdapterId(i as u32);
        mgr.register(
            AdapterMeta {
                id,
                path: dirs[i].clone(),
                root: None,
                bytes: a.size_bytes() as u64,
                num_layers: a.num_layers(),
                disk_secs: 0.001,
            },
            Some(a.clone()),
        );
        thaw_server::memory::apply::stage_host(&mut mgr, &mut e, id, &none);
    }
    let staged = arena_idle(&e);
    let weights: u64 = host.iter().map(|a| a.size_bytes() as u64).sum();
    assert_eq!(staged.encoded_bytes, weights, "every byte encoded once");
    mgr.publish(0, 0);
    let snap = mgr.board().stats.snapshot();
    assert_eq!(snap.host_adapters, host.len() as u64);
    assert_eq!(
        snap.host_bytes, staged.retained as u64,
        "the host tier holds the arena images, nothing else"
    );
    assert!(snap.host_bytes >= weights && snap.host_bytes < 2 * weights);

    // The oracle: heap copies (read into memory: the counter sees each file once), resident.
    let before_oracle = file_bytes_copied();
    let mut oracle = Engine::new(
        CpuBackend::new(&cfg),
        tm.model.clone(),
        EngineConfig::default(),
    )
    .unwrap();
    let prompt: Vec<u32> = (0..40u32)
        .map(|t| 3 + (t * 37) % (cfg.vocab_size as u32 - 3))
        .collect();
    let want: Vec<Vec<u32>> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let a = Arc::new(LoraAdapter::load(d, &cfg).unwrap());
            oracle.register_adapter(AdapterId(i as u32), a).unwrap();
            greedy(&mut oracle, i as u64, AdapterId(i as u32), &prompt)
        })
        .collect();
    assert_eq!(
        file_bytes_copied() - before_oracle,
        dirs.iter().map(file_len).sum::<u64>(),
        "a read into memory copies the whole file once"
    );

    // Two loads of each from the host tier, workers off then on: the tokens are the oracle's,
    // nothing is encoded again (the images are reused), and with workers every load's
    // host-store entry names the file (no copy of the weights into the store).
    let mut seq = 100;
    for workers in [false, true] {
        if workers {
            e.attach_pool(one_worker()).unwrap();
        }
        for round in 0..2 {
            for (i, a) in host.iter().enumerate() {
                let id = AdapterId(i as u32);
                e.register_adapter_streaming(id, a.clone()).unwrap();
                assert!(
                    !e.adapter_is_mapped(id),
                    "a verified host copy, not a stand-in"
                );
                if let Some(pool) = e.pool() {
                    let store = pool.store();
                    assert_eq!(store.pending_fills(), 0, "nothing to copy into the store");
                    let (handle, extent) = store
                        .live_extents()
                        .into_iter()
                        .find(|(h, _)| h.id.0 == i as u64)
                        .expect("the adapter has a host-store entry");
                    assert!(store.lease(handle).unwrap().is_file(), "adapter {i}");
                    assert!(
                        extent.end - extent.start < 8192,
                        "{extent:?}: weights copied"
                    );
                }
                let assisted = e.rows_assisted();
                seq += 1;
                assert_eq!(
                    greedy(&mut e, seq, id, &prompt),
                    want[i],
                    "adapter {i}, workers {workers}, load {round}"
                );
                assert!(
                    e.rows_assisted() > assisted,
                    "adapter {i}: nothing assisted"
                );
                e.unregister_adapter(id).unwrap();
            }
        }
    }
    let after = arena_idle(&e);
    assert_eq!(
        after.encoded_bytes, weights,
        "no load encoded anything again"
    );
    assert!(after.reused_bytes >= 4 * weights);
    assert_eq!(
        file_bytes_copied() - before_oracle,
        dirs.iter().map(file_len).sum::<u64>(),
        "no load copied a file into memory"
    );
    if let Some(mut pool) = e.detach_pool() {
        pool.shutdown();
    }
}

/// The loader's copy read in place replaces a stand-in mapped from the file only if both are
/// the very same file: a copy read before a new file was renamed over the path (the stand-in
/// maps the new one) is refused; one read from the file mapped is adopted, after which the
/// adapter is no longer served from an unverified mapping.
#[test]
fn a_copy_read_in_place_is_adopted_only_from_the_file_mapped() {
    let tm = TestModel::llama(98);
    let cfg = tm.model.config.clone();
    let all = ["q", "v", "down"];
    let dir = tm.adapter_dir_as(8, &all, 981, Some(WeightDtype::Bf16));
    let other = tm.adapter_dir_as(8, &all, 982, Some(WeightDtype::Bf16));
    let file = "adapter_model.safetensors";
    let early = Arc::new(LoraAdapter::load_in_place(&dir, &cfg).unwrap());
    let tmp = dir.join("new.tmp");
    std::fs::copy(other.join(file), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join(file)).unwrap();
    let mut e = thaw_tests::cpu_engine_slow_link(tm.model.clone(), 1e6, 1.0);
    let id = AdapterId(5);
    e.register_adapter_streaming(id, Arc::new(LoraAdapter::map(&dir, &cfg).unwrap()))
        .unwrap();
    assert!(e.adapter_is_mapped(id));
    let err = e.adopt_host_copy(id, early).unwrap_err().to_string();
    assert!(err.contains("differs from the mapped file"), "{err}");
    assert!(e.adapter_is_mapped(id), "the stand-in stays");
    let now = Arc::new(LoraAdapter::load_in_place(&dir, &cfg).unwrap());
    e.adopt_host_copy(id, now).unwrap();
    assert!(
        !e.adapter_is_mapped(id),
        "a verified copy read in place took over"
    );
}
