//! Where the engine thread's time goes, by cause: the forward step, adapter work (registering,
//! evicting, taking finished disk reads), scheduling (everything else the loop does between
//! steps) and idle (waiting for a command or a read). A stall behind host work on the engine
//! thread shows up as adapter time on any backend; with the upload pipeline that time is
//! O(layers) per adapter, not O(bytes).
//!
//! `/metrics` exports the totals as `thaw_engine_time_seconds_total{cause}`; the step log
//! carries each step's share (`engine_time`, since the previous step line).
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// What the engine thread is doing.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    /// Running a step's forward pass (and sampling).
    Forward,
    /// Adapter work: evictions, registrations, finished disk reads.
    Adapter,
    /// Admission, planning, publishing, answering commands.
    Schedule,
    /// Waiting for a command, a disk read or a landed layer.
    Idle,
}

impl Cause {
    pub const ALL: [Self; 4] = [Self::Forward, Self::Adapter, Self::Schedule, Self::Idle];

    /// The `cause` label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Adapter => "adapter",
            Self::Schedule => "schedule",
            Self::Idle => "idle",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Seconds by cause, as one step line of the log reports them.
#[derive(Copy, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CauseTimes {
    pub forward_s: f64,
    pub adapter_s: f64,
    pub schedule_s: f64,
    pub idle_s: f64,
}

impl CauseTimes {
    fn from_ns(ns: [u64; 4]) -> Self {
        let s = |c: Cause| ns[c.index()] as f64 * 1e-9;
        Self {
            forward_s: s(Cause::Forward),
            adapter_s: s(Cause::Adapter),
            schedule_s: s(Cause::Schedule),
            idle_s: s(Cause::Idle),
        }
    }

    pub fn get(&self, c: Cause) -> f64 {
        match c {
            Cause::Forward => self.forward_s,
            Cause::Adapter => self.adapter_s,
            Cause::Schedule => self.schedule_s,
            Cause::Idle => self.idle_s,
        }
    }
}

/// Totals since start, shared with `/metrics`.
#[derive(Debug, Default)]
pub struct EngineTime {
    ns: [AtomicU64; 4],
}

impl EngineTime {
    /// Seconds the engine thread spent on `c`.
    pub fn seconds(&self, c: Cause) -> f64 {
        self.ns[c.index()].load(Relaxed) as f64 * 1e-9
    }

    /// Every cause's seconds.
    pub fn snapshot(&self) -> CauseTimes {
        CauseTimes::from_ns(self.ns.each_ref().map(|n| n.load(Relaxed)))
    }
}

/// The engine thread's stopwatch: one cause runs at a time; [`Stopwatch::switch`] charges the
/// time since the last switch to the cause that was running. Charging is an `Instant::now()`
/// and an atomic add: cheap enough for every switch of every loop iteration.
#[derive(Debug)]
pub struct Stopwatch {
    cause: Cause,
    since: Instant,
    /// Nanoseconds by cause since the last [`Stopwatch::take_step`].
    step: [u64; 4],
}

impl Default for Stopwatch {
    fn default() -> Self {
        Self::new(Instant::now())
    }
}

impl Stopwatch {
    /// Starts scheduling at `now`.
    pub fn new(now: Instant) -> Self {
        Self {
            cause: Cause::Schedule,
            since: now,
            step: [0; 4],
        }
    }

    /// The cause running now.
    pub fn cause(&self) -> Cause {
        self.cause
    }

    /// Charges the time since the last switch to the running cause, then runs `to`; returns
    /// the cause that ran (to switch back to).
    pub fn switch(&mut self, to: Cause, totals: &EngineTime) -> Cause {
        self.switch_at(to, Instant::now(), totals)
    }

    /// [`Stopwatch::switch`] at a given instant (tests).
    pub fn switch_at(&mut self, to: Cause, now: Instant, totals: &EngineTime) -> Cause {
        let d = now.saturating_duration_since(self.since);
        self.charge(d, totals);
        self.since = now.max(self.since);
        std::mem::replace(&mut self.cause, to)
    }

    fn charge(&mut self, d: Duration, totals: &EngineTime) {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        let i = self.cause.index();
        self.step[i] += ns;
        totals.ns[i].fetch_add(ns, Relaxed);
    }

    /// The seconds by cause since the last call (charged up to the last switch), for the
    /// step log; starts the next period.
    pub fn take_step(&mut self) -> CauseTimes {
        CauseTimes::from_ns(std::mem::take(&mut self.step))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the switches, every nanosecond between the first and the last is charged
        /// to exactly one cause — the one running — in the totals and in the step periods.
        #[test]
        fn every_interval_is_charged_once_to_the_running_cause(
            switches in proptest::collection::vec((0usize..4, 0u64..5_000_000), 0..60),
            takes in proptest::collection::vec(any::<bool>(), 60),
        ) {
            let t0 = Instant::now();
            let totals = EngineTime::default();
            let mut sw = Stopwatch::new(t0);
            let mut want = [0u64; 4];
            let mut periods = [0f64; 4];
            let (mut at, mut running) = (t0, Cause::Schedule);
            for (k, ((c, dt), take)) in switches.iter().zip(&takes).enumerate() {
                at += Duration::from_nanos(*dt);
                want[running.index()] += dt;
                let to = Cause::ALL[*c];
                prop_assert_eq!(sw.switch_at(to, at, &totals), running, "switch {}", k);
                running = to;
                if *take {
                    let p = sw.take_step();
                    for c in Cause::ALL {
                        periods[c.index()] += p.get(c);
                    }
                }
            }
            let p = sw.take_step();
            for c in Cause::ALL {
                periods[c.index()] += p.get(c);
                let total = totals.seconds(c);
                prop_assert!((total - want[c.index()] as f64 * 1e-9).abs() < 1e-9, "{:?}", c);
                prop_assert!((periods[c.index()] - total).abs() < 1e-9, "{:?}", c);
            }
            prop_assert_eq!(sw.cause(), running);
        }
    }
}
