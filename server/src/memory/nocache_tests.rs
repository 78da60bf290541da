//! The `no-cache` baseline at the plan level: its plan is the cached plan plus drops, after it
//! no idle unwanted adapter stays on the device, no leased adapter is dropped, the pool is not
//! over-committed, and every other policy plans as before.
use std::collections::HashSet;

use proptest::prelude::*;
use thaw_runtime::ids::AdapterId;

use super::admission::{admit, EvictionOrder, Limits, MemView, Registered};
use super::admission_tests::{cfg, lim, snapshot, Snapshot};
use super::eviction::EvictionPolicy;

proptest! {
    #[test]
    fn no_cache_plan_is_the_cached_plan_plus_idle_drops(
        tiers in proptest::collection::vec((1usize..8, 0u8..3), 1..10),
        running in proptest::collection::vec((1usize..20, 0u32..10), 0..6),
        waiting in proptest::collection::vec((1usize..40, 1usize..12, proptest::option::of(0u32..10)), 0..20),
        total in 16usize..80,
        max_loras in 1usize..4,
        max_seqs in 1usize..8,
        bypass in any::<bool>(),
        prefetch in any::<bool>(),
    ) {
        let c = cfg(total, 64);
        let Snapshot { pool, adapters, order, running, reserved, waiting } =
            snapshot(&c, &tiers, &running, &waiting);
        let view = MemView { pool: &pool, adapters: &adapters, eviction_order: EvictionOrder::Fixed(&order), registered: Registered::AsTracked };
        let with = |keep_idle| Limits { bypass, prefetch, keep_idle, ..lim(max_loras, max_seqs) };
        let cached = admit(&waiting, &running, reserved, &c, view, &with(true));
        // Every policy but no-cache plans with idle adapters kept: exactly the cached plan.
        for p in [EvictionPolicy::Lru, EvictionPolicy::Cost, EvictionPolicy::FixedSlots] {
            let plan = admit(&waiting, &running, reserved, &c, view, &with(p.keeps_idle()));
            prop_assert_eq!(&plan, &cached);
        }
        prop_assert!(!EvictionPolicy::NoCache.keeps_idle());
        let plan = admit(&waiting, &running, reserved, &c, view, &with(false));

        // The same admission and the same moves; only drops added, after the cached evictions.
        prop_assert_eq!(&plan.admit, &cached.admit);
        prop_assert_eq!(&plan.load, &cached.load);
        prop_assert_eq!(&plan.prefetch, &cached.prefetch);
        prop_assert_eq!(&plan.fetch, &cached.fetch);
        prop_assert_eq!(plan.head, cached.head);
        prop_assert_eq!(plan.bypassed, cached.bypassed);
        prop_assert_eq!(&plan.evict[..cached.evict.len()], &cached.evict[..]);

        let leased: HashSet<AdapterId> = running.iter().filter_map(|s| s.adapter).collect();
        let admitted: HashSet<AdapterId> = waiting
            .iter()
            .filter(|s| plan.admit.contains(&s.id))
            .filter_map(|s| s.adapter)
            .collect();
        // Fewer than 65 waiting: all are in admission's view.
        let wanted: HashSet<AdapterId> = waiting
            .iter()
            .filter(|s| !plan.admit.contains(&s.id))
            .filter_map(|s| s.adapter)
            .collect();
        for v in &plan.evict[cached.evict.len()..] {
            prop_assert!(!leased.contains(v), "dropped leased adapter {}", v);
            prop_assert!(!admitted.contains(v) && !wanted.contains(v), "dropped wanted adapter {}", v);
        }
        // Carried out on the pool: nothing over-committed, nothing idle and unwanted left.
        let mut after = pool.clone();
        for v in &plan.evict {
            prop_assert!(after.remove(*v).is_some(), "dropped {} twice or not on the device", v);
        }
        for a in plan.load.iter().chain(&plan.prefetch) {
            let r = after.insert(*a, adapters[a].pages, reserved);
            prop_assert!(r.is_ok(), "planned load does not fit: {:?}", r);
        }
        prop_assert_eq!(plan.kv_capacity, total - after.adapter_pages());
        let kv: usize = reserved
            + waiting.iter().filter(|s| plan.admit.contains(&s.id)).map(|s| s.reservation(&c)).sum::<usize>();
        prop_assert!(kv <= plan.kv_capacity, "KV {} over capacity {}", kv, plan.kv_capacity);
        for (a, _) in after.adapters() {
            prop_assert!(
                leased.contains(&a) || admitted.contains(&a) || wanted.contains(&a),
                "idle adapter {} stays on the device", a
            );
        }
    }
}

/// A finished request's adapter leaves; one a waiting request wants and one a running request
/// uses stay; nothing else changes in the plan.
#[test]
fn no_cache_drops_only_the_idle_unwanted() {
    let c = cfg(40, 64);
    // Adapters 0, 1, 2 on the device; 0 used by a running request, 1 wanted by a waiting one
    // that cannot run yet (max-num-seqs 1), 2 idle.
    let s = snapshot(&c, &[(2, 2), (2, 2), (2, 2)], &[(4, 0)], &[(4, 4, Some(1))]);
    let view = MemView {
        pool: &s.pool,
        adapters: &s.adapters,
        eviction_order: EvictionOrder::Fixed(&s.order),
        registered: Registered::AsTracked,
    };
    let l = Limits {
        keep_idle: false,
        ..lim(4, 1)
    };
    let plan = admit(&s.waiting, &s.running, s.reserved, &c, view, &l);
    assert!(plan.admit.is_empty());
    assert_eq!(plan.evict, vec![AdapterId(2)]);
    assert_eq!(plan.kv_capacity, 40 - 4);
    let kept = admit(&s.waiting, &s.running, s.reserved, &c, view, &lim(4, 1));
    assert!(kept.evict.is_empty() && kept.kv_capacity == 40 - 6);
}
