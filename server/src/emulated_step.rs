//! `--emulated-step-time` (bench-only, off by default): gives the CPU backend a GPU's step
//! time, as `--emulated-link-gbps` gives it a GPU's PCIe link.
//!
//! A tiny model's step on the CPU takes about a millisecond and grows linearly with the batch
//! (compute-bound), so a request holds KV and a batch slot for milliseconds and no admission
//! queue forms. On a GPU a decode step costs 11–34 ms almost regardless of the batch (Punica,
//! Figure 1), so requests hold KV for seconds and KV and `--max-num-seqs` bind. With a
//! [`StepFloor`], the engine loop sleeps after each step until [`StepFloor::floor`] of the
//! step's shape has passed (the engine thread sleeps; the link's copy thread, the HTTP side and
//! the CPU workers keep running). The performance model then fits the padded times, so the
//! scheduler's predictions and the TPOT cap see the emulated device.
//!
//! This is the emulated *device*, not a model of it: the one performance model
//! (`crate::perf`) still learns step time from what it measures.

use std::time::Duration;

use crate::perf::StepShape;

/// The least time a step takes: `base + per_seq × sequences + per_prefill_token × prefill
/// tokens + per_ctx_token × decode context tokens`, in milliseconds.
///
/// The suggested coefficients ([`StepFloor::LLAMA7B_A100`]) come from Punica's Figure 1
/// (`../shared/papers/punica.md`), Llama-7B on an A100:
/// - `base_ms = 11`: a decode step at batch 1 with short sequences takes 11 ms.
/// - `per_seq_ms = 0.065`: at batch 32 it takes 13 ms, (13 − 11) / 31 ≈ 0.065 ms a sequence.
/// - `per_prefill_token_ms = 0.1`: prefill is compute-bound and its latency proportional to
///   its tokens (Punica); 2 × 6.7 G FLOP a token over an A100's 312 TFLOP/s at ≈ 45% use is
///   ≈ 0.095 ms a token (inferred, not read off the figure).
/// - `per_ctx_token_ms = 0.00032`: long sequences take 17 → 34 ms at batch 1 → 32; at batch 32
///   the 21 ms over the short case, spread over 32 × 2,048 context tokens (2,048 = Punica's
///   long layer benchmark; the figure does not give the length) ≈ 0.00032 ms a token (inferred).
///
/// Chameleon's A40 has less than half an A100's memory bandwidth and compute; scale the
/// coefficients up (e.g. ×2) to emulate it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepFloor {
    pub base_ms: f64,
    pub per_seq_ms: f64,
    pub per_prefill_token_ms: f64,
    pub per_ctx_token_ms: f64,
}

impl StepFloor {
    /// Punica's Figure 1, Llama-7B on an A100 (see the type's documentation).
    pub const LLAMA7B_A100: StepFloor = StepFloor {
        base_ms: 11.0,
        per_seq_ms: 0.065,
        per_prefill_token_ms: 0.1,
        per_ctx_token_ms: 0.00032,
    };

    /// The least time a step of `shape` takes, with `decode_ctx` context tokens over its
    /// decode rows. Pure.
    pub fn floor(&self, shape: &StepShape, decode_ctx: usize) -> Duration {
        let seqs = shape.decode + shape.prefills;
        let prefill_tokens = shape.tokens.saturating_sub(shape.decode);
        let ms = self.base_ms
            + self.per_seq_ms * seqs as f64
            + self.per_prefill_token_ms * prefill_tokens as f64
            + self.per_ctx_token_ms * decode_ctx as f64;
        Duration::from_secs_f64(ms.max(0.0) / 1e3)
    }

    /// How long to sleep after a step of `shape` that took `elapsed`: the rest of the floor.
    pub fn pad(&self, shape: &StepShape, decode_ctx: usize, elapsed: Duration) -> Duration {
        self.floor(shape, decode_ctx).saturating_sub(elapsed)
    }
}

impl std::str::FromStr for StepFloor {
    type Err = String;

    /// Parses `key=value,...` with the keys `base_ms`, `per_seq_ms`, `per_prefill_token_ms`,
    /// `per_ctx_token_ms` (missing ones are 0), or `llama7b-a100` for
    /// [`StepFloor::LLAMA7B_A100`].
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "llama7b-a100" {
            return Ok(Self::LLAMA7B_A100);
        }
        let mut f = StepFloor::default();
        let mut seen = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part.split_once('=').ok_or_else(|| {
                format!(
                    "--emulated-step-time: expected key=value, got {part:?} \
                     (e.g. \"base_ms=11,per_seq_ms=0.065,per_prefill_token_ms=0.1\")"
                )
            })?;
            let key = key.trim();
            let v: f64 = value.trim().parse().map_err(|_| {
                format!(
                    "--emulated-step-time: {key} must be a number of milliseconds, got {value:?}"
                )
            })?;
            if !v.is_finite() || v < 0.0 {
                return Err(format!(
                    "--emulated-step-time: {key} must be a non-negative number of milliseconds, got {v}"
                ));
            }
            let slot = match key {
                "base_ms" => &mut f.base_ms,
                "per_seq_ms" => &mut f.per_seq_ms,
                "per_prefill_token_ms" => &mut f.per_prefill_token_ms,
                "per_ctx_token_ms" => &mut f.per_ctx_token_ms,
                _ => {
                    return Err(format!(
                        "--emulated-step-time: unknown key {key:?}; the keys are base_ms, \
                         per_seq_ms, per_prefill_token_ms, per_ctx_token_ms (or the preset \
                         llama7b-a100)"
                    ))
                }
            };
            if seen.contains(&key) {
                return Err(format!("--emulated-step-time: {key} is given twice"));
            }
            seen.push(key);
            *slot = v;
        }
        if seen.is_empty() {
            return Err(
                "--emulated-step-time: give at least one key, e.g. \"base_ms=11,per_seq_ms=0.065\""
                    .into(),
            );
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shape(prefill: &[usize], decode: usize) -> StepShape {
        let mut s = StepShape::default();
        for &p in prefill {
            s.add(p, false, Some(8));
        }
        for _ in 0..decode {
            s.add(1, true, Some(16));
        }
        s
    }

    #[test]
    fn punica_figure_1_decode_steps() {
        let f = StepFloor::LLAMA7B_A100;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        // Batch 1 and 32 of short decodes: 11 and 13 ms (the figure).
        assert!((ms(f.floor(&shape(&[], 1), 0)) - 11.065).abs() < 1e-9);
        assert!((ms(f.floor(&shape(&[], 32), 0)) - 13.08).abs() < 1e-9);
        // Batch 32 at 2,048 tokens of context each: ≈ 34 ms.
        let long = ms(f.floor(&shape(&[], 32), 32 * 2048));
        assert!((long - 34.0).abs() < 1.0, "{long}");
        // A 100-token prefill beside 4 decodes: 11 + 5 × 0.065 + 100 × 0.1.
        assert!((ms(f.floor(&shape(&[100], 4), 0)) - 21.325).abs() < 1e-9);
    }

    #[test]
    fn pad_is_the_rest_of_the_floor() {
        let f: StepFloor = "base_ms=10".parse().unwrap();
        let s = shape(&[], 3);
        assert_eq!(
            f.pad(&s, 0, Duration::from_millis(4)),
            Duration::from_millis(6)
        );
        assert_eq!(f.pad(&s, 0, Duration::from_millis(12)), Duration::ZERO);
    }

    #[test]
    fn parses_keys_and_the_preset() {
        let f: StepFloor = " base_ms=11, per_seq_ms=0.065 ,per_prefill_token_ms=0.1"
            .parse()
            .unwrap();
        assert_eq!(
            f,
            StepFloor {
                base_ms: 11.0,
                per_seq_ms: 0.065,
                per_prefill_token_ms: 0.1,
                per_ctx_token_ms: 0.0
            }
        );
        assert_eq!(
            "llama7b-a100".parse::<StepFloor>().unwrap(),
            StepFloor::LLAMA7B_A100
        );
    }

    #[test]
    fn rejects_bad_input_with_the_reason() {
        for (input, says) in [
            ("base_ms=-1", "non-negative"),
            ("base_ms=NaN", "non-negative"),
            ("base_ms=inf", "non-negative"),
            ("base_ms=abc", "must be a number"),
            ("base=11", "unknown key"),
            ("base_ms", "expected key=value"),
            ("base_ms=1,base_ms=2", "twice"),
            ("", "at least one key"),
        ] {
            let e = input.parse::<StepFloor>().unwrap_err();
            assert!(e.contains(says), "{input:?}: {e}");
        }
    }

    proptest! {
        /// The floor never falls when a step gets more rows or context, and the pad plus the
        /// measured time is never under the floor.
        #[test]
        fn floor_is_monotone_and_pad_reaches_it(
            base in 0.0f64..50.0, per_seq in 0.0f64..1.0, per_tok in 0.0f64..1.0,
            per_ctx in 0.0f64..0.01,
            prefill in proptest::collection::vec(1usize..600, 0..4),
            decode in 0usize..64, ctx in 0usize..100_000,
            more_decode in 0usize..8, more_ctx in 0usize..10_000,
            elapsed_us in 0u64..100_000,
        ) {
            let f = StepFloor { base_ms: base, per_seq_ms: per_seq,
                per_prefill_token_ms: per_tok, per_ctx_token_ms: per_ctx };
            let a = f.floor(&shape(&prefill, decode), ctx);
            let b = f.floor(&shape(&prefill, decode + more_decode), ctx + more_ctx);
            prop_assert!(a <= b);
            let mut more_prefill = prefill.clone();
            more_prefill.push(1);
            prop_assert!(a <= f.floor(&shape(&more_prefill, decode), ctx));
            let e = Duration::from_micros(elapsed_us);
            prop_assert!(e + f.pad(&shape(&prefill, decode), ctx, e) >= a);
        }
    }
}
