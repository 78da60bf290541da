//! Paged KV bookkeeping: a block allocator and the per-sequence block lists it hands out.
//!
//! The storage itself belongs to the backend (one K and one V buffer per layer, each
//! `[num_blocks, block_size, kv_heads, head_dim]`); this module only decides which physical
//! blocks a sequence owns. A [`KvBlocks`] guard is the only way to hold blocks: dropping it
//! returns them, so a cancelled or failed sequence can never leak KV.
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Result, RuntimeError};
use crate::ids::BlockIdx;

/// Usage snapshot of the allocator.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KvUsage {
    pub total_blocks: usize,
    pub used_blocks: usize,
    pub block_size: usize,
}

impl KvUsage {
    pub fn free_blocks(&self) -> usize {
        self.total_blocks - self.used_blocks
    }
}

#[derive(Debug)]
struct FreeList {
    free: Vec<BlockIdx>,
    total: usize,
}

/// Hands out physical KV blocks. Cloning shares the same pool.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    inner: Arc<Mutex<FreeList>>,
    block_size: usize,
}

impl BlockAllocator {
    /// A pool of `num_blocks` blocks of `block_size` token slots each.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "KV block size must be positive");
        // Reverse so that the first allocations get the low block numbers (easier to read in logs).
        let free = (0..num_blocks as u32).rev().map(BlockIdx).collect();
        Self {
            inner: Arc::new(Mutex::new(FreeList {
                free,
                total: num_blocks,
            })),
            block_size,
        }
    }

    fn lock(&self) -> MutexGuard<'_, FreeList> {
        // A panic while holding this lock leaves the free list consistent (every mutation is a
        // single push/pop/extend), so a poisoned lock is safe to keep using.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn usage(&self) -> KvUsage {
        let fl = self.lock();
        KvUsage {
            total_blocks: fl.total,
            used_blocks: fl.total - fl.free.len(),
            block_size: self.block_size,
        }
    }

    /// Blocks needed to hold `tokens` token slots.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// An empty block list bound to this pool.
    pub fn empty(&self) -> KvBlocks {
        KvBlocks {
            blocks: Vec::new(),
            pool: self.clone(),
        }
    }

    /// Grows `blocks` so it holds at least `tokens` slots; all-or-nothing.
    pub fn grow_to(&self, blocks: &mut KvBlocks, tokens: usize) -> Result<()> {
        debug_assert!(Arc::ptr_eq(&self.inner, &blocks.pool.inner));
        let want = self.blocks_for(tokens);
        if want <= blocks.blocks.len() {
            return Ok(());
        }
        let needed = want - blocks.blocks.len();
        let mut fl = self.lock();
        if fl.free.len() < needed {
            return Err(RuntimeError::KvExhausted {
                needed,
                free: fl.free.len(),
                total: fl.total,
            });
        }
        let at = fl.free.len() - needed;
        blocks.blocks.extend(fl.free.drain(at..).rev());
        Ok(())
    }
}

/// The physical blocks of one sequence, in logical order. Dropping it frees them.
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
            self.pool.lock().free.append(&mut self.blocks);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn grow_and_free() {
        let a = BlockAllocator::new(8, 16);
        let mut s = a.empty();
        a.grow_to(&mut s, 17).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(a.usage().used_blocks, 2);
        a.grow_to(&mut s, 32).unwrap();
        assert_eq!(s.len(), 2, "32 tokens fit in two 16-slot blocks");
        let err = a.grow_to(&mut s, 16 * 9).unwrap_err();
        assert!(matches!(
            err,
            RuntimeError::KvExhausted {
                needed: 7,
                free: 6,
                total: 8
            }
        ));
        assert_eq!(s.len(), 2, "a failed grow allocates nothing");
        drop(s);
        assert_eq!(a.usage().used_blocks, 0);
    }

    proptest! {
        /// Block tables never alias, and usage always equals the sum of live tables.
        #[test]
        fn tables_never_alias(ops in proptest::collection::vec((0usize..6, 0usize..80), 1..60)) {
            let a = BlockAllocator::new(24, 8);
            let mut seqs: Vec<Option<KvBlocks>> = (0..6).map(|_| None).collect();
            for (i, tokens) in ops {
                if tokens % 5 == 0 {
                    seqs[i] = None;
                } else {
                    let s = seqs[i].get_or_insert_with(|| a.empty());
                    let before = s.len();
                    match a.grow_to(s, tokens) {
                        Ok(()) => prop_assert!(s.len() * 8 >= tokens),
                        Err(_) => prop_assert_eq!(s.len(), before),
                    }
                }
                let mut seen = HashSet::new();
                let mut live = 0;
                for s in seqs.iter().flatten() {
                    for b in s.blocks() {
                        prop_assert!(seen.insert(*b), "block {:?} owned twice", b);
                        prop_assert!((b.0 as usize) < 24);
                    }
                    live += s.len();
                }
                prop_assert_eq!(a.usage().used_blocks, live);
            }
        }
    }
}
