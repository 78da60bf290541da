//! Which pages of the one device budget hold which adapter (ELORA's / S-LoRA's unified pool on
//! a GPU): a page is one KV block of every layer, and an adapter's device image lives in a run
//! of `n` consecutive pages, so in each layer's K and V buffers it owns one contiguous range
//! of `n` blocks (see [`crate::upload::ImageLayout::paged`]). KV blocks are taken lowest
//! first; adapter runs are taken from the top down, so the two rarely fragment each other.
//!
//! Pure bookkeeping over page indices (no memory, no lock): which pages KV holds is passed in,
//! so the decision is a function of its inputs and property-tested below. The invariants:
//! no page belongs to two adapters or to an adapter and a held KV block, an adapter's run is
//! given back exactly once, and the pages adapters own never exceed the pool.
use std::collections::BTreeMap;
use std::ops::Range;

/// Why an adapter got no run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    #[error("the adapter already owns pages {0:?}")]
    Duplicate(Range<usize>),
    #[error(
        "no {need} consecutive free pages of the device budget ({free} free, {owned} held by \
         adapters, {total} in all); KV blocks in use split the free ones: retry once requests \
         finish, or raise --num-gpu-blocks-override / --gpu-memory-utilization"
    )]
    NoRun {
        need: usize,
        free: usize,
        owned: usize,
        total: usize,
    },
    #[error("the adapter owns no pages (released twice?)")]
    NotAssigned,
}

/// The adapters' runs of pages in a pool of `total` pages, keyed by `K` (an adapter id and
/// its generation).
#[derive(Clone, Debug)]
pub struct AdapterPages<K: Ord + Copy> {
    total: usize,
    /// Runs by owner.
    runs: BTreeMap<K, Range<usize>>,
    /// Runs by first page → end, disjoint.
    by_start: BTreeMap<usize, usize>,
    owned: usize,
}

impl<K: Ord + Copy> AdapterPages<K> {
    pub fn new(total: usize) -> Self {
        Self {
            total,
            runs: BTreeMap::new(),
            by_start: BTreeMap::new(),
            owned: 0,
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Pages adapters own now.
    pub fn owned(&self) -> usize {
        self.owned
    }

    /// The run `owner` holds, if any.
    pub fn run(&self, owner: K) -> Option<Range<usize>> {
        self.runs.get(&owner).cloned()
    }

    /// Whether an adapter owns `page`.
    pub fn is_owned(&self, page: usize) -> bool {
        self.by_start
            .range(..=page)
            .next_back()
            .is_some_and(|(_, &end)| page < end)
    }

    /// Gives `owner` the highest run of `n` pages (at least one) that no adapter owns and
    /// `kv_held(page)` says KV does not hold. KV blocks cached but unreferenced count as
    /// held here: the caller evicts them first if it wants their pages.
    pub fn assign(
        &mut self,
        owner: K,
        n: usize,
        kv_held: impl Fn(usize) -> bool,
    ) -> Result<Range<usize>, PageError> {
        if let Some(r) = self.runs.get(&owner) {
            return Err(PageError::Duplicate(r.clone()));
        }
        let n = n.max(1);
        let mut end = self.total;
        let mut free = 0;
        let mut found = None;
        // Walk down from the top: `end` is one past the highest page of the candidate run.
        let mut p = self.total;
        while p > 0 {
            let page = p - 1;
            if self.is_owned(page) || kv_held(page) {
                end = page;
            } else {
                free += 1;
                if found.is_none() && end - page == n {
                    found = Some(page..end);
                }
            }
            p -= 1;
        }
        let Some(r) = found else {
            return Err(PageError::NoRun {
                need: n,
                free,
                owned: self.owned,
                total: self.total,
            });
        };
        self.by_start.insert(r.start, r.end);
        self.runs.insert(owner, r.clone());
        self.owned += n;
        Ok(r)
    }

    /// Takes `owner`'s run back (once: a second release is an error, never a double free).
    pub fn release(&mut self, owner: K) -> Result<Range<usize>, PageError> {
        let r = self.runs.remove(&owner).ok_or(PageError::NotAssigned)?;
        self.by_start.remove(&r.start);
        self.owned -= r.len();
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn runs_come_from_the_top_and_skip_kv() {
        let mut p = AdapterPages::<u32>::new(10);
        assert_eq!(p.assign(1, 3, |_| false), Ok(7..10));
        // Page 5 is held by KV: the next run of 2 below 7 is 3..5.
        assert_eq!(p.assign(2, 2, |pg| pg == 5), Ok(3..5));
        assert!(matches!(
            p.assign(2, 1, |_| false),
            Err(PageError::Duplicate(_))
        ));
        assert_eq!(p.owned(), 5);
        assert!(matches!(
            p.assign(3, 4, |pg| pg == 1),
            Err(PageError::NoRun { need: 4, .. })
        ));
        assert_eq!(p.release(1), Ok(7..10));
        assert_eq!(p.release(1), Err(PageError::NotAssigned));
        assert_eq!(p.assign(3, 4, |pg| pg == 1), Ok(6..10));
        assert_eq!(p.owned(), 6);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Assign { owner: u8, n: usize, kv: Vec<usize> },
        Release { owner: u8 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (
                0u8..12,
                1usize..9,
                proptest::collection::vec(0usize..40, 0..12)
            )
                .prop_map(|(owner, n, kv)| Op::Assign { owner, n, kv }),
            (0u8..12).prop_map(|owner| Op::Release { owner }),
        ]
    }

    proptest! {
        /// Any sequence of assignments (each beside its own set of KV-held pages) and releases:
        /// no page belongs to two adapters, a run never covers a page KV held when it was
        /// given, runs lie inside the pool, a run is released exactly once, the owned count is
        /// the runs' pages, and a run is refused only when no such run exists.
        #[test]
        fn pages_are_never_shared_and_freed_once(ops in proptest::collection::vec(op(), 1..60)) {
            let total = 40;
            let mut p = AdapterPages::<u8>::new(total);
            let mut model: BTreeMap<u8, Range<usize>> = BTreeMap::new();
            for o in ops {
                match o {
                    Op::Assign { owner, n, kv } => {
                        let held = |pg: usize| kv.contains(&pg);
                        match p.assign(owner, n, held) {
                            Ok(r) => {
                                prop_assert!(!model.contains_key(&owner));
                                prop_assert_eq!(r.len(), n);
                                prop_assert!(r.end <= total);
                                prop_assert!(r.clone().all(|pg| !kv.contains(&pg)));
                                for other in model.values() {
                                    prop_assert!(r.end <= other.start || other.end <= r.start,
                                        "{:?} overlaps {:?}", r, other);
                                }
                                model.insert(owner, r);
                            }
                            Err(PageError::Duplicate(r)) => {
                                prop_assert_eq!(Some(&r), model.get(&owner));
                            }
                            Err(PageError::NoRun { need, .. }) => {
                                prop_assert!(!model.contains_key(&owner));
                                // No window of `need` pages is free of KV and of every run.
                                let busy = |pg: usize| kv.contains(&pg)
                                    || model.values().any(|r| r.contains(&pg));
                                let exists = (0..=total.saturating_sub(need))
                                    .any(|s| (s..s + need).all(|pg| !busy(pg)));
                                prop_assert!(!exists, "refused {} pages that were free", need);
                            }
                            Err(e) => prop_assert!(false, "unexpected {e}"),
                        }
                    }
                    Op::Release { owner } => {
                        let got = p.release(owner);
                        match model.remove(&owner) {
                            Some(r) => prop_assert_eq!(got, Ok(r)),
                            None => prop_assert_eq!(got, Err(PageError::NotAssigned)),
                        }
                    }
                }
                let owned: usize = model.values().map(|r| r.len()).sum();
                prop_assert_eq!(p.owned(), owned);
                prop_assert!(p.owned() <= total);
                for pg in 0..total {
                    prop_assert_eq!(p.is_owned(pg), model.values().any(|r| r.contains(&pg)));
                }
            }
            for owner in model.keys().copied().collect::<Vec<_>>() {
                prop_assert!(p.release(owner).is_ok());
            }
            prop_assert_eq!(p.owned(), 0);
        }
    }
}
