//! The portable fallback: plain Rust, written so that the compiler can vectorise it for the
//! target's baseline (SSE2 on x86-64, NEON on aarch64). Also the reference the SIMD path is
//! checked against.

use std::ops::Range;

use super::{check_block, read_elem, Dims, LoraMat, Ops, Rows, RowsMut, WeightDtype};

/// Expand panel width.
const PANEL: usize = 24;

/// Independent partial sums per dot product: breaks the add chain so it can pipeline.
const LANES: usize = 8;

#[derive(Copy, Clone, Debug)]
pub(crate) struct Scalar;

impl Ops for Scalar {
    const PANEL: usize = PANEL;
    // The trait's portable few-rows expand (no transpose of `B`).
    const BCAST_ROWS: usize = super::BCAST_LANES;

    fn widen(self, dtype: WeightDtype, src: &[u8], dst: &mut [f32], _next: &[u8]) {
        assert_eq!(src.len(), dst.len() * dtype.size(), "widen: length");
        for (i, d) in dst.iter_mut().enumerate() {
            *d = read_elem(dtype, src, i);
        }
    }

    fn shrink(self, x: Rows<'_>, a: Rows<'_>, t: RowsMut<'_>, d: Dims, first: bool) {
        check_block("shrink x", x.data.len(), x.ld, d.m, d.k);
        check_block("shrink a", a.data.len(), a.ld, d.n, d.k);
        check_block("shrink t", t.data.len(), t.ld, d.m, d.n);
        for i in 0..d.m {
            let xr = &x.data[i * x.ld..][..d.k];
            for j in 0..d.n {
                let s = dot(xr, &a.data[j * a.ld..][..d.k]);
                let dst = &mut t.data[i * t.ld + j];
                *dst = if first { s } else { *dst + s };
            }
        }
    }

    fn pack_bt(self, b: LoraMat<'_>, rank: usize, cols: Range<usize>, dst: &mut [f32]) {
        let n = cols.len();
        let panels = n.div_ceil(PANEL);
        assert!(dst.len() >= panels * rank * PANEL, "pack_bt: dst too small");
        assert!(
            b.bytes.len() >= cols.end * rank * b.dtype.size(),
            "pack_bt: b too small"
        );
        for c in 0..panels * PANEL {
            let base = (c / PANEL) * rank * PANEL + c % PANEL;
            for j in 0..rank {
                dst[base + j * PANEL] = if c < n {
                    read_elem(b.dtype, b.bytes, (cols.start + c) * rank + j)
                } else {
                    0.0
                };
            }
        }
    }

    fn expand(self, t: Rows<'_>, panels: &[f32], out: RowsMut<'_>, d: Dims, accumulate: bool) {
        check_block("expand t", t.data.len(), t.ld, d.m, d.k);
        check_block("expand out", out.data.len(), out.ld, d.m, d.n);
        assert!(
            panels.len() >= d.n.div_ceil(PANEL) * d.k * PANEL,
            "expand: panels too small"
        );
        for i in 0..d.m {
            let tr = &t.data[i * t.ld..][..d.k];
            for (pi, c0) in (0..d.n).step_by(PANEL).enumerate() {
                let panel = &panels[pi * d.k * PANEL..][..d.k * PANEL];
                let mut acc = [0.0f32; PANEL];
                for (tj, brow) in tr.iter().zip(panel.chunks_exact(PANEL)) {
                    for (a, b) in acc.iter_mut().zip(brow) {
                        *a += tj * b;
                    }
                }
                let w = PANEL.min(d.n - c0);
                let o = &mut out.data[i * out.ld + c0..][..w];
                for (o, a) in o.iter_mut().zip(&acc) {
                    *o = if accumulate { *o + a } else { *a };
                }
            }
        }
    }
}

fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (xc, xt) = x.split_at(x.len() / LANES * LANES);
    let (yc, yt) = y.split_at(xc.len());
    for (xs, ys) in xc.chunks_exact(LANES).zip(yc.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += xs[l] * ys[l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (a, b) in xt.iter().zip(yt) {
        s += a * b;
    }
    s
}
