//! The blocked driver every ISA shares (see the parent module for the blocking), the
//! [`Ops`] each backend supplies, and the small views they exchange.

use std::ops::Range;

use super::{grow, LoraMat, LoraProblem, Scratch, WeightDtype};

/// Row lanes of the few-rows path's `tᵀ` (one AVX-512 vector).
pub(crate) const BCAST_LANES: usize = 16;

/// The widest [`Ops::PANEL`] of any backend (sizes [`Scratch::for_problem`]).
pub(super) const MAX_PANEL: usize = 48;

/// Cache blocking for one problem.
#[derive(Copy, Clone, Debug)]
pub(super) struct Blocking {
    /// `d_in` chunk: `[rank, kc]` of `A` is at most 512 KiB of f32 (half of a typical L2) and
    /// `[6, kc]` of `x` fits in L1.
    pub kc: usize,
    /// `d_out` chunk, a multiple of the panel width: its `[rank, nc]` panels are at most
    /// 256 KiB of f32 (L2), so each row block sweeps long contiguous runs of `Δ`.
    pub nc: usize,
}

impl Blocking {
    pub(super) fn for_problem(p: &LoraProblem, panel: usize) -> Self {
        let rank = p.rank.max(1);
        // kc ≤ 1024 also keeps a 6-row block of `x` (24 KiB) in L1 across the rank tiles.
        let kc = ((128 * 1024 / rank) & !15)
            .clamp(256, 1024)
            .min(p.d_in.max(1));
        let nc = ((64 * 1024 / rank) / panel * panel).clamp(panel, 4096 / panel * panel);
        Self {
            kc,
            nc: nc.min(p.d_out.max(1)),
        }
    }
}

/// A row-major f32 matrix view: row `i` starts at `data[i * ld]`.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Rows<'a> {
    pub data: &'a [f32],
    pub ld: usize,
}

/// A mutable [`Rows`].
#[derive(Debug)]
pub(crate) struct RowsMut<'a> {
    pub data: &'a mut [f32],
    pub ld: usize,
}

/// Sizes of one inner product: `[m, k] · [k, n]`.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Panics unless an `m × cols` block with leading dimension `ld` fits in `len`.
pub(crate) fn check_block(what: &str, len: usize, ld: usize, m: usize, cols: usize) {
    assert!(
        cols <= ld || m <= 1,
        "{what}: {cols} columns exceed leading dimension {ld}"
    );
    let need = if m == 0 || cols == 0 {
        0
    } else {
        (m - 1) * ld + cols
    };
    assert!(
        need <= len,
        "{what}: block {m}x{cols} (ld {ld}) needs {need} elements, has {len}"
    );
}

/// The per-ISA building blocks the blocked driver is made of. Each checks its own bounds.
pub(crate) trait Ops: Copy {
    /// Columns of one transposed `B` panel: the expand micro-kernel's width.
    const PANEL: usize;

    /// `dst[i] = src[i]` widened to f32, `dst.len()` elements. `next` is the source the
    /// following call will read: a hint to prefetch (rows of `A` are a page apart, so the
    /// hardware prefetcher restarts on every one when the weights are cold).
    fn widen(self, dtype: WeightDtype, src: &[u8], dst: &mut [f32], next: &[u8]);
    /// `t[m, n] (=|+=) x[m, k] · a[n, k]ᵀ` (`=` when `first`).
    fn shrink(self, x: Rows<'_>, a: Rows<'_>, t: RowsMut<'_>, d: Dims, first: bool);
    /// Transposes rows `cols` of `b` (`[_, rank]`) into panels: element `(o, j)` goes to
    /// `dst[(c / P) * rank * P + j * P + c % P]` (`P = PANEL`) with `c = o - cols.start`.
    /// Panel columns past `cols.end` are zeroed.
    fn pack_bt(self, b: LoraMat<'_>, rank: usize, cols: Range<usize>, dst: &mut [f32]);
    /// `out[m, n] (=|+=) t[m, k] · panels` where `panels` is [`Ops::pack_bt`]'s layout with
    /// `rank = k` and `n` columns.
    fn expand(self, t: Rows<'_>, panels: &[f32], out: RowsMut<'_>, d: Dims, accumulate: bool);

    /// Up to this many rows, [`Ops::expand_rows_bcast`] replaces pack + expand (0: never).
    const BCAST_ROWS: usize = 0;

    /// Few-rows expand straight from `B`'s natural layout, no transpose of `B`:
    /// `out[m, n] (=|+=) tᵀ[k, ..m]ᵀ · b[n, k]ᵀ` with `tt` laid out `[k, BCAST_LANES]` and
    /// `b` f32 rows. Vectors run along rows (one broadcast of `b` per FMA), so the cost of
    /// turning them back into rows of `out` scales with `rows · n`, not `rank · n` like the
    /// transpose of `B` — the better deal when `rows` is small.
    fn expand_rows_bcast(
        self,
        tt: &[f32],
        b: Rows<'_>,
        out: RowsMut<'_>,
        d: Dims,
        accumulate: bool,
    ) {
        check_block("bcast b", b.data.len(), b.ld, d.n, d.k);
        check_block("bcast out", out.data.len(), out.ld, d.m, d.n);
        assert!(
            d.m <= BCAST_LANES && tt.len() >= d.k * BCAST_LANES,
            "bcast: tt"
        );
        for i in 0..d.m {
            for o in 0..d.n {
                let brow = &b.data[o * b.ld..][..d.k];
                let s: f32 = brow
                    .iter()
                    .enumerate()
                    .map(|(j, bj)| tt[j * BCAST_LANES + i] * bj)
                    .sum();
                let dst = &mut out.data[i * out.ld + o];
                *dst = if accumulate { *dst + s } else { s };
            }
        }
    }
}

/// One validated call.
pub(super) struct Job<'a, 'p> {
    pub p: &'p LoraProblem,
    pub x: &'a [f32],
    pub a: LoraMat<'a>,
    pub b: LoraMat<'a>,
    pub accumulate: bool,
}

impl Job<'_, '_> {
    pub(super) fn run<O: Ops>(&self, ops: O, out: &mut [f32], scratch: &mut Scratch) {
        let p = self.p;
        if p.rows == 0 || p.d_out == 0 {
            return;
        }
        if p.rank == 0 || p.d_in == 0 {
            if !self.accumulate {
                out.fill(0.0);
            }
            return;
        }
        let mut t = std::mem::take(&mut scratch.t);
        let rt = grow(&mut t, p.rows * p.rank);
        self.shrink(ops, 0..p.rank, rt, &mut scratch.a_chunk);
        self.expand(ops, rt, out, scratch);
        scratch.t = t;
    }

    /// The expand, from the unscaled shrink `t` (`[rows, rank]`, scaled in place).
    pub(super) fn expand<O: Ops>(
        &self,
        ops: O,
        t: &mut [f32],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) {
        let p = self.p;
        let blk = Blocking::for_problem(p, O::PANEL);
        for v in t.iter_mut() {
            *v *= p.scale;
        }
        // Few rows, f32 `B` readable in place: skip the transpose of `B` (its cost scales with
        // rank, the bcast path's with rows). f16/bf16 take the pack path, which widens `B`
        // in the same pass as the transpose.
        if let Some(b) = in_place_f32(self.b).filter(|_| p.rows <= O::BCAST_ROWS && p.rows < p.rank)
        {
            self.expand_bcast(ops, t, b, out, &mut scratch.tt);
            return;
        }
        let t = Rows {
            data: t,
            ld: p.rank,
        };
        let panels = grow(
            &mut scratch.panels,
            blk.nc.div_ceil(O::PANEL) * O::PANEL * p.rank,
        );
        for o0 in (0..p.d_out).step_by(blk.nc) {
            let n = blk.nc.min(p.d_out - o0);
            ops.pack_bt(self.b, p.rank, o0..o0 + n, panels);
            let out = RowsMut {
                data: &mut out[o0..],
                ld: p.d_out,
            };
            let d = Dims {
                m: p.rows,
                n,
                k: p.rank,
            };
            ops.expand(t, panels, out, d, self.accumulate);
        }
    }

    /// The few-rows expand against `tᵀ`, reading f32 `B` in place.
    fn expand_bcast(
        &self,
        ops: impl Ops,
        t: &[f32],
        b: &[f32],
        out: &mut [f32],
        tt: &mut Vec<f32>,
    ) {
        let p = self.p;
        let tt = grow(tt, p.rank * BCAST_LANES);
        tt.fill(0.0);
        for (i, row) in t.chunks_exact(p.rank).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                tt[j * BCAST_LANES + i] = v;
            }
        }
        let b = Rows {
            data: b,
            ld: p.rank,
        };
        let out = RowsMut {
            data: out,
            ld: p.d_out,
        };
        let d = Dims {
            m: p.rows,
            n: p.d_out,
            k: p.rank,
        };
        ops.expand_rows_bcast(tt, b, out, d, self.accumulate);
    }

    /// `t[rows, ranks.len()] = x · A[ranks]ᵀ` (unscaled): columns `ranks` of the shrink, each
    /// element computed as the whole shrink computes it (the blocking is the whole problem's,
    /// and every element has its own accumulator).
    pub(super) fn shrink<O: Ops>(
        &self,
        ops: O,
        ranks: Range<usize>,
        t: &mut [f32],
        a_chunk: &mut Vec<f32>,
    ) {
        let p = self.p;
        let blk = Blocking::for_problem(p, O::PANEL);
        let nr = ranks.len();
        let a_in_place = in_place_f32(self.a);
        for k0 in (0..p.d_in).step_by(blk.kc) {
            let k = blk.kc.min(p.d_in - k0);
            let a = match a_in_place {
                Some(a) => Rows {
                    data: &a[ranks.start * p.d_in + k0..],
                    ld: p.d_in,
                },
                None => {
                    let chunk = grow(a_chunk, nr * k);
                    let es = self.a.dtype.size();
                    let row = |j: usize| {
                        let start = ((j * p.d_in + k0) * es).min(self.a.bytes.len());
                        &self.a.bytes[start..(start + k * es).min(self.a.bytes.len())]
                    };
                    for (j, dst) in chunk.chunks_exact_mut(k).enumerate() {
                        let j = ranks.start + j;
                        ops.widen(self.a.dtype, row(j), dst, row(j + 1));
                    }
                    Rows { data: chunk, ld: k }
                }
            };
            let x = Rows {
                data: &self.x[k0..],
                ld: p.d_in,
            };
            let d = Dims {
                m: p.rows,
                n: nr,
                k,
            };
            ops.shrink(x, a, RowsMut { data: t, ld: nr }, d, k0 == 0);
        }
    }
}

/// f32 weights that can be read as `&[f32]` without a copy (aligned, little-endian host).
fn in_place_f32(m: LoraMat<'_>) -> Option<&[f32]> {
    if m.dtype != WeightDtype::F32 || cfg!(target_endian = "big") {
        return None;
    }
    bytemuck::try_cast_slice(m.bytes).ok()
}

/// Element `i` of `bytes` (little-endian `dtype`), widened.
#[inline(always)]
pub(crate) fn read_elem(dtype: WeightDtype, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        WeightDtype::F32 => {
            let b = &bytes[4 * i..4 * i + 4];
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
        WeightDtype::F16 => half::f16::from_bits(u16_at(bytes, i)).to_f32(),
        WeightDtype::Bf16 => f32::from_bits(u32::from(u16_at(bytes, i)) << 16),
    }
}

#[inline(always)]
fn u16_at(bytes: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])
}
