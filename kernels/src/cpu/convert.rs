//! Little-endian half-precision byte buffers (safetensors payloads) to f32.

use crate::error::KernelError;
use half::f16;

/// Element formats a weight file may store.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FloatFormat {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
}

impl FloatFormat {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
        }
    }
}

/// Decodes `bytes` (little-endian, `out.len()` elements of `format`) into `out`, or reports a
/// length mismatch.
pub fn bytes_to_f32(format: FloatFormat, bytes: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let expected = out.len() * format.size();
    if bytes.len() != expected {
        return Err(KernelError::ByteLength {
            format: format.name(),
            elements: out.len(),
            elem_bytes: format.size(),
            expected,
            got: bytes.len(),
        });
    }
    match format {
        FloatFormat::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        FloatFormat::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        FloatFormat::BF16 => {
            // bf16 is the top half of an f32: widening is exact.
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
    }
    Ok(())
}

/// Decodes little-endian bf16 `bytes` (`2 · out.len()` of them) into `out`.
///
/// # Panics
/// If `bytes.len() != 2 * out.len()`; use [`bytes_to_f32`] for a `Result`.
pub fn bf16_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    if let Err(e) = bytes_to_f32(FloatFormat::BF16, bytes, out) {
        panic!("bf16_bytes_to_f32: {e}");
    }
}

/// Decodes little-endian f16 `bytes` (`2 · out.len()` of them) into `out`.
///
/// # Panics
/// If `bytes.len() != 2 * out.len()`; use [`bytes_to_f32`] for a `Result`.
pub fn f16_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    if let Err(e) = bytes_to_f32(FloatFormat::F16, bytes, out) {
        panic!("f16_bytes_to_f32: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{rand_vec, rng};
    use half::bf16;

    #[test]
    fn round_trips_through_half_formats() {
        let mut r = rng(60);
        let src = rand_vec(&mut r, 257, 300.0);
        let f16s: Vec<f16> = src.iter().map(|&v| f16::from_f32(v)).collect();
        let bf16s: Vec<bf16> = src.iter().map(|&v| bf16::from_f32(v)).collect();
        let fb: Vec<u8> = f16s
            .iter()
            .flat_map(|h| h.to_bits().to_le_bytes())
            .collect();
        let bb: Vec<u8> = bf16s
            .iter()
            .flat_map(|h| h.to_bits().to_le_bytes())
            .collect();
        let mut out = vec![0.0; src.len()];
        f16_bytes_to_f32(&fb, &mut out);
        // Conversion of an exactly representable value is exact.
        assert!(out.iter().zip(&f16s).all(|(o, h)| *o == h.to_f32()));
        bf16_bytes_to_f32(&bb, &mut out);
        assert!(out.iter().zip(&bf16s).all(|(o, h)| *o == h.to_f32()));
        let f32b: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        bytes_to_f32(FloatFormat::F32, &f32b, &mut out).unwrap();
        assert_eq!(out, src);
    }

    #[test]
    fn wrong_length_is_an_error() {
        let mut out = [0.0f32; 3];
        let e = bytes_to_f32(FloatFormat::BF16, &[0; 5], &mut out).unwrap_err();
        assert!(e.to_string().contains("5 bytes but 6"), "{e}");
    }
}
