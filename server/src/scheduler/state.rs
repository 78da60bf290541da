//! What the scheduler knows about each request: lengths, progress and the KV blocks it holds.
//!
//! KV is taken on demand (vLLM V1): a sequence holds the blocks of the tokens it has computed
//! and needs, to run, those of its next chunk ([`SeqState::reservation`]). When the pool runs
//! out, a running sequence is preempted by recompute ([`SchedState::preempt`]): it goes back
//! to the front of the queue with its tokens and resumes by prefilling prompt plus output.
use std::collections::{HashSet, VecDeque};

use thaw_runtime::ids::{AdapterId, SeqId};

/// How a request's KV is charged (`--kv-reservation`).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum KvReservation {
    /// Blocks as tokens are computed: a request is charged the blocks it holds plus its next
    /// chunk's, and a running request that cannot get its next block is preempted by
    /// recompute (vLLM V1).
    #[default]
    OnDemand,
    /// Benchmark baseline only: every request reserves prompt + `max_tokens` (the rest of the
    /// context when it sends none) at admission and is never preempted — Thaw's admission
    /// before on-demand blocks, kept to measure what they gain.
    MaxTokens,
}

/// Limits the policy plans within.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedConfig {
    /// Most sequences in one step (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Most tokens in one step (`--max-num-batched-tokens`); prefill is chunked to fit.
    pub max_num_batched_tokens: usize,
    /// Token slots per KV block.
    pub block_size: usize,
    /// KV blocks in the engine.
    pub total_blocks: usize,
    /// How admission charges a request's KV.
    pub kv_reservation: KvReservation,
}

impl SchedConfig {
    /// Blocks holding `tokens` token slots.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Blocks a new request must leave free when admitted, so running sequences can grow a
    /// while before anyone is preempted (vLLM's watermark: 1% of the cache).
    pub fn watermark(&self) -> usize {
        self.total_blocks / 100
    }
}

/// One request (one engine sequence) as the scheduler sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqState {
    pub id: SeqId,
    pub prompt_len: usize,
    pub max_new_tokens: usize,
    /// Tokens known so far: prompt plus generated.
    pub total_tokens: usize,
    /// Tokens whose KV is computed.
    pub computed: usize,
    /// The request's adapter (the cold-start gate looks at its residency).
    pub adapter: Option<AdapterId>,
    /// vLLM's `priority` (lower first): a preemption takes the newest running request of the
    /// highest value.
    pub priority: i64,
}

impl SeqState {
    pub fn new(id: SeqId, prompt_len: usize, max_new_tokens: usize) -> Self {
        Self {
            id,
            prompt_len,
            max_new_tokens,
            total_tokens: prompt_len,
            computed: 0,
            adapter: None,
            priority: 0,
        }
    }

    /// Tokens the engine has not computed yet (rest of the prompt in prefill, 1 in decode).
    pub fn pending(&self) -> usize {
        self.total_tokens - self.computed
    }

    /// Output tokens it may still generate: its `max_tokens` less those it has generated.
    pub fn tokens_left(&self) -> usize {
        (self.prompt_len + self.max_new_tokens).saturating_sub(self.total_tokens)
    }

    /// Computing more than one token this time: its prompt, or after a preemption its
    /// prompt and output again.
    pub fn in_prefill(&self) -> bool {
        self.computed < self.prompt_len || self.pending() > 1
    }

    /// KV blocks it needs through its next step: those of the tokens it has computed plus
    /// its next chunk (at most a step's token budget). What admission and the memory
    /// manager charge it: blocks come on demand, never for `max_tokens` up front.
    /// Under the `max-tokens` baseline, its worst case ([`Self::worst_case_blocks`]) instead.
    pub fn reservation(&self, cfg: &SchedConfig) -> usize {
        let next = self.pending().min(cfg.max_num_batched_tokens).max(1);
        let now =
            cfg.blocks_for((self.computed + next).min(self.total_tokens.max(self.computed + 1)));
        match cfg.kv_reservation {
            KvReservation::OnDemand => now,
            KvReservation::MaxTokens => now.max(self.worst_case_blocks(cfg)),
        }
    }

    /// Blocks of the tokens it has computed (what finishing or preemption gives back).
    pub fn held_blocks(&self, cfg: &SchedConfig) -> usize {
        cfg.blocks_for(self.computed)
    }

    /// The most KV blocks it can ever hold (prompt plus `max_tokens`): its size for the
    /// multi-level queue's quotas, and the bound a request must fit the pool within.
    pub fn worst_case_blocks(&self, cfg: &SchedConfig) -> usize {
        cfg.blocks_for(self.prompt_len + self.max_new_tokens)
    }

    /// Extra blocks the engine allocates to compute `n` more tokens (mirrors
    /// `Engine::blocks_needed`).
    pub fn blocks_needed(&self, cfg: &SchedConfig, n: usize) -> usize {
        cfg.blocks_for(self.computed + n) - cfg.blocks_for(self.computed)
    }
}

/// The waiting queue (FIFO) and the running set, in admission order.
#[derive(Clone, Debug, Default)]
pub struct SchedState {
    pub waiting: VecDeque<SeqState>,
    pub running: Vec<SeqState>,
    /// Sum of the running sequences' reservations (held blocks plus their next chunk's).
    pub reserved_blocks: usize,
    /// Running sequences preempted so far.
    pub preemptions: u64,
}

impl SchedState {
    /// Adapters the running requests use (leased: never evicted).
    pub fn running_adapters(&self) -> HashSet<AdapterId> {
        self.running.iter().filter_map(|s| s.adapter).collect()
    }

    /// Adapters the waiting requests want.
    pub fn waiting_adapters(&self) -> HashSet<AdapterId> {
        self.waiting.iter().filter_map(|s| s.adapter).collect()
    }

    /// Gives back the queues' room beyond `keep` entries when both are empty: a burst that
    /// filled the bounded queue (`--max-queued-requests`) must not leave its peak resident.
    pub fn shrink_idle(&mut self, keep: usize) {
        if self.is_idle() {
            self.waiting.shrink_to(keep);
            self.running.shrink_to(keep);
        }
    }

    pub fn enqueue(&mut self, s: SeqState) {
        self.waiting.push_back(s);
    }

    /// Recomputes [`Self::reserved_blocks`] (reservations change as sequences advance).
    pub fn recount(&mut self, cfg: &SchedConfig) {
        self.reserved_blocks = self.running.iter().map(|s| s.reservation(cfg)).sum();
    }

    /// Preempts running sequence `id` by recompute: it drops its KV (computed 0), keeps its
    /// tokens and goes back to its place in the queue — by arrival, so ahead of every request
    /// that came after it (the front, unless older ones still wait; `priority` and `sjf`
    /// reposition it by their keys). True if it was running.
    pub fn preempt(&mut self, id: SeqId, cfg: &SchedConfig) -> bool {
        let Some(i) = self.running.iter().position(|s| s.id == id) else {
            return false;
        };
        let mut s = self.running.remove(i);
        s.computed = 0;
        let at = self
            .waiting
            .iter()
            .position(|w| w.id > s.id)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(at, s);
        self.preemptions += 1;
        self.recount(cfg);
        true
    }

    /// Moves the first `n` waiting requests to running (as a `Decision` said).
    pub fn admit(&mut self, n: usize, cfg: &SchedConfig) -> Vec<SeqId> {
        let mut ids = Vec::with_capacity(n);
        for s in self.waiting.drain(..n.min(self.waiting.len())) {
            ids.push(s.id);
            self.running.push(s);
        }
        self.recount(cfg);
        ids
    }

    /// Moves the waiting requests `ids` to running, keeping the queue's order for the rest.
    pub fn admit_ids(&mut self, ids: &[SeqId], cfg: &SchedConfig) {
        for id in ids {
            if let Some(i) = self.waiting.iter().position(|s| s.id == *id) {
                if let Some(s) = self.waiting.remove(i) {
                    self.running.push(s);
                }
            }
        }
        self.recount(cfg);
    }

    /// Records a computed step: `planned` tokens per sequence, then one sampled token per
    /// output; `finished` sequences leave the running set.
    pub fn on_step(
        &mut self,
        planned: &[(SeqId, usize)],
        sampled: &[SeqId],
        finished: &[SeqId],
        cfg: &SchedConfig,
    ) {
        for &(id, n) in planned {
            if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
                s.computed += n;
            }
        }
        for id in sampled {
            if let Some(s) = self.running.iter_mut().find(|s| s.id == *id) {
                s.total_tokens += 1;
            }
        }
        for id in finished {
            self.remove(*id, cfg);
        }
        self.recount(cfg);
    }

    /// Drops a sequence wherever it is (finished, cancelled, failed); true if it was known.
    pub fn remove(&mut self, id: SeqId, cfg: &SchedConfig) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i);
            self.recount(cfg);
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            return true;
        }
        false
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_shrink_gives_back_a_bursts_room_and_keeps_work() {
        let mut st = SchedState::default();
        for i in 0..1000 {
            st.enqueue(SeqState::new(SeqId(i), 8, 4));
        }
        let peak = st.waiting.capacity();
        // Not idle: nothing is dropped and the room stays.
        st.shrink_idle(64);
        assert_eq!(st.waiting.len(), 1000);
        assert_eq!(st.waiting.capacity(), peak);
        st.waiting.clear();
        st.shrink_idle(64);
        assert!(st.waiting.capacity() < 128, "{}", st.waiting.capacity());
        assert!(peak >= 1000);
    }
}
