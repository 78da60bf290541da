//! Decode steps as captured graphs (issue 29; `EngineConfig::cuda_graphs`): the engine's side.
//! Which steps run as a graph and how they are padded is `backend::graph_plan` (pure); the
//! engine reserves the scratch KV block padding rows write, pads the step, and drives the
//! backend's begin / forward / end protocol ([`run`]). Backends without graphs (the CPU one)
//! never get here: every step runs eagerly.
use std::collections::HashSet;

use super::forward::{self, Workspace};
use super::weights::DeviceModel;
use super::EngineConfig;
use crate::backend::graph_plan::{
    decide, pad_step, GraphKey, GraphPhase, GraphPolicy, GraphSizing, StepShape, MAX_GRAPH_RANK,
};
use crate::backend::{Backend, LoraBatch, LoraLayout, StepLayout};
use crate::error::Result;
use crate::kv::{BlockAllocator, KvBlocks};
use crate::model::ModelConfig;

/// How the engine's steps ran, since it started (or graphs were last switched on).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Decode steps run eagerly on their padded shape, before their graph was captured.
    pub warmups: u64,
    /// Graphs captured (one per batch-size bucket and LoRA rank class used).
    pub captures: u64,
    /// Decode steps that replayed a captured graph.
    pub replays: u64,
    /// Captures that failed (their key runs eagerly from then on).
    pub failed: u64,
    /// Steps that ran eagerly while graphs were on (prefill, mixed, too large, CPU-assisted…).
    pub eager: u64,
}

/// The engine's graph state: the policy, what the backend sizes, the scratch block.
pub(super) struct EngineGraphs {
    policy: GraphPolicy,
    sizing: GraphSizing,
    /// One KV block no sequence owns: padding rows write their KV into it.
    scratch: Option<KvBlocks>,
    /// Keys whose capture failed: their steps run eagerly, unpadded.
    failed: HashSet<GraphKey>,
    pub stats: GraphStats,
}

impl EngineGraphs {
    /// Graph state for `cfg`, or `None` when graphs are off or `backend` has none.
    pub fn new<B: Backend>(
        backend: &B,
        c: &ModelConfig,
        cfg: &EngineConfig,
        max_context: usize,
        logit_cap: usize,
    ) -> Option<Self> {
        if !cfg.cuda_graphs || !backend.supports_graphs() {
            return None;
        }
        // A graph's rows are a step's rows and its sequences: both limits bound the buckets.
        let max_bs = cfg
            .cuda_graph_max_bs
            .unwrap_or(cfg.max_batch_seqs)
            .min(cfg.max_batch_seqs)
            .min(cfg.max_batch_tokens);
        let policy = GraphPolicy::new(max_bs, max_context, cfg.kv_block_size);
        let widest = c.hidden_size.max(c.q_dim()).max(c.intermediate_size);
        let sizing = GraphSizing {
            meta: policy.meta_layout(),
            block_size: cfg.kv_block_size,
            num_blocks: cfg.num_kv_blocks,
            x_elems: cfg.max_batch_tokens * widest,
            logit_elems: logit_cap.max(policy.max_bucket()) * c.vocab_size,
            lora_v_elems: cfg.max_batch_tokens * MAX_GRAPH_RANK,
        };
        Some(Self {
            policy,
            sizing,
            scratch: None,
            failed: HashSet::new(),
            stats: GraphStats::default(),
        })
    }

    /// The KV cache was replaced (`resize_kv`): the scratch block belonged to the old pool.
    pub fn kv_resized(&mut self, num_blocks: usize) {
        self.scratch = None;
        self.sizing.num_blocks = num_blocks;
    }

    /// The graph this step replays, after padding `step` and `lora` to its bucket; `None`
    /// (nothing changed) when it runs eagerly. `max_rank`: the largest rank of the step's
    /// adapters.
    pub fn plan(
        &mut self,
        blocks: &BlockAllocator,
        step: &mut StepLayout,
        lora: &mut LoraLayout,
        (cold, scores_prompt, max_rank): (bool, bool, usize),
    ) -> Option<GraphKey> {
        let shape = StepShape::of(step, cold, scores_prompt, max_rank);
        let key = match decide(&shape, &self.policy) {
            Ok(k) if !self.failed.contains(&k) => Some(k),
            Ok(_) => None,
            Err(why) => {
                tracing::trace!(?why, "eager step");
                None
            }
        };
        let Some(key) = key else {
            self.stats.eager += 1;
            return None;
        };
        if self.scratch.is_none() {
            let mut b = blocks.empty();
            if let Err(e) = blocks.grow_to(&mut b, 1) {
                // Every block is taken: padding rows would have nowhere to write.
                tracing::debug!("no KV block for CUDA-graph padding rows yet: {e}");
                self.stats.eager += 1;
                return None;
            }
            self.scratch = Some(b);
        }
        let scratch = self.scratch.as_ref().map(|b| b.blocks()[0].0)?;
        pad_step(step, lora, key.bucket, scratch);
        Some(key)
    }
}

/// Runs one padded step as graph `key`: the backend's begin, the forward unless it replayed,
/// its end; once more, eagerly, if the capture failed. Leaves the real `rows` rows' logits in
/// `logits`, or with `ids` their greedy token ids in it ([`Backend::graph_end_ids`]: the graph
/// itself is the same either way, ending in the LM head; `logits` is then scratch).
#[allow(clippy::too_many_arguments)]
pub(super) fn run<B: Backend>(
    g: &mut EngineGraphs,
    key: GraphKey,
    b: &mut B,
    (c, m): (&ModelConfig, &DeviceModel<B>),
    kv: &mut [B::KvLayer],
    ws: &mut Workspace<B>,
    (step, lora): (&StepLayout, &LoraBatch<'_, B::Lora>),
    rows: usize,
    logits: &mut Vec<f32>,
    mut ids: Option<&mut Vec<u32>>,
) -> Result<()> {
    let Some(phase) = b.graph_begin(key, step, lora, &g.sizing)? else {
        // Failed before (another engine's step, or state the engine did not see): eager.
        g.failed.insert(key);
        g.stats.eager += 1;
        return forward::run(b, c, m, kv, ws, step, lora, None, None, logits, ids);
    };
    if phase != GraphPhase::Replay {
        if let Err(e) = forward::run(b, c, m, kv, ws, step, lora, None, None, logits, None) {
            // Ends a capture in progress; the step's error is the one to report.
            let _ = b.graph_end(logits, rows);
            return Err(e);
        }
    }
    let mut end = |b: &mut B, logits: &mut Vec<f32>| match ids.as_deref_mut() {
        Some(ids) => b.graph_end_ids(logits, ids, rows),
        None => b.graph_end(logits, rows),
    };
    if end(b, logits)? {
        match phase {
            GraphPhase::Warmup => g.stats.warmups += 1,
            GraphPhase::Capture => g.stats.captures += 1,
            GraphPhase::Replay => g.stats.replays += 1,
        }
        return Ok(());
    }
    tracing::warn!(
        bucket = key.bucket,
        lora_rank = key.lora_rank,
        "CUDA graph capture failed; this batch size runs eagerly from now on"
    );
    g.failed.insert(key);
    g.stats.failed += 1;
    forward::run(b, c, m, kv, ws, step, lora, None, None, logits, None)?;
    end(b, logits)?;
    Ok(())
}

/// Largest total length a sequence may reach under `cfg`.
pub(super) fn max_context(c: &ModelConfig, cfg: &EngineConfig) -> usize {
    cfg.max_context
        .unwrap_or(c.max_position_embeddings)
        .min(c.max_position_embeddings)
}

impl<B: Backend> super::Engine<B> {
    /// Switches CUDA-graph decode on or off (`EngineConfig::cuda_graphs`) from the next step;
    /// off drops every captured graph and the padding rows' scratch KV block. Returns whether
    /// graphs are on now (never on a backend without them).
    pub fn set_cuda_graphs(&mut self, on: bool) -> bool {
        self.graphs = None;
        self.backend.graph_reset();
        self.cfg.cuda_graphs = on;
        let max_context = self.max_context();
        let cap = self.ws.logit_cap();
        self.graphs = EngineGraphs::new(&self.backend, &self.config, &self.cfg, max_context, cap);
        self.graphs.is_some()
    }

    /// How steps ran since graphs were switched on (`None`: they are off, or the backend
    /// has none).
    pub fn graph_stats(&self) -> Option<&GraphStats> {
        self.graphs.as_ref().map(|g| &g.stats)
    }
}
