//! The GGUF container (v2 and v3): header, metadata key/values of every type, tensor infos and
//! the aligned data section, parsed from a byte slice without trusting any count or offset.
//!
//! Every length read from the file is checked against the bytes that remain before anything
//! is allocated for it, so a truncated or hostile file is an error, never a huge allocation.

use std::collections::BTreeMap;

use thaw_kernels::cpu::WeightFormat;

/// GGUF's little-endian magic, `"GGUF"`.
const MAGIC: &[u8; 4] = b"GGUF";
/// Default data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Nesting limit for arrays of arrays (real files use none).
const MAX_DEPTH: usize = 4;

/// Why a GGUF file could not be parsed. Messages name the offending field and offset.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file (magic {0:?}, expected \"GGUF\")")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported; Thaw reads versions 2 and 3 (re-convert with a current llama.cpp)")]
    Version(u32),
    #[error("truncated at byte {at}: {what} needs {need} more bytes, {have} remain")]
    Truncated {
        at: usize,
        what: String,
        need: u64,
        have: usize,
    },
    #[error("metadata value type {ty} of `{key}` is unknown")]
    ValueType { key: String, ty: u32 },
    #[error("metadata key or string at byte {at} is not UTF-8")]
    Utf8 { at: usize },
    #[error("metadata `{0}` appears twice")]
    DuplicateKey(String),
    #[error("`general.alignment` is {0}; it must be a power of two")]
    Alignment(u64),
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("tensor `{name}` has ggml type {ty}, which Thaw does not read; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (re-quantise with `llama-quantize`)")]
    UnknownType { name: String, ty: u32 },
    #[error("metadata `{key}`: {reason}")]
    Metadata { key: String, reason: String },
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where one tensor lies and how it is stored.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub format: WeightFormat,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl GgufTensorInfo {
    /// The shape in row-major (HF / numpy) order: `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF header: metadata and tensor infos; tensor bytes stay in the caller's slice.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufFile {
    pub version: u32,
    pub alignment: u64,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    /// Absolute offset of the data section.
    pub data_start: usize,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let have = self.b.len() - self.at;
        if n > have as u64 {
            return Err(GgufError::Truncated {
                at: self.at,
                what: what(),
                need: n,
                have,
            });
        }
        let s = &self.b[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        Ok(self.take(N as u64, what)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let n = self.u64(what)?;
        let at = self.at;
        let s = self.take(n, what)?;
        std::str::from_utf8(s)
            .map(str::to_string)
            .map_err(|_| GgufError::Utf8 { at })
    }

    fn remaining(&self) -> usize {
        self.b.len() - self.at
    }
}

/// Smallest encoding of a value of type `ty` (bounds array counts before allocating).
fn min_size(ty: u32) -> u64 {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

fn value(c: &mut Cursor<'_>, key: &str, ty: u32, depth: usize) -> Result<GgufValue, GgufError> {
    let what = &|| format!("the value of `{key}`");
    Ok(match ty {
        0 => GgufValue::U8(c.array::<1>(what)?[0]),
        1 => GgufValue::I8(c.array::<1>(what)?[0] as i8),
        2 => GgufValue::U16(u16::from_le_bytes(c.array(what)?)),
        3 => GgufValue::I16(i16::from_le_bytes(c.array(what)?)),
        4 => GgufValue::U32(c.u32(what)?),
        5 => GgufValue::I32(i32::from_le_bytes(c.array(what)?)),
        6 => GgufValue::F32(f32::from_le_bytes(c.array(what)?)),
        7 => match c.array::<1>(what)?[0] {
            0 => GgufValue::Bool(false),
            1 => GgufValue::Bool(true),
            b => {
                return Err(GgufError::Metadata {
                    key: key.into(),
                    reason: format!("bool byte {b} is neither 0 nor 1"),
                })
            }
        },
        8 => GgufValue::String(c.string(what)?),
        9 => {
            if depth >= MAX_DEPTH {
                return Err(GgufError::Metadata {
                    key: key.into(),
                    reason: format!("arrays nested deeper than {MAX_DEPTH}"),
                });
            }
            let ety = c.u32(what)?;
            if ety > 12 {
                return Err(GgufError::ValueType {
                    key: key.into(),
                    ty: ety,
                });
            }
            let n = c.u64(what)?;
            // Each element takes at least min_size bytes: a count the file cannot hold is
            // truncation, found before reserving anything.
            let need = n.saturating_mul(min_size(ety));
            if need > c.remaining() as u64 {
                return Err(GgufError::Truncated {
                    at: c.at,
                    what: format!("the {n} elements of `{key}`"),
                    need,
                    have: c.remaining(),
                });
            }
            // Grown as elements parse, so memory follows the bytes actually present.
            let mut v = Vec::with_capacity((n as usize).min(1 << 12));
            for _ in 0..n {
                v.push(value(c, key, ety, depth + 1)?);
            }
            GgufValue::Array(v)
        }
        10 => GgufValue::U64(c.u64(what)?),
        11 => GgufValue::I64(i64::from_le_bytes(c.array(what)?)),
        12 => GgufValue::F64(f64::from_le_bytes(c.array(what)?)),
        ty => {
            return Err(GgufError::ValueType {
                key: key.into(),
                ty,
            })
        }
    })
}

impl GgufFile {
    /// Parses the header of `b` (a whole GGUF file) and checks every tensor lies inside it.
    pub fn parse(b: &[u8]) -> Result<Self, GgufError> {
        let mut c = Cursor { b, at: 0 };
        let magic = c.array::<4>(&|| "the magic".into())?;
        if &magic != MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = c.u32(&|| "the version".into())?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = c.u64(&|| "the tensor count".into())?;
        let n_kv = c.u64(&|| "the metadata count".into())?;
        // A key/value takes ≥ 13 bytes and a tensor info ≥ 28: bound counts by the file size.
        for (n, min, what) in [
            (n_kv, 13u64, "metadata entries"),
            (n_tensors, 28, "tensor infos"),
        ] {
            if n.saturating_mul(min) > c.remaining() as u64 {
                return Err(GgufError::Truncated {
                    at: c.at,
                    what: format!("{n} {what}"),
                    need: n.saturating_mul(min),
                    have: c.remaining(),
                });
            }
        }
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let ty = c.u32(&|| format!("the type of `{key}`"))?;
            let v = value(&mut c, &key, ty, 0)?;
            if metadata.insert(key.clone(), v).is_some() {
                return Err(GgufError::DuplicateKey(key));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                Some(a) => return Err(GgufError::Alignment(a)),
                None => {
                    return Err(GgufError::Metadata {
                        key: "general.alignment".into(),
                        reason: "must be an unsigned integer".into(),
                    })
                }
            },
        };
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor name #{i}"))?;
            let what = || format!("the info of tensor `{name}`");
            let n_dims = c.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::Tensor {
                    name,
                    reason: format!("{n_dims} dimensions (ggml allows 1 to {MAX_DIMS})"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&what)?);
            }
            let ty = c.u32(&what)?;
            let offset = c.u64(&what)?;
            raw.push((name, dims, ty, offset));
        }
        let data_start = (c.at as u64).next_multiple_of(alignment);
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, dims, ty, offset) in raw {
            let Some(format) = WeightFormat::from_ggml_type(ty) else {
                return Err(GgufError::UnknownType { name, ty });
            };
            let bad = |reason: String| GgufError::Tensor {
                name: name.clone(),
                reason,
            };
            let n = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n <= u64::from(u32::MAX) * 64)
                .ok_or_else(|| bad(format!("shape {dims:?} is too large")))?;
            if dims[0] % format.block_elems() as u64 != 0 {
                return Err(bad(format!(
                    "rows of {} values are not whole {format} blocks of {}",
                    dims[0],
                    format.block_elems()
                )));
            }
            let len = n / format.block_elems() as u64 * format.block_bytes() as u64;
            if offset % alignment != 0 {
                return Err(bad(format!(
                    "offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            let start = data_start.checked_add(offset);
            let end = start.and_then(|s| s.checked_add(len));
            match (start, end) {
                (Some(s), Some(e)) if e <= b.len() as u64 => tensors.push(GgufTensorInfo {
                    name,
                    dims,
                    format,
                    start: s as usize,
                    len: len as usize,
                }),
                _ => {
                    return Err(bad(format!(
                        "its {len} bytes at offset {offset} (data starts at {data_start}) run \
                         past the end of the file ({} bytes); the file is truncated or corrupt",
                        b.len()
                    )))
                }
            }
        }
        Ok(Self {
            version,
            alignment,
            metadata,
            tensors,
            data_start: data_start as usize,
        })
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// The bytes of `t` within `file` (the slice this header was parsed from).
    pub fn tensor_data<'a>(&self, file: &'a [u8], t: &GgufTensorInfo) -> &'a [u8] {
        &file[t.start..t.start + t.len]
    }
}
