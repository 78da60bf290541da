//! [`WeightMatrix`]: a `[rows, cols]` weight in its stored format, and `y = x·Wᵀ` over it.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};

use half::{bf16, f16, slice::HalfFloatSliceExt};

use super::blocks::{dequantize_block, dequantize_blocks, quantize_blocks};
use super::WeightFormat;
use crate::cpu::gemm::{dot, linear, GemmShape, SMALL_M};
use crate::cpu::hostvec::HostVec;
use crate::cpu::simd::{
    dequantize_row, dot_rows_bf16, dot_rows_f16, gemm_nt, gemm_nt_available, gemm_nt_bf16_rows,
    gemm_nt_f32, gemm_nt_f32_prompt, gemm_nt_prompt, gemm_nt_vnni, gemm_nt_vnni_prompt, gemv_q8,
    gemv_quant_f32, q8_dot_supported, quantize_q8_for, vnni_dot_active, FloatWeights, Q8Block,
    PROMPT_PANEL_ROWS,
};
use crate::cpu::sys::{sgemm, HugeArena, MatMut, MatRef};
use crate::error::KernelError;

/// The elements of a weight matrix as stored. Each holds a [`HostVec`]: a `Vec` as loaded, or
/// a copy packed into a huge-page arena ([`WeightMatrix::pack_into`]) once the CPU backend
/// keeps the weight.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightData {
    F32(HostVec<f32>),
    F16(HostVec<f16>),
    BF16(HostVec<bf16>),
    /// Whole ggml blocks of a quantised format, row after row (a row never shares a block).
    Quant(WeightFormat, HostVec<u8>),
}

/// A `[rows, cols]` row-major weight (HF `nn.Linear` layout: row `j` produces output `j`).
#[derive(Clone, Debug, PartialEq)]
pub struct WeightMatrix {
    data: WeightData,
    rows: usize,
    cols: usize,
}

thread_local! {
    /// Dequantised rows for the product in flight on this thread: grows to the largest tile
    /// once and is reused, so steady-state products do not allocate.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The activation rows of the product in flight, quantised to 8 bits (Q8_0/Q4_0/Q4_1
    /// weights at decode); reused like `SCRATCH`.
    static Q8_SCRATCH: RefCell<Vec<Q8Block>> = const { RefCell::new(Vec::new()) };
}

/// Bytes of dequantised weight per tile in the many-rows (GEMM) path: a tile stays in L2
/// while `matrixmultiply` packs it.
const TILE_BYTES: usize = 256 << 10;

/// Bytes of dequantised weight per tile for a decode batch: small enough to stay in L1/L2
/// between being written and being read by every activation row.
const DECODE_TILE_BYTES: usize = 32 << 10;

/// Weight rows per group of the AVX-512 decode kernel (`gemm_nt_f32`'s 4 × 4 tiles): a decode
/// tile of dequantised rows is cut in whole groups.
const DECODE_TILE_GROUP: usize = 4;

/// From this many rows, a decode product over quantised weights dequantises a tile of weight
/// rows once and runs the in-place f32 kernel over it for every row (the same arithmetic,
/// bit for bit, as dequantising per row), instead of unpacking every block once per few
/// activation rows.
const DEQUANT_TILE_MIN_ROWS: usize = 4;

/// Whether decode products over Q8_0/Q4_0/Q4_1 weights quantise the activations to Q8 and
/// use integer dots, as ggml does (its `vec_dot_type` for these formats): 0 = not yet read
/// from the environment, 1 = off, 2 = on, 3 = the default: on exactly where the AVX512-VNNI
/// kernel is in use ([`crate::cpu::simd::vnni_dot_active`] for Q8_0, so `set_vnni_dot(false)`
/// turns it off too). The owners' decision (issue 30): quantised formats follow llama.cpp's
/// arithmetic where the CPU has VNNI, and a quantised GGUF's greedy text is llama.cpp's (on
/// SmolLM2-135M Q4_1 the Q8 rounding turns the English answer to a chat prompt French, as
/// llama.cpp's does). Off (without VNNI, or `THAW_Q8_ACTIVATIONS=0`/`off`, or
/// [`set_q8_activations`]`(false)`), each weight block is dequantised in registers and dotted
/// with the f32 activations ([`gemv_quant_f32`]), which computes exactly what the same weights
/// dequantised to f32 compute, bit for bit, reading only the packed bytes.
/// `THAW_Q8_ACTIVATIONS=1`/`on` forces it on without VNNI too (the AVX2 integer dots).
static Q8_ACTIVATIONS: AtomicU8 = AtomicU8::new(0);

/// Turns the Q8-activation decode path on or off for the whole process (benchmarks and the
/// real-model test compare both); returns the previous setting.
pub fn set_q8_activations(on: bool) -> bool {
    let prev = q8_activations();
    Q8_ACTIVATIONS.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    prev
}

/// Puts the Q8-activation decode path back to its default (on where the AVX512-VNNI kernel
/// is in use, see [`set_q8_activations`]), whatever `THAW_Q8_ACTIVATIONS` says; returns the
/// previous setting.
pub fn reset_q8_activations() -> bool {
    let prev = q8_activations();
    Q8_ACTIVATIONS.store(3, Ordering::Relaxed);
    prev
}

/// Whether decode products over Q8_0/Q4_0/Q4_1 quantise the activations to Q8 (see
/// [`set_q8_activations`]; initially from `THAW_Q8_ACTIVATIONS`: `1`/`on` on, `0`/`off` off,
/// otherwise on where the AVX512-VNNI kernel is in use).
pub fn q8_activations() -> bool {
    match Q8_ACTIVATIONS.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        3 => vnni_dot_active(WeightFormat::Q8_0),
        _ => {
            let v = std::env::var("THAW_Q8_ACTIVATIONS").unwrap_or_default();
            let state = match v.as_str() {
                "1" | "on" => 2,
                "0" | "off" => 1,
                _ => 3,
            };
            Q8_ACTIVATIONS.store(state, Ordering::Relaxed);
            q8_activations()
        }
    }
}

/// Whether prompt rows (more than [`SMALL_M`] in one product) over Q4_1 weights quantise the
/// activations to Q8 and take the VNNI integer kernel ([`gemm_nt_vnni_prompt`]) where the CPU
/// has it: 0 = not yet read from the environment, 1 = off, 2 = on. On by default
/// (`THAW_Q8_PROMPT=0` or [`set_q8_prompt`] turn it off): it is llama.cpp's arithmetic for
/// these rows (ggml quantises the activations of a Q4_1 product to Q8_1 blocks whatever the
/// row count), an integer dot runs 64 products per instruction against the f32 GEMM's 16, and
/// a prompt is 128 of the 160 tokens a sequence computes in the side by side. Decode rows
/// follow [`q8_activations`] (on by default where the CPU has VNNI, as llama.cpp computes them).
static Q8_PROMPT: AtomicU8 = AtomicU8::new(0);

/// Turns the Q8-activation prompt path for Q4_1 weights on or off for the whole process
/// (benchmarks and tests compare both); returns the previous setting.
pub fn set_q8_prompt(on: bool) -> bool {
    let prev = q8_prompt();
    Q8_PROMPT.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    prev
}

/// Whether prompt rows over Q4_1 weights multiply Q8 activations (see [`set_q8_prompt`];
/// initially from `THAW_Q8_PROMPT`, on unless `0`/`off`).
pub fn q8_prompt() -> bool {
    match Q8_PROMPT.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = !std::env::var("THAW_Q8_PROMPT").is_ok_and(|v| v == "0" || v == "off");
            Q8_PROMPT.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

impl WeightMatrix {
    fn new(data: WeightData, rows: usize, cols: usize) -> Result<Self, KernelError> {
        let m = Self { data, rows, cols };
        let f = m.format();
        let partial = |values| KernelError::PartialBlock {
            format: f.name(),
            values,
            block: f.block_elems(),
        };
        if !cols.is_multiple_of(f.block_elems()) {
            return Err(partial(cols));
        }
        let n = rows.checked_mul(cols).ok_or(partial(usize::MAX))?;
        let want = f.bytes_for(n).ok_or(partial(n))?;
        let got = m.storage_bytes();
        if got != want {
            return Err(KernelError::ByteLength {
                format: f.name(),
                elements: n,
                elem_bytes: f.block_bytes(),
                expected: want,
                got,
            });
        }
        Ok(m)
    }

    /// An f32 matrix. Panics when `w.len() != rows · cols` (a caller bug, not data).
    pub fn from_f32(w: Vec<f32>, rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "weight is not [{rows}, {cols}]");
        Self {
            data: WeightData::F32(w.into()),
            rows,
            cols,
        }
    }

    /// A matrix over already-typed storage, checking its length.
    pub fn from_data(data: WeightData, rows: usize, cols: usize) -> Result<Self, KernelError> {
        Self::new(data, rows, cols)
    }

    /// A matrix from little-endian bytes in `format` (a safetensors payload or a GGUF tensor).
    pub fn from_bytes(
        format: WeightFormat,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        let partial = |values| KernelError::PartialBlock {
            format: format.name(),
            values,
            block: format.block_elems(),
        };
        if !cols.is_multiple_of(format.block_elems()) {
            return Err(partial(cols));
        }
        let n = rows.checked_mul(cols).ok_or(partial(usize::MAX))?;
        let want = format.bytes_for(n).ok_or(partial(n))?;
        if bytes.len() != want {
            return Err(KernelError::ByteLength {
                format: format.name(),
                elements: n,
                elem_bytes: format.block_bytes(),
                expected: want,
                got: bytes.len(),
            });
        }
        // Little-endian bytes are the values' memory on every target we build (x86_64,
        // aarch64): one copy of the bytes, whatever their alignment in the file.
        const _: () = assert!(cfg!(target_endian = "little"));
        let data = match format {
            WeightFormat::F32 => WeightData::F32(bytemuck::pod_collect_to_vec(bytes).into()),
            WeightFormat::F16 => {
                WeightData::F16(bytemuck::pod_collect_to_vec::<u8, f16>(bytes).into())
            }
            WeightFormat::BF16 => {
                WeightData::BF16(bytemuck::pod_collect_to_vec::<u8, bf16>(bytes).into())
            }
            q => WeightData::Quant(q, bytes.to_vec().into()),
        };
        Self::new(data, rows, cols)
    }

    pub fn format(&self) -> WeightFormat {
        match &self.data {
            WeightData::F32(_) => WeightFormat::F32,
            WeightData::F16(_) => WeightFormat::F16,
            WeightData::BF16(_) => WeightFormat::BF16,
            WeightData::Quant(f, _) => *f,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn data(&self) -> &WeightData {
        &self.data
    }

    /// Bytes the weight occupies in memory.
    pub fn storage_bytes(&self) -> usize {
        match &self.data {
            WeightData::F32(v) => v.len() * 4,
            WeightData::F16(v) => v.len() * 2,
            WeightData::BF16(v) => v.len() * 2,
            WeightData::Quant(_, b) => b.len(),
        }
    }

    /// The elements when stored as f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            WeightData::F32(v) => Some(v),
            _ => None,
        }
    }

    /// Mutable f32 elements, widening the storage to f32 first if needed (merging an
    /// adapter into the weights needs f32).
    pub fn make_f32(&mut self) -> &mut [f32] {
        if !matches!(self.data, WeightData::F32(_)) {
            self.data = WeightData::F32(self.to_f32().into());
        }
        match &mut self.data {
            WeightData::F32(v) => v,
            _ => unreachable!("widened to f32 above"),
        }
    }

    /// Writes row `r` as f32 into `out` (`cols` values).
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        self.rows_to_f32(r..r + 1, out);
    }

    /// Writes rows `rows` as f32 into `out` (`rows.len() · cols` values, row after row): the
    /// values [`Self::row_to_f32`] writes row by row, bit for bit. Quantised rows are whole
    /// blocks stored back to back, so a run of rows is dequantised in one kernel call (a
    /// decode tile of 12 rows of 576 pays one dispatch instead of twelve).
    pub fn rows_to_f32(&self, rows: Range<usize>, out: &mut [f32]) {
        let k = self.cols;
        assert!(
            rows.start <= rows.end && rows.end <= self.rows,
            "rows {rows:?} of a {}-row weight",
            self.rows
        );
        let (e0, e1) = (rows.start * k, rows.end * k);
        let out = &mut out[..e1 - e0];
        match &self.data {
            WeightData::F32(v) => out.copy_from_slice(&v[e0..e1]),
            WeightData::F16(v) => v[e0..e1].convert_to_f32_slice(out),
            WeightData::BF16(v) => v[e0..e1].convert_to_f32_slice(out),
            WeightData::Quant(f, b) => {
                let rb = k / f.block_elems() * f.block_bytes();
                let bytes = &b[rows.start * rb..rows.end * rb];
                if out.is_empty() || dequantize_row(*f, bytes, out) {
                    return;
                }
                let (be, bb) = (f.block_elems(), f.block_bytes());
                for (blk, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
                    dequantize_block(*f, blk, y);
                }
            }
        }
    }

    /// Moves the elements into `arena` (2 MiB pages, see [`HugeArena`]); the values and
    /// every product over them are unchanged. Errors when the arena cannot map more memory
    /// (the matrix then keeps its `Vec`).
    pub fn pack_into(&mut self, arena: &mut HugeArena) -> std::io::Result<()> {
        match &mut self.data {
            WeightData::F32(v) => v.pack_into(arena),
            WeightData::F16(v) => v.pack_into(arena),
            WeightData::BF16(v) => v.pack_into(arena),
            WeightData::Quant(_, v) => v.pack_into(arena),
        }
    }

    /// Whether the elements live in a [`HugeArena`] ([`Self::pack_into`]).
    pub fn is_packed(&self) -> bool {
        match &self.data {
            WeightData::F32(v) => v.is_packed(),
            WeightData::F16(v) => v.is_packed(),
            WeightData::BF16(v) => v.is_packed(),
            WeightData::Quant(_, v) => v.is_packed(),
        }
    }

    /// The elements as f32, without a copy when already stored so in a `Vec`.
    pub fn into_f32(self) -> Vec<f32> {
        match self.data {
            WeightData::F32(v) => v.into_vec(),
            _ => self.to_f32(),
        }
    }

    /// Every element as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        if let WeightData::Quant(f, b) = &self.data {
            let mut v = vec![0.0; self.rows * self.cols];
            dequantize_blocks(*f, b, &mut v).expect("lengths were checked at construction");
            return v;
        }
        let mut v = vec![0.0; self.rows * self.cols];
        for (r, row) in v
            .chunks_exact_mut(self.cols.max(1))
            .enumerate()
            .take(self.rows)
        {
            self.row_to_f32(r, row);
        }
        v
    }

    /// The same matrix re-encoded in `format` (via f32; quantising uses ggml's reference
    /// rounding, so only formats [`super::quantize_blocks`] supports can be targets).
    pub fn convert(&self, format: WeightFormat) -> Result<Self, KernelError> {
        if format == self.format() {
            return Ok(self.clone());
        }
        let v = self.to_f32();
        let data = match format {
            WeightFormat::F32 => WeightData::F32(v.into()),
            WeightFormat::F16 => WeightData::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
            WeightFormat::BF16 => WeightData::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            q => {
                let n = format.bytes_for(v.len()).ok_or(KernelError::PartialBlock {
                    format: q.name(),
                    values: self.cols,
                    block: q.block_elems(),
                })?;
                let mut b = vec![0u8; n];
                quantize_blocks(q, &v, &mut b)?;
                WeightData::Quant(q, b.into())
            }
        };
        Self::new(data, self.rows, self.cols)
    }

    /// `y = x · Wᵀ`: `x` is `[m, cols]`, `out` is `[m, rows]`; f32 accumulation.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        self.matmul_range(x, m, out, 0..self.rows);
    }

    /// Output columns `out_cols` of `y = x · Wᵀ` (weight rows `out_cols`): `x` is `[m, cols]`,
    /// `out` is `[m, out_cols.len()]`, packed. Disjoint ranges can run on different threads
    /// (each thread has its own dequantisation scratch); for one row (decode) the ranges'
    /// outputs are contiguous pieces of the full `[1, rows]` output. Splitting rows of `x`
    /// instead (contiguous pieces of `out` for `0..rows`) works too.
    pub fn matmul_range(&self, x: &[f32], m: usize, out: &mut [f32], out_cols: Range<usize>) {
        let k = self.cols;
        let n = out_cols.len();
        assert!(
            out_cols.end <= self.rows,
            "matmul_range: columns {out_cols:?} of a {}-row weight",
            self.rows
        );
        assert_eq!(x.len(), m * k, "matmul_range: x is not [{m}, {k}]");
        assert_eq!(out.len(), m * n, "matmul_range: out is not [{m}, {n}]");
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            out.fill(0.0);
            return;
        }
        // Q8_0/Q4_K on AVX512-VNNI: activations quantised to Q8 once per call and integer
        // dots, as llama.cpp computes them; one kernel for every `m` (a decode row's result
        // does not depend on its batch).
        if let WeightData::Quant(f, b) = &self.data {
            let rb = k / f.block_elems() * f.block_bytes();
            let w = &b[out_cols.start * rb..out_cols.end * rb];
            if gemm_nt_vnni(*f, w, x, (m, k, n), out, n)
                || (m > SMALL_M && gemm_nt_vnni_prompt(*f, w, x, (m, k, n), out, n))
            {
                return;
            }
        }
        let (c0, c1) = (out_cols.start * k, out_cols.end * k);
        let floats = match &self.data {
            WeightData::F32(w) => return linear(x, &w[c0..c1], out, GemmShape { m, k, n }, false),
            WeightData::F16(w) => Some(FloatWeights::F16(&w[c0..c1])),
            WeightData::BF16(w) => Some(FloatWeights::BF16(&w[c0..c1])),
            WeightData::Quant(..) => None,
        };
        // 16-bit floats on AVX-512: read in place, each weight vector widened once per
        // register tile (decode batches) or once per call while packed (prompt rows), so a
        // batch pays for the conversion once rather than per row. One row keeps the AVX2 row
        // dot (`decode_direct`; same bits): streaming one weight row at a time measured
        // faster there in the engine (bf16 SmolLM2, 1 thread, this 2-core VM).
        if let (WeightData::BF16(w), true) = (&self.data, m <= SMALL_M) {
            // bf16 pairs (`vdpbf16ps`) for decode rows too, where the CPU has AVX512-BF16.
            if gemm_nt_bf16_rows(x, &w[c0..c1], (m, k, n), out, n) {
                return;
            }
        }
        if let Some(fw) = floats {
            let done = if m > SMALL_M {
                gemm_nt_prompt(x, fw, (m, k, n), out, n)
            } else {
                m >= 2 && gemm_nt(x, fw, (m, k, n), out, n)
            };
            if done {
                return;
            }
        }
        let f = self.format();
        let batched = m >= DEQUANT_TILE_MIN_ROWS
            && f.is_quantized()
            && gemm_nt_available()
            && !(q8_activations() && q8_dot_supported(f));
        if m <= SMALL_M && !batched && self.decode_direct(x, m, out, out_cols.clone()) {
            return;
        }
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            // Many rows, or a decode batch of quantised rows: dequantise a tile of weight rows
            // once, then one product per tile over all the rows of `x`.
            let tile_bytes = if m > SMALL_M {
                TILE_BYTES
            } else {
                DECODE_TILE_BYTES
            };
            let mut tile = (tile_bytes / 4 / k.max(1)).clamp(8, n.max(8));
            if m > SMALL_M {
                // Whole panels of the prompt GEMM: a tile of 113 rows (k = 576) would run
                // three 48-row panels for it, a quarter of their lanes idle.
                tile = (tile / PROMPT_PANEL_ROWS).max(1) * PROMPT_PANEL_ROWS;
            } else {
                // Whole 4-row groups of the decode kernel (its 4 × 4 tiles sum their lanes
                // together): 14 rows (k = 576) would end on a 2-row group.
                tile = tile / DECODE_TILE_GROUP * DECODE_TILE_GROUP;
            }
            if s.len() < tile * k {
                s.resize(tile * k, 0.0);
            }
            let mut j0 = out_cols.start;
            while j0 < out_cols.end {
                let j1 = (j0 + tile).min(out_cols.end);
                let t = &mut s[..(j1 - j0) * k];
                self.rows_to_f32(j0..j1, t);
                let c0 = j0 - out_cols.start;
                let o = &mut out[c0..];
                let shape = (m, k, j1 - j0);
                // Prompt rows on the packed GEMM (what the widened f32 weight computes, bit
                // for bit); decode rows on the in-place kernel (the row dots' order, so a
                // row's result does not depend on its batch).
                if (m > SMALL_M && gemm_nt_f32_prompt(x, t, shape, o, n))
                    || gemm_nt_f32(x, t, shape, o, n)
                {
                    j0 = j1;
                    continue;
                }
                if m <= SMALL_M {
                    // Few rows without AVX-512: each widened row dotted with every row of `x`.
                    for (jj, row) in t.chunks_exact(k).enumerate() {
                        for i in 0..m {
                            o[i * n + jj] = dot(&x[i * k..(i + 1) * k], row);
                        }
                    }
                    j0 = j1;
                    continue;
                }
                sgemm(
                    m,
                    k,
                    j1 - j0,
                    1.0,
                    MatRef {
                        data: x,
                        rs: k,
                        cs: 1,
                    },
                    // tileᵀ[p, c] = tile[c, p]
                    MatRef {
                        data: t,
                        rs: 1,
                        cs: k,
                    },
                    0.0,
                    MatMut {
                        data: o,
                        rs: n,
                        cs: 1,
                    },
                );
                j0 = j1;
            }
        });
    }

    /// Few rows (decode) straight from the stored format, without widening a row first:
    /// f16/bf16 rows dotted as they are, Q8_0/Q4_0/Q4_1 rows dequantised block by block in
    /// registers (bit-identical to widening the row, the default) or, when
    /// [`q8_activations`] is on, against the activations quantised to Q8 once per call (see
    /// [`crate::cpu::simd`] for its error bound). Returns
    /// false for formats without such a kernel (f32 has its own path; K-quants widen rows).
    fn decode_direct(&self, x: &[f32], m: usize, out: &mut [f32], cols: Range<usize>) -> bool {
        let (k, n) = (self.cols, cols.len());
        // One pass over each weight row for all `m` activation rows, scattered into `out`.
        let mut col = [0.0f32; SMALL_M];
        let col = &mut col[..m];
        let mut each = |dot_row: &mut dyn FnMut(usize, &mut [f32])| {
            for (jj, j) in cols.clone().enumerate() {
                dot_row(j, col);
                for (i, v) in col.iter().enumerate() {
                    out[i * n + jj] = *v;
                }
            }
        };
        let x = &x[..m * k];
        match &self.data {
            WeightData::F16(w) => each(&mut |j, o| dot_rows_f16(x, &w[j * k..(j + 1) * k], o)),
            WeightData::BF16(w) => each(&mut |j, o| dot_rows_bf16(x, &w[j * k..(j + 1) * k], o)),
            WeightData::Quant(f, b) if q8_activations() && q8_dot_supported(*f) => {
                let kb = k / f.block_elems();
                let rb = kb * f.block_bytes();
                Q8_SCRATCH.with(|q| {
                    let mut q = q.borrow_mut();
                    if q.len() < m * kb {
                        q.resize(m * kb, Q8Block::default());
                    }
                    for i in 0..m {
                        quantize_q8_for(*f, &x[i * k..(i + 1) * k], &mut q[i * kb..(i + 1) * kb]);
                    }
                    let w = &b[cols.start * rb..cols.end * rb];
                    gemv_q8(*f, w, n, &q[..m * kb], &mut out[..m * n], n);
                });
            }
            WeightData::Quant(f, b) if q8_dot_supported(*f) => {
                let rb = k / f.block_elems() * f.block_bytes();
                gemv_quant_f32(*f, &b[cols.start * rb..cols.end * rb], n, x, out, n);
            }
            _ => return false,
        }
        true
    }
}
