//! The block pool: reference-counted physical KV blocks, allocated as tokens are computed.
//!
//! A block is in one of three states: held (referenced by one or more sequences' [`KvBlocks`]),
//! cached (unreferenced, but its full content is registered under a [`BlockHash`] so a later
//! request with the same prefix takes it instead of recomputing), or empty. Allocation takes
//! empty blocks first and then evicts cached ones, least recently released first. The pool's
//! *capacity* (what the server's one device budget leaves KV after adapters) bounds held plus
//! cached blocks; lowering it evicts cached blocks.
//!
//! Step fence: between [`BlockAllocator::begin_step`] and [`BlockAllocator::end_step`] a step
//! is writing its blocks. Blocks registered or released meanwhile are published only when it
//! ends, so no other request shares, and no allocation reuses, a block whose write has not
//! finished (vLLM #38606 was exactly this, under asynchronous scheduling).
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

pub use adapter_runs::PageLease;

use super::prefix::{BlockHash, PrefixKey};

#[path = "blocks_adapters.rs"]
mod adapter_runs;
use crate::error::{Result, RuntimeError};
use crate::ids::{AdapterId, BlockIdx};

/// Usage snapshot of the pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KvUsage {
    pub total_blocks: usize,
    /// Blocks some sequence references.
    pub used_blocks: usize,
    /// Unreferenced blocks kept for prefix reuse (evictable at no cost).
    pub cached_blocks: usize,
    /// Most blocks that may be held or cached (the device budget KV has now).
    pub capacity: usize,
    pub block_size: usize,
}

impl KvUsage {
    /// Blocks sequences may still take: the capacity less what is held (cached blocks are
    /// evicted on demand).
    pub fn free_blocks(&self) -> usize {
        self.capacity.saturating_sub(self.used_blocks)
    }
}

/// A registered block's content, confirmed on every match.
#[derive(Clone, Debug)]
struct Cached {
    hash: BlockHash,
    key: PrefixKey,
    tokens: Box<[u32]>,
    /// The cache entry of the block before it (0: it is the first block).
    parent: u64,
    /// This entry's serial (never reused, so a stale parent never matches).
    serial: u64,
}

#[derive(Clone, Debug, Default)]
struct Meta {
    refs: u32,
    cached: Option<Cached>,
    /// Key in `lru` while unreferenced and cached.
    stamp: u64,
    /// Released during an open step: unusable until it ends.
    fenced: bool,
}

#[derive(Debug)]
struct Pool {
    meta: Vec<Meta>,
    /// Unreferenced blocks without content.
    empty: Vec<BlockIdx>,
    /// Unreferenced cached blocks, oldest release first.
    lru: BTreeMap<u64, BlockIdx>,
    table: HashMap<BlockHash, BlockIdx>,
    used: usize,
    capacity: usize,
    clock: u64,
    serial: u64,
    in_step: bool,
    /// Registrations and releases held back until the open step ends.
    pending_register: Vec<(BlockIdx, Cached)>,
    pending_release: Vec<BlockIdx>,
    /// Runs of blocks adapters' device images own (out of `empty` and `lru` while owned).
    adapters: super::AdapterPages<u64>,
}

impl Pool {
    fn cached_count(&self) -> usize {
        self.lru.len()
    }

    fn evict_one(&mut self) -> Option<BlockIdx> {
        let (_, b) = self.lru.pop_first()?;
        if let Some(c) = self.meta[b.0 as usize].cached.take() {
            if self.table.get(&c.hash) == Some(&b) {
                self.table.remove(&c.hash);
            }
        }
        Some(b)
    }

    /// Releases one reference (outside a step).
    fn release_now(&mut self, b: BlockIdx) {
        let m = &mut self.meta[b.0 as usize];
        debug_assert!(m.refs > 0, "block {b:?} released more often than taken");
        m.refs -= 1;
        if m.refs > 0 {
            return;
        }
        self.used -= 1;
        if m.cached.is_some() {
            self.clock += 1;
            m.stamp = self.clock;
            self.lru.insert(self.clock, b);
        } else {
            self.empty.push(b);
        }
        self.trim();
    }

    /// Evicts cached blocks while held plus cached exceed the capacity.
    fn trim(&mut self) -> usize {
        let mut n = 0;
        while self.used + self.cached_count() > self.capacity {
            match self.evict_one() {
                Some(b) => {
                    self.empty.push(b);
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    fn register_now(&mut self, b: BlockIdx, c: Cached) {
        let m = &mut self.meta[b.0 as usize];
        if m.cached.is_some() || self.table.contains_key(&c.hash) {
            return;
        }
        self.table.insert(c.hash, b);
        if m.refs == 0 {
            // Its last holder left during the step that wrote it.
            self.clock += 1;
            m.stamp = self.clock;
            self.lru.insert(self.clock, b);
            if let Some(p) = self.empty.iter().position(|&e| e == b) {
                self.empty.swap_remove(p);
            }
        }
        self.meta[b.0 as usize].cached = Some(c);
        self.trim();
    }

    /// The cached block confirming (`hash`, `key`, `tokens`) after parent entry `parent`.
    fn confirm(
        &self,
        hash: BlockHash,
        key: PrefixKey,
        tokens: &[u32],
        parent: u64,
    ) -> Option<(BlockIdx, u64)> {
        let &b = self.table.get(&hash)?;
        let c = self.meta[b.0 as usize].cached.as_ref()?;
        (c.key == key && c.parent == parent && *c.tokens == *tokens && !self.is_fenced(b))
            .then_some((b, c.serial))
    }

    fn is_fenced(&self, b: BlockIdx) -> bool {
        self.meta[b.0 as usize].fenced
    }
}

/// Hands out physical KV blocks. Cloning shares the same pool.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    inner: Arc<Mutex<Pool>>,
    block_size: usize,
}

/// A prefix match: the blocks to share and the entry serial of the last one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    pub blocks: Vec<BlockIdx>,
    pub last_serial: u64,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks of `block_size` token slots each, all usable.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "KV block size must be positive");
        // Reverse so that the first allocations get the low block numbers (easier to read in logs).
        let empty = (0..num_blocks as u32).rev().map(BlockIdx).collect();
        Self {
            inner: Arc::new(Mutex::new(Pool {
                meta: vec![Meta::default(); num_blocks],
                empty,
                lru: BTreeMap::new(),
                table: HashMap::new(),
                used: 0,
                capacity: num_blocks,
                clock: 0,
                serial: 0,
                in_step: false,
                pending_register: Vec::new(),
                pending_release: Vec::new(),
                adapters: super::AdapterPages::new(num_blocks),
            })),
            block_size,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pool> {
        // Every mutation leaves the pool consistent before it can panic (asserts come first),
        // so a poisoned lock is safe to keep using.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn usage(&self) -> KvUsage {
        let p = self.lock();
        KvUsage {
            total_blocks: p.meta.len(),
            used_blocks: p.used,
            cached_blocks: p.cached_count(),
            capacity: p.capacity,
            block_size: self.block_size,
        }
    }

    /// Blocks needed to hold `tokens` token slots.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Sets how many blocks may be held or cached (at most the pool's size); cached blocks
    /// beyond it are evicted, oldest first. Returns how many were evicted. Held blocks are
    /// never taken: the caller preempts sequences when they exceed the capacity.
    pub fn set_capacity(&self, capacity: usize) -> usize {
        let mut p = self.lock();
        p.capacity = capacity.min(p.meta.len());
        p.trim()
    }

    /// An empty block list bound to this pool.
    pub fn empty(&self) -> KvBlocks {
        KvBlocks {
            blocks: Vec::new(),
            pool: self.clone(),
        }
    }

    /// Grows `blocks` so it holds at least `tokens` slots; all-or-nothing. Takes empty blocks
    /// first, then evicts cached ones least recently used first.
    pub fn grow_to(&self, blocks: &mut KvBlocks, tokens: usize) -> Result<()> {
        debug_assert!(Arc::ptr_eq(&self.inner, &blocks.pool.inner));
        let want = self.blocks_for(tokens);
        if want <= blocks.blocks.len() {
            return Ok(());
        }
        let needed = want - blocks.blocks.len();
        let mut p = self.lock();
        let free = p.capacity.saturating_sub(p.used);
        let physical = p.empty.len() + p.lru.len();
        if needed > free || needed > physical {
            return Err(RuntimeError::KvExhausted {
                needed,
                free: free.min(physical),
                total: p.meta.len(),
            });
        }
        for _ in 0..needed {
            let b = match p.empty.pop() {
                Some(b) => b,
                None => p.evict_one().expect("counted above"),
            };
            let m = &mut p.meta[b.0 as usize];
            debug_assert_eq!(m.refs, 0);
            m.refs = 1;
            p.used += 1;
            blocks.blocks.push(b);
        }
        // Held plus cached may now exceed the capacity: give cached blocks back.
        p.trim();
        Ok(())
    }

    /// The longest chain of cached blocks confirming `hashes` (over `tokens`) under `key`,
    /// at most `max_blocks` long. Read-only.
    pub fn lookup(
        &self,
        key: PrefixKey,
        hashes: &[BlockHash],
        tokens: &[u32],
        max_blocks: usize,
    ) -> PrefixMatch {
        let p = self.lock();
        let bs = self.block_size;
        let mut m = PrefixMatch::default();
        for (i, &h) in hashes.iter().enumerate().take(max_blocks) {
            let Some(t) = tokens.get(i * bs..(i + 1) * bs) else {
                break;
            };
            match p.confirm(h, key, t, m.last_serial) {
                Some((b, serial)) => {
                    m.blocks.push(b);
                    m.last_serial = serial;
                }
                None => break,
            }
        }
        m
    }

    /// Makes an empty `blocks` share the matched chain (a reference each). Fails, taking
    /// nothing, when the match went stale or taking its unreferenced blocks would exceed the
    /// capacity.
    pub fn share(&self, blocks: &mut KvBlocks, m: &PrefixMatch) -> Result<()> {
        assert!(blocks.blocks.is_empty(), "share into an empty block list");
        let mut p = self.lock();
        for &b in &m.blocks {
            if p.meta[b.0 as usize].cached.is_none() || p.is_fenced(b) {
                return Err(RuntimeError::InvalidPlan(format!(
                    "prefix block {} left the cache before it was shared",
                    b.0
                )));
            }
        }
        let revive = m
            .blocks
            .iter()
            .filter(|b| p.meta[b.0 as usize].refs == 0)
            .count();
        if p.used + revive > p.capacity {
            return Err(RuntimeError::KvExhausted {
                needed: revive,
                free: p.capacity.saturating_sub(p.used),
                total: p.meta.len(),
            });
        }
        for &b in &m.blocks {
            let m = &mut p.meta[b.0 as usize];
            m.refs += 1;
            if m.refs == 1 {
                let stamp = m.stamp;
                p.lru.remove(&stamp);
                p.used += 1;
            }
            blocks.blocks.push(b);
        }
        Ok(())
    }

    /// Registers block `i` of `blocks` (full, its tokens `tokens`) under `hash` after parent
    /// entry `parent` (0 for block 0). Returns the serial of the entry now standing for this
    /// chain position: the new one, or an equal one already cached; None when the hash is
    /// taken by other content (the chain stops being cached there). During a step the entry
    /// is published when the step ends.
    pub fn register(
        &self,
        blocks: &KvBlocks,
        i: usize,
        hash: BlockHash,
        key: PrefixKey,
        tokens: &[u32],
        parent: u64,
    ) -> Option<u64> {
        debug_assert_eq!(tokens.len(), self.block_size);
        let b = blocks.blocks[i];
        let mut p = self.lock();
        if let Some(&other) = p.table.get(&hash) {
            let c = p.meta[other.0 as usize].cached.as_ref()?;
            return (c.key == key && c.parent == parent && *c.tokens == *tokens)
                .then_some(c.serial);
        }
        if p.pending_register.iter().any(|(_, c)| c.hash == hash) {
            return None;
        }
        p.serial += 1;
        let c = Cached {
            hash,
            key,
            tokens: tokens.into(),
            parent,
            serial: p.serial,
        };
        let serial = c.serial;
        if p.in_step {
            p.pending_register.push((b, c));
        } else {
            p.register_now(b, c);
        }
        Some(serial)
    }

    /// Opens a step: blocks registered or released until [`Self::end_step`] are neither shared
    /// nor reused before it.
    pub fn begin_step(&self) {
        self.lock().in_step = true;
    }

    /// Closes the step: its registrations become visible and its releases reusable.
    pub fn end_step(&self) {
        let mut p = self.lock();
        p.in_step = false;
        for (b, c) in std::mem::take(&mut p.pending_register) {
            p.register_now(b, c);
        }
        // Tails first, as outside a step (see `release`).
        for b in std::mem::take(&mut p.pending_release).into_iter().rev() {
            p.meta[b.0 as usize].fenced = false;
            p.release_now(b);
        }
    }

    /// Drops every cached block of `adapter` (any generation): the adapter was unloaded or
    /// replaced, so no later request may reuse KV computed with its weights. Held blocks stay
    /// with their sequences and are freed, not cached, when released.
    pub fn forget_adapter(&self, adapter: AdapterId) -> usize {
        let mut p = self.lock();
        let victims: Vec<BlockIdx> = p
            .table
            .values()
            .copied()
            .filter(|b| {
                p.meta[b.0 as usize]
                    .cached
                    .as_ref()
                    .is_some_and(|c| c.key.adapter.is_some_and(|(a, _)| a == adapter))
            })
            .collect();
        p.pending_register
            .retain(|(_, c)| c.key.adapter.is_none_or(|(a, _)| a != adapter));
        for &b in &victims {
            let m = &mut p.meta[b.0 as usize];
            let c = m.cached.take().expect("filtered above");
            let (refs, stamp) = (m.refs, m.stamp);
            p.table.remove(&c.hash);
            if refs == 0 {
                p.lru.remove(&stamp);
                p.empty.push(b);
            }
        }
        victims.len()
    }

    /// Blocks of `blocks` no other sequence references (what preempting it frees).
    pub fn exclusive(&self, blocks: &KvBlocks) -> usize {
        let p = self.lock();
        blocks
            .blocks
            .iter()
            .filter(|b| p.meta[b.0 as usize].refs == 1)
            .count()
    }

    fn release(&self, blocks: &mut Vec<BlockIdx>) {
        let mut p = self.lock();
        if p.in_step {
            for &b in blocks.iter() {
                p.meta[b.0 as usize].fenced = true;
            }
            p.pending_release.append(blocks);
            return;
        }
        // Last block first into the LRU: a chain's tail is evicted before its head, which
        // other prefixes are likelier to share.
        for b in blocks.drain(..).rev() {
            p.release_now(b);
        }
    }
}

/// The physical blocks of one sequence, in logical order. Dropping it releases them.
#[derive(Debug)]
pub struct KvBlocks {
    blocks: Vec<BlockIdx>,
    pool: BlockAllocator,
}

impl KvBlocks {
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    pub fn blocks(&self) -> &[BlockIdx] {
        &self.blocks
    }

    /// The block table as raw indices, for kernels.
    pub fn table(&self) -> impl Iterator<Item = u32> + '_ {
        self.blocks.iter().map(|b| b.0)
    }
}

impl Drop for KvBlocks {
    fn drop(&mut self) {
        if !self.blocks.is_empty() {
            self.pool.release(&mut self.blocks);
        }
    }
}

#[cfg(test)]
#[path = "blocks_tests.rs"]
mod tests;
