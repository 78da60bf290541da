//! The portable kernels: plain Rust, fixed summation order. The oracle for the SIMD ones
//! (which must agree to f32 rounding) and the fallback on CPUs without them.

use half::{bf16, f16};

use super::Q8Block;
use crate::cpu::quant::WeightFormat;

/// 16 independent partial sums (vectorisable, fixed order for a given length), then a
/// pairwise reduction and the tail.
fn dot_by(n: usize, mut term: impl FnMut(usize) -> f32) -> f32 {
    const L: usize = 16;
    let mut acc = [0.0f32; L];
    let body = n - n % L;
    for c in (0..body).step_by(L) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += term(c + l);
        }
    }
    let mut tail = 0.0f32;
    for i in body..n {
        tail += term(i);
    }
    let mut w = L;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0] + tail
}

/// `out[r] = dot(x[r])` for the rows of `x` (`k` wide).
pub(super) fn rows(x: &[f32], k: usize, out: &mut [f32], dot: impl Fn(&[f32]) -> f32) {
    if k == 0 {
        return out.fill(0.0);
    }
    for (o, xr) in out.iter_mut().zip(x.chunks_exact(k)) {
        *o = dot(xr);
    }
}

pub(super) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_by(a.len(), |i| a[i] * b[i])
}

pub(super) fn dot_f16(x: &[f32], w: &[f16]) -> f32 {
    dot_by(x.len(), |i| x[i] * w[i].to_f32())
}

pub(super) fn dot_bf16(x: &[f32], w: &[bf16]) -> f32 {
    dot_by(x.len(), |i| x[i] * w[i].to_f32())
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// `w·x` for a row of quantised blocks and f32 activations: [`dot_f32`] over the row
/// dequantised block by block (`dot_by` visits elements in increasing order).
pub(super) fn dot_quant_f32(format: WeightFormat, w: &[u8], x: &[f32]) -> f32 {
    let bb = format.block_bytes();
    let mut blk = [0.0f32; super::Q8_BLOCK];
    dot_by(x.len(), |i| {
        let (b, e) = (i / super::Q8_BLOCK, i % super::Q8_BLOCK);
        if e == 0 {
            crate::cpu::quant::dequantize_block(format, &w[b * bb..(b + 1) * bb], &mut blk);
        }
        x[i] * blk[e]
    })
}

/// Per block: the exact integer dot, then `acc += d_w·d_x·isum` (+ `m_w·s_x` for Q4_1).
pub(super) fn dot_q8(format: WeightFormat, w: &[u8], x: &[Q8Block]) -> f32 {
    let bb = format.block_bytes();
    let mut acc = 0.0f32;
    for (b, xb) in w.chunks_exact(bb).zip(x) {
        let d = f16_at(b, 0);
        let (isum, m) = match format {
            WeightFormat::Q8_0 => (
                b[2..34]
                    .iter()
                    .zip(&xb.qs)
                    .map(|(&w, &x)| (w as i8) as i32 * x as i32)
                    .sum::<i32>(),
                0.0,
            ),
            WeightFormat::Q4_0 | WeightFormat::Q4_1 => {
                let (off, zero) = if format == WeightFormat::Q4_0 {
                    (2, 8)
                } else {
                    (4, 0)
                };
                let q = &b[off..off + 16];
                let isum = (0..16)
                    .map(|j| {
                        let lo = (q[j] & 0xF) as i32 - zero;
                        let hi = (q[j] >> 4) as i32 - zero;
                        lo * xb.qs[j] as i32 + hi * xb.qs[j + 16] as i32
                    })
                    .sum::<i32>();
                let m = if format == WeightFormat::Q4_1 {
                    f16_at(b, 2) * xb.s
                } else {
                    0.0
                };
                (isum, m)
            }
            f => unreachable!("dot_q8 checked the format, got {}", f.name()),
        };
        acc += d * xb.d * isum as f32 + m;
    }
    acc
}

/// [`super::quantize_q8`], plain Rust (the definition the AVX2 version reproduces).
pub(super) fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    for (v, b) in x.chunks_exact(super::Q8_BLOCK).zip(out.iter_mut()) {
        let amax = v.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &x) in b.qs.iter_mut().zip(v) {
            let r = (x * id).round_ties_even();
            *q = r as i8;
            sum += r as i32;
        }
        b.d = d;
        b.s = d * sum as f32;
    }
}
