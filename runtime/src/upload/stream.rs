//! Copying an adapter's bytes without flushing the engine's working set out of the caches.
//!
//! A plain `memcpy` of a 76.5 MB adapter reads and writes it through the cache hierarchy: the
//! destination lines are read for ownership and both sides end up in the last-level cache,
//! evicting the base model's weights and the KV cache that the step running beside it reads.
//! On the CPU backend that step computes on the same host, so a load slows it (issue 27,
//! `benches/results/upload-stall.md`). The loader writes the arena once and nobody on the host
//! reads it soon after (the device copy, or on the CPU backend nothing at all), so the copy
//! here uses non-temporal stores (no read for ownership, no cache fill) and non-temporal
//! prefetches of the source.
//!
//! [`streaming_copy`] is the byte copy; [`use_streaming`] the pure choice of when to use it.

/// Copies of fewer bytes than this go through `copy_from_slice`: the fence and the head and
/// tail handling cost more than the cache pollution a small copy causes.
pub const STREAMING_MIN_BYTES: usize = 64 << 10;

/// Whether a copy of `len` bytes should use non-temporal stores: large copies only, on x86-64
/// (the only architecture with the intrinsics used here), unless switched off.
pub fn use_streaming(len: usize, switched_off: bool) -> bool {
    cfg!(target_arch = "x86_64") && !switched_off && len >= STREAMING_MIN_BYTES
}

/// Whether `THAW_UPLOAD_STREAMING=0` switched streaming copies off (read once): an A/B switch
/// for `thaw-bench upload-stall`, never a configuration.
fn switched_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| thaw_kernels::cpu::switched_off("THAW_UPLOAD_STREAMING"))
}

/// Copies `src` into `dst` (same length), bypassing the caches for large copies (see the
/// module docs); the bytes written are those of `dst.copy_from_slice(src)`. The stores are
/// fenced before it returns, so whatever publishes the copy afterwards (a mutex, a release
/// store) orders them like ordinary stores.
pub fn streaming_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "streaming_copy: size mismatch");
    if !use_streaming(dst.len(), switched_off()) {
        dst.copy_from_slice(src);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // Head: up to the first 16-byte-aligned destination address.
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let body = (dst.len() - head) / 16 * 16;
        // SAFETY: `dst[head..head + body]` and `src[head..head + body]` are in bounds (body ≤
        // len − head) and do not overlap (one is borrowed mutably); the destination pointer is
        // 16-byte aligned (`head` is its align_offset), as `_mm_stream_si128` requires.
        unsafe { stream_body(dst[head..].as_mut_ptr(), src[head..].as_ptr(), body) };
        dst[head + body..].copy_from_slice(&src[head + body..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Copies `len` bytes (a multiple of 16) with SSE2 non-temporal stores, prefetching the source
/// non-temporally a few lines ahead, then fences the stores.
///
/// # Safety
/// `dst..dst+len` must be writable, `src..src+len` readable, the two must not overlap, and
/// `dst` must be 16-byte aligned.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_body(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_prefetch, _mm_sfence, _mm_stream_si128, _MM_HINT_NTA,
    };
    /// Bytes ahead of the copy that the source is prefetched.
    const AHEAD: usize = 512;
    debug_assert_eq!(len % 16, 0);
    debug_assert_eq!(dst as usize % 16, 0);
    let mut i = 0;
    while i + 64 <= len {
        // SAFETY: (every call in this block) `i + 64 ≤ len`, so the four 16-byte loads and stores
        // lie inside the ranges the caller vouched for; `dst + i` is 16-byte aligned (`dst`
        // is, and `i` is a multiple of 16). A prefetch of any address is harmless (it never
        // faults), so `wrapping_add` past the end is fine. SSE2 is part of x86-64.
        unsafe {
            _mm_prefetch::<_MM_HINT_NTA>(src.wrapping_add(i + AHEAD) as *const i8);
            let s = src.add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        i += 64;
    }
    while i < len {
        // SAFETY: `i + 16 ≤ len` (len and i are multiples of 16), aligned as above.
        unsafe {
            let v = _mm_loadu_si128(src.add(i) as *const __m128i);
            _mm_stream_si128(dst.add(i) as *mut __m128i, v);
        }
        i += 16;
    }
    // SAFETY: SSE2 is part of x86-64; the fence orders the non-temporal stores above before
    // every later store (the caller's publication).
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_copies_and_switched_off_copies_do_not_stream() {
        assert!(!use_streaming(STREAMING_MIN_BYTES - 1, false));
        assert!(!use_streaming(1 << 30, true));
        assert_eq!(
            use_streaming(STREAMING_MIN_BYTES, false),
            cfg!(target_arch = "x86_64")
        );
    }

    proptest! {
        /// The copy writes exactly the source's bytes at every length and misalignment of
        /// either side, and nothing outside the destination.
        #[test]
        fn copies_exactly(len in 0usize..300_000, src_off in 0usize..16, dst_off in 0usize..16,
                          seed in any::<u8>()) {
            let src: Vec<u8> = (0..len + src_off)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect();
            let mut dst = vec![0xA5u8; len + dst_off + 16];
            streaming_copy(&mut dst[dst_off..dst_off + len], &src[src_off..]);
            prop_assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..]);
            prop_assert!(dst[..dst_off].iter().all(|&b| b == 0xA5));
            prop_assert!(dst[dst_off + len..].iter().all(|&b| b == 0xA5));
        }
    }
}
