//! How long the next step may take under `--tpot-slo-ms` (the rank-aware cap's prefill cut).
//!
//! TPOT, what the SLO bounds and what a client measures, is a request's mean time per output
//! token: (last token − first token) / (tokens − 1). Cutting every step to the SLO bounds
//! each gap, not the mean, and costs the mean: a prompt cut into k chunks makes every
//! co-running decoder sit through k steps instead of one, each paying the step's fixed cost
//! (β and the per-prefill cost of the perf model), so the decoders' total time grows with k.
//! On the CPU backend the fixed cost of a step is several ms, and a decode batch near the
//! SLO leaves a prompt a few rows a step: prefill slows to a trickle, requests queue, and
//! every step is filled to the predicted SLO, so half of them (the model's error is ±20%)
//! land above it — session 9's "the cap made TBT attainment worse and TTFT 3–9× worse".
//!
//! The budget here keeps each running request's mean so far within the SLO instead: a
//! decoder that has had `g` tokens over `t` seconds since its first token stays within the
//! SLO after one more step of `x` seconds when `(t + x) / g ≤ slo`, i.e. `x ≤ slo·g − t`.
//! Decoders that ran fast steps bank slack, and a whole prompt can go in one step when
//! every decoder's slack allows it. The budget is never below the SLO itself (what the
//! per-step cap allowed): only a decoder already above the SLO has less slack than that,
//! and starving prefill would not bring its mean back.

/// The longest the next step may take: the smallest slack `slo·g − t` over the decoding
/// requests `(g, t)` = (tokens they have, seconds since their first token), and never less
/// than `slo_s`.
pub fn step_budget_s(slo_s: f64, decoders: impl IntoIterator<Item = (usize, f64)>) -> f64 {
    decoders
        .into_iter()
        .map(|(g, t)| slo_s * g as f64 - t)
        .fold(f64::INFINITY, f64::min)
        .max(slo_s)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::step_budget_s;

    #[test]
    fn slack_from_fast_steps_lets_a_longer_step_through() {
        // 10 tokens in 45 ms (5 ms a gap): 10·35 − 45 = 305 ms left before the mean passes
        // 35 ms; the newest decoder (1 token, just now) has 35 ms.
        assert!((step_budget_s(0.035, [(10, 0.045)]) - 0.305).abs() < 1e-12);
        assert!((step_budget_s(0.035, [(10, 0.045), (1, 0.0)]) - 0.035).abs() < 1e-12);
        assert_eq!(
            step_budget_s(0.035, []),
            f64::INFINITY,
            "no decoder: no bound"
        );
        assert_eq!(
            step_budget_s(0.035, [(3, 0.5)]),
            0.035,
            "never below the SLO"
        );
    }

    proptest! {
        /// Every decoder within the SLO so far stays within it after a step that keeps to
        /// the budget, and the budget is the largest such step (one decoder ends exactly at
        /// the SLO) unless the SLO floor holds.
        #[test]
        fn a_step_within_the_budget_keeps_every_mean_within_the_slo(
            slo in 0.001f64..0.2,
            ds in prop::collection::vec((1usize..400, 0.0f64..1.0), 1..12),
            frac in 0.0f64..=1.0,
        ) {
            // Decoders whose mean so far is within the SLO: t ≤ slo·(g − 1).
            let ds: Vec<(usize, f64)> =
                ds.iter().map(|&(g, u)| (g, u * slo * (g - 1) as f64)).collect();
            let b = step_budget_s(slo, ds.iter().copied());
            prop_assert!(b >= slo);
            let x = b * frac;
            for &(g, t) in &ds {
                prop_assert!((t + x) / g as f64 <= slo * (1.0 + 1e-9), "{g} {t} {x}");
            }
            let tight = ds
                .iter()
                .any(|&(g, t)| ((t + b) / g as f64 - slo).abs() <= slo * 1e-9);
            prop_assert!(tight || b == slo);
        }
    }
}
