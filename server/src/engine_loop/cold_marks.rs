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

use super::Loop;
use crate::coldstart::{carry_out, Answer, ColdGate};
use crate::scheduler::Gate;

/// How one request's cold start went, until its first token.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct ColdPath {
    /// The gate held it for its adapter's copy for at least one step.
    pub held: bool,
    /// It ran in a step that waited in the forward for its adapter's layers not landed.
    pub layer_wait: bool,
}

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
    use super::*;

    /// The planner's last answer counts; a warm request is not noted.
    #[test]
    fn the_log_keeps_each_cold_requests_last_answer() {
        let log = GateLog::default();
        let (a, s1, s2) = (Some(AdapterId(3)), SeqId(1), SeqId(2));
        let wait = ColdGate::Run {
            cap: None,
            unlanded: UnlandedLayers::Wait,
        };
        assert_eq!(log.record(s1, a, ColdGate::Hold), Gate::Hold);
        assert_eq!(log.record(s1, a, wait), Gate::Go);
        let capped = ColdGate::Run {
            cap: Some(5),
            unlanded: UnlandedLayers::Assist,
        };
        assert_eq!(log.record(s2, a, capped), Gate::Cap(5));
        assert_eq!(log.record(SeqId(9), None, ColdGate::Warm), Gate::Go);
        assert_eq!(log.record(SeqId(8), a, ColdGate::Warm), Gate::Go);
        assert_eq!(
            log.0.into_inner(),
            vec![(s1, AdapterId(3), wait), (s2, AdapterId(3), capped)]
        );
    }
}
