//! A CPU LoRA worker's side of the exchange.

use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::doorbell::{self, Park, WaitStrategy};
use crate::error::{IpcError, Result};
use crate::exchange::{Exchange, Job, WORKER_PID, WORKER_RESULT};
use crate::types::{Module, StepSeq, WorkerId};

/// What [`WorkerPort::wait_step`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    /// A new step was posted; its jobs and inputs are readable until
    /// [`WorkerPort::complete`].
    Step(StepSeq),
    /// The engine asked the workers to exit.
    Shutdown,
    /// The deadline passed with no new step (bump the heartbeat and wait again).
    TimedOut,
}

/// A worker's handle on the exchange: waits for steps, reads its jobs and inputs, writes its
/// Δ rows, reports completion, and keeps its pid and heartbeat words current.
#[derive(Debug)]
pub struct WorkerPort {
    ex: Exchange,
    id: WorkerId,
    last: StepSeq,
    current: Option<StepSeq>,
}

impl WorkerPort {
    /// Claims worker slot `id`: records this process's pid and continues after the step in
    /// the slot's result word (set by the engine with [`Exchange::reset_worker`]).
    pub fn attach(ex: Exchange, id: WorkerId) -> Result<Self> {
        ex.check_worker(id)?;
        let last = StepSeq(ex.slot_word(id, WORKER_RESULT).load(Ordering::Acquire));
        ex.slot_word(id, WORKER_PID)
            .store(std::process::id(), Ordering::Release);
        let port = Self {
            ex,
            id,
            last,
            current: None,
        };
        port.beat();
        Ok(port)
    }

    /// This worker's slot.
    pub fn id(&self) -> WorkerId {
        self.id
    }

    /// The exchange (config, layout).
    pub fn exchange(&self) -> &Exchange {
        &self.ex
    }

    /// Bumps the heartbeat counter.
    pub fn beat(&self) {
        self.ex
            .heartbeat_word(self.id)
            .fetch_add(1, Ordering::Release);
    }

    /// Waits for a step after the last one this worker completed, for shutdown, or for
    /// `deadline`. While the doorbell is armed a `SpinThenFutex` waiter keeps spinning.
    pub fn wait_step(&mut self, strategy: WaitStrategy, deadline: Option<Instant>) -> WaitOutcome {
        if let Some(s) = self.current {
            return WaitOutcome::Step(s);
        }
        let l = *self.ex.layout();
        let park = Park {
            word: self.ex.word(l.bell),
            sleepers: self.ex.word(l.sleepers),
            armed: Some(self.ex.word(l.armed)),
        };
        let seq = self.ex.word(l.seq);
        let last = self.last;
        let ex = &self.ex;
        let got = doorbell::wait_until(strategy, &park, deadline, || {
            if ex.is_shutdown() {
                return Some(WaitOutcome::Shutdown);
            }
            let s = StepSeq(seq.load(Ordering::Acquire));
            (s != last && s.0 != 0).then_some(WaitOutcome::Step(s))
        });
        match got {
            Some(WaitOutcome::Step(s)) => {
                self.current = Some(s);
                WaitOutcome::Step(s)
            }
            Some(o) => o,
            None => WaitOutcome::TimedOut,
        }
    }

    /// The step in progress, if any.
    pub fn current_step(&self) -> Option<StepSeq> {
        self.current
    }

    /// Number of jobs in the current step (0 outside a step).
    pub fn n_jobs(&self) -> usize {
        if self.current.is_none() {
            return 0;
        }
        let n = self
            .ex
            .word(self.ex.layout().n_jobs)
            .load(Ordering::Acquire) as usize;
        n.min(self.ex.config().max_jobs as usize)
    }

    /// Job `i` of the current step (copied out), or `None` outside a step / out of range.
    pub fn job(&self, i: usize) -> Option<Job> {
        if i >= self.n_jobs() {
            return None;
        }
        // SAFETY: we are inside step `current`, whose sequence number we loaded with
        // Acquire after the engine wrote the table and stored it (SeqCst); the engine does
        // not write the table again until our result word says we completed the step.
        let table = unsafe {
            self.ex
                .segment()
                .mapping()
                .slice::<Job>(self.ex.layout().jobs, i + 1)
        };
        Some(table[i])
    }

    /// The jobs of the current step assigned to this worker.
    pub fn my_jobs(&self) -> impl Iterator<Item = Job> + '_ {
        (0..self.n_jobs())
            .filter_map(|i| self.job(i))
            .filter(|j| j.worker == self.id)
    }

    /// For `job` (one of this worker's jobs in the current step) and one of its modules:
    /// the input rows (`[row_count, max_d_in]` f32) and the Δ rows to write
    /// (`[row_count, max_d_out]` f32).
    pub fn job_io(&mut self, job: &Job, module: Module) -> Result<(&[f32], &mut [f32])> {
        if self.current.is_none() {
            return Err(IpcError::InvalidConfig("job_io outside a step".into()));
        }
        job.check(self.ex.config())?;
        if job.worker != self.id || !job.modules.contains(module) {
            return Err(IpcError::InvalidConfig(format!(
                "job {job:?} is not worker {}'s job for {module:?}",
                self.id.0
            )));
        }
        let (in_off, in_n) = self.ex.input_range(job.input, job.rows())?;
        let (out_off, out_n) = self.ex.output_range(module, job.rows())?;
        let map = self.ex.segment().mapping();
        // SAFETY: inside step `current` (Acquire on its sequence number, which the engine
        // stored after writing the inputs); the engine leaves inputs alone until every
        // worker completed the step. Inputs and outputs are disjoint regions of the layout.
        let x = unsafe { map.slice::<f32>(in_off, in_n) };
        // SAFETY: the engine's set_jobs refused any two jobs sharing a (module, row), and
        // this job is ours, so no other worker writes these rows; the engine reads them
        // only after our Release store of the result word; `&mut self` rules out a second
        // slice of them in this process.
        let y = unsafe { map.slice_mut::<f32>(out_off, out_n) };
        Ok((x, y))
    }

    /// Reports the current step complete: Release-stores its number into this worker's
    /// result word and wakes a parked engine. The rows handed out are no longer ours.
    pub fn complete(&mut self) {
        if let Some(s) = self.current.take() {
            let waiters = self.ex.word(self.ex.layout().result_waiters);
            doorbell::store_and_wake(self.ex.slot_word(self.id, WORKER_RESULT), s.0, waiters);
            self.last = s;
        }
    }
}
