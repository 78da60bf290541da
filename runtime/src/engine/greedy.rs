//! Which steps bring back greedy token ids instead of logits (issue 29): pure rules, tested
//! below, and the engine's switch for them.
//!
//! A row's token needs its logits on the host unless its request is greedy (temperature 0)
//! and asked for no logprobs: then the token is the row's [`crate::sampling::argmax`], which
//! [`Backend::greedy_ids`](crate::backend::Backend::greedy_ids) computes where the logits are
//! (on the GPU with `THAW_CUDA_DEVICE_ARGMAX=1`) and copies back as one u32. Thaw has no logits
//! processors (repetition penalty, logit bias: the HTTP layer rejects them), so nothing else
//! reads a row's logits. A step takes the ids when every sampling row can and the plan asks
//! for no logits ([`StepPlan::return_logits`](super::StepPlan::return_logits)); a mixed step
//! (some row sampled at a temperature or with logprobs) copies every row's logits, as before.
//! Prompt scoring (`prompt_logprobs`) has logits of its own and is not affected.
//!
//! On by default on every backend (the CPU backend's op is [`crate::sampling::argmax`] over the
//! logits it computed anyway); `THAW_GREEDY_IDS=0` (read when an engine is created) or
//! [`super::Engine::set_greedy_ids`] turns it off, for A/B runs.
use crate::sampling::SamplingParams;

/// The variable that turns greedy ids off (`0`) for engines created after it is set.
pub const GREEDY_IDS_ENV: &str = "THAW_GREEDY_IDS";

/// What a step copies back for its sampling rows.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Fetch {
    /// Every sampling row's logits; the host samples.
    #[default]
    Logits,
    /// One greedy token id per sampling row.
    Ids,
}

/// Whether a row sampled with `p` needs its logits on the host: anything but a greedy draw
/// without logprobs.
pub fn row_needs_logits(p: &SamplingParams) -> bool {
    needs_logits(p.temperature, p.wants_logprobs())
}

/// [`row_needs_logits`] over its two facts.
pub fn needs_logits(temperature: f32, wants_logprobs: bool) -> bool {
    temperature != 0.0 || wants_logprobs
}

/// What a step copies back: [`Fetch::Ids`] when greedy ids are `enabled`, the plan asks for no
/// logits, and the step has sampling rows, none of which needs its logits (`needs`, one per
/// row); [`Fetch::Logits`] otherwise.
pub fn step_fetch(
    enabled: bool,
    return_logits: bool,
    needs: impl IntoIterator<Item = bool>,
) -> Fetch {
    if !enabled || return_logits {
        return Fetch::Logits;
    }
    let mut any = false;
    for n in needs {
        if n {
            return Fetch::Logits;
        }
        any = true;
    }
    if any {
        Fetch::Ids
    } else {
        Fetch::Logits
    }
}

/// Whether engines created now take greedy ids ([`GREEDY_IDS_ENV`] not `0`).
pub fn enabled_by_env() -> bool {
    !thaw_kernels::cpu::switched_off(GREEDY_IDS_ENV)
}

impl<B: crate::backend::Backend> super::Engine<B> {
    /// Switches greedy ids on or off from the next step (on by default; see the module note).
    pub fn set_greedy_ids(&mut self, on: bool) {
        self.greedy_ids = on;
    }

    /// Whether all-greedy steps bring back token ids instead of logits.
    pub fn greedy_ids(&self) -> bool {
        self.greedy_ids
    }

    /// Steps that brought back greedy token ids instead of logits, since the engine started.
    pub fn greedy_id_steps(&self) -> u64 {
        self.id_steps
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::sampling::{argmax, SampledToken, Sampler, SamplerScratch};

    #[test]
    fn fetch_edges() {
        assert_eq!(step_fetch(true, false, [false, false]), Fetch::Ids);
        assert_eq!(step_fetch(true, false, [false, true]), Fetch::Logits);
        assert_eq!(step_fetch(false, false, [false]), Fetch::Logits);
        assert_eq!(step_fetch(true, true, [false]), Fetch::Logits);
        assert_eq!(
            step_fetch(true, false, []),
            Fetch::Logits,
            "no sampling row: nothing to fetch"
        );
        assert!(!row_needs_logits(&SamplingParams::greedy()));
        let asked = SamplingParams {
            logprobs: true,
            ..SamplingParams::greedy()
        };
        assert!(row_needs_logits(&asked));
        let top = SamplingParams {
            top_logprobs: 2,
            ..SamplingParams::greedy()
        };
        assert!(row_needs_logits(&top));
        let warm = SamplingParams {
            temperature: 0.7,
            ..SamplingParams::greedy()
        };
        assert!(row_needs_logits(&warm));
    }

    proptest! {
        /// Ids exactly when enabled, no logits asked, some row, and no row needs logits.
        #[test]
        fn ids_only_when_every_row_is_plain_greedy(
            enabled: bool,
            return_logits: bool,
            needs in prop::collection::vec(any::<bool>(), 0..40),
        ) {
            let want = enabled && !return_logits && !needs.is_empty() && needs.iter().all(|n| !n);
            let got = step_fetch(enabled, return_logits, needs.iter().copied());
            prop_assert_eq!(got == Fetch::Ids, want);
        }

        /// For any sampling settings a row that needs no logits samples, step after step,
        /// exactly `SampledToken::without_logprobs` of the row's argmax, and leaves its
        /// sampler where sampling would (the next draws agree): the substitution is exact.
        #[test]
        fn a_row_without_logits_samples_its_argmax(
            seed in 0u64..500,
            vocab in 1usize..200,
            temperature in prop_oneof![4 => Just(0.0f32), 1 => 0.05f32..2.0],
            top_k in 0usize..10,
            top_p in 0.05f32..=1.0,
            logprobs in prop::bool::weighted(0.2),
            top_logprobs in prop_oneof![4 => Just(0usize), 1 => 1usize..3],
        ) {
            let p = SamplingParams {
                temperature, top_k, top_p, seed: Some(seed), top_logprobs, logprobs,
            };
            if row_needs_logits(&p) {
                // Only a temperature or logprobs make a row need its logits.
                prop_assert!(temperature != 0.0 || p.wants_logprobs());
                return Ok(());
            }
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let (mut sampled, mut skipped) = (Sampler::new(p.clone(), 0), Sampler::new(p, 0));
            let mut sc = SamplerScratch::default();
            for _ in 0..6 {
                let row: Vec<f32> = (0..vocab)
                    .map(|_| match rng.random_range(0..20) {
                        0 => f32::NAN,
                        1 => f32::NEG_INFINITY,
                        2 => f32::INFINITY,
                        _ => rng.random_range(-12i32..12) as f32 / 4.0,
                    })
                    .collect();
                let t = sampled.sample(&row, &mut sc);
                let g = SampledToken::without_logprobs(argmax(&row));
                prop_assert_eq!(t.id, g.id);
                prop_assert!(t.logprob.is_nan() && g.logprob.is_nan());
                prop_assert_eq!(&t.top, &g.top);
            }
            // The skipped sampler never drew: its stream must be where the sampled one's is.
            let row: Vec<f32> = (0..vocab).map(|i| i as f32).collect();
            prop_assert_eq!(sampled.sample(&row, &mut sc).id, skipped.sample(&row, &mut sc).id);
        }
    }
}
