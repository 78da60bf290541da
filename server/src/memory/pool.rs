//! The device memory budget as one pool of pages shared by KV blocks and adapters (S-LoRA's
//! unified paging): a page is one KV block (every layer's K and V for `block_size` tokens),
//! and an adapter takes `ceil(bytes / page)` pages — its own size, never padded to the largest
//! rank. KV reservations (the scheduler's) and adapter pages together never exceed the pool.
//!
//! The `fixed-slots` layout (a bench-only baseline, the server before this pool) carves
//! `slots` adapter slots, each padded to the largest registered adapter, out of the budget and
//! leaves KV the rest.
use std::collections::BTreeMap;

use thaw_runtime::ids::AdapterId;

/// How adapters take device memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Adapters take exactly their pages out of the budget KV also uses.
    Unified {
        /// Most adapters whose layers are still streaming to the device, if bounded: each
        /// holds a slot of the CPU workers' host store until its last layer lands. Adapters
        /// that have landed are not bounded by it (only by pages).
        max_streaming: Option<usize>,
    },
    /// `slots` slots of `slot_pages` each, reserved for adapters whether used or not.
    FixedSlots { slots: usize, slot_pages: usize },
}

/// Why an adapter does not fit.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("needs {need} pages, {free} free")]
    NoRoom { need: usize, free: usize },
    #[error("all {0} adapter slots are taken")]
    NoSlot(usize),
    #[error(
        "{0} adapters are still streaming to the device, as many as the CPU workers' host \
         store holds (--max-cpu-loras); the next one waits until one lands"
    )]
    Streaming(usize),
    #[error("adapter already in the pool")]
    Duplicate,
}

/// Adapters in the pool: all of them, and those still streaming to the device.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub adapters: usize,
    pub streaming: usize,
}

impl Counts {
    /// One more adapter (a new one always starts streaming).
    pub fn plus_one(self) -> Self {
        Self {
            adapters: self.adapters + 1,
            streaming: self.streaming + 1,
        }
    }

    /// One adapter fewer; `streaming` says whether it was still streaming.
    pub fn minus_one(self, streaming: bool) -> Self {
        Self {
            adapters: self.adapters.saturating_sub(1),
            streaming: self.streaming.saturating_sub(usize::from(streaming)),
        }
    }
}

/// One adapter in the pool.
#[derive(Copy, Clone, Debug)]
struct Held {
    pages: usize,
    streaming: bool,
}

/// Adapter pages in the device budget; KV reservations are passed in (the scheduler owns them).
#[derive(Clone, Debug)]
pub struct PagePool {
    page_bytes: u64,
    total: usize,
    layout: Layout,
    adapters: BTreeMap<AdapterId, Held>,
    adapter_pages: usize,
    streaming: usize,
}

impl PagePool {
    pub fn new(page_bytes: u64, total_pages: usize, layout: Layout) -> Self {
        Self {
            page_bytes: page_bytes.max(1),
            total: total_pages,
            layout,
            adapters: BTreeMap::new(),
            adapter_pages: 0,
            streaming: 0,
        }
    }

    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Pages an adapter of `bytes` takes (its own size; a whole slot in `fixed-slots`).
    pub fn pages_for(&self, bytes: u64) -> usize {
        match self.layout {
            Layout::Unified { .. } => (bytes.div_ceil(self.page_bytes) as usize).max(1),
            Layout::FixedSlots { slot_pages, .. } => slot_pages,
        }
    }

    /// A registered adapter of `bytes`: `fixed-slots` pads every slot to the largest one.
    pub fn note_adapter(&mut self, bytes: u64) {
        let own = (bytes.div_ceil(self.page_bytes) as usize).max(1);
        if let Layout::FixedSlots { slot_pages, .. } = &mut self.layout {
            *slot_pages = (*slot_pages).max(own);
        }
    }

    /// Pages adapters hold now.
    pub fn adapter_pages(&self) -> usize {
        self.adapter_pages
    }

    /// Adapters held now, and how many of them are still streaming.
    pub fn counts(&self) -> Counts {
        Counts {
            adapters: self.adapters.len(),
            streaming: self.streaming,
        }
    }

    /// Whether `id` is in the pool and still streaming.
    pub fn is_streaming(&self, id: AdapterId) -> bool {
        self.adapters.get(&id).is_some_and(|h| h.streaming)
    }

    /// Every layer of `id` has landed: it no longer counts against `max_streaming`.
    /// Returns false if `id` is not in the pool or had landed already.
    pub fn mark_landed(&mut self, id: AdapterId) -> bool {
        match self.adapters.get_mut(&id) {
            Some(h) if h.streaming => {
                h.streaming = false;
                self.streaming -= 1;
                true
            }
            _ => false,
        }
    }

    pub fn contains(&self, id: AdapterId) -> bool {
        self.adapters.contains_key(&id)
    }

    /// The adapters holding pages (on the device or streaming in), with their pages.
    pub fn adapters(&self) -> impl Iterator<Item = (AdapterId, usize)> + '_ {
        self.adapters.iter().map(|(a, h)| (*a, h.pages))
    }

    /// Pages KV may reserve in total while adapters hold `adapter_pages`.
    pub fn kv_capacity_with(&self, adapter_pages: usize) -> usize {
        match self.layout {
            Layout::Unified { .. } => self.total.saturating_sub(adapter_pages),
            Layout::FixedSlots { slots, slot_pages } => {
                self.total.saturating_sub(slots * slot_pages)
            }
        }
    }

    /// Pages KV may reserve in total now.
    pub fn kv_capacity(&self) -> usize {
        self.kv_capacity_with(self.adapter_pages)
    }

    /// Whether one more adapter of `pages` (streaming, as every new one) fits beside
    /// `kv_reserved` KV pages when adapters hold `adapter_pages` in `counts`.
    pub fn fits_with(
        &self,
        pages: usize,
        kv_reserved: usize,
        adapter_pages: usize,
        counts: Counts,
    ) -> Result<(), PoolError> {
        match self.layout {
            Layout::Unified { max_streaming } => {
                if let Some(max) = max_streaming {
                    if counts.streaming >= max {
                        return Err(PoolError::Streaming(max));
                    }
                }
                let free = self.total.saturating_sub(kv_reserved + adapter_pages);
                if pages > free {
                    return Err(PoolError::NoRoom { need: pages, free });
                }
                Ok(())
            }
            Layout::FixedSlots { slots, .. } => {
                if counts.adapters >= slots {
                    return Err(PoolError::NoSlot(slots));
                }
                Ok(())
            }
        }
    }

    /// Takes `pages` for adapter `id`; fails without changing anything if they do not fit.
    pub fn insert(
        &mut self,
        id: AdapterId,
        pages: usize,
        kv_reserved: usize,
    ) -> Result<(), PoolError> {
        if self.adapters.contains_key(&id) {
            return Err(PoolError::Duplicate);
        }
        self.fits_with(pages, kv_reserved, self.adapter_pages, self.counts())?;
        self.adapters.insert(
            id,
            Held {
                pages,
                streaming: true,
            },
        );
        self.adapter_pages += pages;
        self.streaming += 1;
        Ok(())
    }

    /// Gives adapter `id`'s pages back; returns them.
    pub fn remove(&mut self, id: AdapterId) -> Option<usize> {
        let h = self.adapters.remove(&id)?;
        self.adapter_pages -= h.pages;
        self.streaming -= usize::from(h.streaming);
        Some(h.pages)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn mixed_ranks_take_their_own_pages() {
        let mut p = PagePool::new(
            1000,
            10,
            Layout::Unified {
                max_streaming: None,
            },
        );
        assert_eq!(p.pages_for(1), 1);
        assert_eq!(p.pages_for(2500), 3);
        p.insert(AdapterId(1), 3, 4).unwrap();
        assert_eq!(p.kv_capacity(), 7);
        assert_eq!(
            p.insert(AdapterId(2), 4, 4),
            Err(PoolError::NoRoom { need: 4, free: 3 })
        );
        p.insert(AdapterId(2), 3, 4).unwrap();
        assert_eq!(p.remove(AdapterId(1)), Some(3));
        assert_eq!(p.adapter_pages(), 3);
        let mut f = PagePool::new(
            1000,
            10,
            Layout::FixedSlots {
                slots: 2,
                slot_pages: 3,
            },
        );
        assert_eq!(f.pages_for(10), 3, "fixed slots pad to the largest rank");
        assert_eq!(f.kv_capacity(), 4, "slots are carved out even when empty");
        f.insert(AdapterId(1), 3, 4).unwrap();
        f.insert(AdapterId(2), 3, 4).unwrap();
        assert_eq!(f.insert(AdapterId(3), 3, 0), Err(PoolError::NoSlot(2)));
        f.note_adapter(4500);
        assert_eq!(
            f.pages_for(10),
            5,
            "slots grow to the largest adapter registered"
        );
        assert_eq!(f.kv_capacity(), 0);
    }

    /// The streaming bound counts adapters still streaming, not every one on the device: once
    /// they land, more than `max_streaming` adapters stay.
    #[test]
    fn only_streaming_adapters_are_bounded() {
        let mut p = PagePool::new(
            1,
            100,
            Layout::Unified {
                max_streaming: Some(2),
            },
        );
        p.insert(AdapterId(1), 1, 0).unwrap();
        p.insert(AdapterId(2), 1, 0).unwrap();
        assert_eq!(p.insert(AdapterId(3), 1, 0), Err(PoolError::Streaming(2)));
        assert!(p.mark_landed(AdapterId(1)) && !p.mark_landed(AdapterId(1)));
        p.insert(AdapterId(3), 1, 0).unwrap();
        for id in [2, 3] {
            p.mark_landed(AdapterId(id));
        }
        for id in 4..10 {
            p.insert(AdapterId(id), 1, 0).unwrap();
            p.mark_landed(AdapterId(id));
        }
        assert_eq!(
            p.counts(),
            Counts {
                adapters: 9,
                streaming: 0
            }
        );
        p.insert(AdapterId(10), 1, 0).unwrap();
        assert_eq!(p.remove(AdapterId(10)), Some(1));
        assert_eq!(
            p.counts().streaming,
            0,
            "removing a streaming adapter frees its slot"
        );
    }

    proptest! {
        /// Whatever sequence of KV reservations, inserts, landings and removals: KV plus
        /// adapters never exceed the pool, no more than `max_streaming` adapters stream at
        /// once, the streaming count is that of the adapters held, and a refused insert
        /// changes nothing.
        #[test]
        fn never_over_commits(
            total in 1usize..64,
            ops in proptest::collection::vec((0u8..4, 0u32..12, 1usize..20), 1..120),
        ) {
            let mut p = PagePool::new(1, total, Layout::Unified { max_streaming: Some(5) });
            let mut kv = 0usize;
            for (op, id, n) in ops {
                match op {
                    0 => {
                        let before = (p.adapter_pages(), p.counts());
                        if p.insert(AdapterId(id), n, kv).is_err() {
                            prop_assert_eq!(before, (p.adapter_pages(), p.counts()));
                        }
                    }
                    1 => { p.remove(AdapterId(id)); }
                    2 => { p.mark_landed(AdapterId(id)); }
                    _ => {
                        // The scheduler reserves KV only within kv_capacity.
                        if kv + n <= p.kv_capacity() { kv += n } else { kv = kv.saturating_sub(n) }
                    }
                }
                prop_assert!(kv + p.adapter_pages() <= p.total());
                prop_assert!(p.counts().streaming <= 5);
                let streaming = (0..12).filter(|&i| p.is_streaming(AdapterId(i))).count();
                prop_assert_eq!(p.counts().streaming, streaming);
            }
        }
    }
}
