//! Adapter images in the block pool: a run of blocks (pages of the one device budget) taken
//! out of circulation for an adapter while it is on the device, so KV and adapters share the
//! same memory (the CUDA backend writes the adapter's factors into those blocks of every
//! layer's K and V buffers). Which run is [`AdapterPages`](super::super::AdapterPages)'s
//! decision; this file only moves blocks between the free lists and the adapters.
use std::ops::Range;

use super::{BlockAllocator, Pool};
use crate::error::{Result, RuntimeError};
use crate::ids::BlockIdx;

/// An adapter's run of blocks: while it lives no sequence gets them; dropping it (after the
/// last device copy into them completed: the copy holds it) gives them back, exactly once.
#[derive(Debug)]
pub struct PageLease {
    pool: BlockAllocator,
    owner: u64,
    run: Range<usize>,
}

impl PageLease {
    /// The blocks (pages) held.
    pub fn run(&self) -> Range<usize> {
        self.run.clone()
    }
}

impl Drop for PageLease {
    fn drop(&mut self) {
        let mut p = self.pool.lock();
        match p.adapters.release(self.owner) {
            // Back at the bottom of the free stack: KV reuses low blocks first.
            Ok(r) => {
                let back: Vec<BlockIdx> = r.map(|b| BlockIdx(b as u32)).rev().collect();
                p.empty.splice(0..0, back);
            }
            Err(e) => tracing::error!("releasing adapter pages {:?}: {e}", self.run),
        }
    }
}

impl Pool {
    /// Whether block `b` may go to an adapter: empty, or cached and unreferenced (evicted).
    fn assignable(&self) -> Vec<bool> {
        let mut ok = vec![false; self.meta.len()];
        for b in self.empty.iter().chain(self.lru.values()) {
            ok[b.0 as usize] = true;
        }
        ok
    }
}

impl BlockAllocator {
    /// Takes the highest run of `n` blocks that no sequence holds (evicting cached ones in
    /// it) for the adapter image `owner` (unique per registration). Between steps only.
    pub fn assign_adapter(&self, owner: u64, n: usize) -> Result<PageLease> {
        let mut p = self.lock();
        if p.in_step {
            return Err(RuntimeError::Backend(
                "adapter pages are assigned between steps only".into(),
            ));
        }
        let ok = p.assignable();
        let run = p
            .adapters
            .assign(owner, n, |b| !ok[b])
            .map_err(RuntimeError::AdapterPages)?;
        let inside = |b: &BlockIdx| run.contains(&(b.0 as usize));
        p.empty.retain(|b| !inside(b));
        let cached: Vec<(u64, BlockIdx)> = p
            .lru
            .iter()
            .filter(|(_, b)| inside(b))
            .map(|(&k, &b)| (k, b))
            .collect();
        for (stamp, b) in cached {
            p.lru.remove(&stamp);
            if let Some(c) = p.meta[b.0 as usize].cached.take() {
                if p.table.get(&c.hash) == Some(&b) {
                    p.table.remove(&c.hash);
                }
            }
        }
        Ok(PageLease {
            pool: self.clone(),
            owner,
            run,
        })
    }

    /// Blocks adapters own now.
    pub fn adapter_blocks(&self) -> usize {
        self.lock().adapters.owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::PrefixKey;
    use proptest::prelude::*;

    proptest! {
        /// Sequences growing and dropping their blocks and adapters taking and returning runs,
        /// in any order: no block is both a sequence's and an adapter's, adapters' runs are
        /// disjoint, every block is accounted for once (held, free or an adapter's), and
        /// after everything is dropped the whole pool is free again.
        #[test]
        fn adapters_and_sequences_never_share_a_block(
            ops in proptest::collection::vec((0u8..3, 1usize..6, 0usize..4), 1..50),
        ) {
            let total = 32;
            let a = BlockAllocator::new(total, 4);
            let mut seqs: Vec<crate::kv::KvBlocks> = Vec::new();
            let mut leases: Vec<PageLease> = Vec::new();
            let mut next = 0u64;
            for (kind, n, k) in ops {
                match kind {
                    0 => {
                        let mut b = a.empty();
                        if a.grow_to(&mut b, n * 4).is_ok() {
                            seqs.push(b);
                        }
                    }
                    1 => {
                        next += 1;
                        if let Ok(l) = a.assign_adapter(next, n) {
                            prop_assert_eq!(l.run().len(), n);
                            leases.push(l);
                        }
                    }
                    _ => {
                        if k % 2 == 0 && !seqs.is_empty() {
                            seqs.remove(k % seqs.len());
                        } else if !leases.is_empty() {
                            leases.remove(k % leases.len());
                        }
                    }
                }
                let mut seen = vec![0u32; total];
                for s in &seqs {
                    for b in s.blocks() {
                        seen[b.0 as usize] += 1;
                    }
                }
                for l in &leases {
                    for b in l.run() {
                        seen[b] += 1;
                    }
                }
                prop_assert!(seen.iter().all(|&c| c <= 1), "a block is shared: {:?}", seen);
                let p = a.lock();
                let free = p.empty.len() + p.lru.len();
                let held: u32 = seen.iter().sum();
                prop_assert_eq!(free + held as usize, total);
                prop_assert_eq!(p.adapters.owned(), leases.iter().map(|l| l.run().len()).sum::<usize>());
            }
            drop(seqs);
            drop(leases);
            prop_assert_eq!(a.adapter_blocks(), 0);
            let p = a.lock();
            prop_assert_eq!(p.empty.len() + p.lru.len(), total);
        }
    }

    /// A cached prefix block in the way is evicted (and unregistered) for the adapter; a held
    /// one is never taken.
    #[test]
    fn cached_blocks_give_way_held_ones_do_not() {
        let a = BlockAllocator::new(4, 2);
        let mut b = a.empty();
        a.grow_to(&mut b, 8).unwrap();
        let key = PrefixKey::base();
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        let hashes = crate::kv::chain_hashes(key, &tokens, 2);
        let mut parent = 0;
        for (i, h) in hashes.iter().enumerate() {
            parent = a
                .register(&b, i, *h, key, &tokens[2 * i..2 * i + 2], parent)
                .unwrap();
        }
        assert_eq!(a.lock().table.len(), 4);
        assert!(a.assign_adapter(1, 1).is_err(), "every block is held");
        drop(b);
        let l = a.assign_adapter(1, 4).unwrap();
        assert_eq!(l.run(), 0..4);
        {
            let p = a.lock();
            assert!(p.table.is_empty() && p.lru.is_empty());
        }
        drop(l);
        assert_eq!(a.lock().empty.len(), 4);
    }
}
