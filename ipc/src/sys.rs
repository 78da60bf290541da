//! The only module of `thaw-ipc` that contains `unsafe`: memfd creation and sealing,
//! `mmap`/`munmap`, references to atomics inside a mapping, plain (non-atomic) views of
//! mapped bytes, the process-shared futex, and fd inheritance across `exec`.
//!
//! Everything above this module works with byte offsets into a [`Mapping`] and safe
//! wrappers. The two `unsafe fn`s left ([`Mapping::slice`], [`Mapping::slice_mut`]) hand out
//! plain slices; their callers justify them with the protocol of the layout they belong to
//! (a published, leased adapter is immutable; a step's rows belong to the worker the job
//! names until it bumps its result word).

use std::collections::HashSet;
use std::ffi::CString;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Mutex;
use std::time::Duration;

use bytemuck::Pod;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

use crate::error::{IpcError, Result};

/// Seals every segment carries: its size can never change (a peer cannot shrink it under
/// us and turn our loads into SIGBUS), and the seal set itself is frozen.
pub(crate) const REQUIRED_SEALS: SealFlag = SealFlag::F_SEAL_GROW
    .union(SealFlag::F_SEAL_SHRINK)
    .union(SealFlag::F_SEAL_SEAL);

fn sys_err(op: &'static str) -> impl FnOnce(nix::Error) -> IpcError {
    move |source| IpcError::Sys { op, source }
}

/// Creates an anonymous memfd of `len` bytes (zero-filled), close-on-exec, sealed against
/// growing, shrinking and further sealing. It has no path: nothing appears in `/dev/shm`, and
/// the memory is freed when the last fd and mapping are gone, whichever process dies.
pub(crate) fn memfd_sealed(debug_name: &str, len: usize) -> Result<OwnedFd> {
    let name = CString::new(format!("thaw-{debug_name}"))
        .map_err(|_| IpcError::BadName(debug_name.to_owned()))?;
    let fd = memfd_create(
        &name,
        MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
    )
    .map_err(sys_err("memfd_create"))?;
    let len_off = libc::off_t::try_from(len).map_err(|_| IpcError::TooLarge(len))?;
    nix::unistd::ftruncate(&fd, len_off).map_err(sys_err("ftruncate"))?;
    fcntl(fd.as_raw_fd(), FcntlArg::F_ADD_SEALS(REQUIRED_SEALS)).map_err(sys_err("F_ADD_SEALS"))?;
    Ok(fd)
}

/// Size in bytes of the file behind `fd`.
pub(crate) fn fd_len(fd: BorrowedFd<'_>) -> Result<usize> {
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(sys_err("fstat"))?;
    usize::try_from(st.st_size).map_err(|_| IpcError::TooLarge(usize::MAX))
}

/// The seals on `fd` (`EINVAL` for a file that is not a memfd becomes an error).
pub(crate) fn fd_seals(fd: BorrowedFd<'_>) -> Result<SealFlag> {
    let bits = fcntl(fd.as_raw_fd(), FcntlArg::F_GET_SEALS).map_err(sys_err("F_GET_SEALS"))?;
    Ok(SealFlag::from_bits_truncate(bits))
}

/// Fd numbers this process has already wrapped through [`adopt_inherited_fd`].
static ADOPTED: Mutex<Option<HashSet<RawFd>>> = Mutex::new(None);

/// Takes ownership of an fd number inherited from the parent (the number travels in an
/// environment variable set by [`inherit_into`]). Checks that the number is an open memfd
/// carrying [`REQUIRED_SEALS`], and adopts each number at most once per process.
pub(crate) fn adopt_inherited_fd(raw: RawFd) -> Result<OwnedFd> {
    let mut adopted = ADOPTED.lock().unwrap_or_else(|p| p.into_inner());
    let set = adopted.get_or_insert_with(HashSet::new);
    if raw < 0 || set.contains(&raw) {
        return Err(IpcError::NoInheritedFd(format!(
            "fd {raw} is invalid or already adopted"
        )));
    }
    fcntl(raw, FcntlArg::F_GETFD).map_err(sys_err("F_GETFD on inherited fd"))?;
    let seals =
        fcntl(raw, FcntlArg::F_GET_SEALS).map_err(sys_err("F_GET_SEALS on inherited fd"))?;
    if !SealFlag::from_bits_truncate(seals).contains(REQUIRED_SEALS) {
        return Err(IpcError::NotSealed);
    }
    set.insert(raw);
    // SAFETY: `raw` is open (F_GETFD succeeded) and is a sealed memfd, i.e. the segment our
    // parent passed down; the ADOPTED set (held under its lock) guarantees this process
    // wraps the number in at most one OwnedFd, so it is closed exactly once.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Arranges for `fd` to survive `exec` in the child spawned by `cmd` (same fd number).
pub(crate) fn inherit_into(cmd: &mut Command, fd: BorrowedFd<'_>) -> RawFd {
    let raw = fd.as_raw_fd();
    // SAFETY: the hook runs in the forked child before exec, where only async-signal-safe
    // calls are allowed: it performs one fcntl(2) on an integer and reads errno, nothing
    // that allocates or takes a lock. The fd stays open in the parent for as long as
    // `fd` is borrowed, and fork duplicates it into the child under the same number.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(raw, libc::F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    raw
}

/// A shared, read-write mapping of a whole memfd. Unmapped on drop.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory with no thread affinity; every access through
// `&Mapping` is either atomic or goes through the `unsafe fn`s whose contracts rule out
// data races.
unsafe impl Send for Mapping {}
// SAFETY: as above: `&Mapping` only yields atomics or slices whose callers promised
// exclusivity/immutability.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all `len` bytes of `fd` shared and read-write.
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> Result<Self> {
        let nz = NonZeroUsize::new(len).ok_or(IpcError::TooSmall { len, needed: 1 })?;
        // SAFETY: we ask the kernel for a fresh mapping (addr = None), so no existing Rust
        // object is overlapped. The file is sealed against shrinking (callers check the
        // seals before mapping), so every byte of [0, len) stays backed and no access can
        // fault with SIGBUS.
        let p = unsafe {
            mmap(
                None,
                nz,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(sys_err("mmap"))?;
        Ok(Self { ptr: p.cast(), len })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Base address (for registering the mapping as pinned memory, or for tests).
    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    fn check<T>(&self, off: usize, count: usize) -> *mut T {
        let bytes = count
            .checked_mul(std::mem::size_of::<T>())
            .expect("size overflow");
        assert!(
            off.checked_add(bytes).is_some_and(|end| end <= self.len),
            "range {off}+{bytes} outside mapping of {}",
            self.len
        );
        assert_eq!(
            off % std::mem::align_of::<T>(),
            0,
            "misaligned offset {off}"
        );
        // SAFETY: `off + bytes <= len` was just checked, so the result stays inside (or one
        // past the end of) the mapping's single allocation.
        unsafe { self.ptr.as_ptr().add(off).cast() }
    }

    /// The `AtomicU32` at byte offset `off`. Panics if out of range or misaligned.
    pub(crate) fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        let p = self.check::<AtomicU32>(off, 1);
        // SAFETY: `p` is in bounds and 4-aligned (checked); the memory is shared and lives
        // as long as `self`. Every process accesses this word only atomically (layout
        // contract), so an `&AtomicU32` to it is valid for the borrow of `self`.
        unsafe { &*p }
    }

    /// The `AtomicU64` at byte offset `off`. Panics if out of range or misaligned.
    pub(crate) fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        let p = self.check::<AtomicU64>(off, 1);
        // SAFETY: in bounds and 8-aligned (checked); accessed only atomically by every
        // process, per the layout contract, so the shared reference is valid.
        unsafe { &*p }
    }

    /// A shared slice of `count` `T`s at byte offset `off`. Panics if out of range or
    /// misaligned.
    ///
    /// # Safety
    /// No thread or process may write any byte of the range while the returned slice is
    /// alive, and every write before it must happen-before this call (e.g. it was published
    /// with a Release store this thread has read with Acquire).
    pub(crate) unsafe fn slice<T: Pod>(&self, off: usize, count: usize) -> &[T] {
        let p = self.check::<T>(off, count);
        // SAFETY: bounds and alignment checked; `T: Pod` accepts any bit pattern, and the
        // caller guarantees the range is immutable for the slice's lifetime.
        unsafe { std::slice::from_raw_parts(p, count) }
    }

    /// A mutable slice of `count` `T`s at byte offset `off`. Panics if out of range or
    /// misaligned.
    ///
    /// # Safety
    /// While the returned slice is alive no other thread or process may read or write any
    /// byte of the range, and no other reference to it may exist in this process; accesses
    /// by others must be ordered before/after it by the caller's protocol (Acquire/Release
    /// on a sequence word).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<T: Pod>(&self, off: usize, count: usize) -> &mut [T] {
        let p = self.check::<T>(off, count);
        // SAFETY: bounds and alignment checked; `T: Pod`; the caller guarantees exclusive
        // access to the range for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(p, count) }
    }

    /// Backs the whole mapping with pages now and maps them writable (`MADV_POPULATE_WRITE`,
    /// Linux ≥ 5.14), so later first writes take no page fault. Returns false where the
    /// kernel refuses (older kernels): the pages then fault in on first use, as before.
    pub(crate) fn populate_write(&self) -> bool {
        // SAFETY: the range is exactly this live mapping; MADV_POPULATE_WRITE only faults
        // pages in (allocating zeroed shmem pages where none exist) and never changes bytes
        // already there, so no Rust reference into the mapping observes a change.
        unsafe {
            libc::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                libc::MADV_POPULATE_WRITE,
            ) == 0
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and every reference handed out
        // borrows `self`, so none outlives this unmapping.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}

/// Outcome of one [`futex_wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FutexWait {
    /// Woken (or a spurious return); the caller re-checks its condition.
    Woken,
    /// The word no longer held the expected value.
    Changed,
    /// The timeout expired.
    TimedOut,
}

/// Sleeps while `word == expected`, for at most `timeout`. Process-shared: no
/// `FUTEX_PRIVATE_FLAG`, so a wake from another process mapping the same memfd reaches us.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) -> FutexWait {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a live, 4-aligned AtomicU32 (the futex word); `ts_ptr` is null or
    // points to a timespec on our stack that outlives the call; FUTEX_WAIT only reads both.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            ts_ptr,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    if r == 0 {
        return FutexWait::Woken;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EAGAIN) => FutexWait::Changed,
        Some(libc::ETIMEDOUT) => FutexWait::TimedOut,
        _ => FutexWait::Woken, // EINTR: re-check like a wake.
    }
}

/// Wakes up to `n` waiters parked on `word` in any process. Returns how many were woken.
pub(crate) fn futex_wake(word: &AtomicU32, n: u32) -> usize {
    let n = n.min(i32::MAX as u32) as libc::c_int;
    // SAFETY: `word` is a live, aligned AtomicU32; FUTEX_WAKE only uses its address as a key
    // and never dereferences the unused pointer arguments.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            n,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    r.max(0) as usize
}

/// CPU time consumed so far by the calling thread.
pub fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec on our stack; CLOCK_THREAD_CPUTIME_ID is
    // always supported on Linux.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if r != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
