//! Batched heterogeneous LoRA (Punica): `y += scale · (x · Aᵀ) · Bᵀ` where different rows use
//! different adapters. `A` is `[rank, d_in]` (PEFT `lora_A.weight`), `B` is `[d_out, rank]`
//! (PEFT `lora_B.weight`).
//!
//! * SGMV — rows of one adapter are contiguous segments; the intermediate is packed with no
//!   padding (cost ∝ Σ rank).
//! * BGMV — one adapter index per row; the intermediate is padded to the step's max rank (cost ∝
//!   rows · max rank).
//!
//! Both run each adapter's rows as one GEMM (for BGMV: each run of equal indices).

use super::gemm::{linear_scaled, matmul_scaled, GemmShape};
use super::sys::{sgemm, MatMut, MatRef};
use std::ops::Range;

/// One adapter's weights for one projection.
#[derive(Copy, Clone, Debug)]
pub struct LoraRef<'a> {
    /// `[rank, d_in]`, row-major.
    pub a: &'a [f32],
    /// `[d_out, rank]`, row-major.
    pub b: &'a [f32],
    /// LoRA rank `r`.
    pub rank: usize,
    /// Multiplier of the delta, usually `lora_alpha / r`.
    pub scale: f32,
}

/// A contiguous run of rows that all use `lora`.
#[derive(Clone, Debug)]
pub struct LoraSegment<'a> {
    /// Rows of `x` / `y` in this segment.
    pub rows: Range<usize>,
    /// The adapter those rows use.
    pub lora: LoraRef<'a>,
}

impl LoraRef<'_> {
    fn check(&self, op: &str, d_in: Option<usize>, d_out: Option<usize>) {
        if let Some(d_in) = d_in {
            assert_eq!(
                self.a.len(),
                self.rank * d_in,
                "{op}: A has {} elements, want rank {} × d_in {d_in}",
                self.a.len(),
                self.rank
            );
        }
        if let Some(d_out) = d_out {
            assert_eq!(
                self.b.len(),
                d_out * self.rank,
                "{op}: B has {} elements, want d_out {d_out} × rank {}",
                self.b.len(),
                self.rank
            );
        }
    }
}

/// Size of the packed `v` buffer for these segments: `Σ rows_s · rank_s`.
pub fn sgmv_scratch_len(segments: &[LoraSegment<'_>]) -> usize {
    segments.iter().map(|s| s.rows.len() * s.lora.rank).sum()
}

/// SGMV shrink: for each segment `s`, `v_s = x[rows] · Aᵀ`, packed with no padding: segment `s`
/// occupies `v[off_s .. off_s + rows_s·rank_s]` where `off_s = Σ_{t<s} rows_t·rank_t`. `x` is
/// `[rows_total, d_in]`; `v` holds at least [`sgmv_scratch_len`] elements.
pub fn sgmv_shrink(x: &[f32], d_in: usize, segments: &[LoraSegment<'_>], v: &mut [f32]) {
    let need = sgmv_scratch_len(segments);
    assert!(
        v.len() >= need,
        "sgmv_shrink: v has {} elements, segments need {need}",
        v.len()
    );
    let mut off = 0;
    for s in segments {
        s.lora.check("sgmv_shrink", Some(d_in), None);
        assert!(
            s.rows.end * d_in <= x.len(),
            "sgmv_shrink: rows {:?} outside x",
            s.rows
        );
        let (m, len) = (s.rows.len(), s.rows.len() * s.lora.rank);
        let shape = GemmShape {
            m,
            k: d_in,
            n: s.lora.rank,
        };
        let xs = &x[s.rows.start * d_in..s.rows.end * d_in];
        linear_scaled(xs, s.lora.a, &mut v[off..off + len], shape, 1.0, false);
        off += len;
    }
}

/// SGMV expand: `y[rows] += scale · v_s · Bᵀ` for each segment, reading `v` packed as
/// [`sgmv_shrink`] wrote it; `y` is `[rows_total, d_out]`.
pub fn sgmv_expand(v: &[f32], segments: &[LoraSegment<'_>], y: &mut [f32], d_out: usize) {
    let need = sgmv_scratch_len(segments);
    assert!(
        v.len() >= need,
        "sgmv_expand: v has {} elements, segments need {need}",
        v.len()
    );
    let mut off = 0;
    for s in segments {
        s.lora.check("sgmv_expand", None, Some(d_out));
        assert!(
            s.rows.end * d_out <= y.len(),
            "sgmv_expand: rows {:?} outside y",
            s.rows
        );
        let (m, len) = (s.rows.len(), s.rows.len() * s.lora.rank);
        let shape = GemmShape {
            m,
            k: s.lora.rank,
            n: d_out,
        };
        let ys = &mut y[s.rows.start * d_out..s.rows.end * d_out];
        linear_scaled(&v[off..off + len], s.lora.b, ys, shape, s.lora.scale, true);
        off += len;
    }
}

/// Shrink then expand: `y[rows] += scale · x[rows] · Aᵀ · Bᵀ` per segment; `scratch` grows to
/// [`sgmv_scratch_len`] and is reused.
pub fn sgmv(
    x: &[f32],
    d_in: usize,
    segments: &[LoraSegment<'_>],
    y: &mut [f32],
    d_out: usize,
    scratch: &mut Vec<f32>,
) {
    let need = sgmv_scratch_len(segments);
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    sgmv_shrink(x, d_in, segments, &mut scratch[..need]);
    sgmv_expand(&scratch[..need], segments, y, d_out);
}

/// Maximal runs of equal entries in `indices`, as (rows, index).
fn runs(indices: &[Option<u32>]) -> impl Iterator<Item = (Range<usize>, Option<u32>)> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        let first = *indices.get(start)?;
        let len = indices[start..].iter().take_while(|&&i| i == first).count();
        let rows = start..start + len;
        start += len;
        Some((rows, first))
    })
}

fn adapter<'a>(op: &str, adapters: &[LoraRef<'a>], i: u32, max_rank: usize) -> LoraRef<'a> {
    let a = *adapters.get(i as usize).unwrap_or_else(|| {
        panic!(
            "{op}: adapter index {i} but only {} adapters",
            adapters.len()
        )
    });
    assert!(
        a.rank <= max_rank,
        "{op}: adapter {i} has rank {} > max_rank {max_rank}",
        a.rank
    );
    a
}

/// BGMV shrink: `v[r, :rank_i] = x[r] · A_iᵀ` for each row `r` with adapter index `i`
/// (`None` = no LoRA). `x` is `[rows, d_in]`, `v` is `[rows, max_rank]`, padded: entries past an
/// adapter's rank, and whole rows without an adapter, are written as 0.
pub fn bgmv_shrink(
    x: &[f32],
    d_in: usize,
    indices: &[Option<u32>],
    adapters: &[LoraRef<'_>],
    max_rank: usize,
    v: &mut [f32],
) {
    let rows = indices.len();
    assert_eq!(
        x.len(),
        rows * d_in,
        "bgmv_shrink: x is not [{rows}, {d_in}]"
    );
    assert_eq!(
        v.len(),
        rows * max_rank,
        "bgmv_shrink: v is not [{rows}, {max_rank}]"
    );
    for (run, idx) in runs(indices) {
        let vr = &mut v[run.start * max_rank..run.end * max_rank];
        let Some(i) = idx else {
            vr.fill(0.0);
            continue;
        };
        let l = adapter("bgmv_shrink", adapters, i, max_rank);
        l.check("bgmv_shrink", Some(d_in), None);
        let xr = &x[run.start * d_in..run.end * d_in];
        for row in vr.chunks_exact_mut(max_rank) {
            row[l.rank..].fill(0.0);
        }
        sgemm(
            run.len(),
            d_in,
            l.rank,
            1.0,
            MatRef {
                data: xr,
                rs: d_in,
                cs: 1,
            },
            MatRef {
                data: l.a,
                rs: 1,
                cs: d_in,
            },
            0.0,
            MatMut {
                data: vr,
                rs: max_rank,
                cs: 1,
            },
        );
    }
}

/// BGMV expand: `y[r] += scale_i · v[r, :rank_i] · B_iᵀ` for each row `r` with an index;
/// `v` is `[rows, max_rank]`, `y` is `[rows, d_out]`.
pub fn bgmv_expand(
    v: &[f32],
    max_rank: usize,
    indices: &[Option<u32>],
    adapters: &[LoraRef<'_>],
    y: &mut [f32],
    d_out: usize,
) {
    let rows = indices.len();
    assert_eq!(
        v.len(),
        rows * max_rank,
        "bgmv_expand: v is not [{rows}, {max_rank}]"
    );
    assert_eq!(
        y.len(),
        rows * d_out,
        "bgmv_expand: y is not [{rows}, {d_out}]"
    );
    for (run, idx) in runs(indices) {
        let Some(i) = idx else { continue };
        let l = adapter("bgmv_expand", adapters, i, max_rank);
        l.check("bgmv_expand", None, Some(d_out));
        sgemm(
            run.len(),
            l.rank,
            d_out,
            l.scale,
            MatRef {
                data: &v[run.start * max_rank..run.end * max_rank],
                rs: max_rank,
                cs: 1,
            },
            // Bᵀ[p, j] = B[j, p] = b[j*rank + p]
            MatRef {
                data: l.b,
                rs: 1,
                cs: l.rank,
            },
            1.0,
            MatMut {
                data: &mut y[run.start * d_out..run.end * d_out],
                rs: d_out,
                cs: 1,
            },
        );
    }
}

/// Shrink then expand with the padded intermediate in `scratch` (grows to `rows · max_rank`).
#[allow(clippy::too_many_arguments)]
pub fn bgmv(
    x: &[f32],
    d_in: usize,
    indices: &[Option<u32>],
    adapters: &[LoraRef<'_>],
    max_rank: usize,
    y: &mut [f32],
    d_out: usize,
    scratch: &mut Vec<f32>,
) {
    let need = indices.len() * max_rank;
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    bgmv_shrink(x, d_in, indices, adapters, max_rank, &mut scratch[..need]);
    bgmv_expand(&scratch[..need], max_rank, indices, adapters, y, d_out);
}

/// The merged-weight oracle helper: `w[d_out, d_in] += scale · B · A`.
pub fn merge_lora_into(w: &mut [f32], lora: LoraRef<'_>, d_in: usize, d_out: usize) {
    lora.check("merge_lora_into", Some(d_in), Some(d_out));
    let shape = GemmShape {
        m: d_out,
        k: lora.rank,
        n: d_in,
    };
    matmul_scaled(lora.b, lora.a, w, shape, lora.scale, true);
}

#[cfg(test)]
#[path = "lora_tests.rs"]
mod tests;
