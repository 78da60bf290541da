//! The engine on files written by HF transformers and PEFT themselves (tests/fixtures).
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::LoraKernel;
use thaw_runtime::engine::{EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::model::Tokenizer;
use thaw_tests::{cpu_engine, fixture_dir, rel_err};

/// See `oracle.rs` for why 1e-4 (normwise, f32 vs f32 with different summation orders).
const TOL: f64 = 1e-4;

fn logits_of(
    model: HostModel,
    adapters: &[Arc<LoraAdapter>],
    prompts: &[(Vec<u32>, Option<u32>)],
    kernel: LoraKernel,
) -> Vec<Vec<f32>> {
    let mut e = cpu_engine(
        model,
        EngineConfig {
            lora_kernel: kernel,
            ..Default::default()
        },
    );
    for (i, a) in adapters.iter().enumerate() {
        e.register_adapter(AdapterId(i as u32), a.clone()).unwrap();
    }
    for (i, (p, a)) in prompts.iter().enumerate() {
        e.add_sequence(
            SeqId(i as u64),
            SequenceParams {
                prompt: p.clone(),
                adapter: a.map(AdapterId),
                ..Default::default()
            },
        )
        .unwrap();
    }
    let items = prompts
        .iter()
        .enumerate()
        .map(|(i, (p, _))| PlanItem {
            seq: SeqId(i as u64),
            num_tokens: p.len(),
        })
        .collect();
    let mut out = e
        .step(&StepPlan {
            items,
            return_logits: true,
        })
        .unwrap();
    out.sort_by_key(|o| o.seq);
    out.into_iter().map(|o| o.logits.unwrap()).collect()
}

#[test]
fn peft_adapters_on_hf_model_match_merged_weights() {
    let dir = fixture_dir();
    let model = HostModel::load(&dir).expect("HF-written model loads unchanged");
    let tok = Tokenizer::from_dir(&dir, &model.config).unwrap();
    let adapters: Vec<Arc<LoraAdapter>> = ["r4_qv", "r8_all_rslora"]
        .iter()
        .map(|n| Arc::new(LoraAdapter::load(&dir.join("adapters").join(n), &model.config).unwrap()))
        .collect();
    let texts = ["Hello world", "fn main() {}", "The quick brown fox jumps"];
    let prompts: Vec<(Vec<u32>, Option<u32>)> = texts
        .iter()
        .flat_map(|t| {
            let ids = tok.encode(t, true).unwrap();
            [(ids.clone(), None), (ids.clone(), Some(0)), (ids, Some(1))]
        })
        .collect();
    for kernel in [LoraKernel::Sgmv, LoraKernel::Bgmv] {
        let batched = logits_of(model.clone(), &adapters, &prompts, kernel);
        for (i, (p, a)) in prompts.iter().enumerate() {
            let mut merged = model.clone();
            if let Some(a) = a {
                merged.merge_adapter(&adapters[*a as usize]);
            }
            let want = logits_of(merged, &[], &[(p.clone(), None)], kernel).remove(0);
            let err = rel_err(&batched[i], &want);
            assert!(
                err <= TOL,
                "{kernel:?} prompt {i} adapter {a:?}: rel err {err:e}"
            );
        }
        // The real adapters change the output.
        assert!(rel_err(&batched[1], &batched[0]) > 1e-4);
        assert!(rel_err(&batched[2], &batched[0]) > 1e-4);
    }
}
