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

/// Lowers the calling thread's scheduling priority to [`BACKGROUND_NICE`] (Linux: nice is
/// per thread). Best effort: a failure leaves the priority as it was.
pub fn lower_current_thread_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid has no preconditions and returns the caller's thread id.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
        // SAFETY: setpriority only reads its integer arguments; PRIO_PROCESS with a thread id
        // changes that one thread's nice value on Linux.
        let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, BACKGROUND_NICE) };
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
