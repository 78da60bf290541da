//! Where a `thaw-bench cache` cell's TTFT tail comes from, from the client's records alone:
//! requests that are the first in their run to name their adapter (first uses: a miss for
//! every policy unless the warm-up left the adapter cached) against reuses, and the TTFT by
//! adapter rank. Session 9 and 10 did this by hand over cache.json; a tail of reuses means
//! queueing (compute or a full batch), a tail that grows with rank means adapter loads.
use std::collections::{BTreeMap, HashSet};

use super::report::Stats;
use super::runner::RequestRecord;

/// TTFT (seconds) of one cell's completed requests, split.
#[derive(Clone, Debug, PartialEq)]
pub struct TailSplit {
    pub first_use: Stats,
    pub reuse: Stats,
    /// By adapter rank (None: the base model or an adapter of unknown rank), smallest first.
    pub by_rank: Vec<(Option<usize>, Stats)>,
}

/// Splits the requests of `runs` (one record list per run; first use is per run, in send
/// order, failed requests included since they named their adapter too).
pub fn split<'a>(runs: impl IntoIterator<Item = &'a [RequestRecord]>) -> TailSplit {
    let (mut first, mut reuse) = (Vec::new(), Vec::new());
    let mut by_rank: BTreeMap<Option<usize>, Vec<f64>> = BTreeMap::new();
    for recs in runs {
        let mut order: Vec<&RequestRecord> = recs.iter().collect();
        order.sort_by(|a, b| {
            a.scheduled_s
                .total_cmp(&b.scheduled_s)
                .then(a.id.cmp(&b.id))
        });
        let mut seen: HashSet<&str> = HashSet::new();
        for r in order {
            let is_first = seen.insert(r.model.as_str());
            let Some(t) = r.ttft_s.filter(|_| r.ok()) else {
                continue;
            };
            if is_first { &mut first } else { &mut reuse }.push(t);
            by_rank.entry(r.rank).or_default().push(t);
        }
    }
    TailSplit {
        first_use: Stats::of(first),
        reuse: Stats::of(reuse),
        by_rank: by_rank
            .into_iter()
            .map(|(k, v)| (k, Stats::of(v)))
            .collect(),
    }
}

impl TailSplit {
    /// One line: counts and P50/P99 in ms for first uses, reuses and each rank.
    pub fn line(&self) -> String {
        let ms = |s: &Stats| format!("{:.0}/{:.0}", s.p50 * 1e3, s.p99 * 1e3);
        let ranks: Vec<String> = self
            .by_rank
            .iter()
            .map(|(r, s)| match r {
                Some(r) => format!("r{r} {}", ms(s)),
                None => format!("base {}", ms(s)),
            })
            .collect();
        format!(
            "first uses {} at P50/P99 {} ms, reuses {} at {} ms; by rank {}",
            self.first_use.count,
            ms(&self.first_use),
            self.reuse.count,
            ms(&self.reuse),
            ranks.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: usize, at: f64, model: &str, rank: usize, ttft: Option<f64>) -> RequestRecord {
        RequestRecord {
            id,
            instance: 0,
            model: model.into(),
            rank: Some(rank),
            scheduled_s: at,
            sent_s: at,
            sent_unix_s: at,
            prompt_tokens: 10,
            max_tokens: 4,
            output_tokens: 4,
            ttft_s: ttft,
            tpot_s: None,
            e2e_s: ttft,
            error: ttft.is_none().then(|| "refused".to_string()),
        }
    }

    #[test]
    fn first_use_is_per_run_in_send_order_and_failures_still_name_their_adapter() {
        // Listed out of send order; "a" first goes at t=0 (failed), so both its completed
        // requests are reuses. A second run starts afresh: "a" is a first use there.
        let one = vec![
            rec(2, 0.2, "a", 8, Some(0.010)),
            rec(0, 0.0, "a", 8, None),
            rec(1, 0.1, "b", 128, Some(0.300)),
            rec(3, 0.3, "a", 8, Some(0.020)),
        ];
        let two = vec![rec(0, 0.0, "a", 8, Some(0.050))];
        let s = split([one.as_slice(), two.as_slice()]);
        assert_eq!((s.first_use.count, s.reuse.count), (2, 2));
        assert_eq!((s.first_use.max, s.reuse.max), (0.300, 0.020));
        assert!((s.first_use.mean - 0.175).abs() < 1e-12 && (s.reuse.mean - 0.015).abs() < 1e-12);
        assert_eq!(
            s.by_rank
                .iter()
                .map(|(r, st)| (*r, st.count))
                .collect::<Vec<_>>(),
            vec![(Some(8), 3), (Some(128), 1)]
        );
        let line = s.line();
        assert!(
            line.contains("first uses 2") && line.contains("r128 300/300"),
            "{line}"
        );
    }
}
