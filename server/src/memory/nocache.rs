//! The `no-cache` baseline (bench only): S-LoRA's memory behaviour, against which Chameleon
//! measures its cache ("S-LoRA ... does not cache unused adapters", Chameleon §5, Figure 14).
//! The pool is the unified one, unpadded; what differs is that nothing stays cached: an adapter
//! on the device that no running or admitted request uses and no waiting request wants is
//! dropped the step it becomes idle. Adapters of waiting requests are still read and
//! prefetched (S-LoRA prefetches the adapters of queued requests), and requests queue.
//!
//! [`idle_drops`] is the decision; admission appends it to every plan (`Limits::keep_idle`
//! false), and the engine loop applies it once more after a step whose requests finished, so
//! an adapter does not stay on the device while the server sits idle.
use std::collections::HashSet;

use thaw_runtime::ids::AdapterId;

/// The adapters among `on_device` to drop now: those in neither `in_use` (running or admitted
/// requests' adapters) nor `wanted` (waiting requests' adapters), in `on_device`'s order.
pub fn idle_drops(
    on_device: impl IntoIterator<Item = AdapterId>,
    in_use: &HashSet<AdapterId>,
    wanted: &HashSet<AdapterId>,
) -> Vec<AdapterId> {
    on_device
        .into_iter()
        .filter(|a| !in_use.contains(a) && !wanted.contains(a))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Exactly the idle, unwanted adapters are dropped, each once.
        #[test]
        fn drops_exactly_the_idle_unwanted(
            device in proptest::collection::btree_set(0u32..30, 0..20),
            in_use in proptest::collection::hash_set(0u32..30, 0..10),
            wanted in proptest::collection::hash_set(0u32..30, 0..10),
        ) {
            let id = |s: &HashSet<u32>| s.iter().map(|a| AdapterId(*a)).collect::<HashSet<_>>();
            let (u, w) = (id(&in_use), id(&wanted));
            let drops = idle_drops(device.iter().map(|a| AdapterId(*a)), &u, &w);
            let dropped: HashSet<AdapterId> = drops.iter().copied().collect();
            prop_assert_eq!(dropped.len(), drops.len());
            for a in device.iter().map(|a| AdapterId(*a)) {
                let keep = u.contains(&a) || w.contains(&a);
                prop_assert_eq!(dropped.contains(&a), !keep);
            }
        }
    }
}
