//! The predicted wait of the request the memory layer blocks on memory, from the one
//! [`PerfModel`]: the bypass rule (Chameleon §4.2, "the admitted request will not exceed the
//! waiting time for the request at the head") compares a bypasser's predicted service time
//! with it.
//!
//! A blocked request waits for two things, one after the other: the running batch to free
//! enough memory (steps of the running batch, each predicted from its shape: decode rows and
//! their ranks), then its adapter's load from the tier it is in (disk or host). The memory
//! layer tells how many steps its own blocked head needs ([`MemoryWait::head`]). Only that
//! head blocks its queue: a request waiting only for its adapter's fetch cannot be delayed
//! by a bypasser (admission lets through only requests that leave the fetch head fitting),
//! and the others the memory layer could not place are held by its own bypass rule, so the
//! multi-level queue passes them over as `fcfs` does. See [`blocked_wait_s`].
use std::collections::HashMap;

use thaw_runtime::ids::SeqId;

use crate::perf::{PerfModel, StepShape};

/// What the memory layer knows of the requests it could not place this step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryWait {
    /// Its blocked head and the steps until running requests free enough for it (None: it
    /// waits only for its adapter's fetch, no steps).
    pub head: Option<(SeqId, Option<usize>)>,
    /// Predicted seconds to load each blocked request's adapter from its tier (absent: 0,
    /// resident or the base model).
    pub load_s: HashMap<SeqId, f64>,
}

/// Predicted seconds until a blocked request can run: `steps` steps of a running batch of
/// `running` shape, then its adapter's `load_s`.
pub fn predicted_wait_s(perf: &PerfModel, running: &StepShape, steps: usize, load_s: f64) -> f64 {
    let step = if steps == 0 {
        0.0
    } else {
        perf.predict(running)
    };
    steps as f64 * step + load_s
}

/// Predicted seconds blocked request `id` waits, the bound on who of its queue may pass it:
/// `Some` only for the memory layer's head that waits for memory (its bound in steps of the
/// `running` batch, then its adapter's load); None for any other (see the module note).
pub fn blocked_wait_s(
    perf: &PerfModel,
    running: &StepShape,
    mem: &MemoryWait,
    id: SeqId,
) -> Option<f64> {
    let load = mem.load_s.get(&id).copied().unwrap_or(0.0);
    match mem.head {
        Some((h, Some(steps))) if h == id => Some(predicted_wait_s(perf, running, steps, load)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn perf() -> PerfModel {
        PerfModel::default()
    }

    #[test]
    fn wait_is_the_batch_steps_then_the_load() {
        let p = perf();
        let mut shape = StepShape::default();
        for r in [8, 64] {
            shape.add(1, true, Some(r));
        }
        let step = p.predict(&shape);
        assert!(step > 0.0);
        let w = predicted_wait_s(&p, &shape, 10, 0.25);
        assert!((w - (10.0 * step + 0.25)).abs() < 1e-12, "{w}");
        assert_eq!(predicted_wait_s(&p, &shape, 0, 0.25), 0.25);
        // Larger ranks in the running batch make every step, and so the wait, longer.
        let mut big = StepShape::default();
        for r in [128, 128] {
            big.add(1, true, Some(r));
        }
        assert!(predicted_wait_s(&p, &big, 10, 0.25) >= w);
    }

    #[test]
    fn the_memory_heads_bound_applies_to_it_only() {
        let p = perf();
        let mut shape = StepShape::default();
        shape.add(1, true, Some(16));
        let step = p.predict(&shape);
        let mem = MemoryWait {
            head: Some((SeqId(3), Some(40))),
            load_s: [(SeqId(3), 0.5), (SeqId(4), 0.25)].into_iter().collect(),
        };
        let w = |id| blocked_wait_s(&p, &shape, &mem, SeqId(id));
        let head = w(3).unwrap();
        assert!((head - (40.0 * step + 0.5)).abs() < 1e-12);
        assert_eq!(
            w(4),
            None,
            "not the memory layer's head: passed over, no bound"
        );
        assert_eq!(w(5), None);
        let fetch_only = MemoryWait {
            head: Some((SeqId(3), None)),
            ..mem
        };
        assert_eq!(
            blocked_wait_s(&p, &shape, &fetch_only, SeqId(3)),
            None,
            "waiting only for its fetch: passing it cannot delay it"
        );
    }

    proptest! {
        /// The wait grows with the steps and with the load, and is never below the load.
        #[test]
        fn wait_is_monotone(steps in 0usize..500, extra in 0usize..500, load in 0.0f64..10.0,
                            ranks in proptest::collection::vec(1usize..256, 0..16)) {
            let p = perf();
            let mut shape = StepShape::default();
            for r in ranks {
                shape.add(1, true, Some(r));
            }
            let a = predicted_wait_s(&p, &shape, steps, load);
            let b = predicted_wait_s(&p, &shape, steps + extra, load);
            prop_assert!(a >= load - 1e-12);
            prop_assert!(b >= a - 1e-12);
            prop_assert!(predicted_wait_s(&p, &shape, steps, load + 1.0) > a);
        }
    }
}
