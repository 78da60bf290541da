//! Chameleon's per-queue resource quotas (§4.2, "Assigning Quotas per Queue"), in tokens of
//! KV reservation (input + output + the adapter's memory "also expressed in token units").
//!
//! The paper models each queue as a queue in queueing theory: with `S_i` the largest request
//! size of queue `i`, `Q_i` its quota, `T_i` the expected duration of one of its requests and
//! `λ_i` their arrival rate, the queue serves `μ_i = Q_i / (S_i · T_i)` requests per second
//! and a request spends `1 / (μ_i − λ_i)` in the system (M/M/1). Meeting the SLO,
//! `1 / (μ_i − λ_i) ≤ SLO`, needs
//!
//! ```text
//! Q_min,i = S_i · T_i · (λ_i + 1 / SLO)
//! ```
//!
//! (the extracted paper text lost the typeset formula; this is the one its definitions
//! give). "Each queue is assigned its minimal required tokens, and the remaining tokens
//! (T − Σ Q_min) are split across queues proportionally to their initial weights." Thaw's
//! initial weights decrease with size — `K − i` for queue `i` of `K`, smallest requests
//! first — so the fast lane gets the most spare. Every queue gets at least one request of
//! its largest size, so each can always admit (the no-starvation half of the design); when
//! the minima do not fit, all are scaled down alike.

/// What a refit measured of one queue over the recent window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QueueLoad {
    /// `S_i`: largest request in tokens.
    pub max_size: f64,
    /// `T_i`: mean predicted service time, seconds.
    pub mean_service_s: f64,
    /// `λ_i`: arrivals per second.
    pub rate: f64,
}

/// A queue's quota and the part of it the queue keeps even when idle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Quota {
    pub tokens: usize,
    /// `Q_min`: an idle queue lends only what is above it, so a lane is never lent away below
    /// what its SLO needs. 0 when the minima do not fit the total (the cache is too small for
    /// every SLO; every queue lends all it does not use).
    pub min: usize,
}

/// Quotas in tokens, one per queue, summing to `total` (when there is any queue).
pub fn quotas(load: &[QueueLoad], total: usize, slo_s: f64) -> Vec<Quota> {
    let k = load.len();
    if k == 0 {
        return Vec::new();
    }
    let min: Vec<f64> = load
        .iter()
        .map(|q| {
            let m = q.max_size * q.mean_service_s * (q.rate + 1.0 / slo_s.max(1e-6));
            m.max(q.max_size).max(1.0)
        })
        .collect();
    let sum: f64 = min.iter().sum();
    let t = total as f64;
    let raw: Vec<f64> = if sum >= t {
        min.iter().map(|m| t * m / sum).collect()
    } else {
        let wsum = (k * (k + 1) / 2) as f64;
        min.iter()
            .enumerate()
            .map(|(i, m)| m + (t - sum) * (k - i) as f64 / wsum)
            .collect()
    };
    let mut q: Vec<Quota> = raw
        .iter()
        .zip(&min)
        .map(|(x, m)| Quota {
            tokens: x.floor() as usize,
            // Minima that do not all fit cannot all be protected: lend freely then.
            min: if sum >= t { 0 } else { m.floor() as usize },
        })
        .collect();
    let rest = total - q.iter().map(|q| q.tokens).sum::<usize>().min(total);
    q[0].tokens += rest;
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn minima_first_then_spare_by_decreasing_weight() {
        let load = [
            QueueLoad {
                max_size: 32.0,
                mean_service_s: 0.5,
                rate: 2.0,
            },
            QueueLoad {
                max_size: 400.0,
                mean_service_s: 4.0,
                rate: 0.25,
            },
        ];
        // Q_min = 32·0.5·(2 + 1/5) = 35.2 and 400·4·(0.25 + 0.2) = 720.
        let q = quotas(&load, 2000, 5.0);
        assert_eq!(q.iter().map(|q| q.tokens).sum::<usize>(), 2000);
        let spare: f64 = 2000.0 - 35.2 - 720.0;
        assert_eq!(q[1].tokens, (720.0 + spare / 3.0).floor() as usize);
        assert!(q[0].tokens >= (35.2 + 2.0 * spare / 3.0).floor() as usize);
        assert_eq!((q[0].min, q[1].min), (35, 720));
    }

    #[test]
    fn every_queue_can_hold_its_largest_request_when_room_allows() {
        let load = [
            QueueLoad {
                max_size: 10.0,
                ..Default::default()
            },
            QueueLoad {
                max_size: 500.0,
                ..Default::default()
            },
        ];
        let q = quotas(&load, 600, 1.0);
        assert!(q[0].tokens >= 10 && q[1].tokens >= 500, "{q:?}");
    }

    proptest! {
        #[test]
        fn quotas_sum_to_the_total(
            load in proptest::collection::vec((1.0f64..2000.0, 0.0f64..20.0, 0.0f64..10.0), 1..5),
            total in 1usize..100_000,
            slo in 0.1f64..30.0,
        ) {
            let load: Vec<QueueLoad> = load
                .into_iter()
                .map(|(s, t, r)| QueueLoad { max_size: s, mean_service_s: t, rate: r })
                .collect();
            let q = quotas(&load, total, slo);
            prop_assert_eq!(q.len(), load.len());
            prop_assert_eq!(q.iter().map(|q| q.tokens).sum::<usize>(), total);
            prop_assert!(q.iter().all(|q| q.min <= q.tokens));
        }
    }
}
