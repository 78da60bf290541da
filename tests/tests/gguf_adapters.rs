//! PEFT adapters on a GGUF base model: the tiny HF fixture converted to GGUF (mixed
//! Q8_0/Q4_1/Q4_0/F16, `tests/fixtures/gguf`) with the fixture's PEFT adapter gives the same
//! logits as the HF model with the same matrices re-encoded by Thaw, for base-only and
//! adapter rows in one batch — so module names and shapes line up and the adapter is applied.
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::engine::{EngineConfig, HostModel, PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_tests::{cpu_engine, fixture_dir, rel_err};

fn logits(model: HostModel, adapter: &Arc<LoraAdapter>, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut e = cpu_engine(model, EngineConfig::default());
    e.register_adapter(AdapterId(0), adapter.clone()).unwrap();
    for (i, a) in [None, Some(AdapterId(0))].into_iter().enumerate() {
        let params = SequenceParams {
            prompt: prompt.to_vec(),
            adapter: a,
            ..Default::default()
        };
        e.add_sequence(SeqId(i as u64), params).unwrap();
    }
    let items = (0..2)
        .map(|i| PlanItem {
            seq: SeqId(i),
            num_tokens: prompt.len(),
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
fn peft_adapter_on_quantised_gguf_matches_reencoded_hf() {
    let gguf = fixture_dir().join("../gguf/tiny-llama-q8_0.gguf");
    let (g, tok) = HostModel::load_with_tokenizer(&gguf).unwrap();
    let (mut h, _) = HostModel::load_with_tokenizer(&fixture_dir()).unwrap();
    // The HF model in exactly the GGUF file's formats, matrix by matrix.
    h.embed = h.embed.convert(g.embed.format()).unwrap();
    let head = h.lm_head.take().unwrap();
    h.lm_head = Some(head.convert(g.lm_head.as_ref().unwrap().format()).unwrap());
    for (hl, gl) in h.layers.iter_mut().zip(&g.layers) {
        for (hp, gp) in hl.proj.iter_mut().zip(&gl.proj) {
            *hp = hp.convert(gp.format()).unwrap();
        }
    }
    let adapter = Arc::new(
        LoraAdapter::load(&fixture_dir().join("adapters/r8_all_rslora"), &g.config).unwrap(),
    );
    let prompt = tok.encode("The quick brown fox jumps", true).unwrap();
    let got = logits(g, &adapter, &prompt);
    let want = logits(h, &adapter, &prompt);
    // Same weights, same kernels: equal up to summation order (normwise 1e-5).
    for (g, w) in got.iter().zip(&want) {
        let e = rel_err(g, w);
        assert!(e < 1e-5, "GGUF vs re-encoded HF: {e:.2e}");
    }
    // The adapter changes the output (it is applied, not skipped).
    assert!(rel_err(&got[1], &got[0]) > 1e-3);
}
