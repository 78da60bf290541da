//! A fork-join pool for the CPU backend's ops: `threads - 1` persistent helpers that spin
//! between ops and sleep when idle.
//!
//! A decode step runs ~250 small ops (seven products and one attention per layer, each a few
//! hundred microseconds on two threads). Waking a sleeping thread and waking the caller back
//! through a condition variable cost tens of microseconds each on a VM, a large share of
//! such an op; so, as llama.cpp does, the helpers spin on an epoch counter while ops keep
//! coming and the caller spins until they are done. After [`IDLE_SPIN`] without work (between
//! requests) or when the engine yields the cores to the CPU LoRA workers ([`Pool::park`]),
//! the helpers sleep on a condition variable and cost nothing.
//!
//! Job hand-off: the caller writes a pointer to a closure on its stack, bumps the epoch and
//! does not return (even when unwinding) before every helper has acknowledged that epoch, so
//! the closure outlives each use. All `unsafe` of the backend's threading is here.
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle helper spins for the next op before it sleeps.
const IDLE_SPIN: Duration = Duration::from_millis(2);

/// The job of one epoch: `f(part)` for parts `1..parts` (part 0 is the caller's).
type Job<'a> = &'a (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once per job (and once at shutdown).
    epoch: AtomicU64,
    /// Helpers that have not yet acknowledged the current epoch.
    pending: AtomicUsize,
    /// The current job, valid from the epoch bump until `pending` reaches 0.
    job: UnsafeCell<Option<Job<'static>>>,
    /// Parts of the current job (helpers with a larger index only acknowledge it).
    parts: AtomicUsize,
    /// A helper's job panicked during the current epoch.
    panicked: AtomicBool,
    /// Helpers should sleep now rather than spin (the cores are lent to other work).
    park: AtomicBool,
    stop: AtomicBool,
    /// A [`Pool::run`] owns the helpers.
    in_use: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the one caller of `Pool::run` that holds `in_use`
// while every helper has acknowledged the previous epoch (`pending == 0`), and read by helpers
// only between the next epoch bump and their acknowledgement; the epoch's Release/Acquire
// pair orders the write before the reads. The closure it points to is `Sync`.
unsafe impl Sync for Shared {}

/// Helpers plus the calling thread.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
}

impl Pool {
    /// Starts `helpers` threads; `start(i)` runs first on helper `i` (1-based: part `i`).
    pub fn new(
        helpers: usize,
        start: impl Fn(usize) + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            parts: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            park: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            in_use: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let start = Arc::new(start);
        let mut pool = Self {
            shared,
            helpers: Vec::with_capacity(helpers),
        };
        for i in 1..=helpers {
            let (sh, start) = (pool.shared.clone(), start.clone());
            let h = std::thread::Builder::new()
                .name(format!("thaw-compute-{i}"))
                .spawn(move || {
                    start(i);
                    helper(&sh, i);
                })?;
            pool.helpers.push(h);
        }
        Ok(pool)
    }

    /// Threads including the caller.
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Runs `f(p)` for `p < parts` (at most [`Pool::threads`]), part 0 on the calling thread,
    /// and returns when all are done. A panic in any part is re-raised here. A call made
    /// while another is in flight (from a part, or another thread) runs its parts in turn on
    /// its own thread.
    pub fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) {
        let parts = parts.min(self.threads());
        let sh = &*self.shared;
        if parts <= 1 || self.helpers.is_empty() || sh.in_use.swap(true, Acquire) {
            return (0..parts.max(1)).for_each(f);
        }
        let _release = Release_(sh);
        debug_assert_eq!(sh.pending.load(Acquire), 0);
        // SAFETY: no helper reads `job` now (all acknowledged the last epoch, and `in_use`
        // excludes another caller); `Done` below keeps this frame, and so `f`, alive until
        // every helper has acknowledged the epoch published next, after which none reads it.
        unsafe {
            *sh.job.get() = Some(std::mem::transmute::<Job<'_>, Job<'static>>(f));
        }
        sh.parts.store(parts, Relaxed);
        sh.panicked.store(false, Relaxed);
        sh.park.store(false, Relaxed);
        sh.pending.store(self.helpers.len(), Relaxed);
        sh.epoch.fetch_add(1, SeqCst);
        if sh.sleepers.load(SeqCst) > 0 {
            let _g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        let done = Done(sh);
        f(0);
        drop(done);
        if sh.panicked.load(Acquire) {
            panic!("a CPU compute thread panicked (see its message above)");
        }
    }

    /// Sends idle helpers to sleep now instead of after their spin (the cores go to the
    /// CPU LoRA workers); the next [`Pool::run`] wakes them.
    pub fn park(&self) {
        self.shared.park.store(true, Relaxed);
    }
}

/// Lets the next [`Pool::run`] use the helpers (dropped after `Done`).
#[allow(non_camel_case_types)]
struct Release_<'a>(&'a Shared);

impl Drop for Release_<'_> {
    fn drop(&mut self) {
        self.0.in_use.store(false, Release);
    }
}

/// Waits (spinning) for every helper to acknowledge the current epoch, also while a panic
/// in part 0 unwinds: the job on the caller's stack must outlive its readers.
struct Done<'a>(&'a Shared);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.0.pending.load(Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1 << 14) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let sh = &*self.shared;
        sh.stop.store(true, SeqCst);
        sh.epoch.fetch_add(1, SeqCst);
        {
            let _g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

fn helper(sh: &Shared, i: usize) {
    // Epoch 0 is the pool's start: a job published before this thread got here still counts.
    let mut seen = 0;
    loop {
        let now = wait_for_epoch(sh, seen);
        if sh.stop.load(Acquire) {
            return;
        }
        seen = now;
        if i < sh.parts.load(Relaxed) {
            // SAFETY: the epoch moved past `seen` (Acquire), so the caller wrote `job` for it
            // and waits for our acknowledgement below before it returns or writes again.
            let job = unsafe { *sh.job.get() };
            if let Some(f) = job {
                if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                    sh.panicked.store(true, Release);
                }
            }
        }
        sh.pending.fetch_sub(1, Release);
    }
}

/// Spins until the epoch differs from `seen`, sleeping after [`IDLE_SPIN`] or when parked.
fn wait_for_epoch(sh: &Shared, seen: u64) -> u64 {
    let t0 = Instant::now();
    let mut spins = 0u32;
    loop {
        let e = sh.epoch.load(Acquire);
        if e != seen {
            return e;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(256) {
            std::hint::spin_loop();
            continue;
        }
        if sh.park.load(Relaxed) || t0.elapsed() >= IDLE_SPIN {
            let mut g = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.sleepers.fetch_add(1, SeqCst);
            // Re-checked under the lock: a caller that bumped the epoch before seeing us in
            // `sleepers` takes the lock to notify only after we wait.
            while sh.epoch.load(SeqCst) == seen {
                g = sh.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            sh.sleepers.fetch_sub(1, SeqCst);
            return sh.epoch.load(Acquire);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Every part runs exactly once per call, over many back-to-back calls and across sleeps.
    #[test]
    fn each_part_runs_once_per_call() {
        let p = Pool::new(2, |_| {}).unwrap();
        let hits: Vec<AtomicU32> = (0..3).map(|_| AtomicU32::new(0)).collect();
        for round in 0..2000u32 {
            p.run(1 + (round as usize % 3), &|i| {
                hits[i].fetch_add(1, Relaxed);
            });
            if round == 1000 {
                p.park();
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let got: Vec<u32> = hits.iter().map(|h| h.load(Relaxed)).collect();
        // Part 0 every call; part 1 when parts ≥ 2 (2 of 3 calls); part 2 when parts = 3.
        let twos = (0..2000).filter(|r| r % 3 >= 1).count() as u32;
        let threes = (0..2000).filter(|r| r % 3 == 2).count() as u32;
        assert_eq!(got, vec![2000, twos, threes]);
    }

    /// A panicking part reaches the caller, after every part has finished, and the pool
    /// keeps working.
    #[test]
    fn a_panicking_part_panics_the_caller() {
        let p = Pool::new(1, |_| {}).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            p.run(2, &|i| {
                if i == 1 {
                    panic!("part 1 fails");
                }
            })
        }));
        assert!(r.is_err());
        let n = AtomicU32::new(0);
        p.run(2, &|_| {
            n.fetch_add(1, Relaxed);
        });
        assert_eq!(n.load(Relaxed), 2);
    }
}
