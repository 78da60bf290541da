//! Waiting on a word in shared memory: the two strategies behind one interface.
//!
//! * [`WaitStrategy::Spin`] — poll the word (with `spin_loop` hints, yielding the core now
//!   and then) until it is ready or the deadline passes. Lowest latency, burns a core.
//! * [`WaitStrategy::SpinThenFutex`] — poll a bounded number of times, then park in a
//!   process-shared futex (no `FUTEX_PRIVATE_FLAG`, so wakes cross processes). While the
//!   doorbell's *armed* word is set the waiter keeps spinning instead of parking: a GPU can
//!   store a sequence word but cannot wake a futex.
//!
//! The parking protocol (Dekker-style, all `SeqCst`): a waiter increments `sleepers`, loads
//! the futex word, re-checks its condition (and `armed`) and only then sleeps on the value it
//! loaded. A notifier changes the state, bumps/stores the futex word and wakes only if
//! `sleepers > 0`. Either the waiter sees the new state, or the notifier sees the sleeper, or
//! the futex word no longer matches — no wake is lost, and an idle ring costs no syscall.

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::time::{Duration, Instant};

use crate::sys::{self, FutexWait};

/// How a waiter waits. Both strategies pass the same conformance suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStrategy {
    /// Poll until ready; every `yield_every` polls, yield the core to the scheduler.
    Spin {
        /// Polls between `sched_yield`s (0 = never yield).
        yield_every: u32,
    },
    /// Poll `spins` times, then sleep in a futex (unless the doorbell is armed).
    SpinThenFutex {
        /// Polls before parking.
        spins: u32,
        /// Longest single sleep: a safety net that bounds the delay if a sequence word was
        /// ever written without a wake (e.g. a device write while not armed).
        sleep_cap: Duration,
    },
}

impl WaitStrategy {
    /// Pure spinning with an occasional yield.
    pub const fn spin() -> Self {
        WaitStrategy::Spin { yield_every: 4096 }
    }

    /// Spin ~20 µs worth of polls, then futex (100 ms sleep cap).
    pub const fn spin_then_futex() -> Self {
        WaitStrategy::SpinThenFutex {
            spins: 2000,
            sleep_cap: Duration::from_millis(100),
        }
    }

    /// Whether an unarmed waiter with this strategy sleeps instead of burning its core.
    pub fn parks(&self) -> bool {
        matches!(self, WaitStrategy::SpinThenFutex { .. })
    }
}

impl Default for WaitStrategy {
    fn default() -> Self {
        Self::spin_then_futex()
    }
}

/// Where a waiter parks: the futex word, the count of parked waiters the notifier checks,
/// and optionally the armed word that forbids parking.
pub(crate) struct Park<'a> {
    pub word: &'a AtomicU32,
    pub sleepers: &'a AtomicU32,
    pub armed: Option<&'a AtomicU32>,
}

impl Park<'_> {
    fn armed(&self) -> bool {
        self.armed.is_some_and(|a| a.load(SeqCst) != 0)
    }
}

/// Polls between `sched_yield`s of an armed spin (a few microseconds of spinning).
const ARMED_YIELD_EVERY: u32 = 128;

/// Waits until `ready` returns `Some`, or `deadline` passes (`None`).
pub(crate) fn wait_until<T>(
    strategy: WaitStrategy,
    park: &Park<'_>,
    deadline: Option<Instant>,
    mut ready: impl FnMut() -> Option<T>,
) -> Option<T> {
    let mut polls: u32 = 0;
    loop {
        if let Some(t) = ready() {
            return Some(t);
        }
        polls = polls.wrapping_add(1);
        if polls.is_multiple_of(64) && deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        match strategy {
            WaitStrategy::Spin { yield_every } => {
                if yield_every != 0 && polls.is_multiple_of(yield_every) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            WaitStrategy::SpinThenFutex { spins, sleep_cap } => {
                if polls < spins {
                    std::hint::spin_loop();
                    continue;
                }
                if park.armed() {
                    // Armed: keep spinning (no futex round trip per job), but let a thread
                    // that shares this core (a loader, the copy engine) run now and then.
                    if polls.is_multiple_of(ARMED_YIELD_EVERY) {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                    continue;
                }
                let timeout = match deadline {
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return ready();
                        }
                        left.min(sleep_cap)
                    }
                    None => sleep_cap,
                };
                park.sleepers.fetch_add(1, SeqCst);
                let observed = park.word.load(SeqCst);
                let outcome = if park.armed() {
                    None
                } else if let Some(t) = ready() {
                    park.sleepers.fetch_sub(1, SeqCst);
                    return Some(t);
                } else {
                    Some(sys::futex_wait(park.word, observed, Some(timeout)))
                };
                park.sleepers.fetch_sub(1, SeqCst);
                // After a wake the condition is probably true: check it without spinning
                // again; after a timeout or an arm, fall through to the normal loop.
                polls = match outcome {
                    Some(FutexWait::Woken | FutexWait::Changed) => spins,
                    _ => 0,
                };
            }
        }
    }
}

/// Bumps the futex word `word` and wakes every parked waiter, if any.
pub(crate) fn ring(word: &AtomicU32, sleepers: &AtomicU32) {
    word.fetch_add(1, SeqCst);
    if sleepers.load(SeqCst) > 0 {
        sys::futex_wake(word, u32::MAX);
    }
}

/// Stores `value` into the futex word `word` and wakes every parked waiter, if any.
pub(crate) fn store_and_wake(word: &AtomicU32, value: u32, sleepers: &AtomicU32) {
    word.store(value, SeqCst);
    if sleepers.load(SeqCst) > 0 {
        sys::futex_wake(word, u32::MAX);
    }
}
