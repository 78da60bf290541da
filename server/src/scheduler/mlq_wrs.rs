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
//! tier its bytes are in) as a fourth term, `D · load`, so a request that must first pull
//! its adapter over the link sizes as the larger job it is.

/// The weights and the scales each term is normalised by (a value at its scale counts 1;
/// above it is clamped to 1).
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

impl WrsWeights {
    pub fn wrs(&self, r: &RequestSize) -> f64 {
        let norm = |v: f64, max: f64| (v / max.max(f64::MIN_POSITIVE)).clamp(0.0, 1.0);
        self.input * norm(r.input as f64, self.max_input as f64)
            + self.output * norm(r.predicted_output as f64, self.max_output as f64)
            + self.rank * norm(r.rank as f64, self.max_rank as f64)
            + self.load * norm(r.load_s, self.max_load_s)
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
}
