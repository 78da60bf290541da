//! Pacing host work that is proportional to an adapter's bytes against the steps that run on
//! the same host (issue 27: running requests' TPOT must not move while cold adapters load).
//!
//! On the CPU backend the "device" is the host: the engine's forward and the upload pipeline's
//! loader (heap → arena), the host-store fill (heap → store) share two cores' caches and memory
//! bandwidth, and a memcpy running beside a decode step slows it (`benches/results/
//! upload-stall.md`: +11–13% at rank 512 with the copies unpaced). So a CPU engine marks its
//! steps ([`host_step`]), and the paced threads, after each chunk of work (one factor, ≤ a few
//! MB), wait while a step runs until their work is at most [`Pace::share`] of the wall time:
//! byte work proceeds freely between steps and at a bounded duty cycle during them, so a load
//! still finishes, within `work / share` while steps run back to back. A CUDA engine marks no
//! steps (the GPU computes from its own memory; a host copy does not slow it), so its loads are
//! never paced.
//!
//! The decision is [`Pace`]'s, a pure function of the time the paced threads owe and whether a
//! step runs; the threads share one debt, so the share bounds their work together. So that
//! loads still finish when they come faster than the base share drains them, the upload
//! pipeline publishes the work queued ahead ([`publish_backlog`]) and the share rises until
//! that backlog would be done within [`PACED_DEADLINE`] ([`Pace::for_backlog`]).
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The share of a running step's wall time that paced host work may take, unless
/// `THAW_UPLOAD_BUSY_SHARE` says otherwise (e.g. `0.1` to pace, for A/B runs). Off (1) by
/// default: on the quiet 2-core VM a 0.1 share made loads 3–14× slower without reliably
/// lowering the running TPOT (`benches/results/upload-stall.md`, 2026-11-27 session 17).
pub const DEFAULT_BUSY_SHARE: f64 = 1.0;

/// The lowest share accepted: a load never takes more than 1 / this times its work.
pub const MIN_BUSY_SHARE: f64 = 0.02;

/// The longest the work queued ahead of a load is meant to take while steps run back to back:
/// above `share × PACED_DEADLINE` of queued work the share rises ([`Pace::for_backlog`]).
pub const PACED_DEADLINE: Duration = Duration::from_millis(250);

/// The longest single wait: a paced thread re-checks whether a step still runs this often.
pub const MAX_WAIT: Duration = Duration::from_millis(2);

/// Steps running now on this host (CPU-backend engines inside a step's forward).
static STEPS: AtomicUsize = AtomicUsize::new(0);

/// A step running on the host, for as long as it lives ([`host_step`]).
#[derive(Debug)]
pub struct HostStep(());

impl Drop for HostStep {
    fn drop(&mut self) {
        STEPS.fetch_sub(1, Ordering::Release);
    }
}

/// Marks a step running on this host until the guard is dropped: paced threads then keep to
/// their share.
pub fn host_step() -> HostStep {
    STEPS.fetch_add(1, Ordering::AcqRel);
    HostStep(())
}

/// Whether a step runs on this host now.
pub fn host_step_running() -> bool {
    STEPS.load(Ordering::Acquire) > 0
}

/// The pacing decision over the time the paced threads owe, kept as the instant from which they
/// may work again (`free_at`, a duration since any fixed epoch).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pace {
    /// Share of wall time paced work may take while a step runs, in [`MIN_BUSY_SHARE`], 1].
    share: f64,
}

impl Pace {
    /// `share` clamped to [[`MIN_BUSY_SHARE`], 1]; NaN is taken as 1 (unpaced).
    pub fn new(share: f64) -> Self {
        let share = if share.is_nan() { 1.0 } else { share };
        Self {
            share: share.clamp(MIN_BUSY_SHARE, 1.0),
        }
    }

    pub fn share(self) -> f64 {
        self.share
    }

    /// The pace with `backlog` of paced work queued: this share, or more if needed to finish the
    /// backlog within `deadline` while steps run throughout (`backlog / deadline`), at most 1.
    pub fn for_backlog(self, backlog: Duration, deadline: Duration) -> Self {
        let need = backlog.as_secs_f64() / deadline.as_secs_f64().max(1e-9);
        Self::new(self.share.max(need))
    }

    /// After `work` of paced work ending at `now`: when paced work may run again. Work done while
    /// no step runs owes nothing (and forgives what was owed: no step is slowed by it); work
    /// during a step owes `work · (1 − share) / share` of wall time without paced work.
    pub fn charge(
        self,
        free_at: Duration,
        now: Duration,
        work: Duration,
        running: bool,
    ) -> Duration {
        if !running || self.share >= 1.0 {
            return now;
        }
        free_at.max(now) + work.mul_f64((1.0 - self.share) / self.share)
    }

    /// How long to wait at `now` before the next chunk: `None` to go on. At most `MAX_WAIT`,
    /// so a step that ends meanwhile releases the thread within that.
    pub fn wait(self, free_at: Duration, now: Duration, running: bool) -> Option<Duration> {
        (running && free_at > now).then(|| (free_at - now).min(MAX_WAIT))
    }
}

/// The pace every paced thread of this process keeps (`THAW_UPLOAD_BUSY_SHARE`, read once).
pub fn busy_pace() -> Pace {
    static PACE: OnceLock<Pace> = OnceLock::new();
    *PACE.get_or_init(|| {
        let share = std::env::var("THAW_UPLOAD_BUSY_SHARE")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(DEFAULT_BUSY_SHARE);
        Pace::new(share)
    })
}

/// The paced work queued now, in nanoseconds, as the upload pipeline last published it.
static BACKLOG_NS: AtomicU64 = AtomicU64::new(0);

/// Publishes the paced work queued now (the upload pipeline's bytes not yet encoded, at its
/// measured rate): [`after_chunk`] raises the share to drain it within [`PACED_DEADLINE`].
pub fn publish_backlog(backlog: Duration) {
    BACKLOG_NS.store(backlog.as_nanos() as u64, Ordering::Relaxed);
}

/// The shared debt: from when paced work may run again, as time since [`epoch`].
static FREE_AT: Mutex<Duration> = Mutex::new(Duration::ZERO);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn since_epoch() -> Duration {
    epoch().elapsed()
}

/// Called by a paced thread after a chunk of `work`: charges it and waits, per [`busy_pace`],
/// until paced work may go on (at once when no step runs). Returns the time waited.
pub fn after_chunk(work: Duration) -> Duration {
    let backlog = Duration::from_nanos(BACKLOG_NS.load(Ordering::Relaxed));
    let pace = busy_pace().for_backlog(backlog, PACED_DEADLINE);
    if pace.share() >= 1.0 {
        return Duration::ZERO;
    }
    let _ = epoch();
    let lock = || FREE_AT.lock().unwrap_or_else(|e| e.into_inner());
    {
        let mut free_at = lock();
        *free_at = pace.charge(*free_at, since_epoch(), work, host_step_running());
    }
    let start = Instant::now();
    loop {
        let free_at = *lock();
        match pace.wait(free_at, since_epoch(), host_step_running()) {
            Some(d) => std::thread::sleep(d),
            None => return start.elapsed(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn us(v: u64) -> Duration {
        Duration::from_micros(v)
    }

    /// Runs chunks of `works` through the decision with steps running per `running`, waiting in
    /// the slices it asks for (a simulated clock); returns (work, waited, wall) while steps ran.
    fn simulate(pace: Pace, chunks: &[(u64, bool)]) -> (Duration, Duration, Duration) {
        let (mut now, mut free_at) = (Duration::ZERO, Duration::ZERO);
        let (mut work_busy, mut waited) = (Duration::ZERO, Duration::ZERO);
        for &(w, running) in chunks {
            now += us(w);
            if running {
                work_busy += us(w);
            }
            free_at = pace.charge(free_at, now, us(w), running);
            while let Some(d) = pace.wait(free_at, now, running) {
                assert!(d <= MAX_WAIT && d > Duration::ZERO);
                now += d;
                waited += d;
            }
        }
        (work_busy, waited, now)
    }

    proptest! {
        /// While steps run throughout, paced work takes at most its share of the wall time, and
        /// waits no longer than that share requires: a load of W of work ends within W / share.
        #[test]
        fn work_keeps_to_its_share_while_steps_run(
            share in 0.0f64..1.5,
            works in proptest::collection::vec(1u64..5_000, 1..60),
        ) {
            let pace = Pace::new(share);
            let s = pace.share();
            let chunks: Vec<(u64, bool)> = works.iter().map(|&w| (w, true)).collect();
            let (work, waited, wall) = simulate(pace, &chunks);
            prop_assert_eq!(wall, work + waited);
            // Waits are whole nanoseconds: each chunk's may fall short of the exact share by
            // under 1 ns (24 µs of work at share 0.56 went 3e-6 over without this slack).
            let slack = chunks.len() as f64 * 1e-9;
            let duty = work.as_secs_f64() / (wall.as_secs_f64() + slack);
            prop_assert!(duty <= s + 1e-9, "duty {duty} over share {s}");
            prop_assert!(wall.as_secs_f64() <= work.as_secs_f64() / s + 1e-6);
        }

        /// Work while no step runs never waits, and leaves nothing owed to the next step.
        #[test]
        fn work_between_steps_never_waits(
            share in 0.0f64..1.0,
            works in proptest::collection::vec((1u64..5_000, any::<bool>()), 1..60),
        ) {
            let pace = Pace::new(share);
            let (mut now, mut free_at) = (Duration::ZERO, Duration::ZERO);
            for (w, running) in works {
                now += us(w);
                free_at = pace.charge(free_at, now, us(w), running);
                if !running {
                    prop_assert_eq!(free_at, now);
                    prop_assert_eq!(pace.wait(free_at, now, false), None);
                }
                // Whatever is owed, an idle host lets the work go.
                prop_assert_eq!(pace.wait(free_at, now, false), None);
                while let Some(d) = pace.wait(free_at, now, running) {
                    now += d;
                }
            }
        }

        /// A backlog raises the share to at least what drains it within the deadline (so a load
        /// queued behind it finishes), never lowers it, and never past 1.
        #[test]
        fn a_backlog_raises_the_share_to_drain_it(
            share in 0.0f64..1.0,
            backlog_ms in 0u64..2_000,
            more_ms in 0u64..500,
        ) {
            let base = Pace::new(share);
            let deadline = PACED_DEADLINE;
            let p = base.for_backlog(Duration::from_millis(backlog_ms), deadline);
            prop_assert!(p.share() >= base.share() && p.share() <= 1.0);
            let drained = backlog_ms as f64 / 1e3 / p.share();
            prop_assert!(p.share() >= 1.0 || drained <= deadline.as_secs_f64() + 1e-9);
            let q = base.for_backlog(Duration::from_millis(backlog_ms + more_ms), deadline);
            prop_assert!(q.share() >= p.share());
        }

        /// The share is always within [MIN_BUSY_SHARE, 1]; at 1 nothing ever waits.
        #[test]
        fn share_is_clamped_and_one_is_unpaced(share in -2.0f64..3.0, w in 1u64..10_000) {
            let pace = Pace::new(share);
            prop_assert!((MIN_BUSY_SHARE..=1.0).contains(&pace.share()));
            let unpaced = Pace::new(1.0);
            let at = unpaced.charge(Duration::ZERO, us(w), us(w), true);
            prop_assert_eq!(unpaced.wait(at, us(w), true), None);
        }
    }

    #[test]
    fn host_steps_count_while_their_guards_live() {
        // Other tests may mark steps concurrently; this one's guards are counted on top.
        let a = host_step();
        assert!(host_step_running());
        let b = host_step();
        drop(a);
        assert!(host_step_running());
        drop(b);
        assert!(Pace::new(f64::NAN).share() == 1.0);
    }
}
