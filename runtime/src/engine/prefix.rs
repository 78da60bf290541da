//! The engine's side of automatic prefix caching and of preemption by recompute.
//!
//! A sequence with a [`PrefixKey`] shares, when admitted, the longest chain of cached blocks
//! that confirms its tokens, and publishes each full block it computes after the step that
//! wrote it. A preempted sequence gives its blocks back (its full blocks stay cached until
//! evicted) and keeps its tokens, prompt and output alike; resuming it shares what is still
//! cached and recomputes the rest, sampling its next token only when every known token is in
//! the cache again, so its output stream neither repeats nor skips a token.
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use crate::ids::{AdapterId, SeqId};
use crate::kv::prefix::extend_hashes;
use crate::kv::{BlockAllocator, PrefixKey};

use super::sequence::{Sequence, SequenceParams};
use super::Engine;

/// Prefix-cache lookups since the engine started, in tokens (vLLM's
/// `prefix_cache_queries` / `prefix_cache_hits`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Tokens of the sequences that looked the cache up (at admission and at resumption).
    pub queries: u64,
    /// Of those, tokens found cached.
    pub hits: u64,
}

/// Registers the full blocks `s` has computed and not yet published (called after the step
/// that computed them, inside the pool's step fence).
pub(super) fn register_full_blocks(pool: &BlockAllocator, s: &mut Sequence) {
    let (Some(key), Some(mut parent)) = (s.prefix, s.chain) else {
        return;
    };
    let bs = pool.block_size();
    let from = s.hashes.len();
    extend_hashes(&mut s.hashes, key, &s.tokens, bs, s.computed / bs);
    for i in from..s.hashes.len() {
        let t = &s.tokens[i * bs..(i + 1) * bs];
        match pool.register(&s.kv, i, s.hashes[i], key, t, parent) {
            Some(p) => parent = p,
            None => {
                s.chain = None;
                return;
            }
        }
    }
    s.chain = Some(parent);
}

impl<B: Backend> Engine<B> {
    /// The key a request's blocks are cached under, or None when it must not share.
    pub(super) fn prefix_key(&self, p: &SequenceParams) -> Option<PrefixKey> {
        if !self.cfg.enable_prefix_caching || p.prompt_logprobs.is_some() {
            return None;
        }
        Some(match p.adapter {
            Some(a) => PrefixKey::adapter(a, p.adapter_generation),
            None => PrefixKey::base(),
        })
    }

    /// Tokens of `tokens` (a prompt under `key`) the cache holds now, as whole blocks; at
    /// least one token is always left to compute (its logits give the next token).
    pub fn probe_prefix(&self, key: Option<PrefixKey>, tokens: &[u32]) -> usize {
        let Some(key) = key.filter(|_| self.cfg.enable_prefix_caching) else {
            return 0;
        };
        let bs = self.blocks.block_size();
        let max = tokens.len().saturating_sub(1) / bs;
        let mut hashes = Vec::new();
        extend_hashes(&mut hashes, key, tokens, bs, max);
        self.blocks.lookup(key, &hashes, tokens, max).blocks.len() * bs
    }

    /// [`Self::probe_prefix`] for a live (preempted) sequence over all its tokens.
    pub fn probe_sequence(&self, seq: SeqId) -> usize {
        self.seqs
            .get(&seq)
            .map_or(0, |s| self.probe_prefix(s.prefix, &s.tokens))
    }

    /// The key a sequence with these parameters would be cached under.
    pub fn prefix_key_for(&self, p: &SequenceParams) -> Option<PrefixKey> {
        self.prefix_key(p)
    }

    /// Shares the cached chain of a sequence that holds no blocks; returns its cached tokens.
    pub(super) fn share_cached_prefix(&mut self, id: SeqId) -> usize {
        let bs = self.blocks.block_size();
        let Some(s) = self.seqs.get_mut(&id) else {
            return 0;
        };
        debug_assert!(s.kv.is_empty() && s.computed == 0);
        s.hashes.clear();
        s.chain = Some(0);
        s.cached_tokens = 0;
        let Some(key) = s.prefix else {
            return 0;
        };
        self.prefix_stats.queries += s.tokens.len() as u64;
        let max = (s.tokens.len() - 1) / bs;
        extend_hashes(&mut s.hashes, key, &s.tokens, bs, max);
        let m = self.blocks.lookup(key, &s.hashes, &s.tokens, max);
        s.hashes.truncate(m.blocks.len());
        if m.blocks.is_empty() || self.blocks.share(&mut s.kv, &m).is_err() {
            s.hashes.clear();
            return 0;
        }
        s.chain = Some(m.last_serial);
        s.computed = m.blocks.len() * bs;
        s.cached_tokens = s.computed;
        self.prefix_stats.hits += s.computed as u64;
        s.computed
    }

    /// Preempts a live sequence by recompute: its KV blocks go back to the pool (full ones
    /// stay cached until evicted), it keeps every token it has, and it runs no more until
    /// [`Self::resume_sequence`]. Prompt scores not yet handed out are dropped: resuming
    /// computes them again.
    pub fn preempt_sequence(&mut self, id: SeqId) -> Result<()> {
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(RuntimeError::UnknownSequence(id))?;
        s.kv = self.blocks.empty();
        s.computed = 0;
        s.hashes.clear();
        s.chain = Some(0);
        s.preempted = true;
        if s.generated() == 0 {
            s.prompt_scored.clear();
        }
        Ok(())
    }

    /// Resumes a preempted sequence: shares the cached part of its tokens (prompt and output)
    /// and leaves the rest pending; returns the tokens found cached.
    pub fn resume_sequence(&mut self, id: SeqId) -> Result<usize> {
        let s = self
            .seqs
            .get(&id)
            .ok_or(RuntimeError::UnknownSequence(id))?;
        if !s.preempted {
            return Err(RuntimeError::InvalidPlan(format!(
                "sequence {id} is not preempted"
            )));
        }
        if let Some(a) = s.adapter {
            // Its adapter may have left the device while it waited.
            let dev = &self
                .adapters
                .get(&a)
                .ok_or(RuntimeError::UnknownAdapter(a))?
                .dev;
            self.backend.promote_lora(dev);
        }
        if let Some(s) = self.seqs.get_mut(&id) {
            s.preempted = false;
        }
        Ok(self.share_cached_prefix(id))
    }

    /// Live sequences that compute with adapter `id` (preempted ones do not: they hold no
    /// KV, and resuming needs the adapter registered again).
    pub(super) fn adapter_users(&self, id: AdapterId) -> usize {
        self.seqs
            .values()
            .filter(|s| s.adapter == Some(id) && !s.preempted)
            .count()
    }

    /// For an admitted sequence that has computed nothing yet (held while its adapter
    /// streams in, or behind the token budget): shares what the cache holds for it now (a
    /// request admitted beside others with the same prefix finds their blocks once written).
    /// Returns its cached tokens (0 when it has started or shares nothing).
    pub fn reshare_prefix(&mut self, seq: SeqId) -> usize {
        match self.seqs.get(&seq) {
            Some(s) if s.computed == 0 && s.kv.is_empty() && !s.preempted => {}
            _ => return 0,
        }
        let queries = self.prefix_stats.queries;
        let cached = self.share_cached_prefix(seq);
        // Its tokens were counted as queried when it was admitted.
        self.prefix_stats.queries = queries;
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.cached_tokens = s.cached_tokens.max(cached);
        }
        cached
    }

    /// Blocks only `seq` references (what preempting it gives back).
    pub fn exclusive_blocks(&self, seq: SeqId) -> Result<usize> {
        let s = self
            .seqs
            .get(&seq)
            .ok_or(RuntimeError::UnknownSequence(seq))?;
        Ok(self.blocks.exclusive(&s.kv))
    }

    /// Prompt tokens `seq` found cached when last admitted.
    pub fn cached_tokens(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.cached_tokens)
    }

    /// Sets how many KV blocks may be held or cached (the device budget KV has after
    /// adapters); cached blocks beyond it are evicted. Returns how many were.
    pub fn set_kv_capacity(&mut self, blocks: usize) -> usize {
        self.blocks.set_capacity(blocks)
    }

    /// Turns prefix caching on or off for sequences added from now on (start-up measurements
    /// run the same prompt several times and must compute it each time).
    pub fn set_prefix_caching(&mut self, on: bool) {
        self.cfg.enable_prefix_caching = on;
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix_stats
    }
}
