//! One activation row streams the weight in address order.
//!
//! A decode step at batch 1 is bound by reading the weights from memory, and how fast they
//! come depends on the order the kernel touches them in. Measured on this project's 2-core
//! AVX-512 VM (AMD EPYC, Zen 4; `benches/results/cpu-precisions.md`, issue 30): a pass over
//! SmolLM2-135M's f32 weights (540 MB, huge pages) reading **one weight row at a time**
//! streams 2.1–2.3× as fast as the register tile that reads **four rows side by side**
//! (element `p` of rows `j..j + 4`, then `p + 16`, …; 14.8–17.7 vs 6.6–8.6 GB/s on one core),
//! and two rows side by side are no better than four. Interleaved rows make the addresses
//! inside each 4 KiB region jump back and forth (+2304, −6848, … bytes), which the hardware
//! stream prefetcher does not follow; one row at a time is a plain ascending stream. A tile
//! still pays where several activation rows share each weight vector (batches: the loads of
//! a 4 × 4 tile feed four times the multiply-adds), so only the one-row products stream.
//!
//! Each output keeps its own accumulator and the same order of operations whichever way the
//! rows are grouped, so streaming changes no bit of any result. `THAW_ROW_STREAM=0` (read
//! once) or [`set_row_stream`] bring back the interleaved tiles for A/B runs of one binary.
use std::sync::atomic::{AtomicU8, Ordering};

/// 0 = not yet decided, 1 = off, 2 = on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether one-row products read their weight rows one after another (the default).
#[inline]
pub fn row_stream() -> bool {
    super::decided_once(&STATE, || !crate::cpu::switched_off("THAW_ROW_STREAM"))
}

/// Turns the one-row streaming order on or off for the whole process (benchmarks comparing
/// the two orders; results are bit-identical); returns whether it was on.
pub fn set_row_stream(on: bool) -> bool {
    let was = row_stream();
    STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    was
}

/// 0 = not yet decided, 1 = off, 2 = on.
static BATCH_PREFETCH: AtomicU8 = AtomicU8::new(0);

/// Whether decode batches prefetch the next weight rows spread over the compute of the
/// current ones (the default; `THAW_BATCH_PREFETCH=0` turns it off, read once): float
/// weights (`gemm_nt` at 2+ rows, off: no prefetch) prefetch the next register tile's rows
/// while the later activation passes compute from L1, and the VNNI panel kernel (4–16 rows,
/// off: the prompt GEMM's per-tile bursts) spreads the next panel's rows over each tile's
/// blocks. On this project's Zen 4 VM 16-row products were 1.02–1.53× faster
/// (`examples/batch_prefetch.rs`). A hint: no result changes.
#[inline]
pub fn batch_prefetch() -> bool {
    super::decided_once(&BATCH_PREFETCH, || {
        !crate::cpu::switched_off("THAW_BATCH_PREFETCH")
    })
}

/// Turns [`batch_prefetch`] on or off for the whole process (A/B runs of one binary; results
/// are bit-identical); returns whether it was on.
pub fn set_batch_prefetch(on: bool) -> bool {
    let was = batch_prefetch();
    BATCH_PREFETCH.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    was
}

/// Weight rows the VNNI row kernel computes side by side (the lanes of its 256-bit vectors;
/// `x86_512_vnni_row`'s group).
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 8;

/// [`super::x86_512_vnni_row::row_product`] one group of [`GROUP`] rows at a time, each group
/// preceded by a prefetch of the next group's bytes in ascending order. The kernel reads its
/// eight rows side by side (block `b` of each, then block `b + 1`), an order the hardware
/// prefetcher does not follow (see the module note); the prefetch turns the stream into an
/// ascending one that runs a group ahead. Every group is the kernel's own call over its rows,
/// so each output is bit for bit what one call over all `n` rows gives.
///
/// # Safety
/// As [`super::x86_512_vnni_row::row_product`].
#[cfg(target_arch = "x86_64")]
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn row_product_ahead<const F: u8>(
    w: *const u8,
    rb: usize,
    n: usize,
    x: *const super::Q8Block,
    kb: usize,
    out: *mut f32,
) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let mut j = 0;
    while j < n {
        let nr = (n - j).min(GROUP);
        let next = (n - j - nr).min(GROUP);
        // Addresses only (wrapping arithmetic, no dereference): a prefetch of any address is
        // harmless, and these lie inside the caller's `n` rows of `rb` bytes at `w`.
        let (start, end) = (
            w.wrapping_add((j + nr) * rb),
            w.wrapping_add((j + nr + next) * rb),
        );
        let mut line = start.wrapping_sub(start as usize % 64);
        while line < end {
            // A hint: reads nothing architecturally and never faults.
            _mm_prefetch::<_MM_HINT_T0>(line.cast());
            line = line.wrapping_add(64);
        }
        // SAFETY: rows `j..j + nr` of the caller's `n` and their `nr` outputs; `x`, `kb`
        // and the features as the caller guarantees.
        unsafe {
            super::x86_512_vnni_row::row_product::<F>(w.add(j * rb), rb, nr, x, kb, out.add(j))
        };
        j += nr;
    }
}
