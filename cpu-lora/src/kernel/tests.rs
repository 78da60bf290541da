//! Kernel vs a naive f64 reference, per ISA and stored dtype.
//!
//! Tolerance: normwise `‖Δ − ref‖ / ‖ref‖ ≤ 1e-5`. The reference uses the same rounded
//! weights, so the only error is f32 accumulation over `d_in ≤ 11008` then `rank ≤ 128`
//! terms: about `√n · 2⁻²⁴ ≈ 1e-5` in the worst case, and far less in practice because the
//! kernel splits every sum over 8 lanes.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

const TOL: f64 = 1e-5;

/// A weight matrix stored in `dtype`, plus the exact values those bytes hold.
struct Weights {
    dtype: WeightDtype,
    bytes: Vec<u8>,
    values: Vec<f64>,
}

impl Weights {
    fn random(rng: &mut ChaCha8Rng, dtype: WeightDtype, len: usize) -> Self {
        let mut bytes = Vec::with_capacity(len * dtype.size());
        let mut values = Vec::with_capacity(len);
        for _ in 0..len {
            let v: f32 = rng.random_range(-1.0..1.0);
            let stored = match dtype {
                WeightDtype::F32 => {
                    bytes.extend_from_slice(&v.to_le_bytes());
                    v
                }
                WeightDtype::F16 => {
                    let h = half::f16::from_f32(v);
                    bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                    h.to_f32()
                }
                WeightDtype::Bf16 => {
                    let h = half::bf16::from_f32(v);
                    bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                    h.to_f32()
                }
            };
            values.push(f64::from(stored));
        }
        Self {
            dtype,
            bytes,
            values,
        }
    }

    fn mat(&self) -> LoraMat<'_> {
        LoraMat {
            dtype: self.dtype,
            bytes: &self.bytes,
        }
    }
}

/// One seeded problem with its inputs.
struct Case {
    p: LoraProblem,
    x: Vec<f32>,
    a: Weights,
    b: Weights,
    prefill: Vec<f32>,
}

impl Case {
    fn new(seed: u64, dtype: WeightDtype, [rows, d_in, d_out, rank]: [usize; 4]) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let scale = rng.random_range(0.25..2.0);
        let p = LoraProblem {
            rows,
            d_in,
            d_out,
            rank,
            scale,
        };
        let x = (0..rows * d_in)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let a = Weights::random(&mut rng, dtype, rank * d_in);
        let b = Weights::random(&mut rng, dtype, d_out * rank);
        let prefill = (0..rows * d_out)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        Self {
            p,
            x,
            a,
            b,
            prefill,
        }
    }

    /// `Δ` (plus `prefill` when accumulating), in f64 from the stored weights.
    fn reference(&self, accumulate: bool) -> Vec<f64> {
        let p = &self.p;
        let mut t = vec![0.0f64; p.rows * p.rank];
        for i in 0..p.rows {
            for j in 0..p.rank {
                t[i * p.rank + j] = (0..p.d_in)
                    .map(|k| f64::from(self.x[i * p.d_in + k]) * self.a.values[j * p.d_in + k])
                    .sum();
            }
        }
        let mut out = vec![0.0f64; p.rows * p.d_out];
        for i in 0..p.rows {
            for o in 0..p.d_out {
                let s: f64 = (0..p.rank)
                    .map(|j| t[i * p.rank + j] * self.b.values[o * p.rank + j])
                    .sum();
                let base = if accumulate {
                    f64::from(self.prefill[i * p.d_out + o])
                } else {
                    0.0
                };
                out[i * p.d_out + o] = base + f64::from(p.scale) * s;
            }
        }
        out
    }

    fn run(&self, isa: Isa, accumulate: bool, scratch: &mut Scratch) -> Vec<f32> {
        // Not-a-number where the kernel must overwrite: a missed element cannot pass.
        let mut out = if accumulate {
            self.prefill.clone()
        } else {
            vec![f32::NAN; self.prefill.len()]
        };
        lora_delta_on(
            isa,
            &self.p,
            &self.x,
            self.a.mat(),
            self.b.mat(),
            &mut out,
            accumulate,
            scratch,
        )
        .expect("valid problem");
        out
    }
}

/// `‖got − want‖ / ‖want‖`, or the absolute norm when `want` is all zeros.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

/// Every instruction set this CPU can run (the scalar one always).
fn isas() -> Vec<Isa> {
    let (yes, no): (Vec<Isa>, Vec<Isa>) = Isa::ALL.into_iter().partition(|i| i.available());
    if !no.is_empty() {
        eprintln!("note: {no:?} not available on this CPU; not exercised");
    }
    yes
}

const DTYPES: [WeightDtype; 3] = [WeightDtype::F32, WeightDtype::F16, WeightDtype::Bf16];

/// `[rows, d_in, d_out, rank]`: every odd row count, rank and hidden size from the issue.
const SHAPES: [[usize; 4]; 9] = [
    [1, 100, 100, 1],
    [3, 100, 4096, 8],
    [17, 4096, 100, 13],
    [3, 11008, 4096, 64],
    [17, 4096, 11008, 128],
    [1, 4096, 4096, 128],
    [17, 100, 100, 64],
    [16, 4096, 4096, 16],
    [5, 37, 29, 13],
];

#[test]
fn matches_reference_all_dtypes_shapes_isas() {
    let mut scratch = Scratch::new();
    for (s, &shape) in SHAPES.iter().enumerate() {
        for (d, &dtype) in DTYPES.iter().enumerate() {
            let case = Case::new((s * 3 + d) as u64, dtype, shape);
            for accumulate in [false, true] {
                let want = case.reference(accumulate);
                for isa in isas() {
                    let got = case.run(isa, accumulate, &mut scratch);
                    let err = rel_err(&got, &want);
                    assert!(
                        err <= TOL,
                        "{isa:?} {dtype:?} {shape:?} accumulate={accumulate}: rel err {err:.2e}"
                    );
                }
            }
        }
    }
}

#[test]
fn simd_agrees_with_scalar() {
    let mut scratch = Scratch::new();
    for (s, &shape) in SHAPES.iter().enumerate() {
        for dtype in DTYPES {
            let case = Case::new(100 + s as u64, dtype, shape);
            let scalar = case.run(Isa::Scalar, true, &mut scratch);
            let scalar64: Vec<f64> = scalar.iter().map(|&v| f64::from(v)).collect();
            for isa in isas().into_iter().filter(|&i| i != Isa::Scalar) {
                let simd = case.run(isa, true, &mut scratch);
                let err = rel_err(&simd, &scalar64);
                assert!(
                    err <= TOL,
                    "{isa:?} {dtype:?} {shape:?}: vs scalar rel err {err:.2e}"
                );
            }
        }
    }
}

#[test]
fn unaligned_weights_are_read_in_place() {
    for dtype in DTYPES {
        let case = Case::new(7, dtype, [3, 100, 37, 13]);
        let want = case.reference(false);
        // Shift the bytes by one so that no element is naturally aligned.
        let shifted = |w: &Weights| {
            let mut v = vec![0u8; w.bytes.len() + 1];
            v[1..].copy_from_slice(&w.bytes);
            v
        };
        let (a1, b1) = (shifted(&case.a), shifted(&case.b));
        let a = LoraMat {
            dtype,
            bytes: &a1[1..],
        };
        let b = LoraMat {
            dtype,
            bytes: &b1[1..],
        };
        for isa in isas() {
            let mut out = vec![f32::NAN; case.prefill.len()];
            lora_delta_on(
                isa,
                &case.p,
                &case.x,
                a,
                b,
                &mut out,
                false,
                &mut Scratch::new(),
            )
            .unwrap();
            let err = rel_err(&out, &want);
            assert!(err <= TOL, "{isa:?} {dtype:?} unaligned: rel err {err:.2e}");
        }
    }
}

#[test]
fn scratch_is_reused_across_shapes() {
    let mut scratch = Scratch::for_problem(&Case::new(0, WeightDtype::F32, SHAPES[4]).p);
    for (s, &shape) in SHAPES.iter().enumerate().rev() {
        let case = Case::new(200 + s as u64, WeightDtype::Bf16, shape);
        let got = case.run(Isa::best(), false, &mut scratch);
        assert!(rel_err(&got, &case.reference(false)) <= TOL, "{shape:?}");
    }
}

#[test]
fn wrong_lengths_are_errors_and_write_nothing() {
    let case = Case::new(3, WeightDtype::Bf16, [2, 16, 8, 4]);
    let mut out = vec![7.0f32; 16];
    let mut s = Scratch::new();
    let a = case.a.mat();
    let short_b = LoraMat {
        dtype: WeightDtype::Bf16,
        bytes: &case.b.bytes[1..],
    };
    let err = lora_delta(&case.p, &case.x, a, short_b, &mut out, false, &mut s).unwrap_err();
    assert!(matches!(err, LoraError::Weight { which: "B", .. }), "{err}");
    let err = lora_delta(
        &case.p,
        &case.x[1..],
        a,
        case.b.mat(),
        &mut out,
        false,
        &mut s,
    )
    .unwrap_err();
    assert!(
        matches!(err, LoraError::Activation { which: "x", .. }),
        "{err}"
    );
    let as_f32 = LoraMat {
        dtype: WeightDtype::F32,
        bytes: &case.a.bytes,
    };
    let err = lora_delta(
        &case.p,
        &case.x,
        as_f32,
        case.b.mat(),
        &mut out,
        false,
        &mut s,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            LoraError::Weight {
                which: "A",
                dtype: "f32",
                ..
            }
        ),
        "{err}"
    );
    assert!(out.iter().all(|&v| v == 7.0));
}

#[test]
fn typed_constructors_match_bytes() {
    let w = [1.5f32, -2.0];
    assert_eq!(LoraMat::from_f32(&w).bytes.len(), 8);
    let h = [half::bf16::from_f32(1.5)];
    let m = LoraMat::from_bf16(&h);
    assert_eq!(
        (m.dtype, read_elem(m.dtype, m.bytes, 0)),
        (WeightDtype::Bf16, 1.5)
    );
    let h = [half::f16::from_f32(-0.25)];
    assert_eq!(
        read_elem(WeightDtype::F16, LoraMat::from_f16(&h).bytes, 0),
        -0.25
    );
}

fn dtype_strategy() -> impl Strategy<Value = WeightDtype> {
    prop_oneof![
        Just(WeightDtype::F32),
        Just(WeightDtype::F16),
        Just(WeightDtype::Bf16)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_small_shapes(
        rows in 0usize..9,
        d_in in 0usize..70,
        d_out in 0usize..70,
        rank in 0usize..20,
        dtype in dtype_strategy(),
        accumulate in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let case = Case::new(seed, dtype, [rows, d_in, d_out, rank]);
        let want = case.reference(accumulate);
        for isa in isas() {
            let got = case.run(isa, accumulate, &mut Scratch::new());
            let err = rel_err(&got, &want);
            prop_assert!(err <= TOL, "{:?}: rel err {:.2e}", isa, err);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
    /// A shrink split by rank rows (in any chunk sizes), assembled, then expanded into a
    /// slice of the output columns (the rows of `B` for them), is bit for bit `lora_delta` on
    /// those columns — for decode-sized and larger row counts, each stored dtype, written or
    /// accumulated: what lets threads share one shrink and each expand its own columns.
    #[test]
    fn split_shrink_then_expand_equals_lora_delta(
        seed in any::<u64>(),
        rows in 1usize..24,
        d_in in 1usize..1200,
        d_out in 1usize..300,
        rank in 1usize..70,
        chunk in 1usize..20,
        cut in 0.0f64..1.0,
        dtype in prop_oneof![Just(WeightDtype::F32), Just(WeightDtype::F16), Just(WeightDtype::Bf16)],
        accumulate in any::<bool>(),
    ) {
        let c = Case::new(seed, dtype, [rows, d_in, d_out, rank]);
        let mut s = Scratch::new();
        let mut want = c.prefill.clone();
        lora_delta(&c.p, &c.x, c.a.mat(), c.b.mat(), &mut want, accumulate, &mut s).unwrap();
        let mut t = vec![f32::NAN; rows * rank];
        let mut part = Vec::new();
        for r0 in (0..rank).step_by(chunk) {
            let r1 = (r0 + chunk).min(rank);
            part.resize(rows * (r1 - r0), f32::NAN);
            lora_shrink(&c.p, &c.x, c.a.mat(), r0..r1, &mut part, &mut s).unwrap();
            for i in 0..rows {
                t[i * rank + r0..i * rank + r1].copy_from_slice(&part[i * (r1 - r0)..(i + 1) * (r1 - r0)]);
            }
        }
        // Columns lo..d_out only, from the rows of B for them.
        let lo = ((d_out as f64 * cut) as usize).min(d_out - 1);
        let n = d_out - lo;
        let es = dtype.size();
        let b = LoraMat { dtype, bytes: &c.b.bytes[lo * rank * es..] };
        let p = LoraProblem { d_out: n, ..c.p };
        let mut got: Vec<f32> = (0..rows).flat_map(|i| c.prefill[i * d_out + lo..(i + 1) * d_out].to_vec()).collect();
        lora_expand(&p, &mut t, b, &mut got, accumulate, &mut s).unwrap();
        for i in 0..rows {
            let w = &want[i * d_out + lo..(i + 1) * d_out];
            let g = &got[i * n..(i + 1) * n];
            prop_assert!(w.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits()), "row {i}");
        }
    }
}
