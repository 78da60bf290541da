//! Chameleon's queue layout (§4.2, "Determining the Number of Queues"): K-means over recent
//! weighted request sizes for K = 1..=K_max (K_max = 4 "to keep queue management overheads
//! tolerable"), and per-queue cut-offs at "the midpoint between the centroids of two
//! consecutive clusters".
//!
//! The paper "calculates the Within-Cluster Sum of Squares (WCSS) for each configuration and
//! picks K that yields minimal WCSS"; WCSS never grows with K, so read literally that is
//! always K_max. Thaw takes the usual elbow reading of the same rule: the smallest K after
//! which one more queue would cut WCSS by less than `elbow` × WCSS(1). Two well-separated
//! size classes give two queues, a uniform spread three or four, identical sizes one.

/// K-means in one dimension, solved exactly: `(sorted centroids, WCSS)`. In one dimension
/// the optimal clusters are contiguous runs of the sorted values, so dynamic programming over
/// the split points finds the global optimum (Lloyd's iterations from a seeded start can stop
/// at a poor one when one class is rare, e.g. 15 % long requests). O(k·n²) on ≤ a few
/// thousand sizes, once per refit.
pub fn kmeans_1d(xs: &[f64], k: usize) -> (Vec<f64>, f64) {
    if xs.is_empty() || k == 0 {
        return (Vec::new(), 0.0);
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let k = k.min(n);
    let (mut s1, mut s2) = (vec![0.0; n + 1], vec![0.0; n + 1]);
    for (i, &x) in v.iter().enumerate() {
        s1[i + 1] = s1[i] + x;
        s2[i + 1] = s2[i] + x * x;
    }
    // Sum of squares of v[i..j] about its mean.
    let cost = |i: usize, j: usize| {
        let m = (j - i) as f64;
        let s = s1[j] - s1[i];
        (s2[j] - s2[i] - s * s / m).max(0.0)
    };
    // d[c][j]: best WCSS of v[..j] in c + 1 clusters; from[c][j]: where the last one starts.
    let mut d = vec![vec![f64::INFINITY; n + 1]; k];
    let mut from = vec![vec![0usize; n + 1]; k];
    for (j, d0) in d[0].iter_mut().enumerate().skip(1) {
        *d0 = cost(0, j);
    }
    for c in 1..k {
        for j in c + 1..=n {
            for i in c..j {
                let t = d[c - 1][i] + cost(i, j);
                if t < d[c][j] {
                    d[c][j] = t;
                    from[c][j] = i;
                }
            }
        }
    }
    let mut bounds = vec![n];
    let mut j = n;
    for c in (1..k).rev() {
        j = from[c][j];
        bounds.push(j);
    }
    bounds.push(0);
    bounds.reverse();
    let mut centroids: Vec<f64> = bounds
        .windows(2)
        .filter(|w| w[1] > w[0])
        .map(|w| (s1[w[1]] - s1[w[0]]) / (w[1] - w[0]) as f64)
        .collect();
    centroids.dedup_by(|a, b| (*a - *b).abs() <= 1e-12 * b.abs().max(1.0));
    let wcss = v
        .iter()
        .map(|&x| (x - centroids[nearest(&centroids, x)]).powi(2))
        .sum();
    (centroids, wcss)
}

fn nearest(c: &[f64], x: f64) -> usize {
    (0..c.len())
        .min_by(|&a, &b| (x - c[a]).abs().total_cmp(&(x - c[b]).abs()))
        .unwrap_or(0)
}

/// The centroids of the chosen number of queues (1..=`max_k`) by the elbow rule above.
pub fn choose_queues(xs: &[f64], max_k: usize, elbow: f64) -> Vec<f64> {
    let fits: Vec<(Vec<f64>, f64)> = (1..=max_k.max(1)).map(|k| kmeans_1d(xs, k)).collect();
    let base = fits[0].1;
    if base <= 0.0 {
        return fits[0].0.clone();
    }
    for k in 0..fits.len() - 1 {
        if (fits[k].1 - fits[k + 1].1) < elbow * base {
            return fits[k].0.clone();
        }
    }
    fits[fits.len() - 1].0.clone()
}

/// Cut-offs between consecutive queues: queue `i` takes sizes below `cut[i]`, the last one
/// everything above the last cut.
pub fn cutoffs(centroids: &[f64]) -> Vec<f64> {
    centroids.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect()
}

/// The queue a size falls in under `cuts`.
pub fn queue_of(cuts: &[f64], wrs: f64) -> usize {
    cuts.iter().filter(|&&c| wrs >= c).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Seeded sizes around `centres`, each ±`spread`.
    fn clusters(centres: &[f64], per: usize, spread: f64) -> Vec<f64> {
        let mut out = Vec::new();
        for (i, &c) in centres.iter().enumerate() {
            for j in 0..per {
                let u = ((j * 7919 + i * 104_729) % 1000) as f64 / 1000.0 - 0.5;
                out.push(c + 2.0 * spread * u);
            }
        }
        out
    }

    #[test]
    fn finds_two_size_classes_and_cuts_between_them() {
        // 85 % short, 15 % long: the "Why" workload in miniature.
        let mut xs = clusters(&[0.05], 85, 0.01);
        xs.extend(clusters(&[0.6], 15, 0.05));
        let c = choose_queues(&xs, 4, 0.1);
        assert_eq!(c.len(), 2, "{c:?}");
        let cut = cutoffs(&c);
        assert!(cut[0] > 0.07 && cut[0] < 0.54, "{cut:?}");
        assert_eq!(queue_of(&cut, 0.05), 0);
        assert_eq!(queue_of(&cut, 0.6), 1);
    }

    #[test]
    fn identical_sizes_make_one_queue_and_four_classes_four() {
        let one = choose_queues(&[0.3; 50], 4, 0.1);
        assert!(one.len() == 1 && (one[0] - 0.3).abs() < 1e-12, "{one:?}");
        let xs = clusters(&[0.1, 0.35, 0.6, 0.9], 30, 0.01);
        let c = choose_queues(&xs, 4, 0.02);
        assert_eq!(c.len(), 4, "{c:?}");
        assert_eq!(choose_queues(&xs, 2, 0.02).len(), 2, "K_max bounds it");
    }

    #[test]
    fn kmeans_wcss_is_exact_for_separated_points() {
        let (c, w) = kmeans_1d(&[1.0, 1.0, 5.0, 7.0], 2);
        assert_eq!(c, vec![1.0, 6.0]);
        assert!((w - 2.0).abs() < 1e-12);
        // A rare class is still found (85 % at 0, 15 % at 1).
        let mut xs = vec![0.0; 85];
        xs.extend([1.0; 15]);
        assert_eq!(kmeans_1d(&xs, 2), (vec![0.0, 1.0], 0.0));
    }

    proptest! {
        /// Cut-offs ascend and every size lands in a queue that exists.
        #[test]
        fn cutoffs_ascend_and_cover(xs in proptest::collection::vec(0.0f64..1.0, 1..200)) {
            let c = choose_queues(&xs, 4, 0.1);
            prop_assert!(!c.is_empty() && c.len() <= 4);
            let cut = cutoffs(&c);
            prop_assert!(cut.windows(2).all(|w| w[0] < w[1]));
            for &x in &xs {
                prop_assert!(queue_of(&cut, x) < c.len());
            }
        }
    }
}
