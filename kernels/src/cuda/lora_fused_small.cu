// Small-batch LoRA in ONE launch (issue 29, opt-in `THAW_CUDA_LORA_SMALL=1`): y += scale ·
// (x Aᵀ) Bᵀ for SGMV (an adapter per segment) and BGMV (an adapter per row), shrink and expand
// fused. CPU twins: kernels/src/cpu/lora.rs (sgmv_shrink + sgmv_expand, bgmv_shrink +
// bgmv_expand); the plan that picks it and its grid: lora_small_plan.rs.
//
// Why: at a decode step's few rows a call of lora_punica.cu's two kernels is launch-bound (rank
// 16 on a 4096 → 4096 projection reads 128 KiB of A and 128 KiB of B), and each launch costs the
// host a few µs and the GPU a launch gap. One launch halves both.
//
// Design: every block recomputes the shrink v = x · Aᵀ for its rows (A and its rows of x come
// from L2 after the first block's read: cheap at small rank and few rows), keeps v in shared
// memory in f32, then computes its tile of output columns of the expand. No block waits on
// another, so the kernel is correct whatever the grid and whichever blocks the GPU keeps
// resident. The alternative — split-K shrink blocks and expand blocks in one grid, the expand
// blocks spinning on a device counter — needs the whole grid co-resident (a cooperative
// launch) to be free of deadlock, and a counter reset without another launch; its saving is
// the shrink's redundant L2 reads, which the plan bounds instead (at most a few tiles per
// adapter, and a per-block byte budget, lora_small_plan.rs).
//
// Numerics match the two-launch path: f32 accumulation, v kept in f32 (never rounded to the
// weight dtype), the same per-K-chunk warp sums as lora_punica.cu's shrink (`small_rank_dots`,
// with more loads in flight, which changes no sum) and the same expand (`punica_expand_cols`);
// only the grouping of the f32 sums over K differs (the chunks here are PUNICA_K_CHUNK long, the
// split-K plan's may be shorter), so the two agree to f32 summation-order differences.
//
// The registry compiles this file after lora_punica.cu (with PUNICA_DEVICE_ONLY, so only its
// device functions come along). A block takes at most PUNICA_ROWS rows (a longer SGMV segment
// spreads over blockIdx.z) and ranks up to PUNICA_MAX_RANK (the host checks): shared memory
// holds one K chunk of its rows of x and their v, 20 KiB. Latency, not bandwidth, bounds a block
// that walks all of K alone, so it keeps loads in flight: the next chunk of x while the current
// one's dot products run, and several ranks' loads of A at once (`small_rank_dots`).

// Ranks a warp's shrink takes at once, and 16-byte loads of each it issues before using them
// (`small_rank_dots`): 8 loads (4 KiB a warp) in flight; rank 16 is then one round per K chunk
// for each of the 8 warps.
#define SMALL_RANKS_IN_FLIGHT 2
#define SMALL_LOADS_IN_FLIGHT 4

// The shrink's dot products over one staged K chunk (`len` elements from k0): for rows k < n
// (≤ PUNICA_ROWS) and every rank r < rank, Σ_j xs[k][j] · A[r][k0 + j], which lane 0 of the
// rank's warp stores to vs[k][r] (the first chunk) or adds to it (the later ones: the same warp
// owns the same ranks in every chunk, so no other thread touches that element). The loop is
// lora_punica.cu's shrink loop (16-byte loads of A, float4 reads of the staged x, the scalar
// path for rows that are not 16-byte multiples), except that a warp takes
// SMALL_RANKS_IN_FLIGHT of its ranks (r = warp, warp + PUNICA_WARPS, ...) at once and issues
// SMALL_LOADS_IN_FLIGHT loads of each before it uses them: the split-K kernel's block sees one
// short chunk, this block walks all of K, and one load at a time a warp would wait out an L2
// round trip per 512 bytes. Each (rank, row) sum still adds its terms in increasing j. Must be
// called by whole warps.
template <typename W>
__device__ void small_rank_dots(const float (*xs)[PUNICA_K_CHUNK], const W* a, int k0, int len,
                                int d_in, int n, int rank, float (*vs)[PUNICA_MAX_RANK]) {
    constexpr int RU = SMALL_RANKS_IN_FLIGHT, U = SMALL_LOADS_IN_FLIGHT;
    const bool add = k0 > 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int V = Vec16<W>::N;
    constexpr int STEP = 32 * V;
    const bool vec = aligned16(a, (long)d_in * sizeof(W)) && (k0 % V) == 0;
    for (int r0 = warp; r0 < rank; r0 += RU * PUNICA_WARPS) {
        // This warp's ranks of the round: r0 + q * PUNICA_WARPS (warp-uniform, so the whole
        // warp takes the same branches below and the shuffles see every lane).
        float acc[RU][PUNICA_ROWS] = {};
        if (vec) {
            int j = lane * V;
            for (; j + (U - 1) * STEP + V <= len; j += U * STEP) {
                float w[RU][U][V];
#pragma unroll
                for (int q = 0; q < RU; ++q) {
                    const int r = r0 + q * PUNICA_WARPS;
                    if (r < rank) {
#pragma unroll
                        for (int u = 0; u < U; ++u)
                            load16(a + (long)r * d_in + k0 + j + u * STEP, w[q][u]);
                    }
                }
#pragma unroll
                for (int q = 0; q < RU; ++q) {
                    const int r = r0 + q * PUNICA_WARPS;
                    if (r < rank) {
#pragma unroll
                        for (int u = 0; u < U; ++u)
#pragma unroll
                            for (int k = 0; k < PUNICA_ROWS; ++k)
                                if (k < n)
                                    acc[q][k] += dot_shared<V>(&xs[k][j + u * STEP], w[q][u]);
                    }
                }
            }
            // Whole vectors left over from the U-groups, one at a time.
            for (; j + V <= len; j += STEP) {
#pragma unroll
                for (int q = 0; q < RU; ++q) {
                    const int r = r0 + q * PUNICA_WARPS;
                    if (r < rank) {
                        float w[V];
                        load16(a + (long)r * d_in + k0 + j, w);
#pragma unroll
                        for (int k = 0; k < PUNICA_ROWS; ++k)
                            if (k < n) acc[q][k] += dot_shared<V>(&xs[k][j], w);
                    }
                }
            }
        }
        // The scalar path, or the tail past the last whole vector (d_in % V ≠ 0 only in the
        // last chunk).
#pragma unroll
        for (int q = 0; q < RU; ++q) {
            const int r = r0 + q * PUNICA_WARPS;
            if (r < rank) {
                const W* ar = a + (long)r * d_in;
                for (int j = vec ? (len / V) * V + lane : lane; j < len; j += 32) {
                    const float w = to_f32(ar[k0 + j]);
#pragma unroll
                    for (int k = 0; k < PUNICA_ROWS; ++k)
                        if (k < n) acc[q][k] += xs[k][j] * w;
                }
            }
        }
#pragma unroll
        for (int q = 0; q < RU; ++q) {
            const int r = r0 + q * PUNICA_WARPS;
#pragma unroll
            for (int k = 0; k < PUNICA_ROWS; ++k) {
                const float t = warp_sum(acc[q][k]);
                if (lane == 0 && k < n && r < rank) vs[k][r] = add ? vs[k][r] + t : t;
            }
        }
    }
}

// A block stages x one PUNICA_K_CHUNK at a time, one float4 per row per thread.
static_assert(PUNICA_K_CHUNK == 4 * PUNICA_THREADS, "one float4 of a chunk per thread and row");

// This thread's float4 of chunk k0 of each of rows start .. start + n (none past d_in): the
// loads of every row issued before any is used. x's rows must be 16-byte multiples.
__device__ __forceinline__ void small_fetch_x(const float* __restrict__ x, u32 start, int n,
                                              int d_in, int k0, float4 (&nx)[PUNICA_ROWS]) {
    const int j = k0 + 4 * (int)threadIdx.x;
#pragma unroll
    for (int k = 0; k < PUNICA_ROWS; ++k)
        if (k < n && j < d_in)
            nx[k] = __ldg(reinterpret_cast<const float4*>(x + (long)(start + k) * d_in + j));
}

// One block: rows start .. start + n (n ≤ PUNICA_ROWS) of adapter `ls`, output columns c0 ..
// c0 + cols. Must be called by the whole block (it synchronises), of PUNICA_THREADS threads.
template <typename W>
__device__ void small_lora_block(const float* __restrict__ x, float* __restrict__ y,
                                 const LoraSlot* ls, u32 start, int n, int c0, int cols,
                                 int d_in, int d_out) {
    __shared__ __align__(16) float xs[PUNICA_ROWS][PUNICA_K_CHUNK];
    __shared__ __align__(16) float vs[PUNICA_ROWS][PUNICA_MAX_RANK];
    const int rank = (int)ls->rank;
    const W* a = reinterpret_cast<const W*>(ls->a);
    // Rows of x that are 16-byte multiples (d_in % 4 == 0, so is every chunk's length) are
    // staged from registers, the next chunk's loads in flight while this one's dot products
    // run; other widths element by element.
    const bool x4 = aligned16(x, (long)d_in * sizeof(float));
    const int t4 = 4 * (int)threadIdx.x;
    float4 nx[PUNICA_ROWS];
    if (x4) small_fetch_x(x, start, n, d_in, 0, nx);
    for (int k0 = 0; k0 < d_in; k0 += PUNICA_K_CHUNK) {
        const int len = min(PUNICA_K_CHUNK, d_in - k0);
        // Every warp is done with the previous chunk before it is overwritten.
        __syncthreads();
        if (x4) {
#pragma unroll
            for (int k = 0; k < PUNICA_ROWS; ++k)
                if (k < n && t4 < len) *reinterpret_cast<float4*>(&xs[k][t4]) = nx[k];
        } else {
            for (int i = threadIdx.x; i < n * len; i += blockDim.x) {
                const int k = i / len, j = i % len;
                xs[k][j] = x[(long)(start + k) * d_in + k0 + j];
            }
        }
        __syncthreads();
        if (x4 && k0 + PUNICA_K_CHUNK < d_in)
            small_fetch_x(x, start, n, d_in, k0 + PUNICA_K_CHUNK, nx);
        // The first chunk stores v, the later ones add to it.
        small_rank_dots<W>(xs, a, k0, len, d_in, n, rank, vs);
    }
    // v complete (d_in ≥ 1: the host never launches an empty shrink) and visible to every warp.
    __syncthreads();
    punica_expand_cols<W>(vs, y, ls, start, n, c0, cols, d_out);
}

// SGMV: grid (n_segs, column tiles, ceil(longest segment / PUNICA_ROWS)); a block past its
// segment's rows, past d_out, or of a segment without this module returns (block-uniform).
template <typename W>
__device__ void small_sgmv(const float* x, float* y, const u64* seg_tables, const u32* seg_rows,
                           int n_segs, int slot, int d_in, int d_out, int cols) {
    const int s = blockIdx.x;
    if (s >= n_segs) return;
    const LoraSlot* ls = punica_slot(seg_tables[s], slot);
    if (!ls || ls->rank == 0) return;
    const int c0 = blockIdx.y * cols;
    if (c0 >= d_out) return;
    const u32 start = seg_rows[2 * s] + blockIdx.z * PUNICA_ROWS, end = seg_rows[2 * s + 1];
    if (start >= end) return;
    const int n = min((int)(end - start), PUNICA_ROWS);
    small_lora_block<W>(x, y, ls, start, n, c0, cols, d_in, d_out);
}

// BGMV: grid (rows, column tiles); a row without an adapter for this module gets nothing.
template <typename W>
__device__ void small_bgmv(const float* x, float* y, const u64* row_tables, int rows, int slot,
                           int d_in, int d_out, int cols) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const LoraSlot* ls = punica_slot(row_tables[row], slot);
    if (!ls || ls->rank == 0) return;
    const int c0 = blockIdx.y * cols;
    if (c0 >= d_out) return;
    small_lora_block<W>(x, y, ls, (u32)row, 1, c0, cols, d_in, d_out);
}

#define THAW_LORA_SMALL(W, S)                                                                 \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) lora_small_sgmv_##S(        \
        const float* x, float* y, const u64* seg_tables, const u32* seg_rows, int n_segs,    \
        int slot, int d_in, int d_out, int cols) {                                            \
        small_sgmv<W>(x, y, seg_tables, seg_rows, n_segs, slot, d_in, d_out, cols);          \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(PUNICA_THREADS) lora_small_bgmv_##S(        \
        const float* x, float* y, const u64* row_tables, int rows, int slot, int d_in,       \
        int d_out, int cols) {                                                                \
        small_bgmv<W>(x, y, row_tables, rows, slot, d_in, d_out, cols);                      \
    }
THAW_FOR_EACH_DTYPE(THAW_LORA_SMALL)
