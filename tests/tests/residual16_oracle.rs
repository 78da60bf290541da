//! The 16-bit residual stream's numerics on the CPU (issue 29, CUDA's `THAW_CUDA_BF16_ACT=1`,
//! `residual16_plan`). [`CpuBackend::set_act16`] rounds the residual stream to the 16-bit type
//! after `embed` and after every residual add, exactly where the CUDA path stores it in 16
//! bits, beside the MLP half's rounding (`act16_oracle.rs` checks that half alone);
//! [`CpuBackend::set_residual16`] isolates the residual half. No GPU: these tests check the
//! rounding the switch adds (`cuda_parity/residual16.rs` checks the kernels against it on one).
//!
//! - The HF-written tiny Llama (`tests/fixtures/hf-tiny-llama`, always), base rows and a q/v
//!   adapter's: with the whole switch (bf16 and f16) greedy tokens equal f32's and logits stay
//!   within [`TINY_TOL`]; the whole switch's logits differ from the MLP half's alone and the
//!   residual half's from f32's (so the rounding ran: this test fails if it did not).
//! - Generated Llama and Qwen2 (q/k/v biases) test models: the same bounds, prefill + decode.
//! - SmolLM2-135M-Instruct in bf16 (`THAW_SMOLLM2_BF16`, skipped when unset): with the whole
//!   switch the greedy tokens of three chat prompts equal HF transformers'
//!   (`tests/fixtures/smollm2-reference`, whose bf16 model keeps the residual in bf16), the
//!   logits within [`SMOLLM2_TOL`] of f32's and different from the MLP half's alone.
use thaw_runtime::backend::cpu::CpuBackend;
use thaw_runtime::backend::Act16Type;
use thaw_runtime::engine::{Engine, EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::SeqId;
use thaw_runtime::model::Tokenizer;
use thaw_tests::{chat_prompt, fixture_dir, rel_err};

/// Normwise relative error allowed between the logits with the whole switch in bf16 and f32's
/// on the small models. bf16 keeps 8 significant bits (unit roundoff u = 2⁻⁹ ≈ 2e-3): the
/// MLP half rounds gate, up and SwiGLU's output once a layer (`act16_oracle.rs` allows 1e-2
/// for it), and the residual half rounds the stream after the embedding and after each of
/// the 2 adds a layer, each an independent relative perturbation of at most u/2 of the
/// stream that the later layers carry: 5 roundings over 2 layers add at most ~5u/2 ≈ 5e-3
/// in the worst case on top of the MLP's. 2e-2 (about 10 u) bounds the sum with room for
/// the random weights' growth, still far below a wrong residual (an unrounded or dropped add
/// moves the logits by O(1)).
const TINY_TOL: f64 = 2e-2;

/// Normwise relative error allowed between SmolLM2's logits with the whole switch in bf16 and
/// f32's: `act16_oracle.rs` measured 2.5e-2 for the MLP half alone (30 layers, a residual
/// stream dominated by a few large channels); the residual's 61 roundings of the stream
/// (u/2 relative each, not compounding through the norms) add about as much again. 1e-1 bounds
/// the two with room; the greedy tokens equal to transformers' (which rounds the same way)
/// are the stronger check.
const SMOLLM2_TOL: f64 = 1e-1;

/// Which halves of the switch a run emulates.
#[derive(Copy, Clone, Debug, PartialEq)]
enum Emu {
    F32,
    /// The MLP half alone (`set_residual16(None)`).
    Mlp(Act16Type),
    /// The residual half alone.
    Residual(Act16Type),
    /// The whole switch (`set_act16`).
    Whole(Act16Type),
}

impl Emu {
    fn apply(self, b: &mut CpuBackend) {
        match self {
            Emu::F32 => b.set_act16(None),
            Emu::Mlp(t) => {
                b.set_act16(Some(t));
                b.set_residual16(None);
            }
            Emu::Residual(t) => {
                b.set_act16(None);
                b.set_residual16(Some(t));
            }
            Emu::Whole(t) => b.set_act16(Some(t)),
        }
    }
}

/// Logits and greedy tokens of each sequence over `steps` steps (a prefill, then decodes).
struct Run {
    logits: Vec<Vec<Vec<f32>>>,
    tokens: Vec<Vec<u32>>,
}

fn run(
    model: &HostModel,
    emu: Emu,
    adapters: &[std::sync::Arc<thaw_runtime::adapter::LoraAdapter>],
    prompts: &[(Vec<u32>, Option<u32>)],
    steps: usize,
) -> Run {
    let mut backend = CpuBackend::new(&model.config);
    emu.apply(&mut backend);
    let cfg = EngineConfig {
        max_batch_tokens: 1024,
        max_batch_seqs: 8,
        num_kv_blocks: 64,
        ..Default::default()
    };
    let mut e = Engine::new(backend, model.clone(), cfg).expect("engine");
    for (i, a) in adapters.iter().enumerate() {
        let id = thaw_runtime::ids::AdapterId(i as u32);
        e.register_adapter(id, a.clone()).unwrap();
    }
    for (i, (p, a)) in prompts.iter().enumerate() {
        let params = SequenceParams {
            prompt: p.clone(),
            adapter: a.map(thaw_runtime::ids::AdapterId),
            max_new_tokens: steps,
            ignore_eos: true,
            ..Default::default()
        };
        e.add_sequence(SeqId(i as u64), params).unwrap();
    }
    let n = prompts.len();
    let mut out = Run {
        logits: vec![Vec::new(); n],
        tokens: vec![Vec::new(); n],
    };
    for _ in 0..steps {
        let items = (0..n)
            .map(|i| PlanItem {
                seq: SeqId(i as u64),
                num_tokens: e.pending_tokens(SeqId(i as u64)).unwrap(),
            })
            .collect();
        let plan = StepPlan {
            items,
            return_logits: true,
        };
        for o in e.step(&plan).unwrap() {
            let i = o.seq.0 as usize;
            out.tokens[i].push(o.token.id);
            out.logits[i].push(o.logits.expect("asked for logits"));
        }
    }
    out
}

/// The largest normwise error over every step of every sequence.
fn worst(a: &Run, b: &Run) -> f64 {
    a.logits
        .iter()
        .zip(&b.logits)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| rel_err(p, q)))
        .fold(0.0, f64::max)
}

/// Runs `prompts` on every emulation and checks the bounds of the module docs against f32:
/// the whole switch keeps greedy tokens and stays within `tol`, and each half changes what
/// the other leaves (the residual's rounding ran). Returns the whole switch's bf16 error.
fn check_model(
    name: &str,
    model: &HostModel,
    adapters: &[std::sync::Arc<thaw_runtime::adapter::LoraAdapter>],
    prompts: &[(Vec<u32>, Option<u32>)],
    steps: usize,
    tol: f64,
) -> f64 {
    let r = |emu| run(model, emu, adapters, prompts, steps);
    let bf = Act16Type::Bf16;
    let f32s = r(Emu::F32);
    let whole = r(Emu::Whole(bf));
    let mlp = r(Emu::Mlp(bf));
    let resid = r(Emu::Residual(bf));
    let err = worst(&whole, &f32s);
    let (err_mlp, err_res) = (worst(&mlp, &f32s), worst(&resid, &f32s));
    eprintln!(
        "{name}: worst normwise logits error vs f32: whole switch {err:e}, MLP half {err_mlp:e}, \
         residual half {err_res:e}"
    );
    assert!(err <= tol, "{name}: whole switch rel err {err:e} > {tol:e}");
    assert!(
        err_res > 0.0,
        "{name}: the residual emulation rounded nothing"
    );
    assert!(err_res <= tol, "{name}: residual half rel err {err_res:e}");
    assert!(
        worst(&whole, &mlp) > 0.0,
        "{name}: the whole switch equals its MLP half: the residual was not rounded"
    );
    assert_eq!(
        whole.tokens, f32s.tokens,
        "{name}: the switch changed a token"
    );
    assert_eq!(
        resid.tokens, f32s.tokens,
        "{name}: the residual half changed a token"
    );
    // f16 (11 significant bits) is closer still.
    let f16s = r(Emu::Whole(Act16Type::F16));
    let err16 = worst(&f16s, &f32s);
    assert!(err16 <= err, "{name}: f16 {err16:e} vs bf16 {err:e}");
    assert_eq!(f16s.tokens, f32s.tokens, "{name}: f16 changed a token");
    err
}

#[test]
fn tiny_model_with_the_16_bit_residual_keeps_greedy_tokens_within_its_bound() {
    let dir = fixture_dir();
    let model = HostModel::load(&dir).expect("the HF-written fixture loads");
    let tok = Tokenizer::from_dir(&dir, &model.config).unwrap();
    let adapter = thaw_runtime::adapter::LoraAdapter::load(
        &dir.join("adapters").join("r4_qv"),
        &model.config,
    )
    .unwrap();
    let texts = ["Hello world", "fn main() {}", "The quick brown fox jumps"];
    let prompts: Vec<(Vec<u32>, Option<u32>)> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| (tok.encode(t, true).unwrap(), (i == 1).then_some(0)))
        .collect();
    let adapters = [std::sync::Arc::new(adapter)];
    check_model("hf-tiny-llama", &model, &adapters, &prompts, 8, TINY_TOL);
}

#[test]
fn generated_llama_and_qwen2_with_the_16_bit_residual_keep_greedy_tokens() {
    use thaw_server::gen::{ArchOptions, GenArch};
    let preset = thaw_tests::test_preset();
    let qwen = ArchOptions {
        arch: GenArch::Qwen2,
        ..Default::default()
    };
    let models = [
        ("llama", thaw_tests::TestModel::llama(29)),
        ("qwen2", thaw_tests::TestModel::with_arch(&preset, 29, qwen)),
    ];
    for (name, tm) in &models {
        let vocab = tm.model.config.vocab_size as u64;
        let prompts: Vec<(Vec<u32>, Option<u32>)> = [7u64, 12, 3]
            .iter()
            .map(|&len| {
                let p = (0..len)
                    .map(|i| ((i * 37 + len * 11) % vocab) as u32)
                    .collect();
                (p, None)
            })
            .collect();
        check_model(name, &tm.model, &[], &prompts, 6, TINY_TOL);
    }
}

/// The transformers reference (`make_reference.py`).
#[derive(serde::Deserialize)]
struct Reference {
    generator: String,
    new_tokens: usize,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    tokens: Vec<u32>,
}

#[test]
fn smollm2_bf16_greedy_tokens_with_the_whole_switch_equal_transformers() {
    let Some(path) = std::env::var_os("THAW_SMOLLM2_BF16") else {
        eprintln!("skipping: set THAW_SMOLLM2_BF16 to SmolLM2-135M-Instruct in bf16");
        return;
    };
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/smollm2-reference/greedy.json");
    let want: Reference = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let (model, tok) =
        HostModel::load_with_tokenizer(std::path::Path::new(&path)).expect("the model loads");
    assert_eq!(model.format_mix(), "BF16", "{path:?} is not a bf16 model");
    let prompts: Vec<(Vec<u32>, Option<u32>)> = want
        .cases
        .iter()
        .map(|c| {
            let ids = chat_prompt(&tok, &c.prompt);
            assert_eq!(ids, c.prompt_ids, "{:?}: the chat prompt differs", c.prompt);
            (ids, None)
        })
        .collect();
    let bf = Act16Type::Bf16;
    let mut runs = Vec::new();
    for emu in [Emu::F32, Emu::Whole(bf), Emu::Mlp(bf)] {
        let got = run(&model, emu, &[], &prompts, want.new_tokens);
        for (c, g) in want.cases.iter().zip(&got.tokens) {
            // transformers stops after the end-of-turn token; Thaw ran on (ignore_eos).
            let g = &g[..c.tokens.len()];
            eprintln!("{emu:?} {:?}: {:?}", c.prompt, tok.decode(g, true).unwrap());
            assert_eq!(
                g, c.tokens,
                "{emu:?}: {:?} differs from {}",
                c.prompt, want.generator
            );
        }
        runs.push(got);
    }
    let err = worst(&runs[1], &runs[0]);
    let err_mlp = worst(&runs[2], &runs[0]);
    eprintln!(
        "SmolLM2 bf16: worst normwise logits error vs f32: whole switch {err:e}, MLP half \
         {err_mlp:e}"
    );
    assert!(
        worst(&runs[1], &runs[2]) > 0.0,
        "the whole switch equals its MLP half: the residual was not rounded"
    );
    assert!(err <= SMOLLM2_TOL, "whole switch: rel err {err:e}");
}
