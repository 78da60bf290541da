//! Whether a backend keeps the residual stream — the hidden state `h` that every layer adds
//! its attention and MLP outputs to — in 16 bits between layers (issue 29,
//! `THAW_CUDA_BF16_ACT`, on by default, `0` off), as one pure function of facts fixed for the backend's
//! lifetime, so the rule is property-tested on the CPU and the CPU emulation
//! ([`CpuBackend::set_act16`](super::cpu::CpuBackend::set_act16)) rounds exactly where CUDA
//! stores.
//!
//! Why: transformers runs a bf16 Llama with the residual in bf16
//! (`hidden_states = residual + hidden_states`, both bf16), so a 16-bit residual is what the
//! reference computes, and each residual add + RMSNorm moves fewer bytes: per element of the
//! `rows × hidden` stream ([`residual_traffic_bytes`]) the f32 path reads and writes `h` in
//! f32 (8 B), reads the block output `x` (4 B) and writes the f32 norm output (4 B) and its
//! 16-bit GEMM copy (2 B): 18 B; the 16-bit path reads and writes `h` in 16 bits (4 B): 14 B,
//! 22% fewer. At Llama-8B prefill (2048 × 4096, 64 add + norms a pass) that is 9.7 GB against
//! 7.5 GB a pass; at decode the stream is a few KB and the gain is the launch's latency only.
//!
//! Rounding, per element of a row (`rnd` = the weight dtype's round to nearest even), as
//! transformers' bf16 Llama does:
//! - `embed`: `h = table[id]`, already in the weight dtype (no rounding: the 16-bit table is
//!   copied, not widened).
//! - each residual add: `h = rnd(h + x)` with the sum in f32; the RMSNorm that follows it
//!   normalises the rounded `h` (its sum of squares in f32).
//! - the final gather widens `h` exactly to f32 for the final norm.
//!
//! The decision reads no fact of a step (rows, LoRA, graph or eager, GEMV): the buffer's
//! representation is private to the backend's residual ops ([`Backend`](super::Backend)'s
//! docs) and must be the same for every op of a step and every captured graph — a layer that
//! wrote `h` in 16 bits and a next one that read it as f32 would read garbage. The residual
//! itself is never read by a LoRA, a GEMV or the CPU-assist export (they read the norm's f32
//! output), so no per-step fact could ask for f32 anyway.

/// What the decision is made from: facts fixed for the backend's lifetime (a backend that
/// changes them, e.g. a test's `set_act16`, does so between forward passes, each of which
/// rewrites `h` from its `embed`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Residual16Facts {
    /// `THAW_CUDA_BF16_ACT=1` (or the test switch).
    pub switch_on: bool,
    /// The weights are bf16 or f16 (the 16-bit type the residual is stored in).
    pub weights_16bit: bool,
}

/// How the residual stream is stored between a backend's residual ops.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ResidualRepr {
    /// f32 (every backend before issue 29's switch).
    F32,
    /// The weight dtype, rounded to nearest even after every add.
    Sixteen,
}

/// The representation for a backend's lifetime: 16-bit where the switch is on, the weights
/// give a 16-bit type, and the traffic model says it moves fewer bytes (it always does; the
/// comparison keeps the model the one that decides, as `act16_plan` does).
pub fn residual16_plan(f: &Residual16Facts) -> ResidualRepr {
    if !f.switch_on || !f.weights_16bit {
        return ResidualRepr::F32;
    }
    let b = |r| residual_traffic_bytes(r, 1, 1);
    if b(ResidualRepr::Sixteen) < b(ResidualRepr::F32) {
        ResidualRepr::Sixteen
    } else {
        ResidualRepr::F32
    }
}

/// Bytes one residual add + RMSNorm over `rows × hidden` moves on `repr`: `h` read and
/// written, the block output `x` read (f32 on both), the f32 norm output and its 16-bit GEMM
/// copy written (both paths write the copy with 16-bit weights). What [`residual16_plan`]
/// compares and `cuda_bench --act16` divides by its time.
pub fn residual_traffic_bytes(repr: ResidualRepr, rows: usize, hidden: usize) -> usize {
    let n = rows * hidden;
    let h = match repr {
        ResidualRepr::F32 => 4,
        ResidualRepr::Sixteen => 2,
    };
    // h read + written, x read (4), out written (4), x16 written (2).
    (2 * h + 4 + 4 + 2) * n
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The figures the module docs quote: 18 B against 14 B per element; Llama-8B prefill
    /// (2048 × 4096, 64 add + norms) ~9.7 GB against ~7.5 GB a pass.
    #[test]
    fn the_model_matches_the_docs() {
        let b = |r| residual_traffic_bytes(r, 1, 1);
        assert_eq!([b(ResidualRepr::F32), b(ResidualRepr::Sixteen)], [18, 14]);
        let pass = |r| 64 * residual_traffic_bytes(r, 2048, 4096);
        assert!((9_600_000_000..9_700_000_000).contains(&pass(ResidualRepr::F32)));
        assert!((7_500_000_000..7_600_000_000).contains(&pass(ResidualRepr::Sixteen)));
    }

    proptest! {
        /// 16 bits exactly when the switch is on and the weights give a 16-bit type.
        #[test]
        fn sixteen_bit_exactly_when_switched_on_with_16_bit_weights(s: bool, w: bool) {
            let f = Residual16Facts { switch_on: s, weights_16bit: w };
            prop_assert_eq!(residual16_plan(&f) == ResidualRepr::Sixteen, s && w);
        }

        /// The chosen representation never moves more bytes than the other, for any shape;
        /// the 16-bit one moves exactly 14/18 of f32's.
        #[test]
        fn the_chosen_repr_never_moves_more_bytes(
            s: bool, w: bool, rows in 0usize..4096, hidden in 1usize..16384,
        ) {
            let f = Residual16Facts { switch_on: s, weights_16bit: w };
            let f32b = residual_traffic_bytes(ResidualRepr::F32, rows, hidden);
            let b16 = residual_traffic_bytes(ResidualRepr::Sixteen, rows, hidden);
            prop_assert_eq!(18 * b16, 14 * f32b);
            if s && w {
                prop_assert!(residual_traffic_bytes(residual16_plan(&f), rows, hidden) <= f32b);
            }
        }
    }
}
