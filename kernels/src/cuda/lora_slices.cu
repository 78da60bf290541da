// Multi-slice Punica LoRA (issue 29, a default; `THAW_CUDA_LORA_SLICES=0` off): the modules of a layer
// that share one input (q/k/v, gate/up) as ONE shrink launch and ONE expand launch instead of
// two launches per module, as vLLM's Triton `lora_shrink` / `lora_expand` do with "slices".
//
// The registry compiles this file after `lora_punica.cu` (with PUNICA_DEVICE_ONLY, so only its
// device functions come along): every block runs exactly the per-module kernels' block code
// (`punica_shrink_block` / `punica_expand_block`) with the same arguments, so each slice's
// result is bit-identical to its own per-module launch with the same split-K plan.
//
// Per slice: its descriptor slot (layer * 7 + module), its d_out and its output buffer; shared:
// x, the segment metadata and the split-K plan. The slice is the outer factor of blockIdx.z
// (z = slice * inner + inner index, inner = row chunks for SGMV, 1 for BGMV). v_parts is laid
// out [slices][splits][rows_total][v_stride] (v_stride = the largest rank over the slices).
// Expand grids are as wide as the widest slice; a block past its slice's d_out returns.

#define PUNICA_MAX_SLICES 3

// Per-slice parameters, passed by value (the host passes [i32; 3] / [u64; 3]).
struct SliceInts { int v[PUNICA_MAX_SLICES]; };
struct SlicePtrs { u64 v[PUNICA_MAX_SLICES]; };

// SGMV shrink: grid (n_segs, rank_tiles * splits, chunks * n_slices).
template <typename W>
__device__ void slices_sgmv_shrink(const float* x, float* v_parts, const u64* seg_tables,
                                   const u32* seg_rows, int n_segs, SliceInts slots,
                                   int n_slices, int chunks, int d_in, int k_chunk, int splits,
                                   int rows_total, int v_stride) {
    const int s = blockIdx.x;
    const int slice = blockIdx.z / chunks, chunk = blockIdx.z % chunks;
    if (s >= n_segs || slice >= n_slices) return;
    const LoraSlot* ls = punica_slot(seg_tables[s], slots.v[slice]);
    const int tile = blockIdx.y / splits, split = blockIdx.y % splits;
    const int r0 = tile * PUNICA_RANK_TILE;
    if (!ls || r0 >= (int)ls->rank) return;
    const u32 start = seg_rows[2 * s] + chunk * PUNICA_ROWS, end = seg_rows[2 * s + 1];
    if (start >= end) return;
    const int n = min((int)(end - start), PUNICA_ROWS);
    float* vp = v_parts + (long)slice * splits * rows_total * v_stride;
    punica_shrink_block<W>(x, vp, ls, start, n, r0, split, d_in, k_chunk, rows_total, v_stride,
                           (int)ls->rank);
}

// SGMV expand: grid (n_segs, ceil(max d_out / PUNICA_EXPAND_COLS), chunks * n_slices).
template <typename W>
__device__ void slices_sgmv_expand(const float* v_parts, SlicePtrs ys, const u64* seg_tables,
                                   const u32* seg_rows, int n_segs, SliceInts slots,
                                   SliceInts d_outs, int n_slices, int chunks, int splits,
                                   int rows_total, int v_stride) {
    const int s = blockIdx.x;
    const int slice = blockIdx.z / chunks, chunk = blockIdx.z % chunks;
    if (s >= n_segs || slice >= n_slices) return;
    const int d_out = d_outs.v[slice], c0 = blockIdx.y * PUNICA_EXPAND_COLS;
    if (c0 >= d_out) return;
    const LoraSlot* ls = punica_slot(seg_tables[s], slots.v[slice]);
    if (!ls || ls->rank == 0) return;
    const u32 start = seg_rows[2 * s] + chunk * PUNICA_ROWS, end = seg_rows[2 * s + 1];
    if (start >= end) return;
    const int n = min((int)(end - start), PUNICA_ROWS);
    const float* vp = v_parts + (long)slice * splits * rows_total * v_stride;
    punica_expand_block<W>(vp, reinterpret_cast<float*>(ys.v[slice]), ls, start, n, c0, splits,
                           d_out, rows_total, v_stride);
}

// BGMV shrink: grid (rows, ceil(max_rank / PUNICA_RANK_TILE) * splits, n_slices); v padded to
// max_rank (the v_stride) with zeros.
template <typename W>
__device__ void slices_bgmv_shrink(const float* x, float* v_parts, const u64* row_tables,
                                   int rows, SliceInts slots, int n_slices, int d_in,
                                   int k_chunk, int splits, int max_rank) {
    const int row = blockIdx.x, slice = blockIdx.z;
    if (row >= rows || slice >= n_slices) return;
    const LoraSlot* ls = punica_slot(row_tables[row], slots.v[slice]);
    const int tile = blockIdx.y / splits, split = blockIdx.y % splits;
    float* vp = v_parts + (long)slice * splits * rows * max_rank;
    punica_shrink_block<W>(x, vp, ls, (u32)row, 1, tile * PUNICA_RANK_TILE, split, d_in, k_chunk,
                           rows, max_rank, max_rank);
}

// BGMV expand: grid (rows, ceil(max d_out / PUNICA_EXPAND_COLS), n_slices).
template <typename W>
__device__ void slices_bgmv_expand(const float* v_parts, SlicePtrs ys, const u64* row_tables,
                                   int rows, SliceInts slots, SliceInts d_outs, int n_slices,
                                   int splits, int max_rank) {
    const int row = blockIdx.x, slice = blockIdx.z;
    if (row >= rows || slice >= n_slices) return;
    const int d_out = d_outs.v[slice], c0 = blockIdx.y * PUNICA_EXPAND_COLS;
    if (c0 >= d_out) return;
    const LoraSlot* ls = punica_slot(row_tables[row], slots.v[slice]);
    if (!ls || ls->rank == 0) return;
    const float* vp = v_parts + (long)slice * splits * rows * max_rank;
    punica_expand_block<W>(vp, reinterpret_cast<float*>(ys.v[slice]), ls, (u32)row, 1, c0,
                           splits, d_out, rows, max_rank);
}

#define THAW_SLICES(W, S)                                                                     \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) slices_sgmv_shrink_##S(     \
        const float* x, float* v_parts, const u64* seg_tables, const u32* seg_rows,          \
        int n_segs, SliceInts slots, int n_slices, int chunks, int d_in, int k_chunk,        \
        int splits, int rows_total, int v_stride) {                                           \
        slices_sgmv_shrink<W>(x, v_parts, seg_tables, seg_rows, n_segs, slots, n_slices,     \
                              chunks, d_in, k_chunk, splits, rows_total, v_stride);          \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) slices_sgmv_expand_##S(     \
        const float* v_parts, SlicePtrs ys, const u64* seg_tables, const u32* seg_rows,      \
        int n_segs, SliceInts slots, SliceInts d_outs, int n_slices, int chunks, int splits, \
        int rows_total, int v_stride) {                                                       \
        slices_sgmv_expand<W>(v_parts, ys, seg_tables, seg_rows, n_segs, slots, d_outs,      \
                              n_slices, chunks, splits, rows_total, v_stride);               \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) slices_bgmv_shrink_##S(     \
        const float* x, float* v_parts, const u64* row_tables, int rows, SliceInts slots,    \
        int n_slices, int d_in, int k_chunk, int splits, int max_rank) {                      \
        slices_bgmv_shrink<W>(x, v_parts, row_tables, rows, slots, n_slices, d_in, k_chunk,  \
                              splits, max_rank);                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) slices_bgmv_expand_##S(     \
        const float* v_parts, SlicePtrs ys, const u64* row_tables, int rows, SliceInts slots, \
        SliceInts d_outs, int n_slices, int splits, int max_rank) {                           \
        slices_bgmv_expand<W>(v_parts, ys, row_tables, rows, slots, d_outs, n_slices, splits, \
                              max_rank);                                                      \
    }
THAW_FOR_EACH_DTYPE(THAW_SLICES)
