//! One LoRA factor in its stored dtype: the bytes of the safetensors file, kept as they are from
//! file to device (DESIGN §3). A bf16 adapter is 2 bytes a weight in the host tier, the
//! device pages and the copy; kernels read the bytes in place and accumulate in f32.
//!
//! f32 is only widened for oracles and tests ([`LoraTensor::to_f32`]); a conversion to another
//! dtype ([`LoraTensor::converted`]) happens once, on a loader thread, when a backend cannot
//! read the stored one.
use half::{bf16, f16};
use thaw_cpu_lora::kernel::LoraMat;
use thaw_kernels::cpu::{bytes_to_f32, FloatFormat};

pub use thaw_cpu_lora::kernel::WeightDtype;

/// A row-major factor: `numel` little-endian elements of `dtype`, owned (alone, or a range of
/// its adapter's file read whole into memory by [`super::LoraAdapter::load`]) or read in place
/// from the adapter's memory-mapped file ([`super::MappedFile`], the disk tier).
#[derive(Clone)]
pub struct LoraTensor {
    dtype: WeightDtype,
    bytes: Bytes,
}

#[derive(Clone)]
enum Bytes {
    Owned(Vec<u8>),
    /// `range` of the adapter file's bytes, read into memory once for all its tensors (checked
    /// inside it when the tensor was made).
    Shared(std::sync::Arc<Vec<u8>>, std::ops::Range<usize>),
    /// `range` of the mapped file (checked inside it when the tensor was made).
    Mapped(std::sync::Arc<super::MappedFile>, std::ops::Range<usize>),
}

impl PartialEq for LoraTensor {
    fn eq(&self, o: &Self) -> bool {
        self.dtype == o.dtype && self.bytes() == o.bytes()
    }
}

impl std::fmt::Debug for LoraTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraTensor")
            .field("dtype", &self.dtype)
            .field("numel", &self.numel())
            .finish()
    }
}

fn format(d: WeightDtype) -> FloatFormat {
    match d {
        WeightDtype::F32 => FloatFormat::F32,
        WeightDtype::F16 => FloatFormat::F16,
        WeightDtype::Bf16 => FloatFormat::BF16,
    }
}

impl LoraTensor {
    /// Stored bytes of `dtype`; `None` if their length is not a whole number of elements.
    pub fn from_le_bytes(dtype: WeightDtype, bytes: Vec<u8>) -> Option<Self> {
        bytes.len().is_multiple_of(dtype.size()).then_some(Self {
            dtype,
            bytes: Bytes::Owned(bytes),
        })
    }

    /// f32 values, stored as f32.
    pub fn from_f32(v: &[f32]) -> Self {
        Self {
            dtype: WeightDtype::F32,
            bytes: Bytes::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        }
    }

    /// f32 values stored in `dtype` (rounded to nearest even).
    pub fn encode(v: &[f32], dtype: WeightDtype) -> Self {
        let mut bytes = vec![0u8; v.len() * dtype.size()];
        encode_into(v, dtype, &mut bytes);
        Self {
            dtype,
            bytes: Bytes::Owned(bytes),
        }
    }

    pub fn dtype(&self) -> WeightDtype {
        self.dtype
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.bytes().len() / self.dtype.size()
    }

    /// The stored bytes (what the host store, the copy and the device hold).
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Owned(v) => v,
            Bytes::Shared(v, r) => &v[r.clone()],
            Bytes::Mapped(f, r) => &f.bytes()[r.clone()],
        }
    }

    /// `range` of `file` in `dtype`, read in place; `None` if the range is outside the file or
    /// not a whole number of elements.
    pub(crate) fn mapped(
        dtype: WeightDtype,
        file: std::sync::Arc<super::MappedFile>,
        range: std::ops::Range<usize>,
    ) -> Option<Self> {
        (range.start <= range.end
            && range.end <= file.bytes().len()
            && range.len().is_multiple_of(dtype.size()))
        .then_some(Self {
            dtype,
            bytes: Bytes::Mapped(file, range),
        })
    }

    /// `range` of `file`, the bytes of an adapter file read into memory, in `dtype`: held,
    /// not copied; `None` if the range is outside the bytes or not a whole number of elements.
    pub(crate) fn shared(
        dtype: WeightDtype,
        file: &std::sync::Arc<Vec<u8>>,
        range: std::ops::Range<usize>,
    ) -> Option<Self> {
        (range.start <= range.end
            && range.end <= file.len()
            && range.len().is_multiple_of(dtype.size()))
        .then(|| Self {
            dtype,
            bytes: Bytes::Shared(file.clone(), range),
        })
    }

    /// The file and byte range this tensor is read from, when it is read in place from its
    /// adapter's file rather than held in memory.
    pub fn file_range(
        &self,
    ) -> Option<(&std::sync::Arc<super::MappedFile>, std::ops::Range<usize>)> {
        match &self.bytes {
            Bytes::Owned(_) | Bytes::Shared(..) => None,
            Bytes::Mapped(f, r) => Some((f, r.clone())),
        }
    }

    /// A view for the CPU LoRA kernels, which read any stored dtype in place.
    pub fn mat(&self) -> LoraMat<'_> {
        LoraMat {
            dtype: self.dtype,
            bytes: self.bytes(),
        }
    }

    /// The values widened to f32 (exact for every stored dtype): for oracles and tests.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.numel()];
        bytes_to_f32(format(self.dtype), self.bytes(), &mut out)
            .expect("the length is a whole number of elements");
        out
    }

    /// The same values stored in `to`; a no-op copy when the dtype already matches.
    pub fn converted(&self, to: WeightDtype) -> Self {
        if to == self.dtype {
            return self.clone();
        }
        Self::encode(&self.to_f32(), to)
    }

    /// Writes the values stored in `to` into `dst` (`numel * to.size()` bytes): the same
    /// bytes as [`LoraTensor::converted`], without a heap copy (widened a chunk at a time on
    /// the stack), so a loader thread encodes straight into the pinned arena.
    pub fn convert_into(&self, to: WeightDtype, dst: &mut [u8]) {
        assert_eq!(
            dst.len(),
            self.numel() * to.size(),
            "convert_into: size mismatch"
        );
        if to == self.dtype {
            dst.copy_from_slice(self.bytes());
            return;
        }
        const CHUNK: usize = 1024;
        let mut wide = [0.0f32; CHUNK];
        let (from, into) = (self.dtype.size(), to.size());
        for (src, out) in self
            .bytes()
            .chunks(CHUNK * from)
            .zip(dst.chunks_mut(CHUNK * into))
        {
            let n = src.len() / from;
            bytes_to_f32(format(self.dtype), src, &mut wide[..n])
                .expect("the length is a whole number of elements");
            encode_into(&wide[..n], to, out);
        }
    }

    /// Index of the first NaN or infinite element: one whose exponent bits are all ones.
    /// A branch-free pass over blocks (vectorised: a 134 MB bf16 adapter in ~15 ms instead of
    /// ~125 ms element by element) finds the block; only that one is searched.
    pub fn first_non_finite(&self) -> Option<usize> {
        first_non_finite_in(self.dtype, self.bytes())
    }
}

/// The exponent bits of `dtype`'s elements: an element with all of them set is NaN or
/// infinite. For checks fused into another pass over the bytes (the upload pipeline's copy).
pub fn exponent_mask(dtype: WeightDtype) -> u32 {
    match dtype {
        WeightDtype::F32 => 0x7f80_0000,
        WeightDtype::F16 => 0x7c00,
        WeightDtype::Bf16 => 0x7f80,
    }
}

/// [`LoraTensor::first_non_finite`] of `bytes` read as little-endian elements of `dtype`
/// (a trailing partial element is ignored).
pub fn first_non_finite_in(dtype: WeightDtype, bytes: &[u8]) -> Option<usize> {
    let mask = exponent_mask(dtype);
    match dtype.size() {
        4 => first_all_ones(bytes, mask, u32::from_le_bytes),
        _ => first_all_ones(bytes, mask as u16, u16::from_le_bytes),
    }
}

/// Index of the first `N`-byte little-endian element of `bytes` with every bit of `mask` set
/// (for a float's exponent mask: NaN or infinite).
fn first_all_ones<T, const N: usize>(bytes: &[u8], mask: T, word: fn([u8; N]) -> T) -> Option<usize>
where
    T: Copy + PartialEq + std::ops::BitAnd<Output = T>,
{
    const BLOCK: usize = 4096;
    let hit = |e: &[u8]| word(e.try_into().expect("chunks_exact(N)")) & mask == mask;
    bytes.chunks(BLOCK * N).enumerate().find_map(|(i, block)| {
        let any = block.chunks_exact(N).fold(false, |acc, e| acc | hit(e));
        any.then(|| block.chunks_exact(N).position(hit))
            .flatten()
            .map(|j| i * BLOCK + j)
    })
}

/// Writes `src` in `dt` into `dst` (`src.len() * dt.size()` bytes), rounding to nearest even.
pub fn encode_into(src: &[f32], dt: WeightDtype, dst: &mut [u8]) {
    assert_eq!(
        dst.len(),
        src.len() * dt.size(),
        "encode_into: size mismatch"
    );
    match dt {
        WeightDtype::F32 => {
            for (d, &x) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        WeightDtype::Bf16 => {
            for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&bf16::from_f32(x).to_le_bytes());
            }
        }
        WeightDtype::F16 => {
            for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&f16::from_f32(x).to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The element-by-element oracle of [`LoraTensor::first_non_finite`].
    fn first_non_finite_oracle(t: &LoraTensor) -> Option<usize> {
        let b = t.bytes();
        (0..t.numel()).position(|i| match t.dtype() {
            WeightDtype::F32 => {
                !f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()).is_finite()
            }
            WeightDtype::F16 => !f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).is_finite(),
            WeightDtype::Bf16 => !bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).is_finite(),
        })
    }

    proptest! {
        /// The blocked check finds the same first NaN or infinity as the element-by-element
        /// oracle, for any bit patterns (finite, subnormal, ±0, NaN, ±∞), any dtype, and
        /// lengths around the block size, with the bad element anywhere or nowhere.
        #[test]
        fn the_blocked_finite_check_matches_the_oracle(
            dt in 0usize..3,
            n in 0usize..9000,
            seed in any::<u64>(),
            bad in prop::option::of((any::<prop::sample::Index>(), 0usize..3)),
        ) {
            let dtype = [WeightDtype::F32, WeightDtype::F16, WeightDtype::Bf16][dt];
            let mut x = seed | 1;
            let mut bytes: Vec<u8> = (0..n * dtype.size())
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            // Random bytes: clear each element's top exponent bit so only `bad` (if any) is
            // non-finite, then plant it.
            let es = dtype.size();
            for e in bytes.chunks_exact_mut(es) {
                e[es - 1] &= 0xbf;
            }
            if let (Some((ix, kind)), true) = (bad, n > 0) {
                let i = ix.index(n);
                let v = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][kind];
                let enc = LoraTensor::encode(&[v], dtype);
                bytes[i * es..(i + 1) * es].copy_from_slice(enc.bytes());
            }
            let t = LoraTensor::from_le_bytes(dtype, bytes).unwrap();
            prop_assert_eq!(t.first_non_finite(), first_non_finite_oracle(&t));
            if let (Some((ix, _)), true) = (bad, n > 0) {
                prop_assert_eq!(t.first_non_finite(), Some(ix.index(n)));
            }
        }
    }

    fn values(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect()
    }

    /// Converting straight into a buffer gives the bytes of a converted copy, for every pair
    /// of dtypes and lengths around the chunk size.
    #[test]
    fn convert_into_matches_converted() {
        let all = [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::F16];
        for n in [1, 1023, 1024, 1025, 3000] {
            for from in all {
                let t = LoraTensor::encode(&values(n), from);
                for to in all {
                    let mut out = vec![0u8; n * to.size()];
                    t.convert_into(to, &mut out);
                    assert_eq!(out, t.converted(to).bytes(), "{from:?} -> {to:?}, {n}");
                }
            }
        }
    }

    /// Byte counts follow the stored dtype; bf16/f16 round-trips are within half an ulp of the
    /// f32 source (8 and 11 significant bits: 2⁻⁸ and 2⁻¹¹ relative), and f32 is exact.
    #[test]
    fn stored_dtypes_keep_their_size_and_round_to_nearest() {
        let v = values(1000);
        for (dt, rel) in [
            (WeightDtype::F32, 0.0),
            (WeightDtype::Bf16, 1.0 / 256.0),
            (WeightDtype::F16, 1.0 / 2048.0),
        ] {
            let t = LoraTensor::encode(&v, dt);
            assert_eq!(t.bytes().len(), v.len() * dt.size());
            assert_eq!(t.numel(), v.len());
            for (x, y) in v.iter().zip(t.to_f32()) {
                assert!((x - y).abs() <= rel * x.abs(), "{dt:?}: {x} vs {y}");
            }
            assert_eq!(t.first_non_finite(), None);
            assert_eq!(t.converted(dt), t);
        }
        let mut bad = v.clone();
        bad[7] = f32::NAN;
        assert_eq!(
            LoraTensor::encode(&bad, WeightDtype::Bf16).first_non_finite(),
            Some(7)
        );
        bad[7] = f32::INFINITY;
        bad[3] = 1e6; // past f16's range: infinite once stored
        assert_eq!(
            LoraTensor::encode(&bad, WeightDtype::F16).first_non_finite(),
            Some(3)
        );
        assert!(LoraTensor::from_le_bytes(WeightDtype::Bf16, vec![0; 3]).is_none());
    }
}
