//! One forward pass of a Llama-family decoder over a step's rows, through the backend.
use std::time::Instant;

use super::assist::{Assist, ColdSeg};
use super::land_wait::LayerWait;
use super::weights::DeviceModel;
use super::EngineConfig;
use crate::adapter::LoraModule;
use crate::backend::{Backend, LinearDims, LoraBatch, LoraSite, StepLayout};
use crate::error::Result;
use crate::ids::LayerIdx;
use crate::model::ModelConfig;

/// Activation buffers, sized once for the largest step.
pub(crate) struct Workspace<B: Backend> {
    /// The residual stream, in the backend's representation: only its residual ops touch it
    /// ([`Backend`]'s docs).
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
    /// Rows `last` holds: every sample row of a step (one per sequence) in one pass, and
    /// scored prompt rows in passes of this many.
    logit_cap: usize,
}

/// Fewest rows one logits pass takes, so prompt scoring with few sequences per step still
/// runs the LM head as a GEMM rather than row by row; a step's prompt rows (up to
/// `max_batch_tokens`) go through in passes of [`Workspace::logit_cap`] rows, which bounds the
/// `[rows, vocab]` logits buffers on the device and the host.
const MIN_LOGIT_ROWS: usize = 64;

impl<B: Backend> Workspace<B> {
    pub fn new(b: &B, c: &ModelConfig, cfg: &EngineConfig) -> Result<Self> {
        let t = cfg.max_batch_tokens;
        let s = cfg.max_batch_seqs.max(t.min(MIN_LOGIT_ROWS));
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
            logit_cap: s,
        })
    }

    /// Most rows one [`logits`] call takes.
    pub fn logit_cap(&self) -> usize {
        self.logit_cap
    }
}

/// Base projections of weights sharing the input `x` (q/k/v, gate/up, or one), plus every
/// adapter's delta for `modules` of `layer`, as one backend op.
#[allow(clippy::too_many_arguments)]
fn project<B: Backend, const N: usize>(
    b: &mut B,
    c: &ModelConfig,
    ws: [&B::Linear; N],
    x: &B::Buf,
    outs: [&mut B::Buf; N],
    rows: usize,
    (layer, modules): (LayerIdx, [LoraModule; N]),
    lora: &LoraBatch<'_, B::Lora>,
) {
    b.linear_group_lora(x, ws, rows, outs, sites(c, (layer, modules)), lora);
}

/// The LoRA sites of `modules` of `layer`.
fn sites<const N: usize>(
    c: &ModelConfig,
    (layer, modules): (LayerIdx, [LoraModule; N]),
) -> [LoraSite; N] {
    modules.map(|module| {
        let (d_in, d_out) = c.module_shape(module);
        LoraSite {
            layer,
            module,
            dims: LinearDims { d_in, d_out },
        }
    })
}

/// Cold segments of `layer` whose adapter targets a module of `group`, packed in order.
fn cold_segments<L>(
    lora: &LoraBatch<'_, L>,
    assist: &Assist<'_>,
    layer: usize,
    group: &[LoraModule],
    out: &mut Vec<ColdSeg>,
) {
    out.clear();
    let mut packed = 0;
    for (rows, idx) in &lora.layout.segments {
        if lora.on_device(*idx, LayerIdx(layer)) {
            continue;
        }
        let host = assist.host[*idx as usize];
        if !group.iter().any(|&m| host.get(layer, m).is_some()) {
            continue;
        }
        out.push(ColdSeg {
            rows: rows.clone(),
            packed: packed..packed + rows.len(),
            adapter: *idx,
        });
        packed += rows.len();
    }
}

/// Exports the cold rows of `x` and starts their deltas on the CPU. Returns when the base
/// projections that overlap the CPU work begin, or `None` when no row of this layer needs
/// the CPU for `group`.
#[allow(clippy::too_many_arguments)]
fn begin_assist<B: Backend>(
    b: &mut B,
    c: &ModelConfig,
    x: &B::Buf,
    layer: usize,
    group: &[LoraModule],
    lora: &LoraBatch<'_, B::Lora>,
    assist: &mut Option<&mut Assist<'_>>,
    cold: &mut Vec<ColdSeg>,
) -> Result<Option<Instant>> {
    let Some(a) = assist.as_deref_mut() else {
        return Ok(None);
    };
    cold_segments(lora, a, layer, group, cold);
    if cold.is_empty() {
        return Ok(None);
    }
    let d_in = c.module_shape(group[0]).0;
    let d_out_max = group
        .iter()
        .map(|&m| c.module_shape(m).1)
        .max()
        .unwrap_or(0);
    if a.begin_device(b, x, layer, group, cold, d_in, d_out_max)? {
        return Ok(Some(Instant::now()));
    }
    let n: usize = cold.iter().map(|s| s.packed.len()).sum();
    let t0 = Instant::now();
    let (dst, stride) = a.input(n, d_in)?;
    for s in cold.iter() {
        let rows = std::slice::from_ref(&s.rows);
        b.export_rows(x, d_in, rows, &mut dst[s.packed.start * stride..], stride);
    }
    a.buf.profile.export += t0.elapsed();
    a.start(layer, group, cold, d_in, |m| c.module_shape(m).1)?;
    Ok(Some(Instant::now()))
}

/// Waits for the CPU deltas of `group` and adds them into the module outputs; the base
/// projections began at `base_started`.
#[allow(clippy::too_many_arguments)]
fn end_assist<B: Backend>(
    b: &mut B,
    c: &ModelConfig,
    layer: usize,
    group: &[LoraModule],
    outs: &mut [&mut B::Buf],
    assist: &mut Option<&mut Assist<'_>>,
    cold: &[ColdSeg],
    base_started: Instant,
) -> Result<()> {
    let Some(a) = assist.as_deref_mut() else {
        return Ok(());
    };
    a.buf.profile.base += base_started.elapsed();
    if a.buf.device.seq.is_some() {
        return a.end_device(b, layer, group, outs, cold, |m| c.module_shape(m).1);
    }
    let n: usize = cold.iter().map(|s| s.packed.len()).sum();
    a.finish()?;
    let t0 = Instant::now();
    for (&m, y) in group.iter().zip(outs.iter_mut()) {
        let d_out = c.module_shape(m).1;
        let (src, stride) = a.deltas(m, n, d_out)?;
        for s in cold {
            if a.host[s.adapter as usize].get(layer, m).is_none() {
                continue;
            }
            let rows = std::slice::from_ref(&s.rows);
            let src = &src[s.packed.start * stride..];
            b.merge_rows(y, d_out, rows, src, stride);
        }
    }
    a.buf.profile.merge += t0.elapsed();
    Ok(())
}

/// Runs every layer over the step's rows and leaves `[logit_rows, vocab]` logits in `logits`,
/// or with `ids`, the logit rows' greedy token ids in it ([`Backend::greedy_ids`]; `logits` is
/// then its scratch). Rows whose adapter layer has not landed get their deltas from `assist`; with `wait`, the
/// adapters it waits for have each layer waited for until it has landed and computed on the
/// device instead (one step may do both, for different adapters).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<B: Backend>(
    b: &mut B,
    c: &ModelConfig,
    m: &DeviceModel<B>,
    kv: &mut [B::KvLayer],
    ws: &mut Workspace<B>,
    step: &StepLayout,
    lora: &LoraBatch<'_, B::Lora>,
    mut assist: Option<&mut Assist<'_>>,
    mut wait: Option<&mut LayerWait>,
    logits: &mut Vec<f32>,
    ids: Option<&mut Vec<u32>>,
) -> Result<()> {
    let rows = step.rows();
    let hidden = c.hidden_size;
    let mut cold = Vec::new();
    b.embed(&m.embed, &step.token_ids, &mut ws.h);
    let eps = c.rms_norm_eps;
    if let Some(first) = m.layers.first() {
        b.residual_norm(&ws.h, &first.input_norm, eps, rows, &mut ws.x);
    }
    let whole = lora;
    for (i, (layer, kv)) in m.layers.iter().zip(kv.iter_mut()).enumerate() {
        let l = LayerIdx(i);
        // The step's waited adapters with this layer landed since the step began.
        let now_landed;
        let lora = match wait.as_deref_mut() {
            Some(w) => {
                w.until(&*b, whole.adapters, i)?;
                now_landed = LoraBatch {
                    kernel: whole.kernel,
                    layout: whole.layout,
                    adapters: whole.adapters,
                    landed: &w.landed,
                };
                &now_landed
            }
            None => whole,
        };
        let p = &layer.proj;
        use LoraModule::*;
        // Attention block; `ws.x` holds its normed input (the previous layer's last op, or the
        // norm above). One normed input feeds q, k and v: one export on the assist path.
        let g = [Q, K, V];
        let heads = (c.num_heads, c.num_kv_heads);
        let w = [&p[0], &p[1], &p[2]];
        match begin_assist(b, c, &ws.x, i, &g, lora, &mut assist, &mut cold)? {
            Some(t) => {
                // The assist path merges host deltas into f32 q/k/v: the products, then RoPE,
                // the K/V write and attention (one op a backend may fuse), in f32.
                let qkv = [&mut ws.q, &mut ws.k, &mut ws.v];
                project(b, c, w, &ws.x, qkv, rows, (l, g), lora);
                let outs = &mut [&mut ws.q, &mut ws.k, &mut ws.v];
                end_assist(b, c, i, &g, outs, &mut assist, &cold, t)?;
                let qkv = (&mut ws.q, &mut ws.k, &ws.v);
                b.rope_attention(qkv, heads, kv, step, &mut ws.attn);
            }
            None => {
                // q/k/v, their LoRA, RoPE, the K/V write and attention: one op a backend may
                // keep in 16 bits up to the attention kernels.
                let qkv = [&mut ws.q, &mut ws.k, &mut ws.v];
                let sites = sites(c, (l, g));
                b.qkv_attention(&ws.x, w, qkv, sites, lora, heads, kv, step, &mut ws.attn);
            }
        }
        let cpu = begin_assist(b, c, &ws.attn, i, &[O], lora, &mut assist, &mut cold)?;
        project(b, c, [&p[3]], &ws.attn, [&mut ws.o], rows, (l, [O]), lora);
        if let Some(t) = cpu {
            end_assist(b, c, i, &[O], &mut [&mut ws.o], &mut assist, &cold, t)?;
        }
        // The residual add and the MLP block's norm: one op a backend may fuse.
        b.add_rms_norm(
            &mut ws.h,
            &ws.o,
            &layer.post_norm,
            eps,
            rows,
            hidden,
            &mut ws.x,
        );
        let g = [Gate, Up];
        let mlp = [Gate, Up, Down];
        let host_rows = assist.as_deref().is_some_and(|a| {
            cold_segments(lora, a, i, &mlp, &mut cold);
            !cold.is_empty()
        });
        if host_rows {
            // The assist path merges host deltas into f32 gate/up and exports f32 SwiGLU rows
            // for down: the two ops, in f32.
            let cpu = begin_assist(b, c, &ws.x, i, &g, lora, &mut assist, &mut cold)?;
            let gate_up = [&mut ws.gate, &mut ws.up];
            project(b, c, [&p[4], &p[5]], &ws.x, gate_up, rows, (l, g), lora);
            if let Some(t) = cpu {
                let outs = &mut [&mut ws.gate, &mut ws.up];
                end_assist(b, c, i, &g, outs, &mut assist, &cold, t)?;
            }
            b.swiglu(&ws.gate, &ws.up, rows * c.intermediate_size, &mut ws.act);
        } else {
            // Gate/up, their LoRA and SwiGLU: one op a backend may keep in 16 bits.
            let sites = sites(c, (l, g));
            let gate_up = [&mut ws.gate, &mut ws.up];
            let w = [&p[4], &p[5]];
            b.gated_mlp_in(&ws.x, w, rows, gate_up, sites, lora, &mut ws.act);
        }
        let cpu = begin_assist(b, c, &ws.act, i, &[Down], lora, &mut assist, &mut cold)?;
        project(b, c, [&p[6]], &ws.act, [&mut ws.o], rows, (l, [Down]), lora);
        if let Some(t) = cpu {
            end_assist(b, c, i, &[Down], &mut [&mut ws.o], &mut assist, &cold, t)?;
        }
        // The residual add, fused with the next layer's input norm where there is one.
        match m.layers.get(i + 1) {
            Some(next) => b.add_rms_norm(
                &mut ws.h,
                &ws.o,
                &next.input_norm,
                eps,
                rows,
                hidden,
                &mut ws.x,
            ),
            None => b.residual_add(&mut ws.h, &ws.o, rows * hidden),
        }
    }
    match ids {
        Some(ids) => greedy_ids(b, c, m, ws, &step.logit_rows, logits, ids),
        None => self::logits(b, c, m, ws, &step.logit_rows, logits),
    }
    Ok(())
}

/// The final norm of rows `rows` of the last [`run`]'s hidden states into `ws.last_norm`, and
/// the LM head to apply to them; at most [`Workspace::logit_cap`] rows, and at least one.
fn last_rows<'m, B: Backend>(
    b: &mut B,
    c: &ModelConfig,
    m: &'m DeviceModel<B>,
    ws: &mut Workspace<B>,
    rows: &[usize],
) -> &'m B::Linear {
    let n = rows.len();
    assert!(
        n <= ws.logit_cap,
        "{n} logit rows exceed the workspace's {}",
        ws.logit_cap
    );
    b.gather_residual(&ws.h, c.hidden_size, rows, &mut ws.last);
    b.rms_norm(&ws.last, &m.norm, c.rms_norm_eps, n, &mut ws.last_norm);
    m.lm_head.as_ref().unwrap_or(&m.embed)
}

/// The greedy token ids of rows `rows` of the last [`run`]'s final hidden states
/// ([`Backend::greedy_ids`], `scratch` its scratch): what [`logits`] then
/// [`crate::sampling::argmax`] per row would give.
pub(crate) fn greedy_ids<B: Backend>(
    b: &mut B,
    c: &ModelConfig,
    m: &DeviceModel<B>,
    ws: &mut Workspace<B>,
    rows: &[usize],
    scratch: &mut Vec<f32>,
    ids: &mut Vec<u32>,
) {
    if rows.is_empty() {
        ids.clear();
        return;
    }
    let head = last_rows(b, c, m, ws, rows);
    b.greedy_ids(&ws.last_norm, head, rows.len(), scratch, ids);
}

/// `[rows.len(), vocab]` logits of rows `rows` of the last [`run`]'s final hidden states;
/// at most [`Workspace::logit_cap`] rows.
pub(crate) fn logits<B: Backend>(
    b: &mut B,
    c: &ModelConfig,
    m: &DeviceModel<B>,
    ws: &mut Workspace<B>,
    rows: &[usize],
    out: &mut Vec<f32>,
) {
    if rows.is_empty() {
        out.clear();
        return;
    }
    let head = last_rows(b, c, m, ws, rows);
    b.logits(&ws.last_norm, head, rows.len(), out);
}
