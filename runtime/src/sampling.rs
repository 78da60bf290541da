//! Turning a row of logits into a token: greedy, temperature, top-k, top-p, per-request seed,
//! plus the log-probability of the chosen token and the top alternatives.
//!
//! Log-probabilities are those of the model's raw distribution (before temperature and
//! truncation), as vLLM reports them by default.
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
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
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
    pub logprob: f32,
    /// (token, logprob), most likely first.
    pub top: Vec<(u32, f32)>,
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

/// Index of the largest value; the lowest index wins ties.
pub fn argmax(x: &[f32]) -> u32 {
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
