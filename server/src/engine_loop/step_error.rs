//! A step that failed. The engine advanced nothing (`Engine::step`'s contract). When it names
//! an adapter it could not read (a disk-tier adapter whose file went bad while the CPU LoRA
//! workers computed from it), that adapter's requests fail with the reason and what to do,
//! the adapter leaves the engine, and every other request stays where it was and runs in the
//! next step. Any other failure aborts the step's requests.
use thaw_runtime::engine::StepPlan;
use thaw_runtime::ids::SeqId;
use thaw_runtime::RuntimeError;

use super::{EngineEvent, Loop};

impl Loop {
    pub(super) fn on_step_error(&mut self, e: RuntimeError, plan: &StepPlan) {
        let RuntimeError::AdapterUnreadable { adapter, message } = e else {
            tracing::error!("engine step failed: {e}; aborting the step's requests");
            for it in &plan.items {
                if let Some(l) = self.live.get(&it.seq) {
                    let _ = l.events.send(EngineEvent::Aborted(
                        "internal error while running the model; see the server log".into(),
                    ));
                }
                self.forget(it.seq, "abort");
            }
            return;
        };
        let victims: Vec<SeqId> = self
            .state
            .waiting
            .iter()
            .chain(&self.state.running)
            .filter(|s| s.adapter == Some(adapter))
            .map(|s| s.id)
            .collect();
        tracing::error!(
            adapter = adapter.0,
            failed = victims.len(),
            "{message}; failing the adapter's requests, the step's others run again"
        );
        for v in victims {
            let Some(l) = self.live.get(&v) else {
                continue;
            };
            let name = l.lease.as_ref().map(|a| a.slot().name.clone());
            let tx = l.events.clone();
            self.forget(v, "abort");
            let who = name.map_or_else(
                || format!("adapter {}", adapter.0),
                |n| format!("adapter `{n}`"),
            );
            let _ = tx.send(EngineEvent::Aborted(format!("{who} failed: {message}")));
        }
        let wanted = self.state.waiting_adapters();
        crate::memory::mapped::drop_mapped(&mut self.engine, &mut self.mem, adapter, &wanted);
    }
}
