//! Eviction: worked examples, properties of the score, and a replay of Chameleon's workload
//! that compares `cost` with `lru` on the same request sequence (hit rate and reload time).
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

use super::*;

fn c(key: u32, frequency: f64, last_used: f64, reload_secs: f64, pages: usize) -> Candidate<u32> {
    Candidate {
        key,
        frequency,
        last_used,
        reload_secs,
        pages,
        queued: false,
    }
}

#[test]
fn percentiles_share_ties_and_span_zero_to_one() {
    assert_eq!(percentiles(&[3.0, 1.0, 2.0]), vec![1.0, 0.0, 0.5]);
    assert_eq!(percentiles(&[5.0, 5.0, 0.0]), vec![0.75, 0.75, 0.0]);
    assert_eq!(percentiles(&[7.0]), vec![1.0]);
    assert!(percentiles(&[]).is_empty());
}

#[test]
fn cost_keeps_what_a_page_earns_lru_keeps_recent() {
    // 1: large (16 pages), used 16 times, long ago; 2: small (1 page), used twice, just now;
    // 3: small, used 4 times, in between. Per page: 1 earns 1 use, 2 earns 2, 3 earns 4.
    // Reload cost per page is equal (link only), so the size term ties at 1 for all three.
    let cands = [
        c(1, 16.0, 1.0, 16.0, 16),
        c(2, 2.0, 9.0, 1.0, 1),
        c(3, 4.0, 5.0, 1.0, 1),
    ];
    assert_eq!(order(EvictionPolicy::Cost, &cands), vec![1, 2, 3]);
    assert_eq!(order(EvictionPolicy::Lru, &cands), vec![1, 3, 2]);
    let w = scores(&cands);
    let want = [0.45, 0.45 * 0.5 + 0.10 + 0.45, 0.45 + 0.10 * 0.5 + 0.45];
    for (got, want) in w.iter().zip(want) {
        assert!((got - want).abs() < 1e-12, "{w:?}");
    }
}

#[test]
fn a_reload_from_disk_is_kept_over_one_from_host() {
    // Same size and use; 1 would be reloaded from disk (5× the link time).
    let cands = [c(1, 3.0, 2.0, 5.0, 4), c(2, 3.0, 2.0, 1.0, 4)];
    assert_eq!(order(EvictionPolicy::Cost, &cands), vec![2, 1]);
    let w = scores(&cands);
    assert!((w[0] - w[1] - 0.45 * 0.8).abs() < 1e-12, "{w:?}");
}

#[test]
fn adapters_queued_requests_want_go_last() {
    let mut cands = [c(1, 0.0, 0.0, 0.0, 1), c(2, 9.0, 9.0, 9.0, 1)];
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

fn cand() -> impl Strategy<Value = (f64, f64, f64, usize, bool)> {
    (
        0.0..50.0f64,
        0.0..100.0f64,
        0.0..1.0f64,
        1usize..40,
        any::<bool>(),
    )
}

fn build(v: &[(f64, f64, f64, usize, bool)]) -> Vec<Candidate<u32>> {
    v.iter()
        .enumerate()
        .map(|(i, &(f, l, r, p, q))| Candidate {
            queued: q,
            ..c(i as u32, f, l, r, p)
        })
        .collect()
}

fn position(o: &[u32], k: u32) -> usize {
    o.iter().position(|&x| x == k).unwrap()
}

proptest! {
    /// Every candidate appears once, scores lie in [0, 1], and what no queued request wants
    /// goes before anything a queued request wants.
    #[test]
    fn order_is_a_permutation_queued_last(v in prop::collection::vec(cand(), 0..30)) {
        let cands = build(&v);
        for p in [EvictionPolicy::Cost, EvictionPolicy::Lru] {
            let o = order(p, &cands);
            let mut sorted = o.clone();
            sorted.sort();
            prop_assert_eq!(sorted, (0..cands.len() as u32).collect::<Vec<_>>());
            let q: Vec<bool> = o.iter().map(|&k| cands[k as usize].queued).collect();
            prop_assert!(q.windows(2).all(|w| w[0] <= w[1]), "{:?}", q);
        }
        for s in scores(&cands) {
            prop_assert!((0.0..=1.0 + 1e-12).contains(&s), "{}", s);
        }
    }

    /// More use, a later use, or a costlier reload never moves a candidate earlier in the
    /// eviction order (nor lowers its score); more pages for the same use and cost never
    /// moves it later.
    #[test]
    fn monotone_in_each_term(
        v in prop::collection::vec(cand(), 1..30),
        pick in any::<prop::sample::Index>(),
        bump in 0.0..20.0f64,
        more_pages in 1usize..20,
    ) {
        let base = build(&v);
        let i = pick.index(base.len());
        let key = i as u32;
        let before = order(EvictionPolicy::Cost, &base);
        let s0 = scores(&base)[i];
        let up = |f: &dyn Fn(&mut Candidate<u32>)| {
            let mut m = base.clone();
            f(&mut m[i]);
            (position(&order(EvictionPolicy::Cost, &m), key), scores(&m)[i])
        };
        for (what, (pos, s)) in [
            ("frequency", up(&|c| c.frequency += bump)),
            ("recency", up(&|c| c.last_used += bump)),
            ("reload cost", up(&|c| c.reload_secs += bump)),
        ] {
            prop_assert!(pos >= position(&before, key), "{} moved it earlier", what);
            prop_assert!(s >= s0 - 1e-12, "{} lowered its score {} -> {}", what, s0, s);
        }
        let (pos, s) = up(&|c| c.pages += more_pages);
        prop_assert!(pos <= position(&before, key), "more pages moved it later");
        prop_assert!(s <= s0 + 1e-12, "more pages raised its score {} -> {}", s0, s);
    }
}

/// Chameleon's workload: ranks 8..128 round-robin, a rank drawn by P(i) ∝ 1/i, then an adapter
/// of that rank uniformly; a cache of `capacity` pages; one link rate and per-layer latency.
/// Returns (hit rate, seconds spent reloading).
fn replay(policy: EvictionPolicy, adapters: usize, capacity: usize, seed: u64) -> (f64, f64) {
    const RANKS: [usize; 5] = [8, 16, 32, 64, 128];
    // The tiny preset's q,v adapter: 1,792 bytes per rank; 8 KiB pages; 0.2 GB/s, 2 × 10 µs.
    let bytes = |r: usize| (1792 * r) as f64;
    let pages = |r: usize| (bytes(r) / 8192.0).ceil() as usize;
    let reload = |r: usize| bytes(r) / 0.2e9 + 2.0 * 10e-6;
    let rank = |a: usize| RANKS[a % RANKS.len()];
    let weights: Vec<f64> = (1..=RANKS.len()).map(|i| 1.0 / i as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut resident: Vec<usize> = Vec::new();
    let mut freq = vec![0.0f64; adapters];
    let mut last = vec![0.0f64; adapters];
    let (mut hits, mut secs, mut used) = (0usize, 0.0f64, 0usize);
    const REQUESTS: usize = 450;
    for t in 0..REQUESTS {
        let mut x = rng.random::<f64>() * total;
        let g = weights.iter().position(|w| {
            x -= w;
            x < 0.0
        });
        let g = g.unwrap_or(RANKS.len() - 1);
        let in_group = (adapters - g).div_ceil(RANKS.len());
        let a = g + RANKS.len() * rng.random_range(0..in_group);
        freq[a] += 1.0;
        if resident.contains(&a) {
            hits += 1;
        } else {
            secs += reload(rank(a));
            while used + pages(rank(a)) > capacity {
                let cands: Vec<Candidate<usize>> = resident
                    .iter()
                    .map(|&k| Candidate {
                        key: k,
                        frequency: freq[k],
                        last_used: last[k],
                        reload_secs: reload(rank(k)),
                        pages: pages(rank(k)),
                        queued: false,
                    })
                    .collect();
                let victim = order(policy, &cands)[0];
                resident.retain(|&k| k != victim);
                used -= pages(rank(victim));
            }
            resident.push(a);
            used += pages(rank(a));
        }
        last[a] = (t + 1) as f64;
    }
    (hits as f64 / REQUESTS as f64, secs)
}

#[test]
fn replay_cost_hits_more_and_reloads_less_than_lru() {
    for (adapters, capacity) in [(100, 150), (100, 300), (1000, 150), (1000, 400)] {
        let (mut hc, mut hl, mut sc, mut sl) = (0.0, 0.0, 0.0, 0.0);
        for seed in 0..3 {
            let (h, s) = replay(EvictionPolicy::Cost, adapters, capacity, seed);
            hc += h;
            sc += s;
            let (h, s) = replay(EvictionPolicy::Lru, adapters, capacity, seed);
            hl += h;
            sl += s;
        }
        eprintln!(
            "{adapters} adapters, {capacity} pages: hit rate cost {:.3} lru {:.3}, reload ms cost {:.1} lru {:.1}",
            hc / 3.0,
            hl / 3.0,
            sc / 3.0 * 1e3,
            sl / 3.0 * 1e3
        );
        assert!(
            hc > hl,
            "{adapters}/{capacity}: cost hit rate {hc} ≤ lru {hl}"
        );
        assert!(
            sc < sl,
            "{adapters}/{capacity}: cost reload {sc}s ≥ lru {sl}s"
        );
    }
}
