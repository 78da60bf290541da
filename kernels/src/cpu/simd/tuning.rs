//! The switch for the prompt-GEMM tuning of issue 30 (prefill products, more than 16 rows and
//! the packed decode batches that share their kernels). Every change behind it keeps each
//! output's bits: it moves work between instructions, not the arithmetic.
//!
//! - 4-bit weights (Q4_1, Q4_K) on AVX512-VNNI: the weight codes (`0..15`) are `vpdpbusd`'s
//!   unsigned operand and the activation codes its signed one, so each block's integer sum
//!   starts from zero (a zeroing idiom) instead of a copy of the pack's `−128·Σw`, and the
//!   activations are not offset by 128 per call: the same integer `Σ q·w`.
//!
//! `THAW_PROMPT_TUNING=0` (read once) or [`set_prompt_tuning`] bring back the previous kernels
//! for A/B runs of one binary (`examples/prefill_gemm.rs`).
use std::sync::atomic::{AtomicU8, Ordering};

/// 0 = not yet decided, 1 = off, 2 = on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether the prompt kernels take the tuning above (the default).
#[inline]
pub fn prompt_tuning() -> bool {
    super::decided_once(&STATE, || !crate::cpu::switched_off("THAW_PROMPT_TUNING"))
}

/// Turns [`prompt_tuning`] on or off for the whole process (A/B runs; results are
/// bit-identical); returns whether it was on.
pub fn set_prompt_tuning(on: bool) -> bool {
    let was = prompt_tuning();
    STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    was
}
