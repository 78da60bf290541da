//! Surviving workers: the engine standing in for a dead worker's slice, respawning, and the
//! between-steps health check.

use std::time::{Duration, Instant};

use thaw_ipc::{
    Exchange, ReaderSlot, Segment, SegmentKind, StepSeq, WaitOutcome, WaitStrategy, WorkerId,
    WorkerPort,
};

use super::LoraPool;
use crate::procs::{restart_streak, SlotState};
use crate::CpuLoraError;

impl LoraPool {
    /// Computes dead worker `w`'s jobs of step `seq` in this process, through its exchange
    /// slot, with the workers' own code. The process must be dead and reaped. Returns the
    /// row·modules computed.
    pub(super) fn stand_in(
        &mut self,
        w: WorkerId,
        seq: StepSeq,
        deadline: Instant,
    ) -> Result<u32, CpuLoraError> {
        if self.ex.worker_status(w)?.result.reached(seq) {
            return Ok(0); // it finished the step before dying
        }
        let fd = self.ex.segment().try_clone_fd()?;
        let ex = Exchange::open(Segment::open_fd(fd, SegmentKind::Exchange)?)?;
        let mut port = WorkerPort::attach(ex, w)?;
        // A device-triggered step may not be signalled yet: wait for the word like a worker.
        let far = deadline.max(Instant::now()) + Duration::from_secs(10);
        match port.wait_step(WaitStrategy::spin(), Some(far)) {
            WaitOutcome::Step(s) if s == seq => {}
            other => {
                return Err(CpuLoraError::Config(format!(
                    "standing in for worker {} expected step {}, saw {other:?}",
                    w.0, seq.0
                )))
            }
        }
        let stat = self
            .standin
            .run_step(&mut port, self.store.reader(), seq, None);
        port.complete();
        self.ex.reset_worker(w, seq)?;
        if stat.failed > 0 {
            return Err(self.explain(CpuLoraError::JobsFailed {
                worker: w,
                failed: stat.failed,
            }));
        }
        Ok(stat.rows)
    }

    /// Releases a dead slot's store leases and starts a new process, unless the slot is in a
    /// crash loop (`max_restarts` workers in a row died within `stable_after`). The exchange
    /// slot continues after the last posted step.
    pub(super) fn respawn(&mut self, w: WorkerId) -> Result<bool, CpuLoraError> {
        let slot = &mut self.slots[w.0 as usize];
        let uptime = slot.started.elapsed();
        slot.kill();
        self.store.release_reader(ReaderSlot(w.0 + 1))?;
        let next = restart_streak(
            slot.streak,
            uptime,
            self.cfg.stable_after,
            self.cfg.max_restarts,
        );
        let Some(streak) = next.filter(|_| slot.state != SlotState::Disabled) else {
            if slot.state != SlotState::Disabled {
                tracing::error!(
                    worker = w.0,
                    restarts = slot.restarts,
                    "{} CPU LoRA workers in a row died within {:?} of starting; slot disabled",
                    slot.streak + 1,
                    self.cfg.stable_after
                );
            }
            slot.state = SlotState::Disabled;
            return Ok(false);
        };
        self.ex.reset_worker(w, self.seq)?;
        slot.streak = streak;
        slot.restarts += 1;
        match slot.spawn(&self.launch, &self.ex, &self.store, &self.stats) {
            Ok(()) => Ok(true),
            Err(e) => {
                tracing::error!(worker = w.0, error = %e, "CPU LoRA worker respawn failed");
                Ok(false)
            }
        }
    }

    /// Between steps: reaps workers that exited, respawns them, promotes attached ones, and
    /// replaces workers that never attached. Called by every submit; call it when idle too.
    pub fn health_check(&mut self) -> Result<(), CpuLoraError> {
        if self.in_flight.is_some() {
            return Ok(());
        }
        for w in 0..self.slots.len() {
            let id = WorkerId(w as u32);
            let slot = &mut self.slots[w];
            let exited = slot.exited().is_some();
            let never_attached = slot.state == SlotState::Starting
                && slot.started.elapsed() > self.cfg.startup_timeout;
            slot.check_attached(&self.ex);
            if exited || never_attached || slot.state == SlotState::Dead {
                self.respawn(id)?;
            }
        }
        Ok(())
    }
}
