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
//! A layer read from an adapter's mapped file is checked (every weight finite) before its copy
//! is queued. Checking it and then copying it read the bytes twice, the first time through the
//! caches; [`streaming_copy_finite`] checks the elements as the copy loads them, so the file's
//! bytes are read once, non-temporally (issue 27: the disk tier's loads slowed the steps beside
//! them by more than the host tier's).
//!
//! [`streaming_copy`] and [`streaming_copy_finite`] are the byte copies; [`use_streaming`] and
//! [`fused_check`] the pure choices of when to use them.

use crate::adapter::{exponent_mask, first_non_finite_in, WeightDtype};

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
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        // SAFETY: `head` is the destination's align_offset(16), as `stream_split` requires.
        unsafe { stream_split::<0>(dst, src, head, 0) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// How a copy that must also check its elements (of `elem` bytes) finite reads the bytes,
/// given its length, the destination's distance to a 16-byte boundary (`head`) and whether
/// streaming is switched off: in one pass where the copy streams and the body's 16-byte lanes
/// hold whole elements; else the copy, then the check (two passes, as before).
pub fn fused_check(len: usize, head: usize, elem: usize, switched_off: bool) -> bool {
    use_streaming(len, switched_off) && matches!(elem, 2 | 4) && head.is_multiple_of(elem)
}

/// [`streaming_copy`] of `src`, little-endian elements of `dtype`, that also checks every
/// element is finite, in the same pass over the bytes where [`fused_check`] allows it.
/// Returns whether every element is finite; the bytes are copied either way (the caller
/// discards a copy whose source failed its check).
pub fn streaming_copy_finite(dst: &mut [u8], src: &[u8], dtype: WeightDtype) -> bool {
    assert_eq!(dst.len(), src.len(), "streaming_copy_finite: size mismatch");
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    let elem = dtype.size();
    if !fused_check(dst.len(), head, elem, switched_off()) {
        streaming_copy(dst, src);
        return first_non_finite_in(dtype, src).is_none();
    }
    #[cfg(target_arch = "x86_64")]
    {
        let bits = exponent_mask(dtype);
        let finite = |b: &[u8]| first_non_finite_in(dtype, b).is_none();
        // The head and the tail are copied with ordinary stores and checked on their own (their
        // lengths are whole elements: `head` is, per `fused_check`, and so is the whole).
        let body = (dst.len() - head) / 16 * 16;
        let ends = finite(&src[..head]) && finite(&src[head + body..]);
        // SAFETY: `head` is the destination's align_offset(16), as `stream_split` requires.
        let body_hit = unsafe {
            if elem == 4 {
                stream_split::<4>(dst, src, head, bits)
            } else {
                stream_split::<2>(dst, src, head, bits)
            }
        };
        ends && !body_hit
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("fused_check is false off x86-64")
}

/// Copies `src` into `dst`: the first `head` bytes and the tail past the last whole 16 bytes
/// with ordinary stores, the body with [`stream_body`]; returns whether the body held an
/// element (of `W` bytes; 0: none checked) with every bit of `bits` set.
///
/// # Safety
/// `head` must be `dst`'s distance to its first 16-byte-aligned address, at most its length.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_split<const W: usize>(dst: &mut [u8], src: &[u8], head: usize, bits: u32) -> bool {
    assert!(head <= dst.len() && dst.len() == src.len());
    dst[..head].copy_from_slice(&src[..head]);
    let body = (dst.len() - head) / 16 * 16;
    // SAFETY: `dst[head..head + body]` and `src[head..head + body]` are in bounds (body ≤ len −
    // head) and do not overlap (one is borrowed mutably); the destination pointer is 16-byte
    // aligned (`head` is its align_offset, per this function's contract), as `_mm_stream_si128`
    // requires.
    let hit =
        unsafe { stream_body::<W>(dst[head..].as_mut_ptr(), src[head..].as_ptr(), body, bits) };
    dst[head + body..].copy_from_slice(&src[head + body..]);
    hit
}

/// Copies `len` bytes (a multiple of 16) with SSE2 non-temporal stores, prefetching the source
/// non-temporally a few lines ahead, then fences the stores. With `W` 2 or 4 it also tests
/// each `W`-byte lane of what it loads against `bits` (all of them set: NaN or infinite) and
/// returns whether any lane was; with `W` 0 it tests nothing and returns false.
///
/// # Safety
/// `dst..dst+len` must be writable, `src..src+len` readable, the two must not overlap, and
/// `dst` must be 16-byte aligned.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_body<const W: usize>(dst: *mut u8, src: *const u8, len: usize, bits: u32) -> bool {
    use std::arch::x86_64::{
        __m128i, _mm_and_si128, _mm_cmpeq_epi16, _mm_cmpeq_epi32, _mm_loadu_si128,
        _mm_movemask_epi8, _mm_or_si128, _mm_prefetch, _mm_set1_epi16, _mm_set1_epi32,
        _mm_setzero_si128, _mm_sfence, _mm_stream_si128, _MM_HINT_NTA,
    };
    /// Bytes ahead of the copy that the source is prefetched.
    const AHEAD: usize = 512;
    debug_assert_eq!(len % 16, 0);
    debug_assert_eq!(dst as usize % 16, 0);
    // SAFETY: SSE2 is part of x86-64 (every intrinsic below that touches no memory).
    let (mask, mut acc) = unsafe {
        let m = if W == 4 {
            _mm_set1_epi32(bits as i32)
        } else {
            _mm_set1_epi16(bits as u16 as i16)
        };
        (m, _mm_setzero_si128())
    };
    // Lanes with every bit of the mask set, as all-ones lanes (W is a constant: one branch
    // survives, or none when nothing is checked).
    let flag = |v: __m128i| -> __m128i {
        // SAFETY: SSE2 is part of x86-64; these only compute on registers.
        unsafe {
            match W {
                4 => _mm_cmpeq_epi32(_mm_and_si128(v, mask), mask),
                2 => _mm_cmpeq_epi16(_mm_and_si128(v, mask), mask),
                _ => _mm_setzero_si128(),
            }
        }
    };
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
            if W != 0 {
                let ab = _mm_or_si128(flag(a), flag(b));
                let ce = _mm_or_si128(flag(c), flag(e));
                acc = _mm_or_si128(acc, _mm_or_si128(ab, ce));
            }
        }
        i += 64;
    }
    while i < len {
        // SAFETY: `i + 16 ≤ len` (len and i are multiples of 16), aligned as above.
        unsafe {
            let v = _mm_loadu_si128(src.add(i) as *const __m128i);
            _mm_stream_si128(dst.add(i) as *mut __m128i, v);
            if W != 0 {
                acc = _mm_or_si128(acc, flag(v));
            }
        }
        i += 16;
    }
    // SAFETY: SSE2 is part of x86-64; the fence orders the non-temporal stores above before
    // every later store (the caller's publication).
    unsafe {
        _mm_sfence();
        _mm_movemask_epi8(acc) != 0
    }
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

    #[test]
    fn the_check_is_fused_only_where_lanes_hold_whole_elements() {
        let big = STREAMING_MIN_BYTES;
        let on = cfg!(target_arch = "x86_64");
        assert_eq!(fused_check(big, 0, 2, false), on);
        assert_eq!(fused_check(big, 4, 2, false), on);
        assert_eq!(fused_check(big, 8, 4, false), on);
        assert!(!fused_check(big, 3, 2, false));
        assert!(!fused_check(big, 6, 4, false));
        assert!(!fused_check(big - 1, 0, 2, false));
        assert!(!fused_check(big, 0, 2, true));
        assert!(!fused_check(big, 0, 1, false));
    }

    /// Little-endian bytes of one element of `dtype` per word of `words`: finite values of
    /// every kind (normal, subnormal, ±0), with a NaN or an infinity at `bad` (an element
    /// index, taken modulo their number).
    fn elements(dtype: WeightDtype, words: &[u32], bad: Option<(usize, u8)>) -> Vec<u8> {
        let (w, n) = (dtype.size(), words.len());
        let top = exponent_mask(dtype);
        // Clear one exponent bit: never all ones, so finite.
        let mut bytes: Vec<u8> = words
            .iter()
            .flat_map(|&x| (x & !(top & top.wrapping_neg())).to_le_bytes()[..w].to_vec())
            .collect();
        if let (Some((i, kind)), true) = (bad, n > 0) {
            let i = i % n;
            // Exponent all ones: ±infinity (mantissa 0) or a NaN (mantissa not 0).
            let v = top | (kind as u32 & 1) | (((kind as u32 >> 1) & 1) << (8 * w - 1));
            bytes[i * w..(i + 1) * w].copy_from_slice(&v.to_le_bytes()[..w]);
        }
        bytes
    }

    proptest! {
        /// The fused copy writes exactly the source's bytes and reports a non-finite element
        /// exactly when the standalone check finds one, for every dtype, length (around the
        /// streaming threshold), misalignment of either side (fused or not) and place of the
        /// bad element (head, body, tail), and writes nothing outside the destination.
        #[test]
        fn the_fused_copy_copies_and_checks_like_the_two_passes(
            dt in 0usize..3,
            words in proptest::collection::vec(any::<u32>(), 0..80_000),
            src_off in 0usize..16,
            dst_off in 0usize..16,
            bad in proptest::option::of((any::<usize>(), any::<u8>())),
        ) {
            let dtype = [WeightDtype::F32, WeightDtype::F16, WeightDtype::Bf16][dt];
            let n = words.len();
            let bytes = elements(dtype, &words, bad);
            let mut src = vec![0x5Au8; src_off];
            src.extend_from_slice(&bytes);
            let len = bytes.len();
            let mut dst = vec![0xA5u8; len + dst_off + 16];
            let finite = streaming_copy_finite(&mut dst[dst_off..dst_off + len], &src[src_off..], dtype);
            prop_assert_eq!(&dst[dst_off..dst_off + len], &bytes[..]);
            prop_assert!(dst[..dst_off].iter().all(|&b| b == 0xA5));
            prop_assert!(dst[dst_off + len..].iter().all(|&b| b == 0xA5));
            prop_assert_eq!(finite, first_non_finite_in(dtype, &bytes).is_none());
            prop_assert_eq!(finite, bad.is_none() || n == 0);
        }

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
