//! One forward pass of a Llama-family decoder over a step's rows, through the backend.
use super::weights::DeviceModel;
use super::EngineConfig;
use crate::adapter::LoraModule;
use crate::backend::{Backend, LinearDims, LoraBatch, LoraKernel, LoraLayout, StepLayout};
use crate::error::Result;
use crate::ids::LayerIdx;
use crate::model::ModelConfig;

/// Activation buffers, sized once for the largest step.
pub(crate) struct Workspace<B: Backend> {
    h: B::Buf,
    x: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    attn: B::Buf,
    o: B::Buf,
    gate: B::Buf,
    up: B::Buf,
    act: B::Buf,
    last: B::Buf,
    last_norm: B::Buf,
}

impl<B: Backend> Workspace<B> {
    pub fn new(b: &B, c: &ModelConfig, cfg: &EngineConfig) -> Result<Self> {
        let t = cfg.max_batch_tokens;
        let s = cfg.max_batch_seqs;
        Ok(Self {
            h: b.alloc(t * c.hidden_size)?,
            x: b.alloc(t * c.hidden_size)?,
            q: b.alloc(t * c.q_dim())?,
            k: b.alloc(t * c.kv_dim())?,
            v: b.alloc(t * c.kv_dim())?,
            attn: b.alloc(t * c.q_dim())?,
            o: b.alloc(t * c.hidden_size)?,
            gate: b.alloc(t * c.intermediate_size)?,
            up: b.alloc(t * c.intermediate_size)?,
            act: b.alloc(t * c.intermediate_size)?,
            last: b.alloc(s * c.hidden_size)?,
            last_norm: b.alloc(s * c.hidden_size)?,
        })
    }
}

/// Base projection plus every adapter's delta for `module` of `layer`.
#[allow(clippy::too_many_arguments)]
fn project<B: Backend>(
    b: &mut B,
    c: &ModelConfig,
    w: &B::Linear,
    x: &B::Buf,
    y: &mut B::Buf,
    rows: usize,
    at: (LayerIdx, LoraModule),
    lora: &LoraBatch<'_, B::Lora>,
) {
    b.linear(x, w, rows, y);
    if !lora.layout.segments.is_empty() {
        let (d_in, d_out) = c.module_shape(at.1);
        b.lora(x, y, LinearDims { d_in, d_out }, at, lora);
    }
}

/// Runs every layer over the step's rows and leaves `[logit_rows, vocab]` logits in `logits`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<B: Backend>(
    b: &mut B,
    c: &ModelConfig,
    m: &DeviceModel<B>,
    kv: &mut [B::KvLayer],
    ws: &mut Workspace<B>,
    step: &StepLayout,
    lora_layout: &LoraLayout,
    kernel: LoraKernel,
    adapters: &[&B::Lora],
    logits: &mut Vec<f32>,
) {
    let rows = step.rows();
    let hidden = c.hidden_size;
    let lora = LoraBatch {
        kernel,
        layout: lora_layout,
        adapters,
    };
    b.embed(&m.embed, &step.token_ids, &mut ws.h);
    for (i, (layer, kv)) in m.layers.iter().zip(kv.iter_mut()).enumerate() {
        let l = LayerIdx(i);
        let p = &layer.proj;
        use LoraModule::*;
        // Attention block. One normed input feeds q, k and v (one export on the CPU-assist path).
        b.rms_norm(&ws.h, &layer.input_norm, c.rms_norm_eps, rows, &mut ws.x);
        project(b, c, &p[0], &ws.x, &mut ws.q, rows, (l, Q), &lora);
        project(b, c, &p[1], &ws.x, &mut ws.k, rows, (l, K), &lora);
        project(b, c, &p[2], &ws.x, &mut ws.v, rows, (l, V), &lora);
        b.rope(&mut ws.q, &step.positions, c.num_heads);
        b.rope(&mut ws.k, &step.positions, c.num_kv_heads);
        b.attention(&ws.q, &ws.k, &ws.v, kv, step, &mut ws.attn);
        project(b, c, &p[3], &ws.attn, &mut ws.o, rows, (l, O), &lora);
        b.add(&mut ws.h, &ws.o, rows * hidden);
        // MLP block (SwiGLU).
        b.rms_norm(&ws.h, &layer.post_norm, c.rms_norm_eps, rows, &mut ws.x);
        project(b, c, &p[4], &ws.x, &mut ws.gate, rows, (l, Gate), &lora);
        project(b, c, &p[5], &ws.x, &mut ws.up, rows, (l, Up), &lora);
        b.swiglu(&ws.gate, &ws.up, rows * c.intermediate_size, &mut ws.act);
        project(b, c, &p[6], &ws.act, &mut ws.o, rows, (l, Down), &lora);
        b.add(&mut ws.h, &ws.o, rows * hidden);
    }
    let n = step.logit_rows.len();
    if n == 0 {
        logits.clear();
        return;
    }
    b.gather_rows(&ws.h, hidden, &step.logit_rows, &mut ws.last);
    b.rms_norm(&ws.last, &m.norm, c.rms_norm_eps, n, &mut ws.last_norm);
    let head = m.lm_head.as_ref().unwrap_or(&m.embed);
    b.logits(&ws.last_norm, head, n, logits);
}
