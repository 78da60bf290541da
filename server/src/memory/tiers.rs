//! Which adapters are in which tier, kept up to date on every move so that per-step work (the
//! eviction order, streaming progress, the host bound, the published split) touches only the
//! adapters on the device or in host memory, never every registered one: with 10,000 adapters
//! registered and a few dozen active, a step must not scan 10,000 entries.
use std::collections::HashSet;

use thaw_runtime::ids::AdapterId;

use super::admission::Device;

/// Where one adapter is, as far as the index cares.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Place {
    pub device: Device,
    /// It has a host copy.
    pub host: bool,
    /// Its weights (stored dtype: the host copy, and the device's pages).
    pub bytes: u64,
    /// Bytes of its host copy held in memory: all of `bytes` for a heap copy, 0 for one read
    /// in place from its mapped file (the page cache's pages, which the kernel may drop and
    /// read again), for which the host tier counts only the arena image.
    pub heap: u64,
    /// Arena bytes of its host copy's device image, if staged: the host tier holds it too.
    pub image: u64,
}

impl Place {
    /// Host tier means a host copy and nothing on the device (a device adapter's host copy is
    /// counted with the device).
    fn host_only(&self) -> bool {
        self.host && self.device == Device::Absent
    }

    /// What the host tier holds for it: its arena image and its host copy's heap bytes.
    pub fn host_bytes(&self) -> u64 {
        self.heap + self.image
    }
}

/// Sets and sums per tier; the disk tier is everything else.
#[derive(Clone, Debug, Default)]
pub struct TierIndex {
    total: usize,
    device: HashSet<AdapterId>,
    loading: HashSet<AdapterId>,
    host: HashSet<AdapterId>,
    device_bytes: u64,
    host_bytes: u64,
}

/// Counts and bytes per tier.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TierTotals {
    pub device: usize,
    pub device_bytes: u64,
    pub host: usize,
    pub host_bytes: u64,
    pub disk: usize,
}

impl TierIndex {
    /// A new adapter at `p`.
    pub fn add(&mut self, id: AdapterId, p: Place) {
        self.total += 1;
        self.enter(id, p);
    }

    /// An adapter that was at `p` is gone.
    pub fn remove(&mut self, id: AdapterId, p: Place) {
        self.total = self.total.saturating_sub(1);
        self.leave(id, p);
    }

    /// An adapter moved from `from` to `to`.
    pub fn moved(&mut self, id: AdapterId, from: Place, to: Place) {
        if from != to {
            self.leave(id, from);
            self.enter(id, to);
        }
    }

    fn enter(&mut self, id: AdapterId, p: Place) {
        if p.device != Device::Absent {
            self.device.insert(id);
            self.device_bytes += p.bytes;
        }
        if p.device == Device::Loading {
            self.loading.insert(id);
        }
        if p.host_only() {
            self.host.insert(id);
            self.host_bytes += p.host_bytes();
        }
    }

    fn leave(&mut self, id: AdapterId, p: Place) {
        if p.device != Device::Absent && self.device.remove(&id) {
            self.device_bytes -= p.bytes;
        }
        if p.device == Device::Loading {
            self.loading.remove(&id);
        }
        if p.host_only() && self.host.remove(&id) {
            self.host_bytes -= p.host_bytes();
        }
    }

    /// Adapters registered with the engine (loading or resident).
    pub fn device(&self) -> &HashSet<AdapterId> {
        &self.device
    }

    /// Adapters whose layers are still streaming in.
    pub fn loading(&self) -> &HashSet<AdapterId> {
        &self.loading
    }

    /// Adapters in the host tier only.
    pub fn host(&self) -> &HashSet<AdapterId> {
        &self.host
    }

    pub fn totals(&self) -> TierTotals {
        TierTotals {
            device: self.device.len(),
            device_bytes: self.device_bytes,
            host: self.host.len(),
            host_bytes: self.host_bytes,
            disk: self.total - self.device.len() - self.host.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// `image`: the arena image's bytes, held only with a host copy; `code >= 7`: a host copy
    /// read in place.
    fn place(code: u8, bytes: u64, image: u64) -> Place {
        let (in_place, code) = (code >= 7, code % 7);
        let host = code / 3 % 2 == 1;
        Place {
            device: match code % 3 {
                0 => Device::Absent,
                1 => Device::Loading,
                _ => Device::Resident,
            },
            host,
            bytes,
            heap: if host && !in_place { bytes } else { 0 },
            image: if host { image } else { 0 },
        }
    }

    /// The totals a full scan would give.
    fn scan(all: &HashMap<AdapterId, Place>) -> TierTotals {
        let mut t = TierTotals::default();
        for p in all.values() {
            if p.device != Device::Absent {
                t.device += 1;
                t.device_bytes += p.bytes;
            } else if p.host {
                // The host tier holds the arena image, and the heap copy unless the copy
                // is read in place from the file.
                t.host += 1;
                t.host_bytes += p.image + p.heap;
            } else {
                t.disk += 1;
            }
        }
        t
    }

    proptest! {
        /// After any sequence of registrations, moves and removals, the index agrees with a
        /// scan of every adapter, set by set; an image staged or dropped on the way counts in
        /// the host tier's bytes exactly while the adapter is there, and a host copy read in
        /// place counts only its image.
        #[test]
        fn index_matches_a_full_scan(
            ops in prop::collection::vec((0u32..12, 0u8..14, 1u64..1000, 0u64..1300), 1..200)
        ) {
            let mut idx = TierIndex::default();
            let mut all: HashMap<AdapterId, Place> = HashMap::new();
            for (k, code, bytes, image) in ops {
                let id = AdapterId(k);
                match all.get(&id).copied() {
                    None => {
                        let p = place(code, bytes, image);
                        idx.add(id, p);
                        all.insert(id, p);
                    }
                    Some(old) if code % 7 == 6 => {
                        idx.remove(id, old);
                        all.remove(&id);
                    }
                    Some(old) => {
                        let p = place(code, old.bytes, image);
                        idx.moved(id, old, p);
                        all.insert(id, p);
                    }
                }
                prop_assert_eq!(idx.totals(), scan(&all));
                let loading: HashSet<AdapterId> = all
                    .iter()
                    .filter(|(_, p)| p.device == Device::Loading)
                    .map(|(id, _)| *id)
                    .collect();
                prop_assert_eq!(idx.loading(), &loading);
                let host: HashSet<AdapterId> = all
                    .iter()
                    .filter(|(_, p)| p.host_only())
                    .map(|(id, _)| *id)
                    .collect();
                prop_assert_eq!(idx.host(), &host);
            }
        }
    }
}
