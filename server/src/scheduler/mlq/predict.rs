//! The online output-length predictor WRS uses. Chameleon uses a BERT proxy model (Qiu et
//! al.) and reports 80 % accuracy; Thaw has no such model and predicts from history instead:
//! the mean of the request's adapter's recent outputs once it has a few, the mean over all
//! adapters before that, a default before anything finished — always within
//! `[1, max_tokens]`. Outputs that stopped at `max_tokens` count at that length (a lower
//! bound of what the request would have produced).
use std::collections::{HashMap, VecDeque};

use thaw_runtime::ids::AdapterId;

/// Outputs remembered per adapter and over all.
const PER_ADAPTER: usize = 64;
const GLOBAL: usize = 1024;
/// Adapters remembered; the least recently seen is forgotten past this.
const ADAPTERS: usize = 4096;

/// How good the predictions were, each against the request's actual output length.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PredictorStats {
    pub count: u64,
    /// Mean |predicted − actual|, tokens.
    pub mean_abs_err: f64,
    /// Mean of min(p, a) / max(p, a): 1 is perfect, 0.5 is off by 2×.
    pub accuracy: f64,
}

#[derive(Clone, Debug)]
pub struct OutputPredictor {
    /// Before any output is known.
    pub default_output: usize,
    /// Fewest outputs of an adapter before its own mean is used.
    pub min_history: usize,
    per: HashMap<Option<AdapterId>, (VecDeque<u32>, u64)>,
    global: VecDeque<u32>,
    clock: u64,
    stats: PredictorStats,
}

impl Default for OutputPredictor {
    fn default() -> Self {
        Self {
            default_output: 128,
            min_history: 4,
            per: HashMap::new(),
            global: VecDeque::new(),
            clock: 0,
            stats: PredictorStats::default(),
        }
    }
}

fn mean(v: &VecDeque<u32>) -> f64 {
    v.iter().map(|&x| x as f64).sum::<f64>() / v.len().max(1) as f64
}

impl OutputPredictor {
    /// Predicted output tokens of a request for `adapter` allowed `max_tokens`.
    pub fn predict(&self, adapter: Option<AdapterId>, max_tokens: usize) -> usize {
        let own = self.per.get(&adapter).map(|h| &h.0);
        let p = match own {
            Some(h) if h.len() >= self.min_history => mean(h),
            _ if self.global.len() >= self.min_history => mean(&self.global),
            _ => self.default_output as f64,
        };
        (p.round() as usize).clamp(1, max_tokens.max(1))
    }

    /// Records a finished request: `predicted` was said at its arrival, it produced `actual`.
    pub fn observe(&mut self, adapter: Option<AdapterId>, predicted: usize, actual: usize) {
        let a = actual.max(1);
        self.clock += 1;
        if !self.per.contains_key(&adapter) && self.per.len() >= ADAPTERS {
            let oldest = self.per.iter().min_by_key(|(_, v)| v.1).map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.per.remove(&k);
            }
        }
        let h = self.per.entry(adapter).or_default();
        h.1 = self.clock;
        if h.0.len() == PER_ADAPTER {
            h.0.pop_front();
        }
        h.0.push_back(a as u32);
        if self.global.len() == GLOBAL {
            self.global.pop_front();
        }
        self.global.push_back(a as u32);
        let p = predicted.max(1) as f64;
        let s = &mut self.stats;
        s.count += 1;
        let w = 1.0 / s.count as f64;
        s.mean_abs_err += w * ((p - a as f64).abs() - s.mean_abs_err);
        s.accuracy += w * (p.min(a as f64) / p.max(a as f64) - s.accuracy);
    }

    pub fn stats(&self) -> PredictorStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_the_adapters_history_then_the_global_then_the_default() {
        let mut p = OutputPredictor::default();
        let (a, b) = (Some(AdapterId(1)), Some(AdapterId(2)));
        assert_eq!(p.predict(a, 1000), 128, "default before any output");
        assert_eq!(p.predict(a, 50), 50, "bounded by max_tokens");
        for _ in 0..4 {
            p.observe(a, 128, 20);
        }
        assert_eq!(p.predict(a, 1000), 20);
        assert_eq!(p.predict(b, 1000), 20, "no own history: the global mean");
        for _ in 0..4 {
            p.observe(b, 20, 300);
        }
        assert_eq!(p.predict(b, 1000), 300);
        assert_eq!(p.predict(a, 1000), 20, "each adapter its own");
        assert_eq!(
            p.predict(None, 1000),
            160,
            "the base model falls back to all"
        );
        assert_eq!(p.predict(b, 0), 1);
    }

    #[test]
    fn accuracy_is_tracked() {
        let mut p = OutputPredictor::default();
        p.observe(None, 10, 10);
        p.observe(None, 10, 20);
        let s = p.stats();
        assert_eq!(s.count, 2);
        assert!((s.mean_abs_err - 5.0).abs() < 1e-12);
        assert!((s.accuracy - 0.75).abs() < 1e-12);
    }

    #[test]
    fn forgets_the_least_recent_adapter_past_the_cap() {
        let mut p = OutputPredictor::default();
        for i in 0..ADAPTERS as u32 + 1 {
            p.observe(Some(AdapterId(i)), 1, 1);
        }
        assert_eq!(p.per.len(), ADAPTERS);
        assert!(!p.per.contains_key(&Some(AdapterId(0))));
    }
}
