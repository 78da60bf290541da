//! A step that failed. The engine advanced nothing (`Engine::step`'s contract). When it names
//! an adapter it could not read (a disk-tier adapter whose file went bad while the CPU LoRA
//! workers computed from it), that adapter's requests fail with the reason and what to do,
//! the adapter leaves the engine, and every other request stays where it was and runs in the
//! next step. Any other failure aborts the step's requests.
use thaw_runtime::engine::StepPlan;
use thaw_runtime::ids::{AdapterId, SeqId};
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
        tracing::error!(
            adapter = adapter.0,
            "{message}; failing the adapter's requests, the step's others run again"
        );
        let who = self.adapter_label(adapter);
        self.fail_adapter_requests(adapter, &format!("{who} failed: {message}"));
        let wanted = self.state.waiting_adapters();
        crate::memory::mapped::drop_mapped(&mut self.engine, &mut self.mem, adapter, &wanted);
    }

    /// Fails every waiting and running request for adapter `id` with `msg`.
    pub(super) fn fail_adapter_requests(&mut self, id: AdapterId, msg: &str) {
        let victims: Vec<SeqId> = self
            .state
            .waiting
            .iter()
            .chain(&self.state.running)
            .filter(|s| s.adapter == Some(id))
            .map(|s| s.id)
            .collect();
        for v in victims {
            let tx = self.live.get(&v).map(|l| l.events.clone());
            self.forget(v, "abort");
            if let Some(tx) = tx {
                let _ = tx.send(EngineEvent::Aborted(msg.to_string()));
            }
        }
    }
}
