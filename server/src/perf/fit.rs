//! Least squares over a window of measured steps, and the running error of the predictions
//! made before each measurement.
//!
//! CaraServe (§5) fits its kernel models "through lightweight serving performance profiling"
//! as linear regressions (R² 0.96 on its GPUs); Thaw refits the same kind of line online from
//! the steps it runs. A column the window does not excite (all its values within a small
//! spread: no prefill mixed in, only one kernel used, no adapters) cannot be told from the
//! intercept, so it keeps its previous coefficient and only the excited columns are refitted.
use std::collections::VecDeque;

/// Number of feature columns (besides the intercept) the step model uses.
pub const COLS: usize = 4;

/// One measured step: its features and its measured time (seconds per layer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub x: [f64; COLS],
    pub y: f64,
}

/// The last [`StepWindow::CAPACITY`] measured steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepWindow(VecDeque<Sample>);

impl StepWindow {
    /// Steps kept: a few seconds of serving.
    pub const CAPACITY: usize = 512;
    /// Fewest steps a refit needs.
    pub const MIN_STEPS: usize = 16;

    pub fn push(&mut self, s: Sample) {
        if self.0.len() == Self::CAPACITY {
            self.0.pop_front();
        }
        self.0.push_back(s);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Least-squares `(intercept, coefficients)` over the window. Column `j` is refitted only
    /// when its values spread by at least `min_spread[j]`; the others keep `prior[j]` (their
    /// contribution is subtracted first). A refitted coefficient that comes out below
    /// `floor[j]` is pinned to its prior and the rest refitted, so noise never makes a cost
    /// negative. `None` when the window is too small or no column is excited.
    pub fn fit(
        &self,
        prior: &[f64; COLS],
        min_spread: &[f64; COLS],
        floor: &[f64; COLS],
    ) -> Option<(f64, [f64; COLS])> {
        if self.0.len() < Self::MIN_STEPS {
            return None;
        }
        let mut free: Vec<usize> = (0..COLS)
            .filter(|&j| {
                let (lo, hi) = self.0.iter().fold((f64::MAX, f64::MIN), |(lo, hi), s| {
                    (lo.min(s.x[j]), hi.max(s.x[j]))
                });
                hi - lo >= min_spread[j]
            })
            .collect();
        while !free.is_empty() {
            let coef = self.solve(prior, &free)?;
            let bad: Vec<usize> = free
                .iter()
                .copied()
                .filter(|&j| coef.1[j] < floor[j])
                .collect();
            if bad.is_empty() {
                return Some(coef);
            }
            free.retain(|j| !bad.contains(j));
        }
        None
    }

    /// Ordinary least squares of the `free` columns (centred, so the intercept drops out of
    /// the normal equations), the fixed columns held at `prior`.
    fn solve(&self, prior: &[f64; COLS], free: &[usize]) -> Option<(f64, [f64; COLS])> {
        let n = self.0.len() as f64;
        let resid = |s: &Sample| {
            s.y - (0..COLS)
                .filter(|j| !free.contains(j))
                .map(|j| prior[j] * s.x[j])
                .sum::<f64>()
        };
        let my = self.0.iter().map(resid).sum::<f64>() / n;
        let mx: Vec<f64> = free
            .iter()
            .map(|&j| self.0.iter().map(|s| s.x[j]).sum::<f64>() / n)
            .collect();
        let k = free.len();
        // Normal equations [XᵀX | Xᵀy] over centred columns, each scaled by its spread so
        // columns of very different magnitude (tokens vs rank·rows) stay well conditioned.
        let scale: Vec<f64> = (0..k)
            .map(|a| {
                let v = self
                    .0
                    .iter()
                    .map(|s| (s.x[free[a]] - mx[a]).powi(2))
                    .sum::<f64>();
                (v / n).sqrt().max(1e-12)
            })
            .collect();
        let mut m = vec![vec![0.0; k + 1]; k];
        for s in &self.0 {
            let xc: Vec<f64> = (0..k).map(|a| (s.x[free[a]] - mx[a]) / scale[a]).collect();
            let yc = resid(s) - my;
            for a in 0..k {
                for b in 0..k {
                    m[a][b] += xc[a] * xc[b];
                }
                m[a][k] += xc[a] * yc;
            }
        }
        let beta = gauss(m)?;
        let mut coef = *prior;
        let mut intercept = my;
        for a in 0..k {
            coef[free[a]] = beta[a] / scale[a];
            intercept -= coef[free[a]] * mx[a];
        }
        Some((intercept, coef))
    }
}

/// Solves an augmented `k × (k+1)` system by Gaussian elimination with partial pivoting;
/// `None` when it is singular (collinear columns).
fn gauss(mut m: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let k = m.len();
    for c in 0..k {
        let p = (c..k).max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))?;
        if m[p][c].abs() < 1e-9 * (1.0 + m[c][c].abs()) {
            return None;
        }
        m.swap(c, p);
        for r in 0..k {
            if r != c {
                let f = m[r][c] / m[c][c];
                let pivot = m[c].clone();
                for (x, p) in m[r][c..=k].iter_mut().zip(&pivot[c..=k]) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((0..k).map(|r| m[r][k] / m[r][r]).collect())
}

/// Relative error of predictions, each made before its step was measured: an exponentially
/// weighted mean of `|predicted − actual| / actual` and the count behind it.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ErrorStat {
    pub mean_rel: f64,
    pub count: u64,
}

impl ErrorStat {
    /// Weight of each new observation once a few are in (the first ones average plainly).
    const ALPHA: f64 = 0.02;

    pub fn observe(&mut self, predicted: f64, actual: f64) {
        if actual <= 0.0 || !predicted.is_finite() {
            return;
        }
        let e = (predicted - actual).abs() / actual;
        self.count += 1;
        let w = (1.0 / self.count as f64).max(Self::ALPHA);
        self.mean_rel += w * (e - self.mean_rel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(f: impl Fn(usize) -> ([f64; COLS], f64)) -> StepWindow {
        let mut w = StepWindow::default();
        for i in 0..200 {
            let (x, y) = f(i);
            w.push(Sample { x, y });
        }
        w
    }

    #[test]
    fn recovers_every_excited_column() {
        let truth = [2e-5, 5e-6, 1e-7, 3e-8];
        let w = window(|i| {
            let x = [
                (1 + i % 97) as f64,
                (i % 13) as f64,
                ((i * 37) % 2048) as f64,
                ((i * 53) % 4096) as f64,
            ];
            let y = 1e-4 + (0..COLS).map(|j| truth[j] * x[j]).sum::<f64>();
            (x, y)
        });
        let (b, c) = w.fit(&[0.0; COLS], &[1.0; COLS], &[0.0; COLS]).unwrap();
        assert!((b - 1e-4).abs() < 1e-9, "{b}");
        for j in 0..COLS {
            assert!((c[j] - truth[j]).abs() / truth[j] < 1e-6, "{j}: {c:?}");
        }
    }

    #[test]
    fn unexcited_columns_keep_their_prior() {
        // Only tokens vary; the decode and LoRA columns are constant zero.
        let w = window(|i| {
            let t = (1 + i % 64) as f64;
            ([t, 0.0, 0.0, 0.0], 2e-4 + 1e-5 * t)
        });
        let prior = [9.0, 7.0, 5.0, 3.0];
        let (b, c) = w.fit(&prior, &[16.0, 1.0, 1.0, 1.0], &[0.0; COLS]).unwrap();
        assert!(
            (b - 2e-4).abs() < 1e-9 && (c[0] - 1e-5).abs() < 1e-12,
            "{b} {c:?}"
        );
        assert_eq!(&c[1..], &prior[1..]);
    }

    #[test]
    fn a_negative_fit_is_pinned_to_its_prior() {
        // Column 1 anti-correlates with time through noise only: floor it.
        let w = window(|i| {
            let t = (1 + i % 50) as f64;
            let d = (i % 7) as f64;
            ([t, d, 0.0, 0.0], 1e-4 + 1e-5 * t - 1e-6 * d)
        });
        let (_, c) = w
            .fit(&[0.0, 2e-7, 0.0, 0.0], &[1.0; COLS], &[0.0; COLS])
            .unwrap();
        assert_eq!(c[1], 2e-7);
        assert!((c[0] - 1e-5).abs() / 1e-5 < 0.05, "{c:?}");
    }

    #[test]
    fn error_stat_tracks_relative_error() {
        let mut e = ErrorStat::default();
        for _ in 0..500 {
            e.observe(1.1, 1.0);
        }
        assert!((e.mean_rel - 0.1).abs() < 1e-9);
        e.observe(f64::NAN, 1.0);
        assert_eq!(e.count, 500);
    }
}
