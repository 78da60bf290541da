// Batched heterogeneous LoRA in Punica's shape (issue 29): y += scale * (x A^T) B^T, a different
// adapter per segment (SGMV) or per row (BGMV). Same math and descriptor tables as lora.cu; CPU
// twins: kernels/src/cpu/lora.rs (sgmv_shrink / sgmv_expand / bgmv_shrink / bgmv_expand).
//
// What differs from lora.cu:
// * Shrink (x A^T, K = d_in up to 65,536, rank small): split-K. Block (segment or row, tile of
//   PUNICA_RANK_TILE ranks, K chunk): it stages its ≤ PUNICA_ROWS rows of x for the K chunk in
//   shared memory once, then each warp walks whole ranks of A with 16-byte loads (bf16x8 /
//   f16x8 / float4), so A — the bytes that matter — streams at full width and every A element
//   is read once per row chunk. A decode step's few rows still spread over
//   segments x rank tiles x splits blocks.
// * The split-K partial sums go to `v_parts` = [splits, rows_total, v_stride] f32, with no
//   atomics and no memset; the expand sums the splits while it stages v in shared memory.
// * Expand (v B^T, K = rank): a group of G lanes (G = the rank's 16-byte chunks rounded up to
//   a power of two, ≤ 32) reads one column's row of B, [rank] contiguous elements, with one
//   16-byte load per lane, so a warp's loads are contiguous; the group reduces with shuffles.
// * Vector loads need 16-byte aligned rows (the row length in bytes a multiple of 16 and the
//   base aligned); any other shape takes the scalar path of the same kernel.
//
// SGMV: segment s covers rows seg_rows[2s] .. seg_rows[2s+1], computes and reads rank_s columns
// of v (no padding: cost ∝ Σ rank). BGMV: one descriptor table per row (0 = no LoRA), v padded
// to max_rank with zeros (cost ∝ rows · max rank).

#define PUNICA_THREADS 256
#define PUNICA_WARPS (PUNICA_THREADS / 32)
#define PUNICA_ROWS 4
#define PUNICA_RANK_TILE 16
#define PUNICA_K_CHUNK 1024
#define PUNICA_EXPAND_COLS 256
#define PUNICA_MAX_RANK 256

// Elements of W in one 16-byte load.
template <typename W> struct Vec16 { static constexpr int N = 16 / (int)sizeof(W); };

template <typename W>
__device__ __forceinline__ void load16(const W* p, float (&out)[Vec16<W>::N]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const u32 words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < Vec16<W>::N; ++i) {
        if constexpr (sizeof(W) == 4) {
            out[i] = __uint_as_float(words[i]);
        } else {
            const unsigned short h = (unsigned short)(words[i / 2] >> (16 * (i % 2)));
            W w;
            *reinterpret_cast<unsigned short*>(&w) = h;
            out[i] = to_f32(w);
        }
    }
}

// Σ s[e] · w[e] over V (a multiple of 4) floats of 16-byte aligned shared memory, read as
// float4 (one 128-bit shared load per 4 elements).
template <int V>
__device__ __forceinline__ float dot_shared(const float* s, const float (&w)[V]) {
    float t = 0.0f;
#pragma unroll
    for (int e = 0; e < V; e += 4) {
        const float4 q = *reinterpret_cast<const float4*>(s + e);
        t += q.x * w[e] + q.y * w[e + 1] + q.z * w[e + 2] + q.w * w[e + 3];
    }
    return t;
}

__device__ __forceinline__ bool aligned16(const void* p, long row_bytes) {
    return ((reinterpret_cast<u64>(p) | (u64)row_bytes) & 15ull) == 0;
}

__device__ __forceinline__ const LoraSlot* punica_slot(u64 table, int slot) {
    return table ? reinterpret_cast<const LoraSlot*>(table) + slot : nullptr;
}

// One shrink block: rows start .. start+n (n ≤ PUNICA_ROWS) of one adapter, ranks
// r0 .. r0+PUNICA_RANK_TILE, K chunk `split`. Ranks in [rank, pad_to) are written as 0 (BGMV
// padding; SGMV passes pad_to = rank). Must be called by the whole block.
template <typename W>
__device__ void punica_shrink_block(const float* __restrict__ x, float* __restrict__ v_parts,
                                    const LoraSlot* ls, u32 start, int n, int r0, int split,
                                    int d_in, int k_chunk, int rows_total, int v_stride,
                                    int pad_to) {
    __shared__ __align__(16) float xs[PUNICA_ROWS][PUNICA_K_CHUNK];
    const int k0 = split * k_chunk, k1 = min(d_in, k0 + k_chunk);
    const int rank = ls ? (int)ls->rank : 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* vp = v_parts + ((long)split * rows_total + start) * v_stride;
    if (r0 >= rank) {
        // Padding only (BGMV): no A to read, no x to stage.
        for (int i = threadIdx.x; i < n * PUNICA_RANK_TILE; i += blockDim.x) {
            const int k = i / PUNICA_RANK_TILE, r = r0 + i % PUNICA_RANK_TILE;
            if (r < pad_to) vp[(long)k * v_stride + r] = 0.0f;
        }
        return;
    }
    const int len = k1 - k0;
    for (int i = threadIdx.x; i < n * len; i += blockDim.x) {
        const int k = i / len, j = i % len;
        xs[k][j] = x[(long)(start + k) * d_in + k0 + j];
    }
    __syncthreads();
    constexpr int V = Vec16<W>::N;
    const W* a = reinterpret_cast<const W*>(ls->a);
    const bool vec = aligned16(a, (long)d_in * sizeof(W)) && (k0 % V) == 0;
    for (int r = r0 + warp; r < min(r0 + PUNICA_RANK_TILE, pad_to); r += PUNICA_WARPS) {
        float acc[PUNICA_ROWS] = {};
        if (r < rank) {
            const W* ar = a + (long)r * d_in;
            int j = 0;
            if (vec) {
                for (j = lane * V; j + V <= len; j += 32 * V) {
                    float w[V];
                    load16(ar + k0 + j, w);
#pragma unroll
                    for (int k = 0; k < PUNICA_ROWS; ++k)
                        if (k < n) acc[k] += dot_shared<V>(&xs[k][j], w);
                }
                // The tail past the last whole vector (d_in % V ≠ 0 only in the last chunk).
                j = (len / V) * V + lane;
            } else {
                j = lane;
            }
            for (; j < len; j += 32) {
                const float w = to_f32(ar[k0 + j]);
#pragma unroll
                for (int k = 0; k < PUNICA_ROWS; ++k)
                    if (k < n) acc[k] += xs[k][j] * w;
            }
        }
#pragma unroll
        for (int k = 0; k < PUNICA_ROWS; ++k) {
            const float t = warp_sum(acc[k]);
            if (lane == 0 && k < n) vp[(long)k * v_stride + r] = t;
        }
    }
}

// The expand of one block's columns c0 .. c0 + cols (clipped to d_out) for rows start ..
// start + n, from v in shared memory (`vs[k][c]`, c < rank): a group of G lanes per column (see
// the file header), y[row][j] += scale · Σ_c vs[k][c] · B[j][c]. Must be called by the whole
// block (the shuffles need every lane).
template <typename W>
__device__ void punica_expand_cols(const float (*vs)[PUNICA_MAX_RANK], float* __restrict__ y,
                                   const LoraSlot* ls, u32 start, int n, int c0, int cols,
                                   int d_out) {
    const int rank = (int)ls->rank;
    constexpr int V = Vec16<W>::N;
    const W* b = reinterpret_cast<const W*>(ls->b);
    const bool vec = aligned16(b, (long)rank * sizeof(W));
    const int width = vec ? V : 1;
    const int chunks = (rank + width - 1) / width;
    int g = 1;
    while (g < chunks && g < 32) g <<= 1;
    const int lane_g = threadIdx.x & (g - 1), group = threadIdx.x / g, groups = blockDim.x / g;
    const float scale = ls->scale;
    // Every lane runs the same number of iterations: the shuffles below need the whole warp.
    for (int i = 0; i < (cols + groups - 1) / groups; ++i) {
        const int j = c0 + group + i * groups;
        const bool valid = j < d_out && group + i * groups < cols;
        float acc[PUNICA_ROWS] = {};
        if (valid) {
            const W* br = b + (long)j * rank;
            for (int c = lane_g; c < chunks; c += g) {
                if (vec) {
                    float w[V];
                    load16(br + c * V, w);
#pragma unroll
                    for (int k = 0; k < PUNICA_ROWS; ++k)
                        if (k < n) acc[k] += dot_shared<V>(&vs[k][c * V], w);
                } else {
                    const float w = to_f32(br[c]);
#pragma unroll
                    for (int k = 0; k < PUNICA_ROWS; ++k)
                        if (k < n) acc[k] += vs[k][c] * w;
                }
            }
        }
#pragma unroll
        for (int k = 0; k < PUNICA_ROWS; ++k)
            for (int o = g >> 1; o > 0; o >>= 1) acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], o);
        if (valid && lane_g == 0)
            for (int k = 0; k < n; ++k) y[(long)(start + k) * d_out + j] += scale * acc[k];
    }
}

// One expand block: rows start .. start+n of one adapter, output columns
// c0 .. c0+PUNICA_EXPAND_COLS. Sums the split-K partials of v while staging them.
template <typename W>
__device__ void punica_expand_block(const float* __restrict__ v_parts, float* __restrict__ y,
                                    const LoraSlot* ls, u32 start, int n, int c0, int splits,
                                    int d_out, int rows_total, int v_stride) {
    __shared__ __align__(16) float vs[PUNICA_ROWS][PUNICA_MAX_RANK];
    const int rank = (int)ls->rank;
    for (int i = threadIdx.x; i < n * rank; i += blockDim.x) {
        const int k = i / rank, c = i % rank;
        float t = 0.0f;
        for (int sp = 0; sp < splits; ++sp)
            t += v_parts[((long)sp * rows_total + start + k) * v_stride + c];
        vs[k][c] = t;
    }
    __syncthreads();
    punica_expand_cols<W>(vs, y, ls, start, n, c0, PUNICA_EXPAND_COLS, d_out);
}

// SGMV shrink: grid (n_segs, rank_tiles * splits, ceil(longest segment / PUNICA_ROWS)).
template <typename W>
__device__ void punica_sgmv_shrink(const float* x, float* v_parts, const u64* seg_tables,
                                   const u32* seg_rows, int n_segs, int slot, int d_in,
                                   int k_chunk, int splits, int rows_total, int v_stride) {
    const int s = blockIdx.x;
    if (s >= n_segs) return;
    const LoraSlot* ls = punica_slot(seg_tables[s], slot);
    const int tile = blockIdx.y / splits, split = blockIdx.y % splits;
    const int r0 = tile * PUNICA_RANK_TILE;
    if (!ls || r0 >= (int)ls->rank) return;
    const u32 start = seg_rows[2 * s] + blockIdx.z * PUNICA_ROWS, end = seg_rows[2 * s + 1];
    if (start >= end) return;
    const int n = min((int)(end - start), PUNICA_ROWS);
    punica_shrink_block<W>(x, v_parts, ls, start, n, r0, split, d_in, k_chunk, rows_total,
                           v_stride, (int)ls->rank);
}

// SGMV expand: grid (n_segs, ceil(d_out / PUNICA_EXPAND_COLS), ceil(longest segment / ROWS)).
template <typename W>
__device__ void punica_sgmv_expand(const float* v_parts, float* y, const u64* seg_tables,
                                   const u32* seg_rows, int n_segs, int slot, int d_out,
                                   int splits, int rows_total, int v_stride) {
    const int s = blockIdx.x;
    if (s >= n_segs) return;
    const LoraSlot* ls = punica_slot(seg_tables[s], slot);
    if (!ls || ls->rank == 0) return;
    const u32 start = seg_rows[2 * s] + blockIdx.z * PUNICA_ROWS, end = seg_rows[2 * s + 1];
    if (start >= end) return;
    const int n = min((int)(end - start), PUNICA_ROWS);
    punica_expand_block<W>(v_parts, y, ls, start, n, blockIdx.y * PUNICA_EXPAND_COLS, splits,
                           d_out, rows_total, v_stride);
}

// BGMV shrink: grid (rows, ceil(max_rank / PUNICA_RANK_TILE) * splits); v padded to max_rank.
template <typename W>
__device__ void punica_bgmv_shrink(const float* x, float* v_parts, const u64* row_tables,
                                   int rows, int slot, int d_in, int k_chunk, int splits,
                                   int max_rank) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const LoraSlot* ls = punica_slot(row_tables[row], slot);
    const int tile = blockIdx.y / splits, split = blockIdx.y % splits;
    punica_shrink_block<W>(x, v_parts, ls, (u32)row, 1, tile * PUNICA_RANK_TILE, split, d_in,
                           k_chunk, rows, max_rank, max_rank);
}

// BGMV expand: grid (rows, ceil(d_out / PUNICA_EXPAND_COLS)).
template <typename W>
__device__ void punica_bgmv_expand(const float* v_parts, float* y, const u64* row_tables,
                                   int rows, int slot, int d_out, int splits, int max_rank) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const LoraSlot* ls = punica_slot(row_tables[row], slot);
    if (!ls || ls->rank == 0) return;
    punica_expand_block<W>(v_parts, y, ls, (u32)row, 1, blockIdx.y * PUNICA_EXPAND_COLS, splits,
                           d_out, rows, max_rank);
}

#define THAW_PUNICA(W, S)                                                                     \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) punica_sgmv_shrink_##S(     \
        const float* x, float* v_parts, const u64* seg_tables, const u32* seg_rows,          \
        int n_segs, int slot, int d_in, int k_chunk, int splits, int rows_total,             \
        int v_stride) {                                                                       \
        punica_sgmv_shrink<W>(x, v_parts, seg_tables, seg_rows, n_segs, slot, d_in, k_chunk, \
                              splits, rows_total, v_stride);                                 \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) punica_sgmv_expand_##S(     \
        const float* v_parts, float* y, const u64* seg_tables, const u32* seg_rows,          \
        int n_segs, int slot, int d_out, int splits, int rows_total, int v_stride) {         \
        punica_sgmv_expand<W>(v_parts, y, seg_tables, seg_rows, n_segs, slot, d_out, splits, \
                              rows_total, v_stride);                                         \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) punica_bgmv_shrink_##S(     \
        const float* x, float* v_parts, const u64* row_tables, int rows, int slot, int d_in, \
        int k_chunk, int splits, int max_rank) {                                              \
        punica_bgmv_shrink<W>(x, v_parts, row_tables, rows, slot, d_in, k_chunk, splits,     \
                              max_rank);                                                      \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) punica_bgmv_expand_##S(     \
        const float* v_parts, float* y, const u64* row_tables, int rows, int slot,           \
        int d_out, int splits, int max_rank) {                                                \
        punica_bgmv_expand<W>(v_parts, y, row_tables, rows, slot, d_out, splits, max_rank);  \
    }
// lora_slices.cu and lora_fused_small.cu compile this file's device functions with their own
// entry points.
#ifndef PUNICA_DEVICE_ONLY
THAW_FOR_EACH_DTYPE(THAW_PUNICA)
#endif
