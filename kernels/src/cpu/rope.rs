//! Rotary position embeddings (RoPE), HF `rotate_half` (non-interleaved) convention.

use crate::error::KernelError;

/// How the base frequencies are stretched for long contexts (HF `rope_scaling`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Every frequency divided by `factor` (HF `"rope_type": "linear"`).
    Linear {
        /// Divisor applied to every inverse frequency.
        factor: f32,
    },
    /// Llama 3 (`"rope_type": "llama3"`) frequency-dependent scaling, exactly as HF
    /// `_compute_llama3_parameters`: long wavelengths are divided by `factor`, short ones kept,
    /// the band between interpolated smoothly.
    Llama3 {
        /// Divisor for the low-frequency (long-wavelength) band.
        factor: f32,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f32,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f32,
        /// Context length the model was pretrained with.
        original_max_position_embeddings: usize,
    },
}

/// Inverse frequencies for one head size; [`RopeTable::apply`] rotates queries and keys.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl RopeTable {
    /// Builds the table for `head_dim` (even) and base `theta`.
    ///
    /// # Panics
    /// On parameters [`RopeTable::try_new`] rejects; the config parser validates them first.
    pub fn new(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Self {
        match Self::try_new(head_dim, theta, scaling) {
            Ok(t) => t,
            Err(e) => panic!("RopeTable::new: {e}"),
        }
    }

    /// Builds the table, or says which parameter is unusable.
    pub fn try_new(
        head_dim: usize,
        theta: f32,
        scaling: &RopeScaling,
    ) -> Result<Self, KernelError> {
        let bad = |m: String| Err(KernelError::InvalidRope(m));
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {head_dim} must be even and non-zero"));
        }
        if !(theta.is_finite() && theta > 1.0) {
            return bad(format!("rope_theta {theta} must be finite and > 1"));
        }
        // HF: 1 / base^(arange(0, dim, 2) / dim); computed in f64, rounded once.
        let mut inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| (1.0 / (theta as f64).powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        match *scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                if !(factor.is_finite() && factor > 0.0) {
                    return bad(format!("linear scaling factor {factor} must be > 0"));
                }
                inv_freq.iter_mut().for_each(|f| *f /= factor);
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let valid = factor.is_finite()
                    && factor > 0.0
                    && low_freq_factor > 0.0
                    && high_freq_factor > low_freq_factor
                    && original_max_position_embeddings > 0;
                if !valid {
                    return bad(format!(
                        "llama3 scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor \
                         and original_max_position_embeddings > 0; got {scaling:?}"
                    ));
                }
                llama3_scale(
                    &mut inv_freq,
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings as f32,
                );
            }
        }
        Ok(Self { head_dim, inv_freq })
    }

    /// The head size the table was built for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The `head_dim / 2` inverse frequencies after scaling.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Panics unless `x` is `[positions.len(), n_heads, head_dim]`; false when there is nothing
    /// to rotate (no heads). The shape check of [`Self::apply`] and of `RopeCache::apply`.
    pub(crate) fn check_shape(&self, x: &[f32], positions: &[usize], n_heads: usize) -> bool {
        let d = self.head_dim;
        assert_eq!(
            x.len(),
            positions.len() * n_heads * d,
            "rope: x has {} elements, want tokens {} × heads {n_heads} × head_dim {d}",
            x.len(),
            positions.len()
        );
        n_heads > 0
    }

    /// Rotates `x` in place: `x` is `[tokens, n_heads, head_dim]`, `positions.len() == tokens`.
    /// HF `rotate_half` convention: pairs `(i, i + head_dim/2)` rotate by `pos · inv_freq[i]`,
    /// where the angle is rounded to f32 exactly as HF's f32 `inv_freq ⊗ position_ids` does, and
    /// its cos/sin are then evaluated in f64 and rounded once.
    pub fn apply(&self, x: &mut [f32], positions: &[usize], n_heads: usize) {
        if !self.check_shape(x, positions, n_heads) {
            return;
        }
        let d = self.head_dim;
        for (tok, &pos) in x.chunks_exact_mut(n_heads * d).zip(positions) {
            rotate_token(tok, d, |i| sin_cos(pos, self.inv_freq[i]));
        }
    }
}

/// `(sin, cos)` of position `pos`'s angle at inverse frequency `f`, as [`RopeTable::apply`]
/// rounds them: the angle in f32, its sine and cosine in f64, each rounded once.
pub(super) fn sin_cos(pos: usize, f: f32) -> (f32, f32) {
    let angle = pos as f32 * f;
    let (s, c) = (angle as f64).sin_cos();
    (s as f32, c as f32)
}

/// Rotates every head (`d` wide) of one token: pair `(i, i + d/2)` by the angle whose
/// `(sin, cos)` is `sc(i)`.
#[inline]
pub(super) fn rotate_token(tok: &mut [f32], d: usize, sc: impl Fn(usize) -> (f32, f32)) {
    let half = d / 2;
    for i in 0..half {
        let (s, c) = sc(i);
        for head in tok.chunks_exact_mut(d) {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * c - b * s;
            head[i + half] = b * c + a * s;
        }
    }
}

/// HF `_compute_llama3_parameters`, in f32 like the original.
fn llama3_scale(inv_freq: &mut [f32], factor: f32, low: f32, high: f32, old_ctx: f32) {
    let low_freq_wavelen = old_ctx / low;
    let high_freq_wavelen = old_ctx / high;
    for f in inv_freq {
        let wavelen = 2.0 * std::f32::consts::PI / *f;
        if wavelen > low_freq_wavelen {
            *f /= factor;
        } else if wavelen >= high_freq_wavelen {
            let smooth = (old_ctx / wavelen - low) / (high - low);
            *f = (1.0 - smooth) * *f / factor + smooth * *f;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, rand_vec, rng};
    use std::f64::consts::PI;

    const LLAMA3: RopeScaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };

    /// HF's formula written out literally (torch.where on the three bands), in f64.
    fn hf_llama3_f64(head_dim: usize, theta: f64) -> Vec<f64> {
        let (factor, low, high, old) = (8.0, 1.0, 4.0, 8192.0);
        (0..head_dim / 2)
            .map(|i| {
                let inv = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
                let wavelen = 2.0 * PI / inv;
                let llama = if wavelen > old / low {
                    inv / factor
                } else {
                    inv
                };
                let smooth = (old / wavelen - low) / (high - low);
                let smoothed = (1.0 - smooth) * llama / factor + smooth * llama;
                // HF: ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen); no NaNs here.
                let medium = wavelen >= old / high && wavelen <= old / low;
                if medium {
                    smoothed
                } else {
                    llama
                }
            })
            .collect()
    }

    #[test]
    fn llama3_inv_freq_matches_hf_and_band_invariants() {
        let t = RopeTable::new(128, 500_000.0, &LLAMA3);
        let plain = RopeTable::new(128, 500_000.0, &RopeScaling::None);
        let want = hf_llama3_f64(128, 500_000.0);
        // f32 evaluation of a short formula vs f64: a handful of roundings, ≲ 1e-6 relative.
        for (g, w) in t.inv_freq().iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 1e-6 * w, "{g} vs {w}");
        }
        let (mut kept, mut scaled, mut medium) = (0, 0, 0);
        for (&s, &p) in t.inv_freq().iter().zip(plain.inv_freq()) {
            let wavelen = 2.0 * PI / p as f64;
            if wavelen < 8192.0 / 4.0 {
                assert_eq!(s, p, "high frequency must be unchanged");
                kept += 1;
            } else if wavelen > 8192.0 {
                assert_eq!(s, p / 8.0, "low frequency must be divided by factor");
                scaled += 1;
            } else {
                assert!(s < p && s > p / 8.0, "medium band lies strictly between");
                medium += 1;
            }
        }
        assert!(
            kept > 0 && scaled > 0 && medium > 0,
            "{kept} {scaled} {medium}"
        );
        // Frequencies stay monotonically decreasing.
        assert!(t.inv_freq().windows(2).all(|w| w[0] > w[1]));
    }

    #[test]
    fn linear_scaling_divides_every_frequency() {
        let t = RopeTable::new(64, 10_000.0, &RopeScaling::Linear { factor: 4.0 });
        let p = RopeTable::new(64, 10_000.0, &RopeScaling::None);
        for (s, p) in t.inv_freq().iter().zip(p.inv_freq()) {
            assert_eq!(*s, p / 4.0);
        }
        assert!((p.inv_freq()[1] as f64 - 10_000f64.powf(-2.0 / 64.0)).abs() < 1e-7);
    }

    /// f64 rotate_half with a caller-chosen angle.
    fn naive(
        x: &[f32],
        pos: &[usize],
        heads: usize,
        d: usize,
        angle: impl Fn(usize, usize) -> f64,
    ) -> Vec<f64> {
        let mut out = vec![0.0; x.len()];
        let half = d / 2;
        for (t, &p) in pos.iter().enumerate() {
            for h in 0..heads {
                let base = (t * heads + h) * d;
                for i in 0..half {
                    let (a, b) = (x[base + i] as f64, x[base + i + half] as f64);
                    let (s, c) = angle(p, i).sin_cos();
                    out[base + i] = a * c - b * s;
                    out[base + i + half] = b * c + a * s;
                }
            }
        }
        out
    }

    #[test]
    fn apply_matches_f64_rotation() {
        let mut r = rng(30);
        let (heads, d) = (3, 64);
        let t = RopeTable::new(d, 10_000.0, &LLAMA3);
        let inv = t.inv_freq().to_vec();

        // Small positions: the f32 angle is accurate, so compare with a pure f64 angle.
        let pos = [0, 1, 5, 17, 63];
        let x = rand_vec(&mut r, pos.len() * heads * d, 1.0);
        let mut y = x.clone();
        t.apply(&mut y, &pos, heads);
        let want = naive(&x, &pos, heads, d, |p, i| p as f64 * inv[i] as f64);
        // Angle ≤ 63 rounded to f32 errs ≤ 63·6e-8 ≈ 4e-6 absolute; 1e-5 covers it.
        assert_close("rope small pos", &y, &want, 1e-5);

        // Large positions: compare with HF's f32 angle (pos · inv_freq rounded to f32).
        let pos = [1000, 4097, 30_000, 131_071];
        let x = rand_vec(&mut r, pos.len() * heads * d, 1.0);
        let mut y = x.clone();
        t.apply(&mut y, &pos, heads);
        let want = naive(&x, &pos, heads, d, |p, i| (p as f32 * inv[i]) as f64);
        assert_close("rope large pos", &y, &want, 1e-6);

        // A rotation preserves each pair's norm.
        for (a, b) in y.chunks_exact(d).zip(x.chunks_exact(d)) {
            let n = |v: &[f32]| v.iter().map(|&e| (e as f64).powi(2)).sum::<f64>();
            assert!((n(a) - n(b)).abs() <= 1e-5 * n(b));
        }
    }

    #[test]
    fn invalid_parameters_are_errors() {
        assert!(RopeTable::try_new(63, 10_000.0, &RopeScaling::None).is_err());
        let bad = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 4.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        assert!(RopeTable::try_new(64, 10_000.0, &bad).is_err());
    }
}
