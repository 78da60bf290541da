//! The host store's arena allocator: a first-fit free list with coalescing, kept in the
//! writer's private memory (only the writer allocates; readers only follow the index).

use std::collections::BTreeMap;

/// Allocation granularity: every block starts 64-byte aligned (cache line; enough for any
/// dtype and for SIMD loads).
pub(crate) const ALIGN: u64 = 64;

pub(crate) fn round_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// Free blocks of `[0, capacity)`, keyed by offset; adjacent blocks are always merged.
#[derive(Debug, Clone)]
pub(crate) struct FreeList {
    free: BTreeMap<u64, u64>,
    capacity: u64,
}

impl FreeList {
    pub(crate) fn new(capacity: u64) -> Self {
        let capacity = capacity / ALIGN * ALIGN;
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self { free, capacity }
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// First-fit allocation of `len` bytes (rounded up to [`ALIGN`]).
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        let len = round_up(len.max(1));
        let (&off, &size) = self.free.iter().find(|(_, &size)| size >= len)?;
        self.free.remove(&off);
        if size > len {
            self.free.insert(off + len, size - len);
        }
        Some(off)
    }

    /// Returns `[off, off+len)` (as allocated) to the free list, merging neighbours.
    pub(crate) fn free(&mut self, off: u64, len: u64) {
        let mut start = off;
        let mut size = round_up(len.max(1));
        debug_assert!(start + size <= self.capacity);
        if let Some((&p_off, &p_size)) = self.free.range(..off).next_back() {
            debug_assert!(p_off + p_size <= off, "double free at {off}");
            if p_off + p_size == off {
                self.free.remove(&p_off);
                start = p_off;
                size += p_size;
            }
        }
        if let Some(&n_size) = self.free.get(&(off + round_up(len.max(1)))) {
            self.free.remove(&(off + round_up(len.max(1))));
            size += n_size;
        }
        self.free.insert(start, size);
    }

    /// Largest free block.
    pub(crate) fn largest(&self) -> u64 {
        self.free.values().copied().max().unwrap_or(0)
    }

    /// Total free bytes.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn blocks_never_overlap_and_coalesce(ops in proptest::collection::vec((0u8..3, 1u64..5000), 1..200)) {
            let mut fl = FreeList::new(64 * 1024);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (op, n) in ops {
                if op < 2 {
                    if let Some(off) = fl.alloc(n) {
                        let len = round_up(n);
                        prop_assert_eq!(off % ALIGN, 0);
                        prop_assert!(off + len <= fl.capacity());
                        for &(o, l) in &live {
                            prop_assert!(off + len <= o || o + l <= off, "overlap");
                        }
                        live.push((off, len));
                    }
                } else if !live.is_empty() {
                    let (o, l) = live.swap_remove(n as usize % live.len());
                    fl.free(o, l);
                }
                let used: u64 = live.iter().map(|&(_, l)| l).sum();
                prop_assert_eq!(used + fl.free_bytes(), fl.capacity());
            }
            for (o, l) in live.drain(..) {
                fl.free(o, l);
            }
            prop_assert_eq!(fl.largest(), fl.capacity());
        }
    }
}
