//! The CPU ops' raw memory: a bounds-checked safe wrapper over `matrixmultiply::sgemm`, and
//! the huge-page mappings weights are packed into ([`HugeArena`]).

use std::marker::PhantomData;
use std::mem::{align_of, size_of, size_of_val};
use std::ptr::NonNull;
use std::sync::Arc;

/// A read-only strided matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Copy, Clone, Debug)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// A writable strided matrix view, laid out like [`MatRef`].
#[derive(Debug)]
pub(crate) struct MatMut<'a> {
    pub data: &'a mut [f32],
    pub rs: usize,
    pub cs: usize,
}

/// Panics unless every element of a `rows × cols` view with these strides lies inside `len`.
fn check_view(what: &str, len: usize, rows: usize, cols: usize, rs: usize, cs: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    let last = (rows - 1)
        .checked_mul(rs)
        .and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c)));
    assert!(
        matches!(last, Some(l) if l < len),
        "sgemm: {what} view {rows}x{cols} (strides {rs},{cs}) exceeds its buffer of {len}"
    );
    assert!(
        isize::try_from(rs).is_ok() && isize::try_from(cs).is_ok(),
        "sgemm: {what} stride does not fit isize"
    );
}

/// `C[m,n] ← alpha · A[m,k] · B[k,n] + beta · C`, single-threaded. With `beta == 0` the old
/// contents of `C` are ignored (NaNs included).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    c: MatMut<'_>,
) {
    check_view("A", a.data.len(), m, k, a.rs, a.cs);
    check_view("B", b.data.len(), k, n, b.rs, b.cs);
    check_view("C", c.data.len(), m, n, c.rs, c.cs);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // Empty inner dimension: the product is zero; do not hand matrixmultiply empty slices.
        for i in 0..m {
            for j in 0..n {
                let y = &mut c.data[i * c.rs + j * c.cs];
                *y = if beta == 0.0 { 0.0 } else { beta * *y };
            }
        }
        return;
    }
    // SAFETY: `check_view` proved that every index (i*rs + j*cs) the three m×k, k×n, m×n views
    // can touch is inside its slice, and that the strides fit `isize`; A and B are only read; C
    // is an exclusive `&mut` borrow, so nothing else reads or writes it during the call.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            beta,
            c.data.as_mut_ptr(),
            c.rs as isize,
            c.cs as isize,
        );
    }
}

/// Bytes of a transparent huge page on x86-64 (and the alignment of every mapping here).
pub const HUGE_PAGE: usize = 2 << 20;

/// Alignment of every slice placed in a [`HugeArena`]: a cache line, so 64-byte vector loads
/// of a row that starts on a line never straddle two.
pub const ARENA_ALIGN: usize = 64;

/// An anonymous private mapping that starts on a [`HUGE_PAGE`] boundary and spans whole huge
/// pages, optionally advised `MADV_HUGEPAGE` (so THP in `madvise` mode backs it with 2 MiB
/// pages as it is first written); unmapped on drop.
#[derive(Debug)]
struct HugeMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value. Which bytes a thread may read or
// write is decided by the `HugeSlice`s carved out of it, whose ranges never overlap (see
// `HugeArena::place`), so sharing the owner between threads shares no bytes by itself.
unsafe impl Send for HugeMapping {}
// SAFETY: as for `Send`: `&HugeMapping` gives access to no byte of the mapping.
unsafe impl Sync for HugeMapping {}

impl HugeMapping {
    /// At least `len` bytes (rounded up to whole huge pages). With `advise` it asks the kernel
    /// for huge pages; whether they were granted shows in `/proc/<pid>/smaps_rollup`
    /// (`AnonHugePages`). Errors are the OS's (out of address space, `vm.max_map_count`).
    fn new(len: usize, advise: bool) -> std::io::Result<Self> {
        let too_big = || std::io::Error::other(format!("a {len}-byte huge-page mapping"));
        let len = len
            .max(1)
            .div_ceil(HUGE_PAGE)
            .checked_mul(HUGE_PAGE)
            .ok_or_else(too_big)?;
        let span = len.checked_add(HUGE_PAGE).ok_or_else(too_big)?;
        // SAFETY: an anonymous private mapping at an address the kernel picks: it cannot
        // overlap any memory this process already uses, and no file is involved.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = p as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (start - base, base + span - (start + len));
        // SAFETY: `[base, start)` and `[start + len, base + span)` lie inside the mapping
        // created just above and nothing refers to them; unmapping them leaves exactly the
        // aligned `[start, start + len)`. A failed trim only leaves unused address space.
        unsafe {
            if head > 0 {
                libc::munmap(base as *mut libc::c_void, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
        }
        // THP and MADV_HUGEPAGE are Linux's; elsewhere the mapping keeps ordinary pages.
        #[cfg(target_os = "linux")]
        if advise {
            // SAFETY: `[start, start + len)` is the mapping this value owns; MADV_HUGEPAGE
            // changes only how the kernel backs it, never its contents. A refusal (THP built
            // out of the kernel) leaves ordinary pages, which compute the same.
            unsafe {
                libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = advise;
        let ptr = NonNull::new(start as *mut u8).ok_or_else(too_big)?;
        Ok(Self { ptr, len })
    }
}

impl Drop for HugeMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the range `new` kept mapped, and every `HugeSlice`
        // into it holds an `Arc` to this value, so no reference into the range outlives it.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// `len` values of `T` inside a `HugeMapping`, owned exclusively (no two slices of a mapping
/// overlap); the mapping lives as long as any slice into it.
pub struct HugeSlice<T> {
    map: Arc<HugeMapping>,
    off: usize,
    len: usize,
    _t: PhantomData<T>,
}

impl<T> HugeSlice<T> {
    fn ptr(&self) -> *mut T {
        // `off` is inside the mapping (construction invariant), so this stays in bounds.
        self.map.ptr.as_ptr().wrapping_add(self.off).cast()
    }
}

impl<T> std::ops::Deref for HugeSlice<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `HugeArena::place` made `[off, off + len·size_of::<T>())` a range inside the
        // live mapping (the `Arc` keeps it), aligned for `T`, filled with `len` valid `T`s
        // copied from a slice, and handed it to this slice alone; `&self` forbids writes.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }
}

impl<T> std::ops::DerefMut for HugeSlice<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`; the range belongs to this slice alone and `&mut self` is
        // exclusive, so no other reference to these bytes exists while this one lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for HugeSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// Mappings allocated at once: large enough that few of a model's matrices end one.
const ARENA_CHUNK: usize = 64 << 20;

/// A bump allocator over huge-page mappings that weights are copied into, back to back, each
/// at a cache-line boundary: streaming a decode step's weights then crosses a 2 MiB page (one
/// TLB entry) every 2 MiB instead of a 4 KiB page every 4 KiB, and the hardware prefetchers,
/// which stop at page boundaries, run 512 times further. Memory is never reused: a mapping is
/// unmapped when the last slice into it drops.
#[derive(Debug)]
pub struct HugeArena {
    current: Option<(Arc<HugeMapping>, usize)>,
    advise: bool,
}

impl HugeArena {
    /// An empty arena; `advise: false` gives the same layout on ordinary 4 KiB pages.
    pub fn new(advise: bool) -> Self {
        Self {
            current: None,
            advise,
        }
    }

    /// A copy of `v` in the arena. Errors when a new mapping cannot be made.
    pub fn place<T: Copy>(&mut self, v: &[T]) -> std::io::Result<HugeSlice<T>> {
        assert!(
            align_of::<T>() <= ARENA_ALIGN,
            "HugeArena holds types aligned to at most {ARENA_ALIGN} bytes"
        );
        let bytes = size_of_val(v);
        let fits = |(m, used): &(Arc<HugeMapping>, usize)| {
            used.next_multiple_of(ARENA_ALIGN)
                .checked_add(bytes)
                .is_some_and(|end| end <= m.len)
        };
        if !self.current.as_ref().is_some_and(fits) {
            let map = HugeMapping::new(bytes.max(ARENA_CHUNK), self.advise)?;
            self.current = Some((Arc::new(map), 0));
        }
        let (map, used) = self
            .current
            .as_mut()
            .expect("a mapping with room was set above");
        let off = used.next_multiple_of(ARENA_ALIGN);
        // SAFETY: `off + bytes <= map.len` (checked by `fits` or by sizing the new mapping),
        // the destination range starts past every earlier placement (`used` only grows), so it
        // overlaps neither `v` (ordinary memory) nor any other slice; `T: Copy`, so a bytewise
        // copy yields valid `T`s.
        unsafe {
            std::ptr::copy_nonoverlapping(
                v.as_ptr().cast::<u8>(),
                map.ptr.as_ptr().add(off),
                bytes,
            );
        }
        *used = off + bytes;
        debug_assert!(size_of::<T>() == 0 || off.is_multiple_of(align_of::<T>()));
        Ok(HugeSlice {
            map: map.clone(),
            off,
            len: v.len(),
            _t: PhantomData,
        })
    }
}
