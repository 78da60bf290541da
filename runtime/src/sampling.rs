//! Turning a row of logits into a token: greedy, temperature, top-k, top-p, per-request seed,
//! plus the log-probability of the chosen token and the top alternatives.
//!
//! Log-probabilities are those of the model's raw distribution (before temperature and
//! truncation), as vLLM reports them by default. They cost a log-softmax over the whole
//! vocabulary (f64 `exp` of every logit: ~4 ms a step for 16 rows of SmolLM2's 49,152 on the
//! project's 2-core VM), so a row computes them only when its request asked
//! ([`SamplingParams::wants_logprobs`]); the token drawn never depends on them.
//! `THAW_LAZY_LOGPROBS=0` (read once) computes them on every row again, for A/B runs.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, RuntimeError};

/// How to pick the next token.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k truncation.
    pub top_k: usize,
    /// 1.0 means no nucleus truncation.
    pub top_p: f32,
    /// Seed of this request's private random stream; None draws one from the engine.
    pub seed: Option<u64>,
    /// How many top alternatives to return with each token (0 = none).
    pub top_logprobs: usize,
    /// Return the chosen token's log-probability (OpenAI's `logprobs`; implied by
    /// `top_logprobs > 0`). Off, [`SampledToken::logprob`] is NaN and no log-softmax runs.
    pub logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            top_logprobs: 0,
            logprobs: false,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Whether a sampled token carries log-probabilities (see the module note).
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0 || !lazy_logprobs()
    }

    /// Checks the ranges OpenAI and vLLM accept, naming the bad field.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(RuntimeError::InvalidRequest(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(RuntimeError::InvalidRequest(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// A token with its log-probability and the top alternatives: a sampled token, or a scored
/// prompt token (see [`score_token`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SampledToken {
    pub id: u32,
    /// NaN when the request asked for no logprobs ([`SamplingParams::wants_logprobs`]).
    pub logprob: f32,
    /// (token, logprob), most likely first.
    pub top: Vec<(u32, f32)>,
}

impl SampledToken {
    /// Token `id` sampled for a request that asked for no logprobs: no log-probability, no
    /// alternatives (what [`Sampler::sample`] returns then, and the engine's greedy-ids path).
    pub fn without_logprobs(id: u32) -> Self {
        Self {
            id,
            logprob: f32::NAN,
            top: Vec::new(),
        }
    }
}

/// Per-sequence sampler state: the request's parameters and its private random stream.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

/// Reusable buffers so sampling does not allocate per token once warm.
#[derive(Default, Debug)]
pub struct SamplerScratch {
    logprobs: Vec<f32>,
    order: Vec<u32>,
    probs: Vec<f32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, fallback_seed: u64) -> Self {
        let seed = params.seed.unwrap_or(fallback_seed);
        Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32], s: &mut SamplerScratch) -> SampledToken {
        let id = if self.params.temperature == 0.0 {
            argmax(logits)
        } else {
            self.draw(logits, s)
        };
        if !self.params.wants_logprobs() {
            return SampledToken::without_logprobs(id);
        }
        score_token(logits, id, self.params.top_logprobs, s)
    }

    fn draw(&mut self, logits: &[f32], s: &mut SamplerScratch) -> u32 {
        let p = &self.params;
        // Candidates sorted by logit, descending; ties broken by token id so the order (and so
        // a seeded draw) is fully deterministic.
        s.order.clear();
        s.order.extend(0..logits.len() as u32);
        let k = if p.top_k == 0 {
            logits.len()
        } else {
            p.top_k.min(logits.len())
        };
        let cmp = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if k < s.order.len() {
            s.order.select_nth_unstable_by(k - 1, cmp);
            s.order.truncate(k);
        }
        s.order.sort_unstable_by(cmp);

        let max = logits[s.order[0] as usize];
        s.probs.clear();
        let mut sum = 0.0f64;
        for &t in &s.order {
            let e = (((logits[t as usize] - max) / p.temperature) as f64).exp();
            sum += e;
            s.probs.push(e as f32);
        }
        // Nucleus: keep the smallest prefix whose mass reaches top_p (always at least one).
        let mut keep = s.order.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0f64;
            for (i, &pr) in s.probs.iter().enumerate() {
                acc += pr as f64 / sum;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept: f64 = s.probs[..keep].iter().map(|&x| x as f64).sum();
        let mut u = self.rng.random::<f64>() * kept;
        for i in 0..keep {
            u -= s.probs[i] as f64;
            if u <= 0.0 {
                return s.order[i];
            }
        }
        s.order[keep - 1]
    }
}

/// Log-probability of token `id` under one row of logits, with the `top` most likely
/// alternatives: the raw distribution (temperature 1, no truncation), the same numbers a
/// sampled token reports. Also how prompt tokens are scored.
pub fn score_token(logits: &[f32], id: u32, top: usize, s: &mut SamplerScratch) -> SampledToken {
    s.logprobs.clear();
    s.logprobs.extend_from_slice(logits);
    thaw_kernels::cpu::log_softmax_in_place(&mut s.logprobs);
    SampledToken {
        id,
        logprob: s.logprobs[id as usize],
        top: top_n(&s.logprobs, top, &mut s.order),
    }
}

/// Whether rows that asked for no logprobs skip the log-softmax (the default;
/// `THAW_LAZY_LOGPROBS=0` turns it off, read once).
fn lazy_logprobs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !thaw_kernels::cpu::switched_off("THAW_LAZY_LOGPROBS"))
}

/// Index of the largest value; the lowest index wins ties. NaNs are never the largest (a
/// NaN first entry wins, as nothing compares greater than it).
///
/// Two branch-free passes (the maximum over 16 lanes, then its first index) rather than one
/// running comparison: a greedy row of SmolLM2's 49,152 logits is scanned several times
/// faster. `THAW_LANE_ARGMAX=0` (read once) runs the running comparison, for A/B runs.
pub fn argmax(x: &[f32]) -> u32 {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| !thaw_kernels::cpu::switched_off("THAW_LANE_ARGMAX")) {
        return argmax_running(x);
    }
    let Some(&first) = x.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            // `>` is false for NaN, so NaNs are skipped, as in the running comparison.
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = first;
    for &v in lanes.iter().chain(tail) {
        max = if v > max { v } else { max };
    }
    // `first` is not NaN, so `max` is the largest non-NaN value and some entry equals it.
    x.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// [`argmax`] as one running comparison (its oracle, and its form with `THAW_LANE_ARGMAX=0`).
fn argmax_running(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn top_n(logprobs: &[f32], n: usize, order: &mut Vec<u32>) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let n = n.min(logprobs.len());
    order.clear();
    order.extend(0..logprobs.len() as u32);
    let cmp = |a: &u32, b: &u32| {
        logprobs[*b as usize]
            .total_cmp(&logprobs[*a as usize])
            .then(a.cmp(b))
    };
    order.select_nth_unstable_by(n - 1, cmp);
    order.truncate(n);
    order.sort_unstable_by(cmp);
    order.iter().map(|&t| (t, logprobs[t as usize])).collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::Rng;

    use super::*;

    fn logits() -> Vec<f32> {
        vec![0.5, 2.0, -1.0, 1.5, 2.0, 0.0]
    }

    #[test]
    fn greedy_takes_first_max_and_reports_logprobs() {
        let mut s = Sampler::new(
            SamplingParams {
                top_logprobs: 3,
                ..SamplingParams::greedy()
            },
            0,
        );
        let t = s.sample(&logits(), &mut SamplerScratch::default());
        assert_eq!(t.id, 1);
        let lse = logits().iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        assert!((t.logprob as f64 - (2.0 - lse)).abs() < 1e-6);
        assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 4, 3]);
    }

    #[test]
    fn score_token_is_the_raw_logprob_of_any_token() {
        let lse = logits().iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        let mut sc = SamplerScratch::default();
        let t = score_token(&logits(), 2, 2, &mut sc);
        assert_eq!(t.id, 2);
        assert!((t.logprob as f64 - (-1.0 - lse)).abs() < 1e-6);
        assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 4]);
        // A sampled token reports the same numbers, whatever its temperature.
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 0.5,
                top_logprobs: 2,
                seed: Some(3),
                ..Default::default()
            },
            0,
        );
        let drawn = s.sample(&logits(), &mut sc);
        assert_eq!(drawn, score_token(&logits(), drawn.id, 2, &mut sc));
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_repeats() {
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(p, 9);
        for _ in 0..20 {
            assert_eq!(s.sample(&logits(), &mut SamplerScratch::default()).id, 1);
        }
        let p = SamplingParams {
            temperature: 0.8,
            seed: Some(7),
            ..Default::default()
        };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), 0);
            let mut sc = SamplerScratch::default();
            (0..50)
                .map(|_| s.sample(&logits(), &mut sc).id)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(&p), draw(&p));
        let other = SamplingParams {
            seed: Some(8),
            ..p.clone()
        };
        assert_ne!(draw(&p), draw(&other));
    }

    #[test]
    fn top_p_excludes_the_tail_and_frequencies_match() {
        // Probabilities ~ [0.5, 0.3, 0.2]; top_p 0.75 keeps the first two only.
        let l = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 1.0,
                top_p: 0.75,
                seed: Some(1),
                ..Default::default()
            },
            0,
        );
        let mut sc = SamplerScratch::default();
        let mut counts = [0usize; 3];
        let n = 20_000;
        for _ in 0..n {
            counts[s.sample(&l, &mut sc).id as usize] += 1;
        }
        assert_eq!(counts[2], 0, "token outside the nucleus was drawn");
        let f0 = counts[0] as f64 / n as f64;
        // Renormalised: 0.5 / 0.8 = 0.625; 5 sigma of a binomial at n=20000 is ~0.017.
        assert!((f0 - 0.625).abs() < 0.02, "frequency {f0}");
    }

    /// A row that asks for no logprobs gets the same token (and leaves the random stream
    /// where a scored row leaves it) without the log-softmax: NaN logprob, no alternatives.
    #[test]
    fn rows_without_logprobs_skip_the_scores_only() {
        let mut sc = SamplerScratch::default();
        let mut plain = Sampler::new(SamplingParams::greedy(), 0);
        let t = plain.sample(&logits(), &mut sc);
        assert_eq!(t.id, 1);
        assert!(t.logprob.is_nan() && t.top.is_empty());
        let mut asked = Sampler::new(
            SamplingParams {
                logprobs: true,
                ..SamplingParams::greedy()
            },
            0,
        );
        let t = asked.sample(&logits(), &mut sc);
        assert_eq!(t, score_token(&logits(), 1, 0, &mut sc));
        assert!(t.logprob < 0.0 && t.top.is_empty());
    }

    #[test]
    fn argmax_edges() {
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, 5.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 3.0, 3.0]), 2);
        let mut v = vec![f32::NEG_INFINITY; 40];
        assert_eq!(argmax(&v), 0);
        v[33] = f32::INFINITY;
        v[17] = f32::INFINITY;
        assert_eq!(argmax(&v), 17);
        assert_eq!(argmax(&[-0.0, 0.0]), 0, "-0 == +0: the first wins");
    }

    proptest! {
        /// On any values (NaNs, infinities, ±0 and ties included) the lanes give the running
        /// comparison's index.
        #[test]
        fn argmax_is_the_running_comparison(
            x in prop::collection::vec(prop_oneof![
                4 => (-8i32..8).prop_map(|v| v as f32 / 2.0),
                1 => Just(f32::NAN),
                1 => Just(f32::INFINITY),
                1 => Just(f32::NEG_INFINITY),
                1 => Just(-0.0f32),
                2 => prop::num::f32::ANY,
            ], 0..100),
        ) {
            prop_assert_eq!(argmax(&x), argmax_running(&x));
        }

        /// Over random logits and sampling settings, a sampler that reports logprobs and one
        /// that does not draw the same tokens step after step, and the reported numbers are
        /// [`score_token`]'s exactly.
        #[test]
        fn logprobs_change_no_token(
            seed in 0u64..1000,
            vocab in 1usize..300,
            temperature in prop_oneof![Just(0.0f32), 0.05f32..3.0],
            top_k in 0usize..20,
            top_p in 0.05f32..=1.0,
            top in 0usize..5,
        ) {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let p = SamplingParams { temperature, top_k, top_p, seed: Some(seed), top_logprobs: 0, logprobs: false };
            let q = SamplingParams { top_logprobs: top, logprobs: true, ..p.clone() };
            let (mut a, mut b) = (Sampler::new(p, 0), Sampler::new(q, 0));
            let mut sc = SamplerScratch::default();
            for _ in 0..8 {
                // Coarse values so ties (lowest id wins) occur too.
                let row: Vec<f32> = (0..vocab).map(|_| rng.random_range(-40i32..40) as f32 / 4.0).collect();
                let (x, y) = (a.sample(&row, &mut sc), b.sample(&row, &mut sc));
                prop_assert_eq!(x.id, y.id);
                prop_assert!(x.logprob.is_nan() && x.top.is_empty());
                prop_assert_eq!(&y, &score_token(&row, y.id, top, &mut sc));
            }
        }
    }

    #[test]
    fn validate_names_the_field() {
        let bad = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("top_p"));
        let bad = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("temperature"));
    }
}
