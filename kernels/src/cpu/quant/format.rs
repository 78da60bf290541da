//! The element formats a weight matrix may be stored in, with ggml's block geometry.

/// How a weight matrix's elements are stored. Quantised formats are blocks of `block_elems`
/// values packed into `block_bytes` bytes, exactly as ggml lays them out.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)] // ggml's names
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    /// 32 values: f16 scale `d`, 32 × i8. `x = d·q`.
    Q8_0,
    /// 32 values: f16 `d`, 16 bytes of nibbles. `x = d·(q − 8)`.
    Q4_0,
    /// 32 values: f16 `d`, f16 `m`, 16 bytes of nibbles. `x = d·q + m`.
    Q4_1,
    /// 256 values: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.
    Q4_K,
    /// 256 values: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 × i8 scales, f16 `d`.
    Q6_K,
}

impl WeightFormat {
    /// Every supported format.
    pub const ALL: [Self; 8] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q8_0,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q4_K,
        Self::Q6_K,
    ];

    /// Values per block (1 for the float formats).
    pub const fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 => 32,
            Self::Q4_K | Self::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q4_K => 144,
            Self::Q6_K => 210,
        }
    }

    /// Whether this is a block-quantised format.
    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of `n` values, or `None` when `n` is not a whole number of blocks (or overflows).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// ggml's `ggml_type` number for this format.
    pub const fn ggml_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::Q4_K => 12,
            Self::Q6_K => 14,
            Self::BF16 => 30,
        }
    }

    /// The format of a `ggml_type` number, or `None` for a type Thaw does not read.
    pub fn from_ggml_type(t: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.ggml_type() == t)
    }

    /// ggml's name for the type (`Q4_K`, `BF16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q4_K => "Q4_K",
            Self::Q6_K => "Q6_K",
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
