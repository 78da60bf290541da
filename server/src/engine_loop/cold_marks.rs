//! The cold-start gate's answers for one step, carried out once the step is planned: the
//! adapter of each planned request that runs before its adapter landed is marked to have its
//! layers not landed waited for in the forward or computed on the CPU
//! ([`thaw_runtime::engine::Engine::set_adapter_unlanded`]), and each request is counted once
//! by how its cold start went (`thaw_cold_start_layer_waits_total`,
//! `thaw_cold_start_holds_total`, and the `first token` request log).
use std::cell::RefCell;
use std::sync::atomic::Ordering;

use thaw_runtime::engine::{StepPlan, UnlandedLayers};
use thaw_runtime::ids::{AdapterId, SeqId};

use super::gate::ColdGate;
use super::Loop;
use crate::scheduler::Gate;

/// How one request's cold start went, until its first token.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct ColdPath {
    /// The gate held it for its adapter's copy for at least one step.
    pub held: bool,
    /// It ran in a step that waited in the forward for its adapter's layers not landed.
    pub layer_wait: bool,
}

/// One answer of the gate for a request whose adapter had not landed.
type Answer = (SeqId, AdapterId, ColdGate);

/// The gate's answers of one step's planning, for requests whose adapter had not landed (the
/// planner may ask for one request more than once; its last answer is the one it planned by).
#[derive(Debug, Default)]
pub(super) struct GateLog(RefCell<Vec<Answer>>);

impl GateLog {
    /// Notes `g`, the answer for request `seq` of adapter `adapter`, and returns its gate.
    pub(super) fn record(&self, seq: SeqId, adapter: Option<AdapterId>, g: ColdGate) -> Gate {
        if let (Some(a), ColdGate::Hold | ColdGate::Run { .. }) = (adapter, g) {
            let mut log = self.0.borrow_mut();
            match log.iter_mut().find(|(s, ..)| *s == seq) {
                Some(e) => *e = (seq, a, g),
                None => log.push((seq, a, g)),
            }
        }
        g.gate()
    }
}

/// What a planned step does with the answers: the adapters to mark, in the order to mark them
/// (an adapter marked twice keeps its last mark), and the requests held. A request counts only
/// where the plan agrees with its answer (it runs where the gate let it run, it is absent where
/// held). Where two requests of one adapter disagree, waiting wins: the waiting one's step then
/// costs no more than the layer gate allowed, and the assisted one's rows compute the same on
/// the device. Pure.
pub(super) fn carry_out(
    answers: &[Answer],
    planned: impl Fn(SeqId) -> bool,
) -> (Vec<(SeqId, AdapterId, UnlandedLayers)>, Vec<SeqId>) {
    let mut marks: Vec<(SeqId, AdapterId, UnlandedLayers)> = Vec::new();
    let mut held = Vec::new();
    for &(seq, adapter, g) in answers {
        match (g, planned(seq)) {
            (ColdGate::Run { unlanded, .. }, true) => marks.push((seq, adapter, unlanded)),
            (ColdGate::Hold, false) => held.push(seq),
            _ => {}
        }
    }
    // Assist first, so that a wait for the same adapter is its last mark.
    marks.sort_by_key(|&(.., u)| u == UnlandedLayers::Wait);
    (marks, held)
}

impl Loop {
    /// Marks the adapters of the planned requests that run before their adapter landed, and
    /// counts the requests by how they start (each once).
    pub(super) fn carry_out_gates(&mut self, log: GateLog, plan: &StepPlan) {
        let answers = log.0.into_inner();
        if answers.is_empty() {
            return;
        }
        let (marks, held) = carry_out(&answers, |s| plan.items.iter().any(|i| i.seq == s));
        for (seq, adapter, u) in marks {
            if let Err(e) = self.engine.set_adapter_unlanded(adapter, u) {
                // Unregistered since the gate asked: the step fails the request clearly.
                tracing::debug!(seq = %seq, adapter = adapter.0, "marking the adapter: {e}");
            }
            let Some(l) = self.live.get_mut(&seq) else {
                continue;
            };
            if u == UnlandedLayers::Wait && !l.cold.layer_wait {
                l.cold.layer_wait = true;
                self.stats.cold_layer_waits.fetch_add(1, Ordering::Relaxed);
            }
        }
        for seq in held {
            let Some(l) = self.live.get_mut(&seq) else {
                continue;
            };
            if !l.cold.held {
                l.cold.held = true;
                self.stats.cold_holds.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn run(u: UnlandedLayers) -> ColdGate {
        ColdGate::Run {
            cap: None,
            unlanded: u,
        }
    }

    /// The planner's last answer counts; a warm request is not noted.
    #[test]
    fn the_log_keeps_each_cold_requests_last_answer() {
        let log = GateLog::default();
        let (a, s1, s2) = (Some(AdapterId(3)), SeqId(1), SeqId(2));
        assert_eq!(log.record(s1, a, ColdGate::Hold), Gate::Hold);
        assert_eq!(log.record(s1, a, run(UnlandedLayers::Wait)), Gate::Go);
        let capped = ColdGate::Run {
            cap: Some(5),
            unlanded: UnlandedLayers::Assist,
        };
        assert_eq!(log.record(s2, a, capped), Gate::Cap(5));
        assert_eq!(log.record(SeqId(9), None, ColdGate::Warm), Gate::Go);
        assert_eq!(log.record(SeqId(8), a, ColdGate::Warm), Gate::Go);
        assert_eq!(
            log.0.into_inner(),
            vec![
                (s1, AdapterId(3), run(UnlandedLayers::Wait)),
                (s2, AdapterId(3), capped)
            ]
        );
    }

    fn answer() -> impl Strategy<Value = Answer> {
        let gate = prop_oneof![
            Just(ColdGate::Hold),
            Just(run(UnlandedLayers::Wait)),
            Just(run(UnlandedLayers::Assist)),
            (1usize..64).prop_map(|c| ColdGate::Run {
                cap: Some(c),
                unlanded: UnlandedLayers::Assist
            }),
        ];
        (0u64..12, 0u32..4, gate).prop_map(|(s, a, g)| (SeqId(s), AdapterId(a), g))
    }

    proptest! {
        /// Every planned request that runs is marked as its answer says, and only those; every
        /// held request left out of the plan is counted held, and only those; an adapter's last
        /// mark is a wait exactly when some planned request of it waits.
        #[test]
        fn marks_follow_the_answers_and_waiting_wins(
            answers in proptest::collection::vec(answer(), 0..16),
            planned in proptest::collection::vec(any::<bool>(), 12),
        ) {
            // One answer per request, as the log keeps.
            let mut one: Vec<Answer> = Vec::new();
            for a in answers {
                if !one.iter().any(|b| b.0 == a.0) {
                    one.push(a);
                }
            }
            let is_planned = |s: SeqId| planned[s.0 as usize];
            let (marks, held) = carry_out(&one, is_planned);
            for &(s, a, g) in &one {
                let marked = marks.iter().find(|m| m.0 == s);
                match g {
                    ColdGate::Run { unlanded, .. } if is_planned(s) => {
                        prop_assert_eq!(marked, Some(&(s, a, unlanded)));
                    }
                    _ => prop_assert!(marked.is_none()),
                }
                prop_assert_eq!(held.contains(&s), g == ColdGate::Hold && !is_planned(s));
            }
            for a in (0..4).map(AdapterId) {
                let last = marks.iter().rev().find(|m| m.1 == a).map(|m| m.2);
                let waits = one.iter().any(|&(s, b, g)| {
                    b == a && is_planned(s) && g == run(UnlandedLayers::Wait)
                });
                if waits {
                    prop_assert_eq!(last, Some(UnlandedLayers::Wait));
                } else {
                    prop_assert_ne!(last, Some(UnlandedLayers::Wait));
                }
            }
        }
    }
}
