//! Fuzzing on the stable toolchain: proptest strategies run as fuzz targets, in batches of
//! fresh random cases, with failures saved to `tests/fuzz-regressions/<target>.txt` and
//! replayed first on every run (proptest's failure persistence), and a global allocator that
//! turns any single allocation above [`ALLOC_LIMIT`] into a test failure instead of a
//! machine-wide out-of-memory.
//!
//! `cargo test` runs each target for `THAW_FUZZ_CASES` (or `PROPTEST_CASES`) cases, a few
//! seconds' worth by default. A campaign sets `THAW_FUZZ_SECS=600` too: batches repeat with new
//! seeds until the time is up, and the target prints its case count and slowest case:
//!
//! ```text
//! THAW_FUZZ_SECS=600 nice -n 19 cargo test -p thaw-tests --test fuzz_parsers -- \
//!     --nocapture --test-threads 1 adapter_safetensors_structured
//! ```
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestError, TestRunner};

/// Largest single allocation a parser may make from outside bytes. Model-sized buffers are
/// far below it for the test models; a header that claims a terabyte tensor must never get
/// this far.
pub const ALLOC_LIMIT: usize = 1 << 30;

/// The system allocator, refusing (null, so the allocation fails) anything above
/// [`ALLOC_LIMIT`] and remembering the largest request it saw. A refused infallible
/// allocation aborts the process with "memory allocation of N bytes failed": a crash the
/// campaign reports, not an out-of-memory kill of the machine.
pub struct CappedAlloc;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` unchanged except that oversized requests return
// null, which `GlobalAlloc` permits (it signals allocation failure).
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        if layout.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout (we never hand out others).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        if layout.size() > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        if new_size > ALLOC_LIMIT {
            return std::ptr::null_mut();
        }
        // SAFETY: `ptr`/`layout` are the caller's, from `System`; forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// The largest single allocation requested so far in this process.
pub fn largest_allocation() -> usize {
    LARGEST.load(Ordering::Relaxed)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// Runs `test` on cases from `strategy`: `default_cases` (or `THAW_FUZZ_CASES` /
/// `PROPTEST_CASES`) per batch, and batches until `THAW_FUZZ_SECS` have passed when that is
/// set. Any failure or panic is shrunk, saved for replay, and fails the test with the input.
pub fn fuzz<S>(
    target: &str,
    default_cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: Debug + Clone,
{
    let cases = env_u64("THAW_FUZZ_CASES")
        .or_else(|| env_u64("PROPTEST_CASES"))
        .map_or(default_cases, |c| c.clamp(1, u32::MAX as u64) as u32);
    let budget = env_u64("THAW_FUZZ_SECS").map(Duration::from_secs);
    let persistence = format!(
        "{}/fuzz-regressions/{target}.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    let persistence: &'static str = Box::leak(persistence.into_boxed_str());
    let start = Instant::now();
    let run = Cell::new(0u64);
    let slowest = Cell::new(Duration::ZERO);
    let slowest_input = std::cell::RefCell::new(String::new());
    loop {
        let config = Config {
            cases,
            failure_persistence: Some(Box::new(FileFailurePersistence::Direct(persistence))),
            // Shrinking a failure of a slow target must end too.
            max_shrink_time: 60_000,
            ..Config::default()
        };
        let mut runner = TestRunner::new(config);
        let result = runner.run(&strategy, |v| {
            let shown = v.clone();
            let t = Instant::now();
            let r = test(v);
            if t.elapsed() > slowest.get() {
                slowest.set(t.elapsed());
                let mut text = format!("{shown:?}");
                text.truncate(2000);
                *slowest_input.borrow_mut() = text;
            }
            run.set(run.get() + 1);
            r
        });
        match result {
            Ok(()) => {}
            Err(TestError::Fail(reason, input)) => {
                panic!("fuzz target `{target}` failed: {reason}\nminimal input: {input:#?}")
            }
            Err(TestError::Abort(reason)) => panic!("fuzz target `{target}` aborted: {reason}"),
        }
        if budget.is_none_or(|b| start.elapsed() >= b) {
            break;
        }
    }
    eprintln!(
        "fuzz {target}: {} cases in {:.1} s, slowest case {:.1} ms, largest allocation {} KiB",
        run.get(),
        start.elapsed().as_secs_f64(),
        slowest.get().as_secs_f64() * 1e3,
        largest_allocation() >> 10
    );
    if std::env::var_os("THAW_FUZZ_VERBOSE").is_some() {
        eprintln!("fuzz {target}: slowest input {}", slowest_input.borrow());
    }
}
