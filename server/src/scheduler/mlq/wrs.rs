//! Chameleon's weighted request size (§4.2, "Admission to the Queues"):
//!
//! ```text
//! WRS = A · input + B · output + C · rank        A = 0.3, B = 0.5, C = 0.2
//! ```
//!
//! over the known input length, the predicted output length and the adapter's rank, each
//! normalised. "The output size primarily determines the execution time, but is predictive,
//! hence, assigning it a too high value would make the system fragile to prediction
//! accuracy." Chameleon's quotas also count "the memory required for the corresponding
//! adapter"; Thaw adds the adapter's predicted load time (from the performance model, by the
//! tier its bytes are in; 0 when it is on the device) as a fourth term, `D · load`, so a
//! request that must first pull its adapter over the link sizes as the larger job it is.
//!
//! Normalisation ([`WrsScales`]): the paper does not say by what. Dividing by fixed maxima
//! (`--max-model-len`, `--max-lora-rank`) lets whichever term has the widest fixed range
//! decide the queues: with a 2048-token context and ranks 8–128, an output of 16 or 328
//! tokens moves WRS by 0.08 while the rank moves it by 0.19, so the queues split by rank and
//! a long generation sits in the short requests' lane. Once the queues are fitted, each term
//! is therefore divided by its mean over the recent window ([`WrsScales::of_window`]): a
//! request as large as the average one in every respect has WRS A + B + C + D·(load/mean
//! service), whatever the units, and the weights keep the meaning the paper gives them.
//! The load term is divided by the mean predicted service time (seconds by seconds: a load as
//! long as the average request counts one).

/// The weights, and the fixed scales each term is normalised by before the queues are first
/// fitted (a value at its scale counts 1; above it is clamped to 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WrsWeights {
    pub input: f64,
    pub output: f64,
    pub rank: f64,
    pub load: f64,
    pub max_input: usize,
    pub max_output: usize,
    pub max_rank: usize,
    pub max_load_s: f64,
}

impl Default for WrsWeights {
    /// Chameleon's A, B, C; D small so the load term breaks ties rather than dominating.
    fn default() -> Self {
        Self {
            input: 0.3,
            output: 0.5,
            rank: 0.2,
            load: 0.1,
            max_input: 4096,
            max_output: 4096,
            max_rank: 128,
            max_load_s: 1.0,
        }
    }
}

/// What WRS is computed from.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestSize {
    pub input: usize,
    pub predicted_output: usize,
    /// 0 for the base model.
    pub rank: usize,
    /// Predicted seconds until its adapter is on the device (0 when it is).
    pub load_s: f64,
}

/// What each term of WRS is divided by, and where a normalised term is clamped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WrsScales {
    pub input: f64,
    pub output: f64,
    pub rank: f64,
    pub load_s: f64,
    /// Largest value one normalised term may take (so one outlier cannot make its own
    /// queue out of a single term).
    pub clamp: f64,
}

/// A normalised term is at most this many window means.
pub const MEAN_CLAMP: f64 = 8.0;

impl WrsScales {
    /// Means over a window of `(request, predicted service seconds)`; a term whose mean is 0
    /// (e.g. only base-model requests: rank 0) keeps `fixed`'s scale. None for an empty window.
    pub fn of_window<'a>(
        window: impl Iterator<Item = (&'a RequestSize, f64)>,
        fixed: &WrsScales,
    ) -> Option<Self> {
        let (mut n, mut sum) = (0usize, [0.0f64; 4]);
        for (r, service_s) in window {
            n += 1;
            sum[0] += r.input as f64;
            sum[1] += r.predicted_output as f64;
            sum[2] += r.rank as f64;
            sum[3] += service_s;
        }
        if n == 0 {
            return None;
        }
        let mean = |i: usize, or: f64| {
            let m = sum[i] / n as f64;
            if m > 0.0 && m.is_finite() {
                m
            } else {
                or
            }
        };
        Some(Self {
            input: mean(0, fixed.input),
            output: mean(1, fixed.output),
            rank: mean(2, fixed.rank),
            load_s: mean(3, fixed.load_s),
            clamp: MEAN_CLAMP,
        })
    }
}

impl WrsWeights {
    /// The fixed maxima, clamped at 1 (before the first fit).
    pub fn fixed_scales(&self) -> WrsScales {
        WrsScales {
            input: self.max_input as f64,
            output: self.max_output as f64,
            rank: self.max_rank as f64,
            load_s: self.max_load_s,
            clamp: 1.0,
        }
    }

    /// WRS over the fixed maxima.
    pub fn wrs(&self, r: &RequestSize) -> f64 {
        self.wrs_with(r, &self.fixed_scales())
    }

    /// WRS with each term divided by `sc`'s scale and clamped to `[0, sc.clamp]`.
    pub fn wrs_with(&self, r: &RequestSize, sc: &WrsScales) -> f64 {
        let norm = |v: f64, s: f64| (v / s.max(f64::MIN_POSITIVE)).clamp(0.0, sc.clamp);
        self.input * norm(r.input as f64, sc.input)
            + self.output * norm(r.predicted_output as f64, sc.output)
            + self.rank * norm(r.rank as f64, sc.rank)
            + self.load * norm(r.load_s, sc.load_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_the_papers_and_terms_are_normalised() {
        let w = WrsWeights {
            max_input: 100,
            max_output: 200,
            max_rank: 64,
            max_load_s: 2.0,
            ..Default::default()
        };
        let r = RequestSize {
            input: 50,
            predicted_output: 50,
            rank: 16,
            load_s: 1.0,
        };
        let want = 0.3 * 0.5 + 0.5 * 0.25 + 0.2 * 0.25 + 0.1 * 0.5;
        assert!((w.wrs(&r) - want).abs() < 1e-12);
        let huge = RequestSize {
            input: 10_000,
            predicted_output: 10_000,
            rank: 1024,
            load_s: 9.0,
        };
        assert!((w.wrs(&huge) - 1.1).abs() < 1e-12, "each term clamps at 1");
        assert_eq!(w.wrs(&RequestSize::default()), 0.0);
    }

    #[test]
    fn output_weighs_most() {
        let w = WrsWeights::default();
        let base = RequestSize::default();
        let out = RequestSize {
            predicted_output: 1000,
            ..base
        };
        let inp = RequestSize {
            input: 1000,
            ..base
        };
        assert!(w.wrs(&out) > w.wrs(&inp));
    }

    fn req(input: usize, out: usize, rank: usize, load_s: f64) -> RequestSize {
        RequestSize {
            input,
            predicted_output: out,
            rank,
            load_s,
        }
    }

    #[test]
    fn window_means_let_the_output_decide_where_fixed_maxima_let_the_rank() {
        // The issue's "Why" workload on a 2048-token model: 128-token prompts, outputs of 16
        // or 328 tokens, ranks 8 or 128.
        let w = WrsWeights {
            max_input: 2048,
            max_output: 2048,
            max_rank: 128,
            ..Default::default()
        };
        let short_big_rank = req(128, 16, 128, 0.0);
        let long_small_rank = req(128, 328, 8, 0.0);
        let fixed = w.fixed_scales();
        assert!(w.wrs_with(&short_big_rank, &fixed) > w.wrs_with(&long_small_rank, &fixed));
        let window: Vec<(RequestSize, f64)> = (0..100)
            .map(|i| {
                let out = if i % 7 == 0 { 328 } else { 16 };
                let rank = [8, 16, 32, 64, 128][i % 5];
                (req(128, out, rank, 0.0), out as f64 * 0.01)
            })
            .collect();
        let sc = WrsScales::of_window(window.iter().map(|(r, s)| (r, *s)), &fixed).unwrap();
        assert!(w.wrs_with(&long_small_rank, &sc) > w.wrs_with(&short_big_rank, &sc));
    }

    #[test]
    fn a_term_with_a_zero_mean_keeps_its_fixed_scale() {
        let w = WrsWeights::default();
        let fixed = w.fixed_scales();
        let window = [(req(10, 20, 0, 0.0), 0.5), (req(30, 40, 0, 0.0), 1.5)];
        let sc = WrsScales::of_window(window.iter().map(|(r, s)| (r, *s)), &fixed).unwrap();
        assert_eq!((sc.input, sc.output, sc.load_s), (20.0, 30.0, 1.0));
        assert_eq!(sc.rank, fixed.rank, "no adapter in the window");
        assert!(WrsScales::of_window(std::iter::empty(), &fixed).is_none());
    }

    proptest::proptest! {
        /// Window-normalised WRS does not depend on the units: scaling every length, rank and
        /// time of the window and of the request by the same factors leaves it unchanged.
        #[test]
        fn window_wrs_is_scale_free(
            reqs in proptest::collection::vec((1usize..500, 1usize..500, 1usize..128, 0.0f64..2.0), 1..40),
            k in 1usize..5,
            t in 0.25f64..4.0,
        ) {
            let w = WrsWeights::default();
            let fixed = w.fixed_scales();
            let win: Vec<(RequestSize, f64)> = reqs
                .iter()
                .map(|&(i, o, r, l)| (req(i, o, r, l), (i + o) as f64 * 0.01))
                .collect();
            let big: Vec<(RequestSize, f64)> = win
                .iter()
                .map(|(r, s)| (req(r.input * k, r.predicted_output * k, r.rank * k, r.load_s * t), s * t))
                .collect();
            let a = WrsScales::of_window(win.iter().map(|(r, s)| (r, *s)), &fixed).unwrap();
            let b = WrsScales::of_window(big.iter().map(|(r, s)| (r, *s)), &fixed).unwrap();
            for ((r, _), (rb, _)) in win.iter().zip(&big) {
                let (x, y) = (w.wrs_with(r, &a), w.wrs_with(rb, &b));
                proptest::prop_assert!((x - y).abs() < 1e-9 * x.max(1.0), "{x} vs {y}");
                proptest::prop_assert!((0.0..=MEAN_CLAMP * 1.1 + 1e-9).contains(&x));
            }
        }
    }
}
