//! One block at a time: ggml's dequantisation (`dequantize_row_*`) and, for the 32-value
//! types, its reference quantisation (`quantize_row_*_ref`).

use half::f16;

use super::WeightFormat;
use crate::error::KernelError;

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Dequantises one block `b` (`format.block_bytes()` bytes) into `y` (`block_elems` values).
#[inline(always)]
pub(crate) fn dequantize_block(format: WeightFormat, b: &[u8], y: &mut [f32]) {
    match format {
        WeightFormat::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        WeightFormat::F16 => y[0] = f16_at(b, 0),
        WeightFormat::BF16 => {
            y[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
        }
        WeightFormat::Q8_0 => {
            let d = f16_at(b, 0);
            for (o, &q) in y[..32].iter_mut().zip(&b[2..34]) {
                *o = d * (q as i8) as f32;
            }
        }
        WeightFormat::Q4_0 => {
            let d = f16_at(b, 0);
            let (lo, hi) = y[..32].split_at_mut(16);
            for j in 0..16 {
                let q = b[2 + j];
                lo[j] = d * ((q & 0xF) as i32 - 8) as f32;
                hi[j] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
        WeightFormat::Q4_1 => {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            let (lo, hi) = y[..32].split_at_mut(16);
            for j in 0..16 {
                let q = b[4 + j];
                lo[j] = d * (q & 0xF) as f32 + m;
                hi[j] = d * (q >> 4) as f32 + m;
            }
        }
        WeightFormat::Q4_K => dequantize_q4_k(b, y),
        WeightFormat::Q6_K => dequantize_q6_k(b, y),
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8).
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn dequantize_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (c, (q, out)) in qs
        .chunks_exact(32)
        .zip(y[..256].chunks_exact_mut(64))
        .enumerate()
    {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (lo, hi) = out.split_at_mut(32);
        for l in 0..32 {
            lo[l] = d1 * (q[l] & 0xF) as f32 - m1;
            hi[l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn dequantize_q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, rest) = b.split_at(128);
    let (qh, rest) = rest.split_at(64);
    let (sc, _) = rest.split_at(16);
    let d = f16_at(b, 208);
    for n in 0..2 {
        let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
        let out = &mut y[128 * n..128 * (n + 1)];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

fn check_len(format: WeightFormat, bytes: usize, values: usize) -> Result<(), KernelError> {
    let expected = format.bytes_for(values).ok_or(KernelError::PartialBlock {
        format: format.name(),
        values,
        block: format.block_elems(),
    })?;
    if bytes != expected {
        return Err(KernelError::ByteLength {
            format: format.name(),
            elements: values,
            elem_bytes: format.block_bytes(),
            expected,
            got: bytes,
        });
    }
    Ok(())
}

/// Decodes `bytes` (whole blocks of `format`) into `out`, one value per element.
pub fn dequantize_blocks(
    format: WeightFormat,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_len(format, bytes.len(), out.len())?;
    let (be, bb) = (format.block_elems(), format.block_bytes());
    for (b, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        dequantize_block(format, b, y);
    }
    Ok(())
}

/// Quantises `x` into `out` with ggml's reference rounding (`quantize_row_*_ref`). Float
/// formats and Q8_0/Q4_0/Q4_1 are supported; K-quants need ggml's search-based quantiser and
/// are an error (quantise them with llama.cpp's tools).
pub fn quantize_blocks(format: WeightFormat, x: &[f32], out: &mut [u8]) -> Result<(), KernelError> {
    check_len(format, out.len(), x.len())?;
    let (be, bb) = (format.block_elems(), format.block_bytes());
    for (v, b) in x.chunks_exact(be).zip(out.chunks_exact_mut(bb)) {
        match format {
            WeightFormat::F32 => b.copy_from_slice(&v[0].to_le_bytes()),
            WeightFormat::F16 => b.copy_from_slice(&f16::from_f32(v[0]).to_bits().to_le_bytes()),
            WeightFormat::BF16 => {
                b.copy_from_slice(&half::bf16::from_f32(v[0]).to_bits().to_le_bytes())
            }
            WeightFormat::Q8_0 => {
                let amax = v.iter().fold(0.0f32, |a, x| a.max(x.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                b[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                for (q, x) in b[2..].iter_mut().zip(v) {
                    *q = (x * id).round() as i8 as u8;
                }
            }
            WeightFormat::Q4_0 => {
                let (mut amax, mut max) = (0.0f32, 0.0f32);
                for &x in v {
                    if amax < x.abs() {
                        amax = x.abs();
                        max = x;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                b[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                for j in 0..16 {
                    let q0 = ((v[j] * id + 8.5) as i8).min(15) as u8;
                    let q1 = ((v[j + 16] * id + 8.5) as i8).min(15) as u8;
                    b[2 + j] = q0 | (q1 << 4);
                }
            }
            WeightFormat::Q4_1 => {
                let min = v.iter().copied().fold(f32::INFINITY, f32::min);
                let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                b[..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
                b[2..4].copy_from_slice(&f16::from_f32(min).to_bits().to_le_bytes());
                for j in 0..16 {
                    let q0 = (((v[j] - min) * id + 0.5) as i8).min(15) as u8;
                    let q1 = (((v[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
                    b[4 + j] = q0 | (q1 << 4);
                }
            }
            WeightFormat::Q4_K | WeightFormat::Q6_K => {
                return Err(KernelError::QuantizeUnsupported {
                    format: format.name(),
                })
            }
        }
    }
    Ok(())
}
