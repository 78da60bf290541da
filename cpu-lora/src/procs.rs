//! Worker processes as the pool sees them: spawning (fd inheritance, pinning arguments,
//! death with the parent), liveness (exit status, attach, heartbeat age), killing and
//! reaping. Every child is reaped by the pool; none outlives it.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use thaw_ipc::{Exchange, HostStore, WorkerId};

use crate::stats::StatsSegment;
use crate::worker::{WaitMode, EXCHANGE_FD_ENV, STATS_FD_ENV, STORE_FD_ENV};
use crate::CpuLoraError;

/// Where a worker slot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Process spawned, not yet attached to its exchange slot.
    Starting,
    /// Attached: takes rows.
    Ready,
    /// No process (died, killed, or gave up after too many restarts); the engine computes
    /// anything still assigned to it.
    Dead,
    /// Restarted too often; left dead, its rows go to the others.
    Disabled,
}

/// One worker slot's public state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerInfo {
    /// Exchange slot.
    pub id: WorkerId,
    /// Current process id, if a process runs.
    pub pid: Option<u32>,
    /// Core it is pinned to.
    pub core: Option<usize>,
    /// Life-cycle state.
    pub state: SlotState,
    /// Times it was respawned.
    pub restarts: u32,
}

/// How workers are started.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    pub program: PathBuf,
    pub leading_args: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
    pub wait: WaitMode,
    pub heartbeat: Duration,
}

#[derive(Debug)]
pub(crate) struct Slot {
    pub id: WorkerId,
    pub core: Option<usize>,
    pub child: Option<Child>,
    pub state: SlotState,
    pub restarts: u32,
    /// Respawns in a row of workers that died young (see [`restart_streak`]).
    pub streak: u32,
    pub started: Instant,
    /// Last heartbeat value seen and when it last changed.
    pub beat: (u64, Instant),
}

impl Slot {
    pub fn new(id: WorkerId, core: Option<usize>) -> Self {
        Self {
            id,
            core,
            child: None,
            state: SlotState::Dead,
            restarts: 0,
            streak: 0,
            started: Instant::now(),
            beat: (0, Instant::now()),
        }
    }

    pub fn info(&self) -> WorkerInfo {
        WorkerInfo {
            id: self.id,
            pid: self.child.as_ref().map(Child::id),
            core: self.core,
            state: self.state,
            restarts: self.restarts,
        }
    }

    /// Starts a process for this slot. The exchange slot must have been reset and the
    /// slot's old store leases released.
    pub fn spawn(
        &mut self,
        launch: &Launch,
        ex: &Exchange,
        store: &HostStore,
        stats: &StatsSegment,
    ) -> Result<(), CpuLoraError> {
        let mut cmd = Command::new(&launch.program);
        cmd.args(&launch.leading_args)
            .arg("--worker-id")
            .arg(self.id.0.to_string())
            .arg("--reader-slot")
            .arg((self.id.0 + 1).to_string())
            .arg("--wait")
            .arg(launch.wait.as_arg())
            .arg("--heartbeat-ms")
            .arg(launch.heartbeat.as_millis().max(1).to_string())
            .args(["--exchange-fd-env", EXCHANGE_FD_ENV])
            .args(["--store-fd-env", STORE_FD_ENV])
            .args(["--stats-fd-env", STATS_FD_ENV]);
        if let Some(core) = self.core {
            cmd.arg("--core").arg(core.to_string());
        }
        cmd.envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        ex.segment().inherit_into(&mut cmd, EXCHANGE_FD_ENV);
        store.segment().inherit_into(&mut cmd, STORE_FD_ENV);
        stats.segment().inherit_into(&mut cmd, STATS_FD_ENV);
        crate::sys::die_with_parent(&mut cmd);
        let child = cmd.spawn().map_err(|source| CpuLoraError::Spawn {
            worker: self.id,
            source,
        })?;
        self.child = Some(child);
        self.state = SlotState::Starting;
        self.started = Instant::now();
        self.beat = (0, Instant::now());
        Ok(())
    }

    /// Reaps the process if it exited; returns its status as text.
    pub fn exited(&mut self) -> Option<String> {
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => {
                self.child = None;
                self.state = SlotState::Dead;
                Some(status.to_string())
            }
            Ok(None) => None,
            Err(e) => {
                // ECHILD: someone else reaped it; it is gone either way.
                self.child = None;
                self.state = SlotState::Dead;
                Some(e.to_string())
            }
        }
    }

    /// SIGKILLs and reaps the process, if any.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if self.state != SlotState::Disabled {
            self.state = SlotState::Dead;
        }
    }

    /// Promotes Starting → Ready once the process wrote its pid into its exchange slot.
    pub fn check_attached(&mut self, ex: &Exchange) {
        if self.state != SlotState::Starting {
            return;
        }
        let pid = ex.worker_status(self.id).map(|s| s.pid).unwrap_or(0);
        if self.child.as_ref().is_some_and(|c| c.id() == pid) {
            self.state = SlotState::Ready;
            self.beat = (0, Instant::now());
        }
    }

    /// Starts the heartbeat clock over (the slot is about to be waited on).
    pub fn rebase_heartbeat(&mut self, ex: &Exchange) {
        let hb = ex.worker_status(self.id).map(|s| s.heartbeat).unwrap_or(0);
        self.beat = (hb, Instant::now());
    }

    /// How long the heartbeat has not moved.
    pub fn heartbeat_age(&mut self, ex: &Exchange, now: Instant) -> Duration {
        let hb = ex.worker_status(self.id).map(|s| s.heartbeat).unwrap_or(0);
        if hb != self.beat.0 {
            self.beat = (hb, now);
        }
        now.saturating_duration_since(self.beat.1)
    }
}

/// Whether a slot whose worker died after `uptime` may be respawned, with `streak` workers in
/// a row behind it that died within `stable_after`; and the streak after this respawn
/// (`None`: a crash loop, leave the slot disabled). A worker that lived `stable_after` or
/// longer was healthy: it is always replaced and the streak starts over.
pub(crate) fn restart_streak(
    streak: u32,
    uptime: Duration,
    stable_after: Duration,
    max_restarts: u32,
) -> Option<u32> {
    if uptime >= stable_after {
        Some(0)
    } else {
        (streak < max_restarts).then_some(streak + 1)
    }
}

/// Asks every worker to exit (already done by the caller through the exchange), waits up
/// to `grace` for them, then SIGKILLs and reaps the rest.
pub(crate) fn reap_all(slots: &mut [Slot], grace: Duration) {
    let until = Instant::now() + grace;
    while slots.iter_mut().any(|s| {
        s.exited();
        s.child.is_some()
    }) && Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    for s in slots.iter_mut() {
        s.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::restart_streak;
    use proptest::prelude::*;
    use std::time::Duration;

    const STABLE: Duration = Duration::from_secs(60);

    #[test]
    fn crash_loop_is_bounded_but_healthy_workers_always_come_back() {
        // Dying young: allowed max_restarts times in a row, then refused.
        let mut streak = 0;
        for _ in 0..3 {
            streak = restart_streak(streak, Duration::from_secs(1), STABLE, 3).unwrap();
        }
        assert_eq!(
            restart_streak(streak, Duration::from_secs(1), STABLE, 3),
            None
        );
        // A worker that ran a minute is replaced and resets it, however many deaths came
        // before; then three more young deaths are allowed again.
        assert_eq!(restart_streak(streak, STABLE, STABLE, 3), Some(0));
        assert_eq!(restart_streak(0, Duration::ZERO, STABLE, 0), None);
        assert_eq!(restart_streak(0, STABLE, STABLE, 0), Some(0));
    }

    proptest! {
        /// Over any history of deaths, a refusal only comes after more than max_restarts
        /// short-lived workers in a row, and a long-lived worker is always respawned.
        #[test]
        fn refuses_only_after_a_run_of_short_lives(
            uptimes in proptest::collection::vec(0u64..120, 0..64),
            max in 0u32..6,
        ) {
            let mut streak = 0;
            let mut young_run = 0u32;
            for up in uptimes {
                let uptime = Duration::from_secs(up);
                young_run = if uptime >= STABLE { 0 } else { young_run + 1 };
                match restart_streak(streak, uptime, STABLE, max) {
                    Some(s) => {
                        prop_assert!(s <= max);
                        streak = s;
                    }
                    None => {
                        prop_assert!(uptime < STABLE);
                        prop_assert!(young_run > max, "{young_run} young deaths, max {max}");
                        break;
                    }
                }
            }
        }
    }
}
