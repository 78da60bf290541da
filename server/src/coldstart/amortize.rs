//! What CPU assist of a cold request costs the requests already running, measured the way they
//! feel it: as their time per output token over the tokens they have left (DESIGN §4, "never
//! predicted to slow other requests' decode beyond a small bound").
//!
//! An assisted step is stretched by the assist path's overhead (and by whatever the CPU work
//! does not hide under the device's); every request in that step waits for it. A bound per
//! step (the step with assist against the step without) forbids a 100 µs-a-layer overhead
//! next to a 0.4 ms decode layer for good, however few steps it lasts. What a running request
//! sees is the stretch spread over its remaining tokens: `E(r) / (r · tpot)`, with `E(r)` the
//! extra seconds of the assisted steps among its next `r` steps. CaraServe's Algorithm 1
//! weighs a newcomer the same way (its prefill's extra time divided by the response length,
//! plus the decode's extra per token).
//!
//! ```text
//! rise(r)      = E(r) / (r · tpot)                    r: tokens a running request has left
//! E(r)         = Σ_k<r e_k                             e_k: extra seconds of assisted step k
//! worst(r_min) = sup_{r ≥ r_min} rise(r) ≤ MAX_TPOT_SLOWDOWN
//! ```
//!
//! Every running request has at least `r_min` tokens left (the fewest of them), so `worst`
//! bounds each one's rise whatever the others have left.

/// Largest predicted rise of a running request's time per output token, over the tokens it
/// has left, that CPU assist of a cold request may cause: the GPU acceptance's TPOT ≤ 1.02×
/// cached (issue 27). It replaces a bound on each step (5% of the step with assist against
/// without), which a fixed overhead per layer could never meet next to a GPU's short decode
/// layers, however few steps the assist lasted.
pub const MAX_TPOT_SLOWDOWN: f64 = 0.02;

/// The steps a cold request's assist stretches, in the order they run: runs of alike steps,
/// each `(steps, extra seconds a step)`. Step counts may be fractional (the assisted decode
/// steps until its adapter lands are a time over a step's length).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct Stretch {
    runs: [(f64, f64); 4],
    len: usize,
}

impl Stretch {
    /// Appends `steps` steps each `extra` seconds longer than without assist (nothing when
    /// either is not positive).
    pub fn push(&mut self, steps: f64, extra: f64) {
        if steps > 0.0 && extra > 0.0 {
            assert!(
                self.len < self.runs.len(),
                "a stretch has at most four runs"
            );
            self.runs[self.len] = (steps, extra);
            self.len += 1;
        }
    }

    fn runs(&self) -> &[(f64, f64)] {
        &self.runs[..self.len]
    }

    /// Extra seconds of all its steps: what each request running through all of them waits.
    pub fn total(&self) -> f64 {
        self.runs().iter().map(|&(n, e)| n * e).sum()
    }

    /// `E(r)`: extra seconds of its first `r` steps.
    pub fn first(&self, r: f64) -> f64 {
        let (mut before, mut sum) = (0.0, 0.0);
        for &(n, e) in self.runs() {
            sum += (r - before).clamp(0.0, n) * e;
            before += n;
        }
        sum
    }

    /// The largest rise of the time per token, `E(r) / (r · tpot_s)`, of a request with any
    /// `r ≥ fewest_left` tokens left (at least one) whose tokens take `tpot_s` each without
    /// assist. Within a run `E(r)/r` is monotone in `r` and past the last step it falls, so
    /// the supremum is at `fewest_left` or at a run's end beyond it.
    pub fn worst_rise(&self, fewest_left: usize, tpot_s: f64) -> f64 {
        let r_min = fewest_left.max(1) as f64;
        let rise = |r: f64| self.first(r) / (r * tpot_s.max(1e-12));
        let mut worst = rise(r_min);
        let mut end = 0.0;
        for &(n, _) in self.runs() {
            end += n;
            if end > r_min {
                worst = worst.max(rise(end));
            }
        }
        worst
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn one_long_step_then_cheap_ones() {
        // A 176 ms step (a 128-row CPU prefill next to a 13.2 ms decode step), then 20
        // assisted decode steps 3.2 ms longer each.
        let mut s = Stretch::default();
        s.push(1.0, 0.176);
        s.push(20.0, 0.0032);
        assert!((s.total() - 0.24).abs() < 1e-12);
        assert!((s.first(1.0) - 0.176).abs() < 1e-12);
        assert!((s.first(11.0) - 0.208).abs() < 1e-12);
        // A request at its last token pays the whole long step on it: 13×.
        assert!((s.worst_rise(1, 0.0132) - 0.176 / 0.0132).abs() < 1e-9);
        // One with 1,000 tokens left spreads all of it: 0.24 s / 13.2 s = 1.8%.
        assert!((s.worst_rise(1000, 0.0132) - 0.24 / 13.2).abs() < 1e-12);
        // Nothing stretched, nothing felt.
        assert_eq!(Stretch::default().worst_rise(1, 0.0132), 0.0);
    }

    proptest! {
        /// `worst_rise` is the supremum over every whole number of tokens left from
        /// `fewest_left` on (checked against a scan), and never grows with `fewest_left`.
        #[test]
        fn the_worst_rise_bounds_every_request_left(
            runs in proptest::collection::vec((0.0f64..40.0, 0.0f64..0.2), 0..4),
            fewest in 0usize..80,
            more in 0usize..80,
            tpot in 1e-3f64..0.1,
        ) {
            let mut s = Stretch::default();
            for (n, e) in runs {
                s.push(n, e);
            }
            let worst = s.worst_rise(fewest, tpot);
            for r in fewest.max(1)..fewest.max(1) + 200 {
                let rise = s.first(r as f64) / (r as f64 * tpot);
                prop_assert!(rise <= worst * (1.0 + 1e-12), "{} at {}: {} > {}", fewest, r, rise, worst);
            }
            prop_assert!(s.worst_rise(fewest + more, tpot) <= worst * (1.0 + 1e-12));
        }
    }
}
