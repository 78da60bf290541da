//! Seeded, deterministic weight initialisation.
//!
//! Every tensor is generated in chunks of [`CHUNK_ELEMS`] elements; chunk `c` of a tensor is
//! drawn from its own `ChaCha8Rng` keyed by `(seed, stream, c)`, where `stream` is a hash
//! of the tensor's label. A tensor's bytes therefore depend only on the seed and its name —
//! not on the order tensors are written in, nor on how many threads fill it — and the same
//! seed gives the same values (rounded) in every dtype.
//!
//! The scales below are chosen so that a randomly initialised model is *not degenerate*:
//! the residual stream keeps an RMS of order 1 through every layer, attention scores are
//! not uniform, and the logits have enough spread that sampling is not uniform noise and
//! greedy decoding depends on the context. They are starting points; tune them here.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

use super::presets::{Projection, WeightDtype};

/// Standard deviation of `embed_tokens` rows: the residual stream starts at RMS ≈ 1.
pub const EMBED_STD: f32 = 1.0;
/// Gain of `q_proj` and `k_proj` (σ = gain/√d_in). Above 1 so softmax(q·k/√d) is peaked
/// enough that attention is not a plain average (scores have std ≈ gain²).
pub const QK_GAIN: f32 = 1.5;
/// Gain of `v_proj` (σ = gain/√d_in): values keep the RMS of the normed input.
pub const V_GAIN: f32 = 1.0;
/// Gain of `gate_proj` and `up_proj` (σ = gain/√d_in).
pub const MLP_IN_GAIN: f32 = 1.0;
/// Gain of the residual-branch outputs `o_proj` and `down_proj`, further divided by
/// √(2·num_layers) (GPT-2 style) so that 2·L branches add ≈ 1 to the residual variance
/// instead of drowning the token embedding: σ = gain/√(d_in · 2L).
pub const RESIDUAL_OUT_GAIN: f32 = 1.0;
/// RMSNorm weights are 1 plus normal noise of this standard deviation.
pub const NORM_NOISE_STD: f32 = 0.05;
/// Target standard deviation of the logits for a normed final hidden state
/// (`lm_head` σ = LOGIT_STD/√hidden). 3 gives a top-1 probability of roughly 0.2–0.6 over a
/// few hundred tokens: peaked, not one-hot.
pub const LOGIT_STD: f32 = 3.0;

/// Gain of a projection's weight: its σ is `gain / √d_in` (see [`linear_std`]).
pub fn projection_gain(proj: Projection, num_layers: usize) -> f32 {
    match proj {
        Projection::Q | Projection::K => QK_GAIN,
        Projection::V => V_GAIN,
        Projection::Gate | Projection::Up => MLP_IN_GAIN,
        Projection::O | Projection::Down => {
            RESIDUAL_OUT_GAIN / ((2 * num_layers.max(1)) as f32).sqrt()
        }
    }
}

/// Standard deviation of a projection weight with `d_in` input features in a model of
/// `num_layers` layers. For a random input `x`, `‖W·x‖ ≈ gain · √(d_out/d_in) · ‖x‖`.
pub fn linear_std(proj: Projection, d_in: usize, num_layers: usize) -> f32 {
    projection_gain(proj, num_layers) / (d_in as f32).sqrt()
}

/// Elements per independently seeded chunk.
pub const CHUNK_ELEMS: usize = 1 << 16;

/// How a tensor's values are drawn: `mean + std · N(0, 1)`; rows at or past `live_rows`
/// (vocabulary padding) are zero.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Init {
    pub mean: f32,
    pub std: f32,
    /// Rows (first dimension) that get random values; `None` means all of them.
    pub live_rows: Option<usize>,
}

impl Init {
    /// `N(0, std²)` everywhere.
    pub fn normal(std: f32) -> Self {
        Init {
            mean: 0.0,
            std,
            live_rows: None,
        }
    }
}

/// One tensor to generate: its safetensors name, shape, dtype and initialisation.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: WeightDtype,
    pub init: Init,
    /// Random stream of this tensor, see [`stream_id`].
    pub stream: u64,
}

impl TensorSpec {
    /// A tensor whose random stream is derived from its own name.
    pub fn new(name: String, shape: Vec<usize>, dtype: WeightDtype, init: Init) -> Self {
        let stream = stream_id(&name);
        TensorSpec {
            name,
            shape,
            dtype,
            init,
            stream,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    /// Generates the tensor's little-endian bytes, filling chunks on all cores.
    pub fn generate(&self, seed: u64) -> Vec<u8> {
        let esz = self.dtype.size_bytes();
        let mut out = vec![0u8; self.size_bytes()];
        let chunks: Vec<(usize, &mut [u8])> =
            out.chunks_mut(CHUNK_ELEMS * esz).enumerate().collect();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(chunks.len());
        if threads <= 1 {
            for (idx, chunk) in chunks {
                self.fill_chunk(seed, idx, chunk);
            }
            return out;
        }
        let mut groups: Vec<Vec<(usize, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
        for (k, chunk) in chunks.into_iter().enumerate() {
            groups[k % threads].push(chunk);
        }
        std::thread::scope(|s| {
            for group in groups {
                s.spawn(move || {
                    for (idx, chunk) in group {
                        self.fill_chunk(seed, idx, chunk);
                    }
                });
            }
        });
        out
    }

    fn fill_chunk(&self, seed: u64, chunk_idx: usize, out: &mut [u8]) {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        key[8..16].copy_from_slice(&self.stream.to_le_bytes());
        key[16..24].copy_from_slice(&(chunk_idx as u64).to_le_bytes());
        key[24..].copy_from_slice(b"thawgen1");
        let mut rng = ChaCha8Rng::from_seed(key);

        let n = out.len() / self.dtype.size_bytes();
        let start = chunk_idx * CHUNK_ELEMS;
        let row_len: usize = self.shape.iter().skip(1).product::<usize>().max(1);
        let live_end = self
            .init
            .live_rows
            .map_or(usize::MAX, |rows| rows * row_len);
        let values: Vec<f32> = (start..start + n)
            .map(|i| {
                if i >= live_end {
                    0.0
                } else {
                    let z: f32 = rng.sample(StandardNormal);
                    self.init.mean + self.init.std * z
                }
            })
            .collect();
        self.dtype.encode(&values, out);
    }
}

/// FNV-1a hash of a label: the random stream of the tensor it names.
pub fn stream_id(label: &str) -> u64 {
    label.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_f32(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    #[test]
    fn generation_is_deterministic_and_has_the_requested_moments() {
        let spec = TensorSpec::new(
            "w".into(),
            vec![300, 700],
            WeightDtype::F32,
            Init::normal(0.5),
        );
        let a = spec.generate(7);
        assert_eq!(a, spec.generate(7));
        assert_ne!(a, spec.generate(8));
        let v = decode_f32(&a);
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        // 210k samples: the sample mean is within ~4.4 standard errors (0.5/√n ≈ 0.001).
        assert!(mean.abs() < 0.005, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "std {}", var.sqrt());
    }

    #[test]
    fn padding_rows_are_zero_and_live_rows_are_not() {
        let init = Init {
            live_rows: Some(3),
            ..Init::normal(1.0)
        };
        let spec = TensorSpec::new("e".into(), vec![5, 4], WeightDtype::F32, init);
        let v = decode_f32(&spec.generate(0));
        assert!(v[..12].iter().all(|&x| x != 0.0));
        assert!(v[12..].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn dtypes_hold_the_same_values_rounded() {
        let f32_spec = TensorSpec::new(
            "n".into(),
            vec![100_000],
            WeightDtype::F32,
            Init::normal(1.0),
        );
        let bf16_spec = TensorSpec {
            dtype: WeightDtype::Bf16,
            ..f32_spec.clone()
        };
        let full = decode_f32(&f32_spec.generate(3));
        let bf = bf16_spec.generate(3);
        for (i, x) in full.iter().enumerate().step_by(997) {
            let y = half::bf16::from_le_bytes([bf[2 * i], bf[2 * i + 1]]).to_f32();
            assert_eq!(y, half::bf16::from_f32(*x).to_f32());
        }
    }
}
