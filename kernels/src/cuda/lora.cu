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

// v[row, r] = x[row, :] . A[r, :], one warp per rank r, lanes split d_in.
template <typename W>
__device__ __forceinline__ float row_dot(const float* __restrict__ xr, const W* __restrict__ ar,
                                         int d_in, int lane) {
    float s = 0.0f;
    for (int j = lane; j < d_in; j += 32) s += xr[j] * to_f32(ar[j]);
    return warp_sum(s);
}

// grid (n_segs, ceil(v_stride / THAW_LORA_WARPS)), THAW_LORA_WARPS warps.
template <typename W>
__device__ void sgmv_shrink(const float* __restrict__ x, float* __restrict__ v,
                            const u64* __restrict__ seg_tables, const u32* __restrict__ seg_rows,
                            int n_segs, int slot, int d_in, int v_stride) {
    const int s = blockIdx.x;
    if (s >= n_segs) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.y * THAW_LORA_WARPS + warp;
    const LoraSlot* ls = lora_slot(seg_tables[s], slot);
    if (r >= (int)ls->rank) return;
    const W* ar = reinterpret_cast<const W*>(ls->a) + (long)r * d_in;
    for (u32 row = seg_rows[2 * s]; row < seg_rows[2 * s + 1]; ++row) {
        const float d = row_dot(x + (long)row * d_in, ar, d_in, lane);
        if (lane == 0) v[(long)row * v_stride + r] = d;
    }
}

// y[row, j] += scale * v[row, :rank] . B[j, :]; grid (n_segs, ceil(d_out / 256)), 256 threads,
// one output column per thread; the v row is staged in shared memory.
template <typename W>
__device__ void sgmv_expand(const float* __restrict__ v, float* __restrict__ y,
                            const u64* __restrict__ seg_tables, const u32* __restrict__ seg_rows,
                            int n_segs, int slot, int d_out, int v_stride) {
    const int s = blockIdx.x;
    if (s >= n_segs) return;
    const LoraSlot* ls = lora_slot(seg_tables[s], slot);
    const int rank = (int)ls->rank;
    if (rank == 0) return;
    const float scale = ls->scale;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    const W* br = reinterpret_cast<const W*>(ls->b) + (long)j * rank;
    __shared__ float vs[THAW_MAX_LORA_RANK];
    for (u32 row = seg_rows[2 * s]; row < seg_rows[2 * s + 1]; ++row) {
        __syncthreads();
        for (int k = threadIdx.x; k < rank; k += blockDim.x) vs[k] = v[(long)row * v_stride + k];
        __syncthreads();
        if (j < d_out) {
            float acc = 0.0f;
            for (int k = 0; k < rank; ++k) acc += vs[k] * to_f32(br[k]);
            y[(long)row * d_out + j] += scale * acc;
        }
    }
}

// grid (rows, ceil(max_rank / THAW_LORA_WARPS)), THAW_LORA_WARPS warps; v is [rows, max_rank].
template <typename W>
__device__ void bgmv_shrink(const float* __restrict__ x, float* __restrict__ v,
                            const u64* __restrict__ row_tables, int rows, int slot, int d_in,
                            int max_rank) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.y * THAW_LORA_WARPS + warp;
    if (r >= max_rank) return;
    const u64 table = row_tables[row];
    const LoraSlot* ls = table ? lora_slot(table, slot) : nullptr;
    float d = 0.0f;
    if (ls && r < (int)ls->rank) {
        const W* ar = reinterpret_cast<const W*>(ls->a) + (long)r * d_in;
        d = row_dot(x + (long)row * d_in, ar, d_in, lane);
    }
    if (lane == 0) v[(long)row * max_rank + r] = d;
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
