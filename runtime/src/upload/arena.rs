//! Space in the pinned host arena: a first-fit allocator over byte offsets `[0, capacity)`,
//! with neighbours coalesced on free. Pure bookkeeping (no memory): the pipeline's plan owns
//! one and the memory itself is the backend's single pinned allocation ([`super::PinnedMemory`]).
use std::collections::BTreeMap;
use std::ops::Range;

/// Every range starts on this boundary: DMA sources and `f32` reads stay aligned.
pub const ARENA_ALIGN: usize = 256;

/// Free and taken ranges of an arena of `capacity` bytes.
#[derive(Debug, Clone)]
pub struct ArenaAlloc {
    capacity: usize,
    /// Free ranges by start → end, disjoint and never adjacent (coalesced).
    free: BTreeMap<usize, usize>,
    /// Taken ranges by start → end.
    taken: BTreeMap<usize, usize>,
    used: usize,
}

impl ArenaAlloc {
    /// An empty arena of `capacity` bytes (rounded down to [`ARENA_ALIGN`]).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity / ARENA_ALIGN * ARENA_ALIGN;
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Self {
            capacity,
            free,
            taken: BTreeMap::new(),
            used: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes taken (each range rounded up to [`ARENA_ALIGN`]).
    pub fn used(&self) -> usize {
        self.used
    }

    /// The lowest free range of `len` bytes (at least one byte is taken, so every job has a
    /// distinct range), or `None` if no free range is that long.
    pub fn alloc(&mut self, len: usize) -> Option<Range<usize>> {
        let len = len.max(1).next_multiple_of(ARENA_ALIGN);
        let (&start, &end) = self.free.iter().find(|(&s, &e)| e - s >= len)?;
        self.free.remove(&start);
        if start + len < end {
            self.free.insert(start + len, end);
        }
        self.taken.insert(start, start + len);
        self.used += len;
        Some(start..start + len)
    }

    /// Returns `r` (as [`ArenaAlloc::alloc`] gave it) to the free list.
    ///
    /// # Panics
    /// If `r` is not a taken range: a double free would let two jobs share bytes.
    pub fn free(&mut self, r: Range<usize>) {
        assert_eq!(
            self.taken.remove(&r.start),
            Some(r.end),
            "arena range {r:?} freed but not taken (a double free)"
        );
        self.used -= r.len();
        let (mut start, mut end) = (r.start, r.end);
        if let Some((&s, &e)) = self.free.range(..start).next_back() {
            if e == start {
                self.free.remove(&s);
                start = s;
            }
        }
        if let Some(e) = self.free.remove(&end) {
            end = e;
        }
        self.free.insert(start, end);
    }

    /// Checks the bookkeeping: free and taken ranges tile `[0, capacity)` without overlap.
    #[cfg(test)]
    pub fn check(&self) {
        let mut all: Vec<(usize, usize, bool)> = self
            .free
            .iter()
            .map(|(&s, &e)| (s, e, true))
            .chain(self.taken.iter().map(|(&s, &e)| (s, e, false)))
            .collect();
        all.sort();
        let mut at = 0;
        for (s, e, _) in &all {
            assert_eq!(*s, at, "gap or overlap at {at}: {all:?}");
            assert!(e > s);
            at = *e;
        }
        assert_eq!(at, self.capacity, "{all:?}");
        let used: usize = self.taken.iter().map(|(s, e)| e - s).sum();
        assert_eq!(used, self.used);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any sequence of allocations and frees keeps the ranges tiling the arena, aligned,
        /// within capacity; after freeing everything the arena is one free range again.
        #[test]
        fn ranges_tile_the_arena(ops in proptest::collection::vec((0usize..3000, any::<bool>(), 0usize..8), 1..80)) {
            let mut a = ArenaAlloc::new(8192);
            let mut held: Vec<Range<usize>> = Vec::new();
            for (len, free, k) in ops {
                if free && !held.is_empty() {
                    a.free(held.remove(k % held.len()));
                } else if let Some(r) = a.alloc(len) {
                    prop_assert_eq!(r.start % ARENA_ALIGN, 0);
                    prop_assert!(r.len() >= len && r.end <= a.capacity());
                    held.push(r);
                } else {
                    prop_assert!(a.capacity() - a.used() < len.max(1) || a.free.values().count() > 1);
                }
                a.check();
            }
            for r in held.drain(..) {
                a.free(r);
            }
            a.check();
            prop_assert_eq!(a.used(), 0);
            prop_assert_eq!(a.alloc(8192), Some(0..8192));
        }
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn a_double_free_panics() {
        let mut a = ArenaAlloc::new(4096);
        let r = a.alloc(10).unwrap();
        a.free(r.clone());
        a.free(r);
    }
}
