// Batched heterogeneous LoRA: y += scale * (x A^T) B^T with a different adapter per row group.
// CPU twins: kernels/src/cpu/lora.rs (sgmv_shrink / sgmv_expand / bgmv_shrink / bgmv_expand).
//
// Adapters are found through per-adapter descriptor tables: `tables[i]` is the device address
// of adapter i's LoraSlot array ([n_layers * 7], index layer * 7 + module), so the per-step
// segment / row lists are built once per step and every (layer, module) reuses them; `slot`
// picks the (layer, module). The intermediate v is [rows, v_stride] f32.
//
// SGMV (Punica): segment s covers rows seg_rows[2s] .. seg_rows[2s+1]; only rank_s columns of
// v are computed and read (no padding: cost ∝ Σ rank). BGMV: one table per row (0 = no LoRA);
// v is padded to max_rank — columns past an adapter's rank and rows without an adapter are
// written as 0 and the expand multiplies them (cost ∝ rows · max_rank), as in S-LoRA.

#define THAW_LORA_WARPS 8
#define THAW_LORA_EXPAND_THREADS 256
#define THAW_MAX_LORA_RANK 256

__device__ __forceinline__ const LoraSlot* lora_slot(u64 table, int slot) {
    return reinterpret_cast<const LoraSlot*>(table) + slot;
}

// Rows of one segment a block handles: A / B are read once per block and reused for them.
#define THAW_LORA_ROWS 4

// The block's n (≤ THAW_LORA_ROWS) partial sums, reduced over the block; thread k < n gets
// row k's total. Every thread of the block must call it.
__device__ __forceinline__ float block_sum_rows(float (&acc)[THAW_LORA_ROWS]) {
    __shared__ float part[THAW_LORA_ROWS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int k = 0; k < THAW_LORA_ROWS; ++k) {
        const float t = warp_sum(acc[k]);
        if (lane == 0) part[k][warp] = t;
    }
    __syncthreads();
    float t = 0.0f;
    if (threadIdx.x < THAW_LORA_ROWS)
        for (int w = 0; w < warps; ++w) t += part[threadIdx.x][w];
    return t;
}

// SGMV shrink, grid (n_segs, v_stride, ceil(longest segment / THAW_LORA_ROWS)),
// THAW_LORA_WARPS warps: one block per (segment, rank r, chunk of ≤ THAW_LORA_ROWS rows); its
// threads split d_in, so a decode step's few rows still spread over rank × segments blocks
// (a warp per rank looping over the segment's rows serially ran 90 µs for 8 rows on an H100).
template <typename W>
__device__ void sgmv_shrink(const float* __restrict__ x, float* __restrict__ v,
                            const u64* __restrict__ seg_tables, const u32* __restrict__ seg_rows,
                            int n_segs, int slot, int d_in, int v_stride) {
    const int s = blockIdx.x, r = blockIdx.y;
    if (s >= n_segs) return;
    const LoraSlot* ls = lora_slot(seg_tables[s], slot);
    if (r >= (int)ls->rank) return;
    const u32 start = seg_rows[2 * s] + blockIdx.z * THAW_LORA_ROWS, end = seg_rows[2 * s + 1];
    if (start >= end) return;
    const int n = min((int)(end - start), THAW_LORA_ROWS);
    const W* ar = reinterpret_cast<const W*>(ls->a) + (long)r * d_in;
    const float* xr = x + (long)start * d_in;
    float acc[THAW_LORA_ROWS] = {};
    for (int j = threadIdx.x; j < d_in; j += blockDim.x) {
        const float a = to_f32(ar[j]);
#pragma unroll
        for (int k = 0; k < THAW_LORA_ROWS; ++k)
            if (k < n) acc[k] += xr[(long)k * d_in + j] * a;
    }
    const float t = block_sum_rows(acc);
    if (threadIdx.x < n) v[(long)(start + threadIdx.x) * v_stride + r] = t;
}

// SGMV expand, grid (n_segs, ceil(d_out / 256), ceil(longest segment / THAW_LORA_ROWS)), 256
// threads, one output column per thread for ≤ THAW_LORA_ROWS rows; B's row is read once.
template <typename W>
__device__ void sgmv_expand(const float* __restrict__ v, float* __restrict__ y,
                            const u64* __restrict__ seg_tables, const u32* __restrict__ seg_rows,
                            int n_segs, int slot, int d_out, int v_stride) {
    const int s = blockIdx.x;
    if (s >= n_segs) return;
    const LoraSlot* ls = lora_slot(seg_tables[s], slot);
    const int rank = (int)ls->rank;
    if (rank == 0) return;
    const u32 start = seg_rows[2 * s] + blockIdx.z * THAW_LORA_ROWS, end = seg_rows[2 * s + 1];
    if (start >= end) return;
    const int n = min((int)(end - start), THAW_LORA_ROWS);
    __shared__ float vs[THAW_LORA_ROWS][THAW_MAX_LORA_RANK];
    for (int i = threadIdx.x; i < n * rank; i += blockDim.x)
        vs[i / rank][i % rank] = v[(long)(start + i / rank) * v_stride + i % rank];
    __syncthreads();
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= d_out) return;
    const W* br = reinterpret_cast<const W*>(ls->b) + (long)j * rank;
    float acc[THAW_LORA_ROWS] = {};
    for (int c = 0; c < rank; ++c) {
        const float b = to_f32(br[c]);
#pragma unroll
        for (int k = 0; k < THAW_LORA_ROWS; ++k) acc[k] += vs[k][c] * b;
    }
    const float scale = ls->scale;
    for (int k = 0; k < n; ++k) y[(long)(start + k) * d_out + j] += scale * acc[k];
}

// BGMV shrink, grid (rows, max_rank), THAW_LORA_WARPS warps: one block per (row, rank r), its
// threads split d_in; v is [rows, max_rank], padded with 0.
template <typename W>
__device__ void bgmv_shrink(const float* __restrict__ x, float* __restrict__ v,
                            const u64* __restrict__ row_tables, int rows, int slot, int d_in,
                            int max_rank) {
    const int row = blockIdx.x, r = blockIdx.y;
    if (row >= rows || r >= max_rank) return;
    const u64 table = row_tables[row];
    const LoraSlot* ls = table ? lora_slot(table, slot) : nullptr;
    if (!ls || r >= (int)ls->rank) {
        if (threadIdx.x == 0) v[(long)row * max_rank + r] = 0.0f;
        return;
    }
    const W* ar = reinterpret_cast<const W*>(ls->a) + (long)r * d_in;
    const float* xr = x + (long)row * d_in;
    float d = 0.0f;
    for (int j = threadIdx.x; j < d_in; j += blockDim.x) d += xr[j] * to_f32(ar[j]);
    d = block_sum(d);
    if (threadIdx.x == 0) v[(long)row * max_rank + r] = d;
}

// grid (rows, ceil(d_out / 256)), 256 threads.
template <typename W>
__device__ void bgmv_expand(const float* __restrict__ v, float* __restrict__ y,
                            const u64* __restrict__ row_tables, int rows, int slot, int d_out,
                            int max_rank) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const u64 table = row_tables[row];
    if (!table) return;
    const LoraSlot* ls = lora_slot(table, slot);
    const int rank = (int)ls->rank;
    if (rank == 0) return;
    __shared__ float vs[THAW_MAX_LORA_RANK];
    for (int k = threadIdx.x; k < max_rank; k += blockDim.x) vs[k] = v[(long)row * max_rank + k];
    __syncthreads();
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= d_out) return;
    const W* br = reinterpret_cast<const W*>(ls->b) + (long)j * rank;
    float acc = 0.0f;
    for (int k = 0; k < max_rank; ++k) acc += vs[k] * (k < rank ? to_f32(br[k]) : 0.0f);
    y[(long)row * d_out + j] += ls->scale * acc;
}

#define THAW_LORA(W, S)                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * THAW_LORA_WARPS)                        \
        sgmv_shrink_##S(const float* x, float* v, const u64* seg_tables, const u32* seg_rows, \
                        int n_segs, int slot, int d_in, int v_stride) {                       \
        sgmv_shrink<W>(x, v, seg_tables, seg_rows, n_segs, slot, d_in, v_stride);           \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(THAW_LORA_EXPAND_THREADS)                    \
        sgmv_expand_##S(const float* v, float* y, const u64* seg_tables, const u32* seg_rows, \
                        int n_segs, int slot, int d_out, int v_stride) {                      \
        sgmv_expand<W>(v, y, seg_tables, seg_rows, n_segs, slot, d_out, v_stride);          \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * THAW_LORA_WARPS)                        \
        bgmv_shrink_##S(const float* x, float* v, const u64* row_tables, int rows, int slot,   \
                        int d_in, int max_rank) {                                             \
        bgmv_shrink<W>(x, v, row_tables, rows, slot, d_in, max_rank);                         \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(THAW_LORA_EXPAND_THREADS)                    \
        bgmv_expand_##S(const float* v, float* y, const u64* row_tables, int rows, int slot,   \
                        int d_out, int max_rank) {                                            \
        bgmv_expand<W>(v, y, row_tables, rows, slot, d_out, max_rank);                        \
    }
THAW_FOR_EACH_DTYPE(THAW_LORA)
