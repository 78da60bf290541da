//! Protecting the oldest large request (the multi-level queue's P99 rule).
//!
//! MLQ keeps the small requests' lane open by admitting from every queue's quota, so under
//! load the pages a finishing request frees are taken by the fast lane again and a request of
//! a larger queue waits until a lull leaves enough free at once: its wait, not the small
//! requests', becomes the P99. Chameleon bounds the harm of a bypass by the blocked request's
//! predicted wait; here the same bound protects the oldest large request once it is due:
//!
//! - it is *due* when it is the oldest waiting request overall, sits in a queue above the
//!   fast lane, and has waited at least the time the running batch is predicted to need to
//!   free its KV reservation ([`fit_steps`] times the perf model's step time: the "drain
//!   time" for it) — by then `fcfs` would have placed it;
//! - while due it goes first for memory admission and for the step (as a request past the
//!   starvation bound does), so the memory layer's bypass rule lets the smaller queues
//!   backfill only with requests predicted to finish within its wait (EASY backfilling), and
//!   its wait from then on is bounded by that prediction.
//!
//! Only one request is protected at a time, so the fast lane is held for at most one large
//! request's fit, not for every overdue one (`--mlq-max-wait-ms 250` held it for several and
//! made P99 worse in session 8).
use thaw_runtime::ids::SeqId;

/// A running request's hold on the KV cache: the blocks its reservation frees when it
/// finishes, and the steps until it is predicted to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Hold {
    pub steps: usize,
    pub blocks: usize,
}

/// Fewest steps after which `free` blocks plus the reservations of the running requests
/// predicted to have finished cover `need` (0 when it fits now); None when even all of them
/// finishing does not.
pub fn fit_steps(free: usize, holds: &[Hold], need: usize) -> Option<usize> {
    if need <= free {
        return Some(0);
    }
    let mut h = holds.to_vec();
    h.sort_by_key(|h| h.steps);
    let mut have = free;
    for x in h {
        have += x.blocks;
        if have >= need {
            return Some(x.steps);
        }
    }
    None
}

/// A waiting request as the rule sees it.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Waiter {
    pub id: SeqId,
    pub arrived_s: f64,
    pub queue: usize,
}

/// The request to protect at `now_s`: the oldest waiting request overall (ties: the first
/// listed), when it is not in the fast lane (queue 0) and has waited at least `bound_s` of it.
pub fn protected(waiting: &[Waiter], now_s: f64, bound_s: impl Fn(SeqId) -> f64) -> Option<SeqId> {
    let oldest = waiting
        .iter()
        .reduce(|a, b| if b.arrived_s < a.arrived_s { b } else { a })?;
    (oldest.queue > 0 && now_s - oldest.arrived_s >= bound_s(oldest.id)).then_some(oldest.id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fits_once_enough_running_requests_finish() {
        let holds = [
            Hold {
                steps: 30,
                blocks: 10,
            },
            Hold {
                steps: 5,
                blocks: 4,
            },
            Hold {
                steps: 12,
                blocks: 6,
            },
        ];
        assert_eq!(fit_steps(8, &holds, 8), Some(0));
        assert_eq!(fit_steps(8, &holds, 12), Some(5));
        assert_eq!(fit_steps(8, &holds, 13), Some(12));
        assert_eq!(fit_steps(8, &holds, 28), Some(30));
        assert_eq!(fit_steps(8, &holds, 29), None);
    }

    #[test]
    fn only_the_oldest_and_only_above_the_fast_lane() {
        let w = |id, arrived_s, queue| Waiter {
            id: SeqId(id),
            arrived_s,
            queue,
        };
        let ws = [w(1, 2.0, 0), w(2, 1.0, 3), w(3, 0.5, 1)];
        assert_eq!(protected(&ws, 3.0, |_| 1.0), Some(SeqId(3)));
        assert_eq!(protected(&ws, 1.4, |_| 1.0), None, "not waited long enough");
        let fast_oldest = [w(1, 0.1, 0), w(2, 1.0, 3)];
        assert_eq!(
            protected(&fast_oldest, 9.0, |_| 0.0),
            None,
            "the fast lane's quota serves its own oldest"
        );
        assert_eq!(protected(&[], 1.0, |_| 0.0), None);
    }

    proptest! {
        /// `fit_steps` is the least step count that covers the need.
        #[test]
        fn fit_steps_is_minimal(free in 0usize..50, need in 0usize..200,
                                holds in proptest::collection::vec((0usize..100, 0usize..40), 0..12)) {
            let holds: Vec<Hold> = holds.into_iter().map(|(steps, blocks)| Hold { steps, blocks }).collect();
            let freed_by = |t: usize| free + holds.iter().filter(|h| h.steps <= t).map(|h| h.blocks).sum::<usize>();
            match fit_steps(free, &holds, need) {
                Some(t) => {
                    prop_assert!(freed_by(t) >= need);
                    if need > free {
                        prop_assert!(t == 0 || freed_by(t - 1) < need);
                    } else {
                        prop_assert_eq!(t, 0);
                    }
                }
                None => prop_assert!(free + holds.iter().map(|h| h.blocks).sum::<usize>() < need),
            }
        }

        /// At most the oldest is protected, never before its bound nor from the fast lane; and
        /// once the oldest large request is past its bound it is protected.
        #[test]
        fn protects_exactly_the_due_oldest(
            ws in proptest::collection::vec((0.0f64..10.0, 0usize..4), 0..20),
            now in 0.0f64..20.0, bound in 0.0f64..10.0,
        ) {
            let ws: Vec<Waiter> = ws.iter().enumerate()
                .map(|(i, &(a, q))| Waiter { id: SeqId(i as u64), arrived_s: a, queue: q }).collect();
            let got = protected(&ws, now, |_| bound);
            let min = ws.iter().map(|w| w.arrived_s).fold(f64::INFINITY, f64::min);
            let first_oldest = ws.iter().find(|w| w.arrived_s == min);
            match got {
                Some(id) => {
                    let w = ws.iter().find(|w| w.id == id).unwrap();
                    prop_assert_eq!(w.arrived_s, min);
                    prop_assert!(w.queue > 0 && now - w.arrived_s >= bound);
                }
                None => if let Some(o) = first_oldest {
                    prop_assert!(o.queue == 0 || now - o.arrived_s < bound);
                }
            }
        }
    }
}
