//! CUDA-graph decode (issue 29), the host side as pure functions: which batch sizes get a
//! captured graph, which graph a step replays (or why it runs eagerly), how a step is padded up
//! to its graph's size, and the persistent metadata buffer a graph reads. A captured graph
//! bakes in device addresses and launch shapes, so everything that changes per step lives at
//! fixed addresses with fixed capacities and is written by one host → device copy before the
//! launch; the CUDA side (`cuda/graph.rs`) only captures, replays and copies.
//!
//! Capture sizes follow vLLM's default (`cudagraph_capture_sizes`): 1, 2, 4, then every
//! multiple of 8 up to 256, then every multiple of 16, up to the largest size ≤ the engine's
//! `--cuda-graph-max-bs` (default `--max-num-seqs`) and ≤ [`MAX_CAPTURE_SIZE`]. A decode step
//! of `n` sequences replays the smallest captured size ≥ `n`, its rows past `n` padded with
//! inert rows ([`pad_step`]: token 0 at position 0 whose KV goes to a scratch block no sequence
//! owns, no adapter, logits ignored); a step with any prefill rows, more sequences than the
//! largest size, adapter layers still streaming (CPU assist), or prompt scoring runs eagerly.
//!
//! LoRA in a graph: the BGMV kernels (per-row descriptor tables, 0 = no adapter), launched for
//! every (layer, module) with the key's rank class ([`rank_class`]) as `max_rank`. BGMV reads
//! each row's real rank and zero-fills the columns past it, so a rank-16 adapter in a
//! rank-class-32 graph gives the same deltas as an eager BGMV step of rank 16; one graph per
//! (bucket, rank class) serves every mix of adapters of that class. A step with no adapter
//! replays the rank-0 graph, which launches no LoRA kernel at all.
//!
//! Lifecycle of one key ([`next_phase`]): the first step runs eagerly on the padded shape
//! (a warm-up: first-use library work and buffer growth happen outside the capture, as vLLM
//! warms up before capturing), the second is captured and launched, later ones replay. A
//! capture that fails marks the key eager for good and the step is rerun eagerly.
use super::step_meta::{AttnHost, LoraHost};
use super::{LoraLayout, SeqSlice, StepLayout};

/// The largest batch vLLM captures by default.
pub const MAX_CAPTURE_SIZE: usize = 512;

/// Largest LoRA rank a graph's BGMV launches take (`THAW_MAX_LORA_RANK` of `lora.cu`).
pub const MAX_GRAPH_RANK: usize = 256;

/// The batch sizes that get a graph, ascending.
pub fn capture_sizes(max_num_seqs: usize) -> Vec<usize> {
    let cap = max_num_seqs.min(MAX_CAPTURE_SIZE);
    let small = [1, 2, 4].into_iter();
    let by8 = (8..=256).step_by(8);
    let by16 = (272..=MAX_CAPTURE_SIZE).step_by(16);
    small.chain(by8).chain(by16).filter(|&s| s <= cap).collect()
}

/// The captured size a decode step of `batch` sequences replays, or `None` (run eagerly) when
/// `batch` is 0 or above every captured size. `sizes` ascending, as [`capture_sizes`] gives.
pub fn bucket_for(batch: usize, sizes: &[usize]) -> Option<usize> {
    if batch == 0 {
        return None;
    }
    let i = sizes.partition_point(|&s| s < batch);
    sizes.get(i).copied()
}

/// The `max_rank` a graph's LoRA launches use for a step whose largest adapter rank is
/// `max_rank`: 0 (no adapter: no LoRA launch), else the next power of two, at least 8 — a few
/// graphs per bucket instead of one per rank, at most 2× the padded BGMV columns.
pub fn rank_class(max_rank: usize) -> usize {
    match max_rank {
        0 => 0,
        r => r.next_power_of_two().max(8),
    }
}

/// Which graph a step replays: its padded batch size and its LoRA rank class.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphKey {
    pub bucket: usize,
    pub lora_rank: usize,
}

/// What the engine knows about a step when it chooses between a graph and the eager path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    pub rows: usize,
    pub seqs: usize,
    /// Every sequence has exactly one row (a decode step).
    pub decode_only: bool,
    /// Every row is sampled, in row order (the graph computes logits for every row).
    pub samples_every_row: bool,
    /// Some row's logits also score a prompt token (prompt logprobs).
    pub scores_prompt: bool,
    /// Some adapter layer is not on the device yet (its rows are CPU-assisted).
    pub cold: bool,
    /// Largest rank among the step's adapters, 0 when no row has one.
    pub max_rank: usize,
    /// Block-table entries of the step, all sequences together.
    pub table_blocks: usize,
}

impl StepShape {
    /// The shape of `step`; the facts the layout does not hold are given.
    pub fn of(step: &StepLayout, cold: bool, scores_prompt: bool, max_rank: usize) -> Self {
        let rows = step.rows();
        Self {
            rows,
            seqs: step.seqs.len(),
            decode_only: step.seqs.len() == rows && step.seqs.iter().all(|s| s.rows.len() == 1),
            samples_every_row: step.logit_rows.len() == rows
                && step.logit_rows.iter().enumerate().all(|(i, &r)| i == r),
            scores_prompt,
            cold,
            max_rank,
            table_blocks: step.block_tables.len(),
        }
    }
}

/// Graph sizing, fixed when graphs are switched on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphPolicy {
    /// Captured batch sizes, ascending ([`capture_sizes`]).
    pub sizes: Vec<usize>,
    /// Block-table entries one sequence may have (its longest context ÷ block size).
    pub max_blocks_per_seq: usize,
}

impl GraphPolicy {
    /// Graphs up to `max_bs` sequences (≤ the step's row and sequence limits) for sequences of
    /// at most `max_context` tokens in blocks of `block_size`.
    pub fn new(max_bs: usize, max_context: usize, block_size: usize) -> Self {
        Self {
            sizes: capture_sizes(max_bs),
            max_blocks_per_seq: max_context.div_ceil(block_size.max(1)).max(1),
        }
    }

    /// The largest captured size (0 when none).
    pub fn max_bucket(&self) -> usize {
        self.sizes.last().copied().unwrap_or(0)
    }

    /// The metadata buffer every graph of this policy shares.
    pub fn meta_layout(&self) -> GraphMetaLayout {
        let c = self.max_bucket();
        GraphMetaLayout::new(c, c * self.max_blocks_per_seq)
    }
}

/// What a backend sizes once for its graphs: the metadata buffer, the KV geometry the block
/// tables index, and the scratch buffers a graph's kernels write, reserved at their largest
/// (an eager step never has to grow, and so move, one of them under a captured graph).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphSizing {
    pub meta: GraphMetaLayout,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Elements of the largest activation a projection reads (`max_batch_tokens` × the widest
    /// projection input): the 16-bit copy of it the GEMMs read.
    pub x_elems: usize,
    /// f32 logits of the largest logits pass (`rows × vocab`).
    pub logit_elems: usize,
    /// f32 LoRA intermediate (`max_batch_tokens` × [`MAX_GRAPH_RANK`]).
    pub lora_v_elems: usize,
}

/// Why a step runs eagerly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Eager {
    /// No rows.
    Empty,
    /// Some sequence has more than one row (prefill, or a mixed step).
    Prefill,
    /// More sequences than the largest captured size.
    TooLarge { rows: usize, largest: usize },
    /// Some adapter layer is CPU-assisted this step.
    Cold,
    /// Prompt logprobs need logits of rows the graph does not sample.
    ScoresPrompt,
    /// Some row is not sampled, or sampled rows are not in row order.
    PartialSampling,
    /// An adapter above [`MAX_GRAPH_RANK`].
    RankTooLarge(usize),
    /// The padded block tables would not fit the metadata buffer.
    TablesTooLong { words: usize, capacity: usize },
}

/// The graph a step replays (after [`pad_step`] to its bucket), or why it runs eagerly.
pub fn decide(s: &StepShape, p: &GraphPolicy) -> Result<GraphKey, Eager> {
    if s.rows == 0 {
        return Err(Eager::Empty);
    }
    if !s.decode_only {
        return Err(Eager::Prefill);
    }
    if s.cold {
        return Err(Eager::Cold);
    }
    if s.scores_prompt {
        return Err(Eager::ScoresPrompt);
    }
    if !s.samples_every_row {
        return Err(Eager::PartialSampling);
    }
    if s.max_rank > MAX_GRAPH_RANK {
        return Err(Eager::RankTooLarge(s.max_rank));
    }
    let bucket = bucket_for(s.rows, &p.sizes).ok_or(Eager::TooLarge {
        rows: s.rows,
        largest: p.max_bucket(),
    })?;
    // Each padding row's table is the one scratch block.
    let words = s.table_blocks + (bucket - s.rows);
    let capacity = p.meta_layout().table_capacity();
    if words > capacity {
        return Err(Eager::TablesTooLong { words, capacity });
    }
    Ok(GraphKey {
        bucket,
        lora_rank: rank_class(s.max_rank),
    })
}

/// Where one graph key is in its lifecycle.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KeyState {
    /// Ran once eagerly on the padded shape.
    WarmedUp,
    /// Captured; replays from now on.
    Captured,
    /// Its capture failed: eager for good.
    Failed,
}

/// What the backend does with a graph step.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GraphPhase {
    /// Run the padded step eagerly, reading the persistent metadata (first use of a key).
    Warmup,
    /// Capture the padded step's forward into a graph, then launch it.
    Capture,
    /// Launch the captured graph; the forward is not run on the host at all.
    Replay,
}

/// The phase of a key in `state` (`None`: never seen), or `None` to run eagerly.
pub fn next_phase(state: Option<KeyState>) -> Option<GraphPhase> {
    match state {
        None => Some(GraphPhase::Warmup),
        Some(KeyState::WarmedUp) => Some(GraphPhase::Capture),
        Some(KeyState::Captured) => Some(GraphPhase::Replay),
        Some(KeyState::Failed) => None,
    }
}

/// The state a key is in after a phase ran (`ok`: its capture succeeded).
pub fn after_phase(phase: GraphPhase, ok: bool) -> KeyState {
    match (phase, ok) {
        (GraphPhase::Warmup, _) => KeyState::WarmedUp,
        (GraphPhase::Capture | GraphPhase::Replay, true) => KeyState::Captured,
        (GraphPhase::Capture | GraphPhase::Replay, false) => KeyState::Failed,
    }
}

/// Pads a decode step of `n ≤ bucket` rows up to `bucket` rows with inert rows: token 0 at
/// position 0, its KV written to slot 0 of `scratch_block` (a block no sequence owns, whose
/// contents nothing else reads), attending to that one slot, no adapter, its logits computed
/// and ignored. Real rows, their tables and the LoRA segments are untouched; the padding rows
/// come after them, so sampled row `i` is still row `i`.
pub fn pad_step(step: &mut StepLayout, lora: &mut LoraLayout, bucket: usize, scratch_block: u32) {
    let n = step.rows();
    debug_assert!(n <= bucket, "{n} rows do not fit a graph of {bucket}");
    for r in n..bucket {
        let b0 = step.block_tables.len();
        step.block_tables.push(scratch_block);
        step.token_ids.push(0);
        step.positions.push(0);
        step.seqs.push(SeqSlice {
            rows: r..r + 1,
            start_pos: 0,
            blocks: b0..b0 + 1,
        });
        step.logit_rows.push(r);
        lora.row_adapter.push(None);
    }
}

/// Offsets (in u32 words) of the persistent metadata every graph reads, in one device buffer.
/// Regions hold `bucket` rows (the largest captured size) whatever the step's batch, so their
/// addresses never change. The block tables come last, so a step copies only the words it uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GraphMetaLayout {
    /// Rows every region holds.
    pub bucket: usize,
    /// `[bucket]` u64 BGMV descriptor table address per row (0 = no adapter), little-endian
    /// word pairs; first, so it is 8-byte aligned.
    pub row_tables: usize,
    /// `[bucket]` token ids.
    pub tokens: usize,
    /// `[bucket]` positions.
    pub positions: usize,
    /// `[bucket]` KV slot each row writes.
    pub slots: usize,
    /// `[bucket, 3]` (table offset, position, row): the decode attention's row metadata.
    pub decode: usize,
    /// `[bucket]` rows whose logits are computed (0, 1, … : every row).
    pub logit_rows: usize,
    /// Block tables, concatenated as the step has them (offsets in `decode`).
    pub tables: usize,
    /// Total words.
    pub len: usize,
}

impl GraphMetaLayout {
    /// Regions for `bucket` rows and `table_words` block-table entries.
    pub fn new(bucket: usize, table_words: usize) -> Self {
        let mut at = 0;
        let mut take = |n: usize| {
            let o = at;
            at += n;
            o
        };
        let row_tables = take(2 * bucket);
        let tokens = take(bucket);
        let positions = take(bucket);
        let slots = take(bucket);
        let decode = take(3 * bucket);
        let logit_rows = take(bucket);
        let tables = take(table_words);
        Self {
            bucket,
            row_tables,
            tokens,
            positions,
            slots,
            decode,
            logit_rows,
            tables,
            len: at,
        }
    }

    /// Block-table entries the buffer holds.
    pub fn table_capacity(&self) -> usize {
        self.len - self.tables
    }

    /// Writes a (padded) decode step into `out` (`len` words) and returns how many leading
    /// words hold it (what the step copies to the device). `attn` and `lora` are the step's
    /// metadata as the eager path builds it ([`AttnHost::build`], [`LoraHost::build`]), so a
    /// graph reads exactly what an eager step would have uploaded. Errors when the step is not
    /// a decode step that fits (the caller then runs it eagerly).
    pub fn fill(
        &self,
        step: &StepLayout,
        attn: &AttnHost,
        lora: &LoraHost,
        out: &mut [u32],
    ) -> Result<usize, String> {
        let n = step.rows();
        if out.len() != self.len {
            return Err(format!(
                "metadata buffer of {} words, layout has {}",
                out.len(),
                self.len
            ));
        }
        if n > self.bucket {
            return Err(format!(
                "{n} rows do not fit graphs of at most {}",
                self.bucket
            ));
        }
        if attn.n_decode() != n || attn.n_tiles() != 0 || step.logit_rows.len() != n {
            return Err(format!(
                "not a decode step: {} decode rows, {} prefill tiles, {} logit rows of {n}",
                attn.n_decode(),
                attn.n_tiles(),
                step.logit_rows.len()
            ));
        }
        if attn.tables.len() > self.table_capacity() {
            return Err(format!(
                "{} block-table entries exceed the graphs' {}",
                attn.tables.len(),
                self.table_capacity()
            ));
        }
        if lora.row_tables.len() != n {
            return Err(format!(
                "{} LoRA row tables for {n} rows",
                lora.row_tables.len()
            ));
        }
        for (r, &t) in lora.row_tables.iter().enumerate() {
            out[self.row_tables + 2 * r] = t as u32;
            out[self.row_tables + 2 * r + 1] = (t >> 32) as u32;
        }
        out[self.tokens..self.tokens + n].copy_from_slice(&step.token_ids);
        for (o, &p) in out[self.positions..self.positions + n]
            .iter_mut()
            .zip(&step.positions)
        {
            *o = p as u32;
        }
        out[self.slots..self.slots + n].copy_from_slice(&attn.slots);
        out[self.decode..self.decode + 3 * n].copy_from_slice(&attn.decode);
        for (o, &r) in out[self.logit_rows..self.logit_rows + n]
            .iter_mut()
            .zip(&step.logit_rows)
        {
            *o = r as u32;
        }
        let t = attn.tables.len();
        out[self.tables..self.tables + t].copy_from_slice(&attn.tables);
        Ok(self.tables + t)
    }
}

#[cfg(test)]
#[path = "graph_plan_tests.rs"]
mod tests;
