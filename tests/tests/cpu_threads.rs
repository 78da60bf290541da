//! The CPU backend's multi-threaded ops give the tokens and logits of the one-thread path,
//! bit for bit: mixed adapters, prefill chunks of different lengths, then batched decode.
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::cpu_par::CpuThreads;
use thaw_runtime::backend::LoraKernel;
use thaw_runtime::engine::{Engine, EngineConfig, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_tests::TestModel;

/// Every step's (sequence, token, logits) for a fixed workload on `threads` threads.
fn run(tm: &TestModel, threads: usize, kernel: LoraKernel) -> Vec<(SeqId, u32, Vec<f32>)> {
    let cfg = &tm.model.config;
    let t = CpuThreads {
        // Split every op, however small, so the tiny model exercises every split path.
        min_part_work: 1,
        ..CpuThreads::unpinned(threads)
    };
    let backend = CpuBackend::with_threads(cfg, t).expect("compute threads start");
    assert_eq!(backend.compute_threads(), threads);
    let ecfg = EngineConfig {
        lora_kernel: kernel,
        ..Default::default()
    };
    let mut e = Engine::new(backend, tm.model.clone(), ecfg).expect("engine");
    let adapters = [
        tm.adapter(8, &["q", "v"], 11),
        tm.adapter(16, &["q", "k", "v", "o", "gate", "up", "down"], 12),
        tm.adapter(4, &["o", "down"], 13),
    ];
    for (i, a) in adapters.into_iter().enumerate() {
        e.register_adapter(AdapterId(i as u32), a).unwrap();
    }
    // Prompts of different lengths (one long enough to split attention by rows), adapters
    // mixed, one sequence on the base model.
    let seqs = 6u64;
    for s in 0..seqs {
        let len = 3 + 13 * s as usize;
        e.add_sequence(
            SeqId(s),
            SequenceParams {
                prompt: (0..len)
                    .map(|i| ((i * 37 + s as usize * 11) % 380) as u32 + 3)
                    .collect(),
                adapter: (s % 4 != 3).then_some(AdapterId((s % 3) as u32)),
                max_new_tokens: 6,
                ignore_eos: true,
                ..Default::default()
            },
        )
        .unwrap();
    }
    let mut out = Vec::new();
    while e.num_sequences() > 0 {
        let items = (0..seqs)
            .map(SeqId)
            .filter_map(|s| {
                e.pending_tokens(s).ok().map(|n| PlanItem {
                    seq: s,
                    num_tokens: n,
                })
            })
            .collect();
        let step = e
            .step(&StepPlan {
                items,
                return_logits: true,
            })
            .unwrap();
        for o in step {
            out.push((o.seq, o.token.id, o.logits.expect("asked for logits")));
        }
    }
    out
}

#[test]
fn threads_give_the_one_thread_tokens_and_logits() {
    let tm = TestModel::llama(5);
    for kernel in [LoraKernel::Sgmv, LoraKernel::Bgmv] {
        let one = run(&tm, 1, kernel);
        assert_eq!(one.len(), 6 * 6, "every sequence generated its tokens");
        for threads in [2, 3] {
            let many = run(&tm, threads, kernel);
            assert_eq!(many.len(), one.len());
            for ((s1, t1, l1), (s2, t2, l2)) in one.iter().zip(&many) {
                assert_eq!((s1, t1), (s2, t2), "{threads} threads, {kernel:?}");
                let same = l1.iter().zip(l2).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "logits of {s1} differ at {threads} threads, {kernel:?}"
                );
            }
        }
    }
}

/// While CPU LoRA workers assist, the backend computes on one thread; after, on all.
#[test]
fn assist_in_flight_drops_to_one_thread() {
    use thaw_runtime::backend::Backend;
    let tm = TestModel::llama(6);
    let mut b = CpuBackend::with_threads(&tm.model.config, CpuThreads::unpinned(3)).unwrap();
    assert_eq!(b.compute_threads(), 3);
    b.set_cpu_assist(true);
    assert_eq!(b.compute_threads(), 1);
    b.set_cpu_assist(false);
    assert_eq!(b.compute_threads(), 3);
}
