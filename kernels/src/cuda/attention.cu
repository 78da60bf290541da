// Paged KV writes and causal GQA attention over the paged cache. CPU twin:
// kernels/src/cpu/attention.rs (write_kv, paged_attention).
//
// Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim] for K and for V, of
// the cache dtype T. Query head h reads kv head h / (n_heads / n_kv_heads). A query at position
// `pos` attends to [lo, pos] with lo = 0, or pos + 1 - window when window > 0 (Mistral).
// Softmax is online (running max and sum) in f32; head_dim <= 256 (THAW_MAX_HEAD_DIM).
// The output is stored as O: f32 (attn_decode_T, attn_prefill_T), or with THAW_CUDA_BF16_ACT
// the weight dtype o_proj's GEMM reads (issue 29; attn_decode_T_out_O, attn_prefill_T_out_O):
// the same f32 value, rounded once by from_f32<O> on the store.

#define THAW_MAX_HEAD_DIM 256
#define THAW_HD_PER_LANE (THAW_MAX_HEAD_DIM / 32)
#define THAW_ATTN_WARPS 4
// Prefill: queries per block (one sequence, one head) and keys staged per shared-memory tile.
#define THAW_PREFILL_Q 16
#define THAW_PREFILL_QPW (THAW_PREFILL_Q / THAW_ATTN_WARPS)
#define THAW_PREFILL_KC 16

// kc[slots[r], :] = k[r, :] (same for v); slots[r] = phys_block * block_size + pos % block_size,
// built on the host from the block tables. One block per row.
template <typename T>
__device__ void write_kv(const float* __restrict__ k, const float* __restrict__ v,
                         T* __restrict__ kc, T* __restrict__ vc, const u32* __restrict__ slots,
                         int rows, int token_len) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const long dst = (long)slots[r] * token_len, src = (long)r * token_len;
    for (int j = threadIdx.x; j < token_len; j += blockDim.x) {
        kc[dst + j] = from_f32<T>(k[src + j]);
        vc[dst + j] = from_f32<T>(v[src + j]);
    }
}

// Decode (one query row per sequence): one block per (listed row, query head); warps take keys
// round-robin with their own online softmax, then merge through shared memory.
// row_meta[3i..3i+3] = (offset of the row's block table in `block_tables`, position, row of q /
// out).
template <typename T, typename O>
__device__ void attn_decode(const float* __restrict__ q, const T* __restrict__ kc,
                            const T* __restrict__ vc, O* __restrict__ out,
                            const u32* __restrict__ block_tables, const u32* __restrict__ row_meta,
                            int rows, int n_heads, int n_kv_heads, int head_dim, int block_size,
                            int window, float scale) {
    const int i = blockIdx.x, h = blockIdx.y;
    if (i >= rows) return;
    const int warp = threadIdx.x >> 5;
    const int kvh = h / (n_heads / n_kv_heads);
    const int token_len = n_kv_heads * head_dim;
    const u32* table = block_tables + row_meta[3 * i];
    const int pos = (int)row_meta[3 * i + 1];
    const long r = row_meta[3 * i + 2];
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;

    float qv[THAW_HD_PER_LANE], acc[THAW_HD_PER_LANE];
    attn_load_q<THAW_HD_PER_LANE>(q + (r * n_heads + h) * head_dim, head_dim, scale, qv, acc);
    float m = -THAW_INF, l = 0.0f;
    attn_warp_keys<THAW_HD_PER_LANE, T>(qv, kc, vc, table, block_size, token_len,
                                        (long)kvh * head_dim, head_dim, lo + warp, pos + 1,
                                        THAW_ATTN_WARPS, m, l, acc);
    O* orow = out + (r * n_heads + h) * head_dim;
    float mx, denom;
    attn_merge_warps<THAW_ATTN_WARPS, THAW_HD_PER_LANE>(
        m, l, acc, head_dim, mx, denom,
        [&](int j, float s) { orow[j] = from_f32<O>(s / denom); });
}

// Prefill: one block per (tile of up to THAW_PREFILL_Q consecutive query rows of one sequence,
// query head). K/V rows are staged through shared memory THAW_PREFILL_KC at a time and reused
// by all the tile's queries; each warp owns THAW_PREFILL_QPW queries.
// tiles[4t..4t+4] = (block table offset, position of the tile's first row, first row, rows).
template <typename T, typename O>
__device__ void attn_prefill(const float* __restrict__ q, const T* __restrict__ kc,
                             const T* __restrict__ vc, O* __restrict__ out,
                             const u32* __restrict__ block_tables, const u32* __restrict__ tiles,
                             int n_tiles, int n_heads, int n_kv_heads, int head_dim,
                             int block_size, int window, float scale) {
    const int t = blockIdx.x, h = blockIdx.y;
    if (t >= n_tiles) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = h / (n_heads / n_kv_heads);
    const int token_len = n_kv_heads * head_dim;
    const u32* table = block_tables + tiles[4 * t];
    const int pos0 = (int)tiles[4 * t + 1], row0 = (int)tiles[4 * t + 2];
    const int nq = (int)tiles[4 * t + 3];
    const int last = pos0 + nq - 1;
    const int lo = window > 0 ? max(0, pos0 + 1 - window) : 0;

    float qv[THAW_PREFILL_QPW][THAW_HD_PER_LANE], acc[THAW_PREFILL_QPW][THAW_HD_PER_LANE];
    float m[THAW_PREFILL_QPW], l[THAW_PREFILL_QPW];
#pragma unroll
    for (int i = 0; i < THAW_PREFILL_QPW; ++i) {
        const int qi = warp * THAW_PREFILL_QPW + i;
        const float* qr = q + ((long)(row0 + qi) * n_heads + h) * head_dim;
#pragma unroll
        for (int e = 0; e < THAW_HD_PER_LANE; ++e) {
            const int j = lane + 32 * e;
            qv[i][e] = (qi < nq && j < head_dim) ? qr[j] * scale : 0.0f;
            acc[i][e] = 0.0f;
        }
        m[i] = -THAW_INF;
        l[i] = 0.0f;
    }

    __shared__ float ks[THAW_PREFILL_KC][THAW_MAX_HEAD_DIM];
    __shared__ float vs[THAW_PREFILL_KC][THAW_MAX_HEAD_DIM];
    for (int c0 = lo; c0 <= last; c0 += THAW_PREFILL_KC) {
        const int nk = min(THAW_PREFILL_KC, last + 1 - c0);
        __syncthreads();  // the previous tile is no longer read
        for (int idx = threadIdx.x; idx < nk * head_dim; idx += blockDim.x) {
            const int kk = idx / head_dim, j = idx % head_dim;
            const long off = kv_offset(table, c0 + kk, block_size, token_len) +
                             (long)kvh * head_dim + j;
            ks[kk][j] = to_f32(kc[off]);
            vs[kk][j] = to_f32(vc[off]);
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < THAW_PREFILL_QPW; ++i) {
            const int qi = warp * THAW_PREFILL_QPW + i;
            if (qi >= nq) continue;  // warp-uniform
            const int pos = pos0 + qi;
            const int qlo = window > 0 ? max(0, pos + 1 - window) : 0;
            for (int kk = 0; kk < nk; ++kk) {
                const int p = c0 + kk;
                if (p < qlo || p > pos) continue;  // warp-uniform
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < THAW_HD_PER_LANE; ++e) {
                    const int j = lane + 32 * e;
                    if (j < head_dim) dot += qv[i][e] * ks[kk][j];
                }
                const float s = warp_sum(dot);
                const float m_new = fmaxf(m[i], s);
                const float corr = expf(m[i] - m_new), pe = expf(s - m_new);
                l[i] = l[i] * corr + pe;
#pragma unroll
                for (int e = 0; e < THAW_HD_PER_LANE; ++e) {
                    const int j = lane + 32 * e;
                    const float vj = j < head_dim ? vs[kk][j] : 0.0f;
                    acc[i][e] = acc[i][e] * corr + pe * vj;
                }
                m[i] = m_new;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < THAW_PREFILL_QPW; ++i) {
        const int qi = warp * THAW_PREFILL_QPW + i;
        if (qi >= nq) continue;
        O* orow = out + ((long)(row0 + qi) * n_heads + h) * head_dim;
        const float inv = 1.0f / l[i];
#pragma unroll
        for (int e = 0; e < THAW_HD_PER_LANE; ++e) {
            const int j = lane + 32 * e;
            if (j < head_dim) orow[j] = from_f32<O>(acc[i][e] * inv);
        }
    }
}

#define THAW_ATTENTION(T, S)                                                                 \
    extern "C" __global__ void write_kv_##S(const float* k, const float* v, T* kc, T* vc,    \
                                            const u32* slots, int rows, int token_len) {     \
        write_kv<T>(k, v, kc, vc, slots, rows, token_len);                                   \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * THAW_ATTN_WARPS)                       \
        attn_decode_##S(const float* q, const T* kc, const T* vc, float* out,                \
                        const u32* block_tables, const u32* row_meta, int rows, int n_heads, \
                        int n_kv_heads, int head_dim, int block_size, int window,            \
                        float scale) {                                                       \
        attn_decode<T, float>(q, kc, vc, out, block_tables, row_meta, rows, n_heads,         \
                              n_kv_heads, head_dim, block_size, window, scale);              \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * THAW_ATTN_WARPS)                       \
        attn_prefill_##S(const float* q, const T* kc, const T* vc, float* out,               \
                         const u32* block_tables, const u32* tiles, int n_tiles,             \
                         int n_heads, int n_kv_heads, int head_dim, int block_size,          \
                         int window, float scale) {                                          \
        attn_prefill<T, float>(q, kc, vc, out, block_tables, tiles, n_tiles, n_heads,        \
                               n_kv_heads, head_dim, block_size, window, scale);             \
    }
THAW_FOR_EACH_DTYPE(THAW_ATTENTION)

// The 16-bit-output entries: KV dtype T, output dtype O (the weight dtype), the f32 entries'
// signatures but for `out`. The full names are spelled here so a search finds them.
#define THAW_ATTENTION_OUT(T, O, DECODE, PREFILL)                                             \
    extern "C" __global__ void __launch_bounds__(32 * THAW_ATTN_WARPS)                       \
        DECODE(const float* q, const T* kc, const T* vc, O* out, const u32* block_tables,    \
               const u32* row_meta, int rows, int n_heads, int n_kv_heads, int head_dim,     \
               int block_size, int window, float scale) {                                    \
        attn_decode<T, O>(q, kc, vc, out, block_tables, row_meta, rows, n_heads, n_kv_heads, \
                          head_dim, block_size, window, scale);                              \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * THAW_ATTN_WARPS)                       \
        PREFILL(const float* q, const T* kc, const T* vc, O* out, const u32* block_tables,   \
                const u32* tiles, int n_tiles, int n_heads, int n_kv_heads, int head_dim,    \
                int block_size, int window, float scale) {                                   \
        attn_prefill<T, O>(q, kc, vc, out, block_tables, tiles, n_tiles, n_heads,            \
                           n_kv_heads, head_dim, block_size, window, scale);                 \
    }
THAW_ATTENTION_OUT(float, bf16_t, attn_decode_f32_out_bf16, attn_prefill_f32_out_bf16)
THAW_ATTENTION_OUT(float, f16_t, attn_decode_f32_out_f16, attn_prefill_f32_out_f16)
THAW_ATTENTION_OUT(bf16_t, bf16_t, attn_decode_bf16_out_bf16, attn_prefill_bf16_out_bf16)
THAW_ATTENTION_OUT(bf16_t, f16_t, attn_decode_bf16_out_f16, attn_prefill_bf16_out_f16)
THAW_ATTENTION_OUT(f16_t, bf16_t, attn_decode_f16_out_bf16, attn_prefill_f16_out_bf16)
THAW_ATTENTION_OUT(f16_t, f16_t, attn_decode_f16_out_f16, attn_prefill_f16_out_f16)
