//! CPU assist from the disk tier when the adapter's file goes bad (issue 27): the CPU LoRA
//! worker cannot read it, and the step's error names the adapter, the file, what failed and
//! what to do — not "jobs failed". The step advances nothing, so once that adapter's
//! sequence is gone the step's other sequence runs on to the oracle's tokens.
use std::path::Path;
use std::sync::Arc;

use thaw_cpu_lora::LoraPool;
use thaw_ipc::HostStore;
use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{Engine, EngineConfig, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SamplingParams;
use thaw_runtime::RuntimeError;
use thaw_server::gen::WeightDtype;
use thaw_tests::TestModel;

mod workers_support;

const TARGETS: [&str; 4] = ["q", "k", "v", "o"];
const FILE: &str = "adapter_model.safetensors";

fn pool() -> LoraPool {
    workers_support::pool_with(1, HostStore::create(64 << 20, 64).expect("host store"))
}

fn params(prompt: &[u32], adapter: AdapterId) -> SequenceParams {
    SequenceParams {
        prompt: prompt.to_vec(),
        adapter: Some(adapter),
        sampling: SamplingParams::greedy(),
        max_new_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    }
}

/// How the file goes bad after the adapter was registered from it.
#[derive(Clone, Copy, Debug)]
enum Break {
    /// Deleted.
    Remove,
    /// Saved again, cut short (a new file renamed over the old: truncating the registered
    /// file in place would fault the engine's own mapping, which DESIGN forbids).
    Truncate,
}

fn break_file(dir: &Path, how: Break) {
    let path = dir.join(FILE);
    match how {
        Break::Remove => std::fs::remove_file(&path).unwrap(),
        Break::Truncate => {
            let bytes = std::fs::read(&path).unwrap();
            let tmp = dir.join("adapter_model.tmp");
            std::fs::write(&tmp, &bytes[..bytes.len() / 2]).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
        }
    }
}

#[test]
fn an_unreadable_adapter_file_fails_its_sequence_alone() {
    let tm = TestModel::llama(83);
    let cfg = tm.model.config.clone();
    let good_dir = tm.adapter_dir_as(16, &TARGETS, 980, Some(WeightDtype::Bf16));
    let vocab = cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..24u32).map(|t| 3 + (t * 31) % (vocab - 3)).collect();
    let good = Arc::new(LoraAdapter::load(&good_dir, &cfg).unwrap());
    let mut oracle = Engine::new(
        CpuBackend::new(&cfg),
        tm.model.clone(),
        EngineConfig::default(),
    )
    .unwrap();
    oracle.register_adapter(AdapterId(0), good.clone()).unwrap();
    let want = thaw_tests::greedy_alone(&mut oracle, SeqId(0), AdapterId(0), &prompt, 64);

    for (i, how) in [Break::Remove, Break::Truncate].into_iter().enumerate() {
        let bad_dir = tm.adapter_dir_as(16, &TARGETS, 990 + i as u64, Some(WeightDtype::Bf16));
        // The bad adapter takes about 5 s on the link: the step below finds it streaming and
        // has the worker compute it from its file.
        let bytes = good.size_bytes() as f64;
        let mut e = thaw_tests::cpu_engine_slow_link(tm.model.clone(), bytes, 5.0);
        e.attach_pool(pool()).unwrap();
        let (ok, bad) = (AdapterId(0), AdapterId(1));
        e.register_adapter(ok, good.clone()).unwrap();
        let mapped = Arc::new(LoraAdapter::map(&bad_dir, &cfg).unwrap());
        e.register_adapter_streaming(bad, mapped).unwrap();
        assert!(e.adapter_is_mapped(bad));
        break_file(&bad_dir, how);

        let (s_ok, s_bad) = (SeqId(10), SeqId(11));
        e.add_sequence(s_ok, params(&prompt, ok)).unwrap();
        e.add_sequence(s_bad, params(&prompt, bad)).unwrap();
        let both = StepPlan {
            items: vec![
                PlanItem {
                    seq: s_ok,
                    num_tokens: prompt.len(),
                },
                PlanItem {
                    seq: s_bad,
                    num_tokens: prompt.len(),
                },
            ],
            return_logits: false,
        };
        match e.step(&both) {
            Err(RuntimeError::AdapterUnreadable { adapter, message }) => {
                assert_eq!(adapter, bad, "{how:?}: {message}");
                // Which file, what failed, what to do.
                let file = bad_dir.join(FILE);
                assert!(
                    message.contains(&file.display().to_string()),
                    "{how:?}: {message}"
                );
                let what = match how {
                    Break::Remove => "No such file",
                    Break::Truncate => "replaced since the adapter was registered",
                };
                assert!(message.contains(what), "{how:?}: {message}");
                assert!(message.contains("reload"), "{how:?}: {message}");
                assert!(!message.contains("jobs failed"), "{how:?}: {message}");
            }
            other => panic!("{how:?}: expected the bad adapter's error, got {other:?}"),
        }
        // Nothing advanced: the good sequence still has its whole prompt to run.
        assert_eq!(e.pending_tokens(s_ok).unwrap(), prompt.len());
        e.remove_sequence(s_bad).unwrap();
        e.unregister_adapter(bad).unwrap();
        let mut tokens = Vec::new();
        loop {
            let n = e.pending_tokens(s_ok).unwrap();
            let plan = StepPlan {
                items: vec![PlanItem {
                    seq: s_ok,
                    num_tokens: n,
                }],
                return_logits: false,
            };
            let out = e.step(&plan).expect("the good sequence runs on");
            let o = out.first().expect("one token a step");
            tokens.push(o.token.id);
            if o.finish.is_some() {
                break;
            }
        }
        assert_eq!(tokens, want, "{how:?}: the other sequence's tokens");
        e.detach_pool().unwrap().shutdown();
    }
}

/// The loader's owned copy replaces an adapter registered from its mapped file only while the
/// file is the one mapped (the check is a `stat`, not a comparison of every byte on the engine
/// thread): after the file was replaced by another of the same shape, the adoption is refused
/// and the mapped copy stays; with the file untouched, it is adopted.
#[test]
fn an_owned_copy_is_adopted_only_from_the_file_mapped() {
    let tm = TestModel::llama(83);
    let cfg = tm.model.config.clone();
    let dir = tm.adapter_dir_as(16, &TARGETS, 995, Some(WeightDtype::Bf16));
    let other = tm.adapter_dir_as(16, &TARGETS, 996, Some(WeightDtype::Bf16));
    let mut e = thaw_tests::cpu_engine_slow_link(tm.model.clone(), 1e6, 1.0);
    let id = AdapterId(3);
    let mapped = Arc::new(LoraAdapter::map(&dir, &cfg).unwrap());
    e.register_adapter_streaming(id, mapped).unwrap();
    // Replaced (a new file renamed over it) by an adapter of the same shape.
    let tmp = dir.join("adapter_model.tmp");
    std::fs::copy(other.join(FILE), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join(FILE)).unwrap();
    let replaced = Arc::new(LoraAdapter::load(&dir, &cfg).unwrap());
    let err = e.adopt_host_copy(id, replaced).unwrap_err().to_string();
    assert!(err.contains("differs from the mapped file"), "{err}");
    assert!(e.adapter_is_mapped(id), "the mapped copy stays");
    // Registered again from the file as it is now, it adopts the copy read from it.
    e.unregister_adapter(id).unwrap();
    let mapped = Arc::new(LoraAdapter::map(&dir, &cfg).unwrap());
    e.register_adapter_streaming(id, mapped).unwrap();
    let owned = Arc::new(LoraAdapter::load(&dir, &cfg).unwrap());
    e.adopt_host_copy(id, owned).unwrap();
    assert!(!e.adapter_is_mapped(id));
}
