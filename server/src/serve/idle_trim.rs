//! Gives freed heap back to the OS when the server goes idle. glibc keeps freed memory in its
//! per-thread arenas; after a burst of requests (many tokio and blocking-pool threads
//! allocating at once) RSS stays at the burst's peak though nothing is live. Once the engine
//! has run steps and then sits with nothing running or waiting for two checks in a row,
//! `malloc_trim(0)` returns the free pages of every arena.
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::http::AppState;

/// How often idleness is checked.
const PERIOD: Duration = Duration::from_secs(1);

/// What the trimmer last saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// Engine steps at the last trim.
    pub trimmed_at_steps: u64,
    /// Consecutive idle checks since the last step.
    pub idle_checks: u32,
    pub last_steps: u64,
}

/// One check: the new state and whether to trim now. Trims once per idle period, after work.
pub fn decide(seen: Seen, steps: u64, busy: bool) -> (Seen, bool) {
    let idle_checks = if busy || steps != seen.last_steps {
        0
    } else {
        seen.idle_checks.saturating_add(1)
    };
    let trim = idle_checks >= 2 && steps != seen.trimmed_at_steps;
    let next = Seen {
        trimmed_at_steps: if trim { steps } else { seen.trimmed_at_steps },
        idle_checks,
        last_steps: steps,
    };
    (next, trim)
}

/// Releases free heap pages to the OS.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own arenas under their locks and takes no
    // pointers from us; it is documented as safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// glibc arenas `thaw serve` allows unless `MALLOC_ARENA_MAX` says otherwise. glibc's default
/// (8 per core) lets each of tokio's and the blocking pool's threads grow its own arena, and the
/// free memory left inside them after a burst is what kept idle RSS 11% above its warm value in
/// a 30-minute soak while the live heap stayed flat (benches/results/soak-30min.md); two
/// arenas halved that held-but-free memory and kept RSS flat.
pub const ARENA_MAX: usize = 2;

/// Allocations of at least this many bytes get their own mapping, returned to the OS when
/// freed, unless `MALLOC_MMAP_THRESHOLD_` says otherwise. glibc's threshold starts at the same
/// 128 KiB but rises to the size of every mapped block freed (up to 32 MiB), after which request
/// bodies, token buffers and per-request vectors of a burst land inside the arenas, and the
/// holes they leave between long-lived blocks stay resident after `malloc_trim`: a 3-minute
/// soak at 3× the sustainable rate ended 15 MiB above its start at idle with glibc's
/// sliding threshold, 4.5 MiB with it fixed (benches/results/soak-30min.md).
pub const MMAP_THRESHOLD: usize = 128 * 1024;

/// A tunable to set: none when the operator set glibc's own variable for it (glibc reads
/// it itself; `MALLOC_ARENA_MAX=0` asks for glibc's default), else our value.
pub fn tunable(env_value: Option<&str>, ours: usize) -> Option<usize> {
    match env_value {
        Some(_) => None,
        None => Some(ours),
    }
}

/// Caps glibc's arenas ([`ARENA_MAX`]) and fixes its mmap threshold ([`MMAP_THRESHOLD`]);
/// call before the runtime starts its threads.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    for (var, param, ours) in [
        ("MALLOC_ARENA_MAX", libc::M_ARENA_MAX, ARENA_MAX),
        (
            "MALLOC_MMAP_THRESHOLD_",
            libc::M_MMAP_THRESHOLD,
            MMAP_THRESHOLD,
        ),
    ] {
        if let Some(value) = tunable(std::env::var(var).ok().as_deref(), ours) {
            // SAFETY: mallopt only sets a glibc tunable under glibc's own lock and takes no
            // pointers; a lower arena cap affects only arenas created later, and a fixed mmap
            // threshold only where later allocations are placed, never memory handed out.
            unsafe {
                libc::mallopt(param, value as libc::c_int);
            }
        }
    }
}

/// What the allocator holds: bytes in live allocations, and bytes taken from the OS (the
/// difference is free memory inside the arenas: fragmentation, or pages not yet trimmed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeapStats {
    pub allocated: u64,
    pub held: u64,
}

/// glibc's totals over every arena (`mallinfo2`); None with another allocator.
pub fn heap_stats() -> Option<HeapStats> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes each arena's lock while it sums that arena and returns a
        // plain struct by value; it touches no memory of ours.
        let m = unsafe { libc::mallinfo2() };
        Some(HeapStats {
            allocated: (m.uordblks + m.hblkhd) as u64,
            held: (m.arena + m.hblkhd) as u64,
        })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}

/// Runs until the runtime shuts down.
pub fn spawn(state: Arc<AppState>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut seen = Seen::default();
        loop {
            tokio::time::sleep(PERIOD).await;
            let s = &state.engine.stats;
            let busy = s.running.load(Ordering::Relaxed) + s.waiting.load(Ordering::Relaxed) > 0;
            let (next, now) = decide(seen, s.steps.load(Ordering::Relaxed), busy);
            seen = next;
            if now {
                let _ = tokio::task::spawn_blocking(trim).await;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn trims_once_after_work_then_idle() {
        let mut seen = Seen::default();
        let mut trims = Vec::new();
        // (steps, busy) per check: idle at start, a burst, idle, idle, idle, more work, idle.
        let checks = [
            (0, false),
            (0, false),
            (0, false),
            (5, true),
            (9, false),
            (9, false),
            (9, false),
            (9, false),
            (12, true),
            (12, false),
            (12, false),
        ];
        for (i, &(steps, busy)) in checks.iter().enumerate() {
            let (n, t) = decide(seen, steps, busy);
            seen = n;
            if t {
                trims.push(i);
            }
        }
        assert_eq!(trims, vec![6, 10]);
    }

    #[test]
    fn tunables_yield_to_the_operator() {
        assert_eq!(tunable(None, ARENA_MAX), Some(ARENA_MAX));
        assert_eq!(tunable(Some("4"), ARENA_MAX), None);
        assert_eq!(tunable(Some("0"), ARENA_MAX), None);
        assert_eq!(tunable(None, MMAP_THRESHOLD), Some(128 * 1024));
        assert_eq!(tunable(Some("65536"), MMAP_THRESHOLD), None);
    }

    #[test]
    fn heap_stats_see_a_live_allocation() {
        if heap_stats().is_none() {
            return;
        }
        let big = vec![1u8; 64 << 20];
        let during = heap_stats().unwrap();
        // Live now, whatever other tests free meanwhile.
        assert!(during.allocated >= 64 << 20, "{during:?}");
        assert!(during.held >= during.allocated, "{during:?}");
        drop(big);
    }

    proptest! {
        /// Never trims while busy, and never twice without steps in between.
        #[test]
        fn never_while_busy_nor_twice_per_idle(checks in proptest::collection::vec((0u64..4, any::<bool>()), 0..64)) {
            let mut seen = Seen::default();
            let mut steps = 0;
            let mut trimmed_at = None;
            for (d, busy) in checks {
                steps += d;
                let (n, t) = decide(seen, steps, busy);
                seen = n;
                if t {
                    prop_assert!(!busy);
                    prop_assert_ne!(trimmed_at, Some(steps));
                    trimmed_at = Some(steps);
                }
            }
        }
    }
}
