//! Keeping host work proportional to an adapter's bytes away from the engine thread: the
//! pipeline's (and the disk loader's) threads run at a lower scheduling priority, so on a
//! machine short of cores they yield to the engine thread rather than stretch a step; and the
//! last reference to a large host copy is dropped, and the workers' host store is filled
//! ([`super::store_fill`]), on one background thread, since unmapping or copying tens of
//! megabytes costs the thread that does it.
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

/// Nice value of background host threads (loader, copy, background): below the engine thread's.
pub const BACKGROUND_NICE: i32 = 10;

/// How the threads that move adapter bytes (upload loaders, the copy thread, the background
/// thread, the disk loader) are scheduled against the engine thread. Nice 10 by default:
/// `SCHED_IDLE` starved the loads on a host whose cores other processes keep busy (rank 512:
/// 47–48 of 48 loads unfinished, against none at nice 10, `benches/results/upload-stall.md`
/// 2026-11-27 h27tpot), and where a core is spare the policy changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteThreadSched {
    /// The normal policy at this nice value ([`BACKGROUND_NICE`]: CFS weight 110 against the
    /// engine thread's 1024, so a shared core gives it ~10%).
    Nice(i32),
    /// `SCHED_IDLE` (weight 3): runs only on a core nothing else wants.
    Idle,
}

impl ByteThreadSched {
    /// The policy `THAW_BACKGROUND_SCHED` names (`idle`, `nice`, or a nice value `0`–`19`),
    /// else `default`.
    pub fn from_setting(setting: Option<&str>, default: Self) -> Self {
        match setting.map(str::trim) {
            Some("idle") => Self::Idle,
            Some("nice") => Self::Nice(BACKGROUND_NICE),
            Some(v) => v
                .parse::<i32>()
                .ok()
                .filter(|n| (0..=19).contains(n))
                .map_or(default, Self::Nice),
            None => default,
        }
    }
}

/// The policy of this process's byte-moving threads (`THAW_BACKGROUND_SCHED`, read once).
pub fn byte_thread_sched() -> ByteThreadSched {
    static SCHED: OnceLock<ByteThreadSched> = OnceLock::new();
    *SCHED.get_or_init(|| {
        ByteThreadSched::from_setting(
            std::env::var("THAW_BACKGROUND_SCHED").ok().as_deref(),
            ByteThreadSched::Nice(BACKGROUND_NICE),
        )
    })
}

/// Lowers the calling thread's scheduling priority per [`byte_thread_sched`] (Linux: nice and
/// the policy are per thread). Best effort: a failure leaves the priority as it was.
pub fn lower_current_thread_priority() {
    #[cfg(target_os = "linux")]
    match byte_thread_sched() {
        ByteThreadSched::Nice(nice) => {
            // SAFETY: gettid has no preconditions and returns the caller's thread id.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
            // SAFETY: setpriority only reads its integer arguments; PRIO_PROCESS with a thread
            // id changes that one thread's nice value on Linux.
            let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) };
        }
        ByteThreadSched::Idle => {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param that lives
            // across the call (SCHED_IDLE requires priority 0), and the call only reads it.
            let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

fn background() -> Option<Sender<Job>> {
    static TX: OnceLock<Option<Mutex<Sender<Job>>>> = OnceLock::new();
    let tx = TX.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        let spawned = std::thread::Builder::new()
            .name("thaw-background".into())
            .spawn(move || {
                lower_current_thread_priority();
                for job in rx {
                    job();
                }
            });
        spawned.ok().map(|_| Mutex::new(tx))
    });
    tx.as_ref()
        .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).clone())
}

/// Runs `f` on the background thread, after the jobs queued before it (inline if the thread
/// cannot be started). For host work proportional to an adapter's bytes that the engine
/// thread must not do: freeing a large copy, filling the workers' host store.
pub fn run_later(f: impl FnOnce() + Send + 'static) {
    match background() {
        Some(tx) => {
            if let Err(e) = tx.send(Box::new(f)) {
                (e.0)();
            }
        }
        None => f(),
    }
}

/// Drops `v` on the background thread (inline if it cannot be started).
pub fn drop_later<T: Send + 'static>(v: T) {
    run_later(move || drop(v));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    struct Flag(Arc<AtomicBool>, std::thread::ThreadId);

    impl Drop for Flag {
        fn drop(&mut self) {
            // Dropped on another thread than the one that handed it over.
            assert_ne!(std::thread::current().id(), self.1);
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_setting_names_the_policy_and_anything_else_keeps_the_default() {
        let d = ByteThreadSched::Nice(BACKGROUND_NICE);
        let from = |s| ByteThreadSched::from_setting(s, ByteThreadSched::Idle);
        assert_eq!(from(Some("idle")), ByteThreadSched::Idle);
        assert_eq!(from(Some(" nice ")), d);
        assert_eq!(from(Some("19")), ByteThreadSched::Nice(19));
        assert_eq!(from(Some("0")), ByteThreadSched::Nice(0));
        for bad in ["-5", "20", "fast", ""] {
            assert_eq!(from(Some(bad)), ByteThreadSched::Idle, "{bad}");
        }
        assert_eq!(ByteThreadSched::from_setting(None, d), d);
    }

    #[test]
    fn values_are_dropped_on_the_background_thread() {
        let done = Arc::new(AtomicBool::new(false));
        drop_later(Flag(done.clone(), std::thread::current().id()));
        let t = std::time::Instant::now();
        while !done.load(Ordering::SeqCst) {
            assert!(t.elapsed().as_secs() < 60, "never dropped");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}
