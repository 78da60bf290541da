//! Admission against the engine's registered adapters: a request is admitted only when the
//! engine will have its adapter once the plan is carried out, so the engine loop never sends
//! an admitted request back to wait (it used to filter `admit` after applying the plan).
use std::collections::HashSet;

use proptest::prelude::*;
use thaw_runtime::ids::AdapterId;

use super::admission::{admit, AdmitPlan, EvictionOrder, MemView, Registered};
use super::admission_tests::{cfg, lim, snapshot, Snapshot};
use crate::scheduler::SchedConfig;

/// Admission over `s` with the engine lacking `stale` (adapters the memory manager places on
/// the device) and having `extra` (adapters it places elsewhere) besides.
fn plan_with(
    s: &Snapshot,
    c: &SchedConfig,
    stale: &HashSet<AdapterId>,
    extra: &HashSet<AdapterId>,
    max_loras: usize,
) -> AdmitPlan {
    let has = |a: AdapterId| (s.pool.contains(a) && !stale.contains(&a)) || extra.contains(&a);
    let view = MemView {
        pool: &s.pool,
        adapters: &s.adapters,
        eviction_order: EvictionOrder::Fixed(&s.order),
        registered: Registered::Engine(&has),
    };
    admit(
        &s.waiting,
        &s.running,
        s.reserved,
        c,
        view,
        &lim(max_loras, 64),
    )
}

/// A preempted request whose adapter the engine no longer has (the memory manager still
/// places it on the device) waits without holding up the request behind it, and is admitted
/// once the engine has the adapter again.
#[test]
fn a_request_whose_adapter_the_engine_lacks_waits_and_others_pass() {
    let c = cfg(64, 64);
    // Adapters 0 and 1 on the device; a preempted request (prompt and output to recompute)
    // of adapter 0, then a new one of adapter 1.
    let mut s = snapshot(
        &c,
        &[(2, 2), (2, 2)],
        &[],
        &[(8, 8, Some(0)), (8, 8, Some(1))],
    );
    s.waiting[0].total_tokens = 12;
    let stale: HashSet<AdapterId> = [AdapterId(0)].into();
    let plan = plan_with(&s, &c, &stale, &HashSet::new(), 4);
    assert_eq!(plan.admit, vec![s.waiting[1].id], "{plan:?}");
    assert_eq!(
        plan.head, None,
        "a stale adapter does not make a blocked head"
    );
    assert!(plan.load.is_empty() && plan.evict.is_empty(), "{plan:?}");
    let plan = plan_with(&s, &c, &HashSet::new(), &HashSet::new(), 4);
    assert_eq!(plan.admit, vec![s.waiting[0].id, s.waiting[1].id]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the engine lacks or has beyond the memory manager's view: every admitted
    /// request's adapter is one the engine has and the plan keeps, or one the plan loads; the
    /// plan carried out as `apply` does (evictions, then loads) fits the pool and leaves every
    /// admitted request's adapter on it; and the admitted are exactly those admitted with the
    /// stale adapters' requests left out of the queue (they hold nobody up) unless the plan
    /// evicts a stale adapter.
    #[test]
    fn admission_never_picks_a_request_the_engine_would_refuse(
        tiers in proptest::collection::vec((1usize..6, 0u8..3), 1..8),
        running in proptest::collection::vec((1usize..24, 0u32..8), 0..6),
        waiting in proptest::collection::vec(
            (1usize..24, 1usize..8, proptest::option::of(0u32..8)), 1..14),
        stale_bits in any::<u8>(),
        extra_bits in any::<u8>(),
        max_loras in 1usize..4,
    ) {
        let c = cfg(48, 32);
        let s = snapshot(&c, &tiers, &running, &waiting);
        let n = tiers.len();
        let busy: HashSet<AdapterId> = s.running.iter().filter_map(|r| r.adapter).collect();
        let ids = (0..n).map(|i| AdapterId(i as u32));
        // Running requests' adapters are the engine's (it computes with them).
        let stale: HashSet<AdapterId> = ids
            .clone()
            .filter(|a| stale_bits & (1 << a.0) != 0 && s.pool.contains(*a) && !busy.contains(a))
            .collect();
        let extra: HashSet<AdapterId> = ids
            .filter(|a| extra_bits & (1 << a.0) != 0 && !s.pool.contains(*a))
            .collect();
        let plan = plan_with(&s, &c, &stale, &extra, max_loras);
        let has = |a: AdapterId| (s.pool.contains(a) && !stale.contains(&a)) || extra.contains(&a);

        let mut pool = s.pool.clone();
        for v in &plan.evict {
            prop_assert!(pool.remove(*v).is_some(), "evicted {v}, not on the device");
        }
        for a in &plan.load {
            let pages = s.adapters[a].pages;
            let r = pool.insert(*a, pages, s.reserved);
            prop_assert!(r.is_ok(), "planned load of {a} refused: {r:?}");
        }
        for id in &plan.admit {
            let r = s.waiting.iter().find(|w| w.id == *id).unwrap();
            let Some(a) = r.adapter else { continue };
            let loaded = plan.load.contains(&a);
            let kept = has(a) && !plan.evict.contains(&a);
            prop_assert!(loaded || kept, "admitted {id} of {a}: the engine would refuse it");
            prop_assert!(pool.contains(a), "admitted {id}: {a} is not on the device after the plan");
            prop_assert!(!stale.contains(&a) || loaded);
        }

        // A stale adapter evicted to make room may be loaded again for its request behind.
        if plan.evict.iter().any(|v| stale.contains(v)) {
            return Ok(());
        }
        let mut without = s.clone();
        without.waiting.retain(|w| !w.adapter.is_some_and(|a| stale.contains(&a)));
        let clean = plan_with(&without, &c, &stale, &extra, max_loras);
        prop_assert_eq!(&plan.admit, &clean.admit);
        prop_assert_eq!(&plan.load, &clean.load);
        prop_assert_eq!(&plan.evict, &clean.evict);
    }
}
