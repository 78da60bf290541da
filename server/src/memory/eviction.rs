//! Which device-resident adapter goes first when memory is needed.
//!
//! `cost` is Chameleon's compound score `F·frequency + R·recency + S·size` with its weights
//! (0.45, 0.10, 0.45), each feature normalised over the candidates; the size term is the
//! adapter's reload cost, which is its size over the link plus, when its host copy is gone, the
//! disk read — so a large adapter, or one whose reload starts from disk, is kept longer. The
//! lowest score goes first. `lru` orders by last use alone. Either way, adapters no queued
//! request wants go before those a queued request wants (Chameleon keeps those "provided there
//! is sufficient memory"), and leased adapters (used by running requests) are never candidates.

/// `--adapter-eviction`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EvictionPolicy {
    /// Least recently used first.
    Lru,
    /// Chameleon's frequency/recency/size score, size as the tier's reload cost.
    Cost,
    /// Bench-only baseline: `--max-loras` fixed slots padded to the largest rank, LRU, and a
    /// request refused (429) when every slot is leased — the server before the unified pool.
    #[value(hide = true)]
    FixedSlots,
}

impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Cost => "cost",
            EvictionPolicy::FixedSlots => "fixed-slots",
        })
    }
}

/// Chameleon's weights: frequency, recency, size.
pub const WEIGHTS: (f64, f64, f64) = (0.45, 0.10, 0.45);

/// What eviction knows of one idle device-resident adapter.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Candidate<K> {
    pub key: K,
    /// Decayed request count (uses per half-life).
    pub frequency: f64,
    /// Seconds since some fixed origin of its last use (larger = more recent).
    pub last_used: f64,
    /// Seconds a reload would take from the tier it falls back to.
    pub reload_secs: f64,
    /// A queued request wants it.
    pub queued: bool,
}

/// Chameleon's score of each candidate (higher = keep), features normalised to [0, 1].
pub fn scores<K>(cands: &[Candidate<K>]) -> Vec<f64> {
    let max = |f: fn(&Candidate<K>) -> f64| {
        cands
            .iter()
            .map(f)
            .fold(0.0f64, f64::max)
            .max(f64::MIN_POSITIVE)
    };
    let fmax = max(|c| c.frequency);
    let smax = max(|c| c.reload_secs);
    let oldest = cands
        .iter()
        .map(|c| c.last_used)
        .fold(f64::INFINITY, f64::min);
    let span = cands
        .iter()
        .map(|c| c.last_used - oldest)
        .fold(0.0f64, f64::max)
        .max(f64::MIN_POSITIVE);
    let (wf, wr, ws) = WEIGHTS;
    cands
        .iter()
        .map(|c| {
            wf * c.frequency / fmax + wr * (c.last_used - oldest) / span + ws * c.reload_secs / smax
        })
        .collect()
}

/// Sorts `cands` into eviction order: unwanted before queued-for, then by the policy.
pub fn order<K: Copy>(policy: EvictionPolicy, cands: &[Candidate<K>]) -> Vec<K> {
    let s = scores(cands);
    let mut idx: Vec<usize> = (0..cands.len()).collect();
    idx.sort_by(|&a, &b| {
        let (ca, cb) = (&cands[a], &cands[b]);
        ca.queued.cmp(&cb.queued).then_with(|| match policy {
            EvictionPolicy::Cost => s[a].total_cmp(&s[b]),
            EvictionPolicy::Lru | EvictionPolicy::FixedSlots => {
                ca.last_used.total_cmp(&cb.last_used)
            }
        })
    });
    idx.into_iter().map(|i| cands[i].key).collect()
}

/// An exponentially decayed use count: each use adds 1, halving every `HALF_LIFE_SECS`.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct Decayed {
    value: f64,
    at: f64,
}

/// Half-life of the frequency count (Chameleon's "within a specific time frame").
pub const HALF_LIFE_SECS: f64 = 60.0;

impl Decayed {
    pub fn value(&self, now: f64) -> f64 {
        self.value * (-(now - self.at).max(0.0) / HALF_LIFE_SECS).exp2()
    }

    pub fn hit(&mut self, now: f64) {
        self.value = self.value(now) + 1.0;
        self.at = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(key: u32, frequency: f64, last_used: f64, reload_secs: f64) -> Candidate<u32> {
        Candidate {
            key,
            frequency,
            last_used,
            reload_secs,
            queued: false,
        }
    }

    #[test]
    fn cost_keeps_frequent_and_costly_lru_keeps_recent() {
        // 1: popular and large, used a while ago; 2: rare and small, used just now.
        let cands = [
            c(1, 10.0, 1.0, 4.0),
            c(2, 1.0, 9.0, 1.0),
            c(3, 5.0, 5.0, 2.0),
        ];
        assert_eq!(order(EvictionPolicy::Cost, &cands), vec![2, 3, 1]);
        assert_eq!(order(EvictionPolicy::Lru, &cands), vec![1, 3, 2]);
        let w = scores(&cands);
        assert!((w[0] - (0.45 + 0.0 + 0.45)).abs() < 1e-12, "{w:?}");
        assert!(
            (w[1] - (0.45 * 0.1 + 0.10 + 0.45 * 0.25)).abs() < 1e-12,
            "{w:?}"
        );
    }

    #[test]
    fn adapters_queued_requests_want_go_last() {
        let mut cands = [c(1, 0.0, 0.0, 0.0), c(2, 9.0, 9.0, 9.0)];
        cands[0].queued = true;
        for p in [EvictionPolicy::Cost, EvictionPolicy::Lru] {
            assert_eq!(order(p, &cands), vec![2, 1]);
        }
    }

    #[test]
    fn frequency_halves_per_half_life() {
        let mut d = Decayed::default();
        d.hit(0.0);
        d.hit(0.0);
        assert!((d.value(HALF_LIFE_SECS) - 1.0).abs() < 1e-12);
        d.hit(HALF_LIFE_SECS);
        assert!((d.value(HALF_LIFE_SECS) - 2.0).abs() < 1e-12);
    }
}
