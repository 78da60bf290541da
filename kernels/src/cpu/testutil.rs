//! Shared helpers for the unit tests: seeded inputs and tolerance checks against f64 references.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub(crate) fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `len` values uniform in `[-amp, amp)`.
pub(crate) fn rand_vec(rng: &mut ChaCha8Rng, len: usize, amp: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-amp..amp)).collect()
}

pub(crate) fn rms(v: &[f64]) -> f64 {
    (v.iter().map(|x| x * x).sum::<f64>() / v.len().max(1) as f64).sqrt()
}

/// Asserts `|got - want| ≤ tol · (|want| + rms(want))` elementwise and returns the worst
/// normalised error. Adding the tensor's RMS keeps the check meaningful for entries that are
/// near zero because of cancellation, where a pure relative error says nothing about the op.
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = rms(want).max(f64::MIN_POSITIVE);
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / (w.abs() + scale);
        assert!(
            err <= tol,
            "{what}: element {i}: got {g}, want {w}, normalised error {err:.3e} > {tol:.1e}"
        );
        worst = worst.max(err);
    }
    worst
}
