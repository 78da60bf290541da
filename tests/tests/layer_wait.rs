//! Layer-wise start without CPU assist (`on-demand`, issue 27): a request whose adapter is
//! still streaming runs in the step, the forward waiting for each layer to land before it
//! computes it on the device. Same tokens as the cached oracle, nothing computed on the CPU,
//! and the step started before the adapter had landed (it waited for layers). The choice is
//! per adapter (`auto` waits for the copy of some adapters and assists others): one step may
//! wait for one adapter's layers and compute another's on the CPU, with the same tokens.
use std::sync::Arc;
use std::time::Duration;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::engine::{
    Engine, EngineConfig, PlanItem, SequenceParams, StepPlan, UnlandedLayers,
};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SamplingParams;
use thaw_tests::{CpuEngine, TestModel};

/// A test model from `seed`, two rank-16 adapters on every module (seeds `adapter_seed` and
/// the next), and an engine with both registered and landed: the oracle.
fn model_and_oracle(seed: u64, adapter_seed: u64) -> (TestModel, Vec<Arc<LoraAdapter>>, CpuEngine) {
    let tm = TestModel::llama(seed);
    let adapters: Vec<Arc<LoraAdapter>> = (0..2)
        .map(|i| {
            tm.adapter(
                16,
                &["q", "k", "v", "o", "gate", "up", "down"],
                adapter_seed + i,
            )
        })
        .collect();
    let cfg = &tm.model.config;
    let mut oracle = Engine::new(
        CpuBackend::new(cfg),
        tm.model.clone(),
        EngineConfig::default(),
    )
    .unwrap();
    for (i, a) in adapters.iter().enumerate() {
        oracle
            .register_adapter(AdapterId(i as u32), a.clone())
            .unwrap();
    }
    oracle
        .wait_adapters_landed(Duration::from_secs(60))
        .unwrap();
    (tm, adapters, oracle)
}

/// `n` prompt tokens of stride `k`, all above the special ids.
fn prompt(n: u32, k: u32, vocab: usize) -> Vec<u32> {
    (0..n).map(|t| 3 + (t * k) % (vocab as u32 - 3)).collect()
}

#[test]
fn a_request_runs_while_its_adapter_streams_and_waits_for_each_layer() {
    let (tm, adapters, mut oracle) = model_and_oracle(71, 1300);
    let prompt = prompt(24, 41, tm.model.config.vocab_size);
    let greedy = |e: &mut thaw_tests::CpuEngine, seq: u64, a: u32| {
        thaw_tests::greedy_alone(e, SeqId(seq), AdapterId(a), &prompt, usize::MAX)
    };
    let want: Vec<Vec<u32>> = (0..2)
        .map(|i| greedy(&mut oracle, 10 + i, i as u32))
        .collect();

    // Each adapter takes about 200 ms on the link: the first step finds it streaming.
    let bytes = adapters[0].size_bytes() as f64;
    let mut e = thaw_tests::cpu_engine_slow_link(tm.model.clone(), bytes, 0.2);
    e.set_unlanded_layers(UnlandedLayers::Wait);
    for (i, a) in adapters.iter().enumerate() {
        let id = AdapterId(i as u32);
        let waited = e.layer_wait();
        e.register_adapter_streaming(id, a.clone()).unwrap();
        let (landed, layers) = e.adapter_landed(id).unwrap();
        assert!(
            landed < layers,
            "adapter {i} still streaming at the first step"
        );
        assert_eq!(
            greedy(&mut e, 100 + i as u64, i as u32),
            want[i],
            "adapter {i}"
        );
        assert_eq!(e.rows_assisted(), 0, "no row computed on the CPU");
        assert!(
            e.layer_wait() > waited,
            "adapter {i}: the first step waited for its layers"
        );
        assert!(e.adapter_resident(id));
    }
}

/// Adds greedy requests `seqs[i]` of `prompts[i]` under adapter `i` (6 new tokens each).
fn add_pair(e: &mut CpuEngine, seqs: [SeqId; 2], prompts: [&[u32]; 2]) {
    for (i, (seq, prompt)) in seqs.into_iter().zip(prompts).enumerate() {
        let params = SequenceParams {
            prompt: prompt.to_vec(),
            adapter: Some(AdapterId(i as u32)),
            sampling: SamplingParams::greedy(),
            max_new_tokens: 6,
            ignore_eos: true,
            ..Default::default()
        };
        e.add_sequence(seq, params)
            .expect("the sequence is admitted");
    }
}

/// One step computing every pending token of the live ones of `seqs`, their tokens appended.
fn step_pair(
    e: &mut CpuEngine,
    seqs: [SeqId; 2],
    tokens: &mut [Vec<u32>; 2],
    done: &mut [bool; 2],
) {
    let items = (0..2)
        .filter(|&i| !done[i])
        .map(|i| PlanItem {
            seq: seqs[i],
            num_tokens: e.pending_tokens(seqs[i]).expect("a live sequence"),
        })
        .collect();
    let plan = StepPlan {
        items,
        return_logits: false,
    };
    for o in e.step(&plan).expect("a two-sequence step") {
        let i = seqs
            .iter()
            .position(|&s| s == o.seq)
            .expect("a planned sequence");
        tokens[i].push(o.token.id);
        done[i] |= o.finish.is_some();
    }
}

/// The rest of a pair's steps, until both finished.
fn finish_pair(
    e: &mut CpuEngine,
    seqs: [SeqId; 2],
    mut tokens: [Vec<u32>; 2],
    mut done: [bool; 2],
) -> [Vec<u32>; 2] {
    while !done.iter().all(|&d| d) {
        step_pair(e, seqs, &mut tokens, &mut done);
    }
    tokens
}

/// Two requests batched in every step, their adapters both streaming at the first: the step
/// waits for the layers of the adapter marked to wait and computes those of the other on the
/// CPU (the engine's default). The greedy tokens are the all-landed run's; the first step
/// waited, landed the waited adapter, and assisted only the other's rows.
#[test]
fn one_step_waits_for_one_adapter_and_assists_another() {
    let (tm, adapters, mut oracle) = model_and_oracle(73, 1400);
    let vocab = tm.model.config.vocab_size;
    // Different lengths: the rows the CPU computed tell whose they were.
    let (p0, p1) = (prompt(24, 41, vocab), prompt(17, 29, vocab));
    let prompts = [p0.as_slice(), p1.as_slice()];
    let seqs = [SeqId(10), SeqId(11)];
    add_pair(&mut oracle, seqs, prompts);
    let want = finish_pair(&mut oracle, seqs, Default::default(), [false; 2]);
    assert_eq!(oracle.rows_assisted(), 0);

    // Each adapter takes about 200 ms on the link, the second queued behind the first.
    let bytes = adapters[0].size_bytes() as f64;
    let mut e = thaw_tests::cpu_engine_slow_link(tm.model.clone(), bytes, 0.2);
    for (i, a) in adapters.iter().enumerate() {
        e.register_adapter_streaming(AdapterId(i as u32), a.clone())
            .unwrap();
    }
    e.set_adapter_unlanded(AdapterId(0), UnlandedLayers::Wait)
        .unwrap();
    assert!(e
        .set_adapter_unlanded(AdapterId(7), UnlandedLayers::Wait)
        .is_err());
    for i in 0..2 {
        let (landed, layers) = e.adapter_landed(AdapterId(i)).unwrap();
        assert!(
            landed < layers,
            "adapter {i} still streaming at the first step"
        );
    }
    let seqs = [SeqId(20), SeqId(21)];
    add_pair(&mut e, seqs, prompts);
    let (mut got, mut done) = (<[Vec<u32>; 2]>::default(), [false; 2]);
    step_pair(&mut e, seqs, &mut got, &mut done);
    assert!(
        e.layer_wait() > Duration::ZERO,
        "the first step waited for layers"
    );
    assert!(
        e.adapter_resident(AdapterId(0)),
        "the waited adapter landed in the step"
    );
    let assisted = e.rows_assisted();
    let per_layer = (prompts[1].len() * 7) as u64;
    assert!(
        assisted > 0 && assisted.is_multiple_of(per_layer),
        "{assisted} row·modules assisted: whole layers of the second request's 17 rows × 7 \
         modules, none of the first's 24"
    );
    assert_eq!(finish_pair(&mut e, seqs, got, done), want);
}
