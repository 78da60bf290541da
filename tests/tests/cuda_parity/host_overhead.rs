//! What a steady-state eager decode step asks of the driver on the CUDA backend (issue 29),
//! from the backend's running counts (`CudaBackend::device_counts`): no device allocation (every
//! scratch buffer has grown to the decode shape in the warm-up steps), at most
//! [`MAX_UPLOADS`] host → device copies of metadata (token ids, positions, the attention
//! metadata packed in one copy, the three LoRA tables, the sample rows: each once a step, never
//! per layer) of at most [`MAX_UPLOAD_BYTES`] bytes, no counted synchronisation (the logits copy's
//! one wait, in `try_logits`, is outside the counts), one cuBLAS product per projection plus
//! the LM head, and the same counts every step. With 16-bit weights (and the default fused
//! kernels) a projection's input is cast to 16 bits at most once per input: the fused add +
//! RMSNorm writes q/k/v's and gate/up's 16-bit input beside its f32 output, the fused SwiGLU
//! down's, and k, v and up read q's and gate's; only the first layer's q/k/v input (after the
//! plain RMSNorm), every o_proj input and the LM head's are cast. So bf16 launches exactly
//! `layers + 2` kernels more than f32 (it was `6 · layers + 1`: a cast per product but down).
//! Those counts are derived for the four defaults of `KernelPlan` with the nine of `OptInPlan`
//! off, which the helpers set explicitly (their own steady tests turn one on: `lt.rs`,
//! `act16.rs`, `attn16.rs`, `residual16.rs`); with all thirteen on, as a backend starts by
//! default, the step still allocates nothing, uploads its metadata once and repeats its counts,
//! eager and replayed. Part of `cuda_parity` (its helpers, its GPU skip rules).
use std::sync::Arc;

use thaw_runtime::adapter::LoraAdapter;
use thaw_runtime::backend::cuda::{AttnImpl, CudaBackend, DType};
use thaw_runtime::backend::device_counts::DeviceCounts;
use thaw_runtime::engine::{PlanItem, SequenceParams, StepPlan};
use thaw_runtime::ids::{AdapterId, SeqId};
use thaw_runtime::sampling::SamplingParams;
use thaw_tests::graphs::prompts;
use thaw_tests::TestModel;

use super::graphs::engine_with;

/// Host → device copies a decode step may make: token ids, positions, the attention metadata
/// (slots, block tables, decode rows: one packed copy), three LoRA tables, sample rows.
const MAX_UPLOADS: u64 = 7;
/// Their bytes for this test's 3 short sequences (a few hundred in practice).
const MAX_UPLOAD_BYTES: u64 = 4096;

/// Counts of each of `steps` decode steps after a prefill and two warm-up decode steps of 3
/// sequences, two of them on a rank-8 q/v adapter. The prompts are 3 tokens, so that no
/// context crosses a 16-token KV block within the steps: the block tables keep their size,
/// which is what steady means here (a table that grows may grow its device buffer).
fn decode_counts(tm: &TestModel, dt: DType, steps: usize) -> Vec<DeviceCounts> {
    decode_counts_with(tm, dt, steps, |_| {})
}

/// [`decode_counts`] with `extra` switching the backend after the fixed kernels are set (the
/// cuBLASLt and 16-bit activation tests: `lt.rs`, `act16.rs`).
pub(super) fn decode_counts_with(
    tm: &TestModel,
    dt: DType,
    steps: usize,
    extra: impl FnOnce(&mut CudaBackend),
) -> Vec<DeviceCounts> {
    let adapter = tm.adapter(8, &["q", "v"], 90);
    decode_counts_on(tm, dt, steps, (Some(adapter), false), extra)
}

/// [`decode_counts_with`] with the two adapter rows on `adapter` (base rows without one) and,
/// with `graphs`, CUDA graphs on (the two warm-up decode steps then warm up and capture: the
/// counted steps replay).
pub(super) fn decode_counts_on(
    tm: &TestModel,
    dt: DType,
    steps: usize,
    (adapter, graphs): (Option<Arc<LoraAdapter>>, bool),
    extra: impl FnOnce(&mut CudaBackend),
) -> Vec<DeviceCounts> {
    assert!(3 + 2 + steps < 16, "contexts stay inside one KV block");
    // The kernels the counts below are derived for, whatever the environment asks: fused on,
    // flash-decoding's default chunks, and the nine of `OptInPlan` off (defaults since session
    // 24: the GEMV would take the 3-row products from cuBLAS and their casts, the occupancy
    // decode flash-decoding's launches, the device argmax the logits' copy back); `extra` turns on
    // what a test counts against this.
    let mut e = engine_with(&tm.model, dt, adapter.as_slice(), graphs, |b| {
        b.set_fused(true).unwrap();
        b.set_attn_impl(AttnImpl::SPLIT).unwrap();
        super::defaults::nine_off(b);
        extra(b);
    });
    let mut p = prompts(3, tm.model.config.vocab_size, 7);
    for prompt in &mut p {
        prompt.truncate(3);
    }
    let on = adapter.as_ref().map(|_| 0);
    let who = [on, None, on];
    let ids: Vec<SeqId> = (0..3).map(SeqId).collect();
    for ((&id, a), prompt) in ids.iter().zip(who).zip(&p) {
        e.add_sequence(
            id,
            SequenceParams {
                prompt: prompt.clone(),
                adapter: a.map(AdapterId),
                sampling: SamplingParams::greedy(),
                max_new_tokens: steps + 4,
                ignore_eos: true,
                ..Default::default()
            },
        )
        .expect("the sequence is admitted");
    }
    let plan = |first: bool| StepPlan {
        items: ids
            .iter()
            .zip(&p)
            .map(|(&seq, prompt)| PlanItem {
                seq,
                num_tokens: if first { prompt.len() } else { 1 },
            })
            .collect(),
        return_logits: false,
    };
    e.step(&plan(true)).expect("prefill");
    for _ in 0..2 {
        e.step(&plan(false)).expect("warm-up decode");
    }
    (0..steps)
        .map(|_| {
            let before = e.backend().device_counts();
            e.step(&plan(false)).expect("decode");
            e.backend().device_counts().since(&before)
        })
        .collect()
}

#[test]
fn steady_eager_decode_allocates_nothing_and_uploads_metadata_once() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    let layers = tm.model.config.num_layers as u64;
    let mut launches = Vec::new();
    for dt in [DType::F32, DType::Bf16] {
        let counts = decode_counts(&tm, dt, 3);
        println!("{dt:?}: {:?}", counts[0]);
        for (i, c) in counts.iter().enumerate() {
            assert_eq!(
                c, &counts[0],
                "{dt:?}: decode step {i} differs from the first"
            );
        }
        let c = counts[0];
        assert_eq!(
            (c.allocs, c.alloc_bytes),
            (0, 0),
            "{dt:?}: a steady decode step allocated device memory"
        );
        assert!(
            c.htod <= MAX_UPLOADS && c.htod_bytes <= MAX_UPLOAD_BYTES,
            "{dt:?}: {} host → device copies of {} bytes a step (at most {MAX_UPLOADS} of \
             {MAX_UPLOAD_BYTES}): metadata uploaded per layer?",
            c.htod,
            c.htod_bytes
        );
        assert_eq!(
            (c.syncs, c.dtoh, c.graph_launches),
            (0, 0, 0),
            "{dt:?}: an eager step waited for, or copied back from, the stream outside the logits"
        );
        assert_eq!(
            c.gemms,
            7 * layers + 1,
            "{dt:?}: one product per projection and the LM head"
        );
        launches.push(c.launches);
    }
    assert_eq!(
        launches[1] - launches[0],
        layers + 2,
        "bf16 over f32 launches ({launches:?}): casts only for layer 0's q/k/v input, every \
         o_proj input and the LM head's"
    );
}

/// The defaults, all thirteen on (the nine set explicitly, whatever the environment says): a
/// steady decode step, eager and graph-replayed, allocates nothing (every scratch of the GEMV,
/// the 16-bit activations, the occupancy decode's splits, the device argmax's ids and
/// cuBLASLt's descriptors grew in the warm-up steps), uploads at most [`MAX_UPLOADS`] copies of
/// metadata, repeats the same counts every step, and a replay is one graph launch with no
/// product from the host. The launch and product counts themselves are not derived here (the
/// GEMV, grouped products and sliced LoRA each change them); the tests above pin those for the
/// paths whose counts they derive.
#[test]
fn steady_decode_on_the_defaults_allocates_nothing() {
    if !thaw_tests::gpu_or_skip() {
        return;
    }
    let tm = TestModel::llama(6);
    for dt in [DType::F32, DType::Bf16] {
        for graphs in [false, true] {
            let adapter = tm.adapter(8, &["q", "v"], 90);
            let counts = decode_counts_on(&tm, dt, 4, (Some(adapter), graphs), |b| {
                super::defaults::set_nine(b, true, dt != DType::F32)
            });
            let what = format!("{dt:?} graphs {graphs}");
            println!("{what}, the defaults: {:?}", counts[0]);
            for (i, c) in counts.iter().enumerate() {
                assert_eq!(
                    c, &counts[0],
                    "{what}: decode step {i} differs from the first"
                );
            }
            let c = counts[0];
            assert_eq!(
                (c.allocs, c.alloc_bytes),
                (0, 0),
                "{what}: a steady decode step on the defaults allocated device memory"
            );
            assert!(
                c.htod <= MAX_UPLOADS && c.htod_bytes <= MAX_UPLOAD_BYTES,
                "{what}: {} host → device copies of {} bytes a step",
                c.htod,
                c.htod_bytes
            );
            if graphs {
                assert_eq!(
                    (c.graph_launches, c.gemms),
                    (1, 0),
                    "{what}: a replay is one graph launch, no product from the host"
                );
            } else {
                assert_eq!(c.graph_launches, 0, "{what}");
            }
        }
    }
}
