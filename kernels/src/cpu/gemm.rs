//! Dense matrix products over row-major f32 slices (single-threaded). `linear` runs on the
//! AVX-512 kernels where the CPU has them — decode rows (≤ `SMALL_M`) on the in-place dot
//! kernel, prompt rows on the packed-weight GEMM (`simd::gemm_nt_f32_prompt`) — else on
//! `matrixmultiply` (prompt rows) or row dots (decode rows).

use super::sys::{sgemm, MatMut, MatRef};

/// The sizes of one product: `x` is `[m, k]`, the output `[m, n]`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GemmShape {
    /// Rows of `x` and of the output.
    pub m: usize,
    /// Inner (reduction) dimension.
    pub k: usize,
    /// Columns of the output.
    pub n: usize,
}

fn check(op: &str, x: &[f32], w: &[f32], y: &[f32], s: GemmShape) {
    assert_eq!(
        x.len(),
        s.m * s.k,
        "{op}: x has {} elements, shape {s:?} wants m·k",
        x.len()
    );
    assert_eq!(
        w.len(),
        s.n * s.k,
        "{op}: w has {} elements, shape {s:?} wants n·k",
        w.len()
    );
    assert_eq!(
        y.len(),
        s.m * s.n,
        "{op}: y has {} elements, shape {s:?} wants m·n",
        y.len()
    );
}

/// `y[m,n] = x[m,k] · wᵀ` (or `+=` when `accumulate`) where `w` is `[n,k]` row-major — the
/// HF `nn.Linear` weight layout.
pub fn linear(x: &[f32], w: &[f32], y: &mut [f32], shape: GemmShape, accumulate: bool) {
    linear_scaled(x, w, y, shape, 1.0, accumulate);
}

/// `y[m,n] = alpha · x[m,k] · wᵀ` (or `+=` when `accumulate`), `w` is `[n,k]` row-major.
pub fn linear_scaled(
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    shape: GemmShape,
    alpha: f32,
    accumulate: bool,
) {
    check("linear", x, w, y, shape);
    let GemmShape { m, k, n } = shape;
    // AVX-512: prompt rows on the packed-weight GEMM, decode rows on the in-place dot
    // kernel (no packing copy; each weight row is read once anyway).
    if alpha == 1.0 && !accumulate {
        if m > SMALL_M && super::simd::gemm_nt_f32_prompt(x, w, (m, k, n), y, n) {
            return;
        }
        if super::simd::gemm_nt_f32(x, w, (m, k, n), y, n) {
            return;
        }
    }
    if m <= SMALL_M {
        return linear_small_m(x, w, y, shape, alpha, accumulate);
    }
    sgemm(
        m,
        k,
        n,
        alpha,
        MatRef {
            data: x,
            rs: k,
            cs: 1,
        },
        // wᵀ[i, j] = w[j, i] = w[j*k + i]
        MatRef {
            data: w,
            rs: 1,
            cs: k,
        },
        if accumulate { 1.0 } else { 0.0 },
        MatMut {
            data: y,
            rs: n,
            cs: 1,
        },
    );
}

/// Up to this many rows, [`linear`] streams `w` once with dot products instead of packing it
/// for a GEMM: decode steps are bound by reading the weights, and packing them costs a copy.
pub(crate) const SMALL_M: usize = 16;

/// Up to this many rows per part, a product split over threads splits by output columns
/// (each part packs and reads only its share of the weight; a prompt chunk of a few
/// sequences) rather than by rows (each part packs all of it). Column parts keep the whole
/// product's row count, so they take its kernel path and match it bit for bit.
pub const ROW_SPLIT_MIN: usize = 128;

/// `linear` for few rows: every row of `w` is read once and dotted with each row of `x`
/// (which stays in L1).
fn linear_small_m(x: &[f32], w: &[f32], y: &mut [f32], s: GemmShape, alpha: f32, accumulate: bool) {
    let GemmShape { m, k, n } = s;
    let mut col = [0.0f32; SMALL_M];
    let col = &mut col[..m];
    for j in 0..n {
        super::simd::dot_rows_f32(x, &w[j * k..(j + 1) * k], col);
        for (i, &d) in col.iter().enumerate() {
            let o = &mut y[i * n + j];
            *o = if accumulate {
                *o + alpha * d
            } else {
                alpha * d
            };
        }
    }
}

/// Dot product: AVX2/FMA where the CPU has it, else 16 partial sums in a fixed order (see
/// [`super::simd`]); either way fixed in summation order for a given length and level.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    super::simd::dot_f32(a, b)
}

/// `y[m,n] = x[m,k] · w[k,n]` (or `+=` when `accumulate`), all row-major.
pub fn matmul(x: &[f32], w: &[f32], y: &mut [f32], shape: GemmShape, accumulate: bool) {
    matmul_scaled(x, w, y, shape, 1.0, accumulate);
}

/// `y[m,n] = alpha · x[m,k] · w[k,n]` (or `+=` when `accumulate`), all row-major.
pub fn matmul_scaled(
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    shape: GemmShape,
    alpha: f32,
    accumulate: bool,
) {
    check("matmul", x, w, y, shape);
    let GemmShape { m, k, n } = shape;
    sgemm(
        m,
        k,
        n,
        alpha,
        MatRef {
            data: x,
            rs: k,
            cs: 1,
        },
        MatRef {
            data: w,
            rs: n,
            cs: 1,
        },
        if accumulate { 1.0 } else { 0.0 },
        MatMut {
            data: y,
            rs: n,
            cs: 1,
        },
    );
}

/// `y[r, :] += bias` for every row `r` of `y` (`[rows, bias.len()]`).
pub fn add_bias(y: &mut [f32], bias: &[f32]) {
    if bias.is_empty() {
        assert!(y.is_empty(), "add_bias: empty bias for a non-empty y");
        return;
    }
    assert_eq!(
        y.len() % bias.len(),
        0,
        "add_bias: y has {} elements, not a multiple of the bias length {}",
        y.len(),
        bias.len()
    );
    for row in y.chunks_exact_mut(bias.len()) {
        for (o, b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, rand_vec, rng};

    /// f64 `x[m,k] · op(w)` where `w_at(j, p)` reads the (p, j) element of the `[k, n]` operand.
    fn naive(x: &[f32], s: GemmShape, w_at: impl Fn(usize, usize) -> f32) -> Vec<f64> {
        let mut y = vec![0.0f64; s.m * s.n];
        for i in 0..s.m {
            for j in 0..s.n {
                y[i * s.n + j] = (0..s.k)
                    .map(|p| x[i * s.k + p] as f64 * w_at(j, p) as f64)
                    .sum();
            }
        }
        y
    }

    // Shapes that are not multiples of the microkernel tiles, plus degenerate ones.
    const SHAPES: [(usize, usize, usize); 6] = [
        (1, 1, 1),
        (1, 64, 37),
        (13, 70, 9),
        (33, 128, 65),
        (7, 3, 200),
        (64, 257, 31),
    ];

    // Tolerance: f32 accumulation over k ≤ 257 terms of size ≤ 1 errs by ~sqrt(k)·6e-8 ≈ 1e-6
    // relative to the output RMS in practice; 1e-5 leaves margin without hiding indexing bugs
    // (which produce O(1) errors).
    const TOL: f64 = 1e-5;

    #[test]
    fn linear_and_matmul_match_f64() {
        let mut r = rng(1);
        for (m, k, n) in SHAPES {
            let s = GemmShape { m, k, n };
            let x = rand_vec(&mut r, m * k, 1.0);
            let w = rand_vec(&mut r, n * k, 1.0);
            let y0 = rand_vec(&mut r, m * n, 1.0);

            let want = naive(&x, s, |j, p| w[j * k + p]);
            let mut y = y0.clone();
            linear(&x, &w, &mut y, s, false);
            assert_close("linear", &y, &want, TOL);

            let want_acc: Vec<f64> = want.iter().zip(&y0).map(|(a, b)| a + *b as f64).collect();
            let mut y = y0.clone();
            linear(&x, &w, &mut y, s, true);
            assert_close("linear accumulate", &y, &want_acc, TOL);

            let want = naive(&x, s, |j, p| w[p * n + j]);
            let mut y = y0.clone();
            matmul(&x, &w, &mut y, s, false);
            assert_close("matmul", &y, &want, TOL);

            let want: Vec<f64> = want
                .iter()
                .zip(&y0)
                .map(|(a, b)| -0.5 * a + *b as f64)
                .collect();
            let mut y = y0.clone();
            matmul_scaled(&x, &w, &mut y, s, -0.5, true);
            assert_close("matmul_scaled accumulate", &y, &want, TOL);
        }
    }

    #[test]
    fn overwrite_ignores_nan_and_empty_k_zeroes() {
        let mut r = rng(2);
        let s = GemmShape { m: 3, k: 5, n: 4 };
        let (x, w) = (rand_vec(&mut r, 15, 1.0), rand_vec(&mut r, 20, 1.0));
        let mut y = vec![f32::NAN; 12];
        linear(&x, &w, &mut y, s, false);
        assert!(y.iter().all(|v| v.is_finite()));

        let mut y = rand_vec(&mut r, 6, 1.0);
        linear(&[], &[], &mut y, GemmShape { m: 2, k: 0, n: 3 }, false);
        assert_eq!(y, vec![0.0; 6]);
    }

    #[test]
    fn add_bias_adds_per_row() {
        let mut r = rng(3);
        let bias = rand_vec(&mut r, 5, 1.0);
        let y0 = rand_vec(&mut r, 15, 1.0);
        let mut y = y0.clone();
        add_bias(&mut y, &bias);
        for (i, (g, o)) in y.iter().zip(&y0).enumerate() {
            assert_eq!(*g, o + bias[i % 5]);
        }
    }
}
