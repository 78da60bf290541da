//! Which device-resident adapter goes first when memory is needed.
//!
//! `cost` is Chameleon's compound score `F·frequency + R·recency + S·size` with its weights
//! (0.45, 0.10, 0.45); the lowest score goes first. `lru` orders by last use alone. Either way,
//! adapters no queued request wants go before those a queued request wants (Chameleon keeps
//! those "provided there is sufficient memory"), and leased adapters (used by running requests)
//! are never candidates.
//!
//! How the terms are measured and normalised (Chameleon §4 names the features, not a scale):
//! - The cache's currency is pages, so frequency and size are taken per page the adapter holds.
//!   Frequency is decayed uses per page; size is the reload cost per page: seconds over the link
//!   (bytes ÷ rate plus one transfer latency per layer) plus, when the host copy would be gone,
//!   the disk read. A page of a large, rarely used adapter then earns less than a page of a
//!   small popular one, and a page whose reload starts from disk more than one on the host.
//! - Frequency and recency are normalised by rank (percentile over the candidates, ties share
//!   the mean rank), so a skewed count cannot squash the term toward 0 as min–max did. The
//!   reload cost keeps its ratio scale (divided by the candidates' largest), so a disk-tier
//!   reload stays as much costlier as it is, and equal costs score equal.
//!
//! With min–max frequency and raw size (the first version), `cost` kept the rarest, largest
//! adapters under Chameleon's rank power law and hit 0.35 against LRU's 0.50; the replay in
//! `eviction_tests` compares the two on that workload.
//!
//! Two other size terms were measured and not kept (`benches/results/cache-cpu.md`): the raw
//! reload cost (session 10: hit rate 0.78 → 0.35, P50 2.3× worse) and the expected reload
//! seconds a page saves, reload cost × (uses + 1) ÷ pages (Greedy-Dual-Size-Frequency, session
//! 11: the same hit rate and a P99 that differs by +0.3% in the median of 10 paired rounds).
//! Where loads set the tail, the slowest requests are large adapters' first uses, which no
//! eviction order avoids, queued on the link behind other copies (the per-request wait
//! reasons of [`super::waits`]).

/// `--adapter-eviction`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EvictionPolicy {
    /// Least recently used first.
    Lru,
    /// Chameleon's frequency/recency/size score; use and reload cost counted per page held.
    Cost,
    /// Bench-only baseline: `--max-loras` fixed slots padded to the largest rank, LRU, and a
    /// request refused (429) when every slot is leased — the server before the unified pool.
    #[value(hide = true)]
    FixedSlots,
    /// Bench-only baseline, S-LoRA's memory: the unified pool with no cache. An adapter that
    /// no running or admitted request uses and no waiting request wants leaves the device at
    /// once; waiting requests' adapters are still prefetched, and requests queue, never 429.
    #[value(hide = true)]
    NoCache,
}

impl EvictionPolicy {
    /// Whether idle adapters stay on the device until memory is needed (every policy but the
    /// `no-cache` baseline).
    pub fn keeps_idle(self) -> bool {
        self != EvictionPolicy::NoCache
    }
}

impl std::fmt::Display for EvictionPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Cost => "cost",
            EvictionPolicy::FixedSlots => "fixed-slots",
            EvictionPolicy::NoCache => "no-cache",
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
    /// Pages it holds in the pool (at least 1).
    pub pages: usize,
    /// A queued request wants it.
    pub queued: bool,
}

impl<K> Candidate<K> {
    fn per_page(&self, x: f64) -> f64 {
        x / self.pages.max(1) as f64
    }
}

/// Percentile rank of each value in [0, 1] (ties share their mean rank; one value ranks 1).
/// Non-finite values rank as their IEEE total order says, so a NaN cannot panic the sort.
pub fn percentiles(values: &[f64]) -> Vec<f64> {
    let n = values.len();
    if n <= 1 {
        return vec![1.0; n];
    }
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    let mut out = vec![0.0; n];
    let mut i = 0;
    while i < n {
        let mut j = i;
        while j + 1 < n && values[idx[j + 1]].total_cmp(&values[idx[i]]).is_eq() {
            j += 1;
        }
        let p = (i + j) as f64 / 2.0 / (n - 1) as f64;
        for &k in &idx[i..=j] {
            out[k] = p;
        }
        i = j + 1;
    }
    out
}

/// Chameleon's score of each candidate (higher = keep), each term in [0, 1]: frequency per
/// page and recency by percentile, reload cost per page over the largest (module docs).
pub fn scores<K>(cands: &[Candidate<K>]) -> Vec<f64> {
    let freq = percentiles(
        &cands
            .iter()
            .map(|c| c.per_page(c.frequency.max(0.0)))
            .collect::<Vec<_>>(),
    );
    let recency = percentiles(&cands.iter().map(|c| c.last_used).collect::<Vec<_>>());
    let cost: Vec<f64> = cands
        .iter()
        .map(|c| c.per_page(c.reload_secs.max(0.0)))
        .map(|x| if x.is_finite() { x } else { 0.0 })
        .collect();
    let cmax = cost.iter().copied().fold(0.0f64, f64::max);
    let (wf, wr, ws) = WEIGHTS;
    (0..cands.len())
        .map(|i| {
            let size = if cmax > 0.0 { cost[i] / cmax } else { 0.0 };
            wf * freq[i] + wr * recency[i] + ws * size
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
            // No-cache holds only adapters of running and waiting requests; of those, the
            // waiting ones' prefetched copies go in LRU order when memory is needed.
            EvictionPolicy::Lru | EvictionPolicy::FixedSlots | EvictionPolicy::NoCache => {
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
#[path = "eviction_tests.rs"]
mod tests;
