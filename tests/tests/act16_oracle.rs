//! The 16-bit MLP activations' numerics on the CPU (issue 29, CUDA's `THAW_CUDA_BF16_ACT=1`).
//! [`CpuBackend::set_act16`] rounds gate, up and SwiGLU's output to bf16 exactly where the CUDA
//! path stores them in 16 bits (the same `act16_plan`), everything else f32 (the residual
//! stream's half of the switch is off here, `set_residual16(None)`; `residual16_oracle.rs`
//! checks it and the whole switch): these tests check
//! the rounding decision itself with no GPU (`cuda_parity/act16.rs` checks the kernels against
//! it on one).
//!
//! - The HF-written tiny Llama (`tests/fixtures/hf-tiny-llama`, always): logits with the
//!   rounding stay within [`TINY_TOL`] of f32's and greedy tokens are identical, with base rows
//!   and q/v-only adapters; a step where a row's adapter targets gate/up runs f32 whole (the
//!   plan: its deltas on the 16-bit path would move more bytes than f32), so its logits are
//!   bit-identical to the f32 run's.
//! - CUDA-graph decode steps (the CPU's graph emulation: padded to their bucket, the plan read
//!   from the key's rank class as on CUDA): a key without a rank class runs 16-bit, giving the
//!   eager steps' tokens and logits within the padding test's 1e-5 and f32's within
//!   [`TINY_TOL`]; a key with one runs f32, bit-identical to the f32 run.
//! - SmolLM2-135M-Instruct in bf16 (`THAW_SMOLLM2_BF16`, skipped when unset): the greedy
//!   tokens of three chat prompts (16, or up to the end-of-turn token) equal HF transformers'
//!   (`tests/fixtures/smollm2-reference`, bf16 weights computed in f32) with the rounding as
//!   without, batched beside a row whose generated adapter targets down (so every step takes
//!   the 16-bit path with SwiGLU's f32 copy for down's LoRA); no adapter targets q/k/v, so the
//!   switch's attention half rounds q, k and v too (`attn16_oracle.rs` measures it alone).
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::Act16Type;
use thaw_runtime::engine::HostModel;
use thaw_runtime::model::Tokenizer;
use thaw_tests::smollm2::{run_logged, Run, SmolLm2};
use thaw_tests::{fixture_dir, rel_err};

/// Normwise relative error allowed between the logits with bf16 MLP activations and f32's on
/// the tiny model: bf16 keeps 8 significant bits (unit roundoff 2⁻⁹ ≈ 2e-3); gate, up and
/// SwiGLU's output each rounded once per layer, over 2 layers, perturb the residual stream by
/// a few units of that in the worst case, and the LM head's sums average them down. 1e-2
/// (about 5 units) leaves room for the random weights' growth without hiding a missing
/// rounding step's absence or an f32 path's (the test also asserts the error is not 0).
const TINY_TOL: f64 = 1e-2;

/// Normwise relative error allowed between SmolLM2's logits with the switch's 16-bit
/// activations and f32's, over the reference's steps: 30 layers of six roundings each (q, k, v
/// by the attention half, gate, up and SwiGLU's output by the MLP's; 2⁻⁹ relative) on a trained
/// model whose residual stream is dominated by a few large channels; measured 4.5e-2 (this VM,
/// CPU backend; 2.5e-2 with the MLP half alone, 1.4e-2 with the attention half alone,
/// `attn16_oracle.rs`). 1e-1 bounds it with twice that room; the tokens above are the stronger
/// check.
const SMOLLM2_TOL: f64 = 1e-1;

fn run(
    model: &HostModel,
    act16: Option<Act16Type>,
    adapters: &[Arc<LoraAdapter>],
    prompts: &[(Vec<u32>, Option<u32>)],
    steps: usize,
) -> Run {
    let mut backend = CpuBackend::new(&model.config);
    backend.set_act16(act16);
    // The MLP half alone: the residual stream's rounding is `residual16_oracle.rs`'s.
    backend.set_residual16(None);
    run_logged(backend, model, adapters, prompts, steps)
}

fn tiny() -> (HostModel, Tokenizer, Vec<Arc<LoraAdapter>>) {
    let dir = fixture_dir();
    let model = HostModel::load(&dir).expect("the HF-written fixture loads");
    let tok = Tokenizer::from_dir(&dir, &model.config).unwrap();
    let adapters = ["r4_qv", "r8_all_rslora"]
        .iter()
        .map(|n| Arc::new(LoraAdapter::load(&dir.join("adapters").join(n), &model.config).unwrap()))
        .collect();
    (model, tok, adapters)
}

#[test]
fn tiny_model_bf16_mlp_activations_stay_within_their_bound_and_keep_greedy_tokens() {
    let (model, tok, adapters) = tiny();
    let texts = ["Hello world", "fn main() {}", "The quick brown fox jumps"];
    // Base rows and rows whose adapter targets only q and v: the plan serves the step.
    let prompts: Vec<(Vec<u32>, Option<u32>)> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| (tok.encode(t, true).unwrap(), (i == 1).then_some(0)))
        .collect();
    let f32s = run(&model, None, &adapters, &prompts, 8);
    let b16 = run(&model, Some(Act16Type::Bf16), &adapters, &prompts, 8);
    let err = b16.worst(&f32s);
    eprintln!("tiny model, bf16 MLP activations: worst normwise logits error {err:e}");
    assert!(err <= TINY_TOL, "bf16 MLP activations: rel err {err:e}");
    assert!(err > 0.0, "the emulation rounded nothing");
    assert_eq!(
        b16.tokens, f32s.tokens,
        "bf16 MLP activations changed a token"
    );
    // f16 (11 significant bits) is closer still.
    let f16s = run(&model, Some(Act16Type::F16), &adapters, &prompts, 8);
    let err16 = f16s.worst(&f32s);
    assert!(err16 <= err, "f16 {err16:e} vs bf16 {err:e}");
    assert_eq!(f16s.tokens, f32s.tokens);
}

/// Logits of two runs bit for bit.
fn bit_identical(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn tiny_model_steps_with_lora_on_gate_up_stay_f32_bit_for_bit() {
    let (model, tok, adapters) = tiny();
    // One row's adapter targets every projection, gate and up among them: the whole step
    // keeps f32 activations.
    let prompts: Vec<(Vec<u32>, Option<u32>)> = ["Hello world", "The quick brown fox"]
        .iter()
        .enumerate()
        .map(|(i, t)| (tok.encode(t, true).unwrap(), (i == 1).then_some(1)))
        .collect();
    let f32s = run(&model, None, &adapters, &prompts, 4);
    let b16 = run(&model, Some(Act16Type::Bf16), &adapters, &prompts, 4);
    assert_eq!(b16.tokens, f32s.tokens);
    for (a, b) in b16
        .logits
        .iter()
        .flatten()
        .zip(f32s.logits.iter().flatten())
    {
        assert!(
            bit_identical(a, b),
            "a step with LoRA on gate/up was rounded"
        );
    }
    // Without the gate/up row the same prompts are rounded: the switch is on in this run.
    let base: Vec<_> = prompts.iter().map(|(p, _)| (p.clone(), None)).collect();
    let b16 = run(&model, Some(Act16Type::Bf16), &adapters, &base, 4);
    let f32s = run(&model, None, &adapters, &base, 4);
    assert!(b16.worst(&f32s) > 0.0, "the emulation rounded nothing");
}

/// Emulated CUDA-graph decode steps, the switch on and off: batches of base rows (graph keys
/// without a rank class: 16-bit) and batches with an every-projection adapter (keys with one:
/// f32, as is their eager prefill with LoRA on gate/up); buckets 1, 4, 8; one batch above the
/// largest bucket runs eager.
#[test]
fn graph_decode_steps_run_16_bit_only_for_keys_without_lora() {
    use thaw_runtime::engine::GraphStats;
    use thaw_tests::graphs::{decode_batch, emulated_engine_on, prompts};
    let tm = thaw_tests::TestModel::llama(7);
    let adapters = [tm.adapter(32, &["q", "k", "v", "o", "gate", "up", "down"], 71)];
    let vocab = tm.model.config.vocab_size;
    let steps = 4;
    let batches: [(usize, &[Option<u32>]); 4] = [
        (1, &[None]),
        (3, &[None, Some(0)]),
        (8, &[None]),
        (11, &[None, Some(0)]),
    ];
    let mut runs = Vec::new();
    for (act16, graphs) in [
        (None, true),
        (Some(Act16Type::Bf16), false),
        (Some(Act16Type::Bf16), true),
    ] {
        let mut b = CpuBackend::new(&tm.model.config);
        b.set_act16(act16);
        b.set_residual16(None);
        let mut e = emulated_engine_on(b, &tm.model, &adapters, graphs);
        let mut first = 0;
        let mut all = Vec::new();
        for (n, pattern) in batches {
            let who: Vec<Option<u32>> = (0..n).map(|i| pattern[i % pattern.len()]).collect();
            let lora = who.iter().any(Option::is_some);
            let got = decode_batch(&mut e, first, &who, &prompts(n, vocab, n as u64), steps);
            all.extend(got.into_iter().map(|d| (lora, d)));
            first += n as u64;
        }
        if graphs {
            let s = e.graph_stats().cloned().expect("graphs on");
            assert_eq!(
                s,
                GraphStats {
                    warmups: 3 * steps as u64,
                    eager: 4 + steps as u64,
                    ..Default::default()
                }
            );
        }
        runs.push(all);
    }
    let (f32_graph, eager, graph) = (&runs[0], &runs[1], &runs[2]);
    let (mut rounded, mut plain) = (0.0f64, 0);
    for (i, (((lora, g), (_, e)), (_, f))) in graph.iter().zip(eager).zip(f32_graph).enumerate() {
        if *lora {
            assert_eq!(g.tokens, f.tokens, "seq {i}");
            assert!(
                bit_identical(&g.logits, &f.logits),
                "seq {i}: a step with LoRA on gate/up (a graph key with a rank class) was rounded"
            );
            continue;
        }
        plain += 1;
        assert_eq!(
            g.tokens, e.tokens,
            "seq {i}: graph steps changed a greedy token"
        );
        let err = rel_err(&g.logits, &e.logits);
        assert!(
            err <= 1e-5,
            "seq {i}: graph vs eager logits rel err {err:e}"
        );
        let err = rel_err(&g.logits, &f.logits);
        assert!(
            err <= TINY_TOL,
            "seq {i}: bf16 vs f32 graph rel err {err:e}"
        );
        rounded = rounded.max(err);
    }
    eprintln!(
        "graph decode steps without LoRA, bf16 vs f32 MLP activations: worst rel err {rounded:e}"
    );
    assert_eq!(plain, 1 + 8, "rows of the batches without LoRA");
    assert!(
        rounded > 0.0,
        "the switch rounded nothing in a graph without LoRA"
    );
}

#[test]
fn smollm2_bf16_greedy_tokens_with_bf16_mlp_activations_equal_transformers() {
    let Some(SmolLm2 {
        dir: path,
        model,
        tok,
        want,
        prompts,
    }) = SmolLm2::load()
    else {
        return;
    };
    let mut prompts: Vec<(Vec<u32>, Option<u32>)> =
        prompts.into_iter().map(|p| (p, None)).collect();
    // One more row, on a generated rank-16 adapter of down: every step of the batch takes the
    // 16-bit path with SwiGLU's f32 copy (read by down's LoRA shrink), which must leave the
    // reference rows' tokens as they are. (An adapter on gate or up would keep the whole step
    // f32: its deltas on the 16-bit path would move more bytes.)
    let dir = tempfile::tempdir().unwrap();
    let opts = thaw_server::gen::GenAdaptersOptions {
        model_dir: std::path::PathBuf::from(&path),
        out_dir: dir.path().to_path_buf(),
        count: 1,
        ranks: vec![16],
        targets: ["down"].map(thaw_tests::projection).to_vec(),
        seed: 2929,
        ..Default::default()
    };
    let adir = thaw_server::gen::write_adapters(&opts).expect("gen-adapters");
    let adapter = Arc::new(LoraAdapter::load(&adir[0], &model.config).expect("adapter loads"));
    prompts.push((prompts[0].0.clone(), Some(0)));
    let mut runs = Vec::new();
    for act16 in [None, Some(Act16Type::Bf16)] {
        let got = run(
            &model,
            act16,
            std::slice::from_ref(&adapter),
            &prompts,
            want.new_tokens,
        );
        for (c, g) in want.cases.iter().zip(&got.tokens) {
            // transformers stops after the end-of-turn token; Thaw ran on (ignore_eos).
            let g = &g[..c.tokens.len()];
            eprintln!(
                "{act16:?} {:?}: {:?}",
                c.prompt,
                tok.decode(g, true).unwrap()
            );
            assert_eq!(
                g, c.tokens,
                "{act16:?}: {:?} differs from {}",
                c.prompt, want.generator
            );
        }
        runs.push(got);
    }
    // Same tokens, so the same contexts: the reference rows' logits compare step by step (the
    // adapter row's tokens are not pinned, so its contexts may part).
    eprintln!(
        "adapter row: f32 {:?}, bf16 {:?}",
        runs[0].tokens[want.cases.len()],
        runs[1].tokens[want.cases.len()]
    );
    for r in &mut runs {
        r.logits.truncate(want.cases.len());
    }
    // Each row is compared over the reference's steps (the tokens transformers pinned, so the
    // contexts agree): past its end-of-turn token the model runs on off-distribution contexts
    // (ignore_eos) whose flat logits magnify the rounding (measured 7.4e-2 there).
    for r in &mut runs {
        for (l, c) in r.logits.iter_mut().zip(&want.cases) {
            l.truncate(c.tokens.len());
        }
    }
    let err = runs[1].worst(&runs[0]);
    eprintln!("SmolLM2 bf16, bf16 MLP activations: worst normwise logits error {err:e}");
    assert!(err > 0.0, "the emulation rounded nothing");
    assert!(err <= SMOLLM2_TOL, "bf16 MLP activations: rel err {err:e}");
}
