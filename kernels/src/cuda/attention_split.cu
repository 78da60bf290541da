// Flash-decoding (issue 29): paged decode attention that splits each sequence's context across
// blocks, then a reduce kernel merges the partial softmaxes. CPU twin:
// kernels/src/cpu/attention.rs (paged_attention). Same cache layout, GQA mapping, sliding window
// and row metadata as attention.cu's attn_decode; at batch 1 with a long context that kernel
// runs n_heads blocks, far too few to pull the KV cache at HBM bandwidth — this one runs
// n_heads · splits.
//
// Pass 1, attn_decode_split_T: grid (rows, n_heads, splits), THAW_SPLIT_WARPS warps. Block
// (i, h, s) covers positions [lo + s·chunk, min(pos + 1, lo + (s+1)·chunk)) of row i's context;
// warps take keys round-robin with their own online softmax and merge in shared memory. It
// writes the unnormalised output acc (relative to its max m) and (m, l) for the split; an empty
// split writes m = -inf, l = 0, which the reduce skips.
// Pass 2, attn_decode_reduce: grid (rows, n_heads): out = Σ_s acc_s e^(m_s - M) / Σ_s l_s
// e^(m_s - M), M = max_s m_s.
//
// Scratch: part_acc [rows, n_heads, splits, head_dim] f32, part_ml [rows, n_heads, splits, 2].

#define THAW_SPLIT_WARPS 4
#define THAW_SPLIT_MAX_HEAD_DIM 256
#define THAW_SPLIT_HD_PER_LANE (THAW_SPLIT_MAX_HEAD_DIM / 32)

template <typename T>
__device__ void attn_decode_split(const float* __restrict__ q, const T* __restrict__ kc,
                                  const T* __restrict__ vc, float* __restrict__ part_acc,
                                  float* __restrict__ part_ml, const u32* __restrict__ block_tables,
                                  const u32* __restrict__ row_meta, int rows, int n_heads,
                                  int n_kv_heads, int head_dim, int block_size, int window,
                                  float scale, int splits, int chunk) {
    const int i = blockIdx.x, h = blockIdx.y, sp = blockIdx.z;
    if (i >= rows || sp >= splits) return;
    const int warp = threadIdx.x >> 5;
    const DecodeRow d =
        decode_row(block_tables, row_meta, i, h, n_heads, n_kv_heads, head_dim, window);
    const int p0 = d.lo + sp * chunk, p1 = min(d.pos + 1, p0 + chunk);
    const long part = ((long)i * n_heads + h) * splits + sp;

    float qv[THAW_SPLIT_HD_PER_LANE], acc[THAW_SPLIT_HD_PER_LANE];
    attn_load_q<THAW_SPLIT_HD_PER_LANE>(q + (d.r * n_heads + h) * head_dim, head_dim, scale, qv,
                                        acc);
    float m = -THAW_INF, l = 0.0f;
    attn_warp_keys<THAW_SPLIT_HD_PER_LANE, T>(qv, kc, vc, d.table, block_size, d.token_len,
                                              (long)d.kvh * head_dim, head_dim, p0 + warp, p1,
                                              THAW_SPLIT_WARPS, m, l, acc);
    // An empty split (the context ends before it starts) merges to m = -inf, l = 0, acc = 0,
    // which the reduce skips.
    float* pa = part_acc + part * head_dim;
    float mx, denom;
    attn_merge_warps<THAW_SPLIT_WARPS, THAW_SPLIT_HD_PER_LANE>(
        m, l, acc, head_dim, mx, denom, [&](int j, float s) { pa[j] = s; });
    if (threadIdx.x == 0) {
        part_ml[2 * part] = mx;
        part_ml[2 * part + 1] = denom;
    }
}

// Pass 2: grid (rows, n_heads), any multiple of 32 threads. The output is stored as O: f32
// (attn_decode_reduce), or with THAW_CUDA_BF16_ACT the weight dtype o_proj's GEMM reads
// (attn_decode_reduce_out_bf16 / _f16, issue 29): the same f32 value, rounded once on the
// store. Pass 1 writes only the f32 partials, so it has no 16-bit-output entry.
template <typename O>
__device__ void attn_decode_reduce_t(const float* __restrict__ part_acc,
                                     const float* __restrict__ part_ml, O* __restrict__ out,
                                     const u32* __restrict__ row_meta, int rows, int n_heads,
                                     int head_dim, int splits) {
    const int i = blockIdx.x, h = blockIdx.y;
    if (i >= rows) return;
    const long r = row_meta[3 * i + 2];
    const long base = ((long)i * n_heads + h) * splits;
    float mx = -THAW_INF;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part_ml[2 * (base + s)]);
    float denom = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float ms = part_ml[2 * (base + s)];
        if (ms > -THAW_INF) denom += part_ml[2 * (base + s) + 1] * expf(ms - mx);
    }
    O* orow = out + (r * n_heads + h) * head_dim;
    for (int j = threadIdx.x; j < head_dim; j += blockDim.x) {
        float t = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float ms = part_ml[2 * (base + s)];
            if (ms > -THAW_INF) t += part_acc[(base + s) * head_dim + j] * expf(ms - mx);
        }
        orow[j] = from_f32<O>(t / denom);
    }
}

#define THAW_ATTN_REDUCE(O, NAME)                                                              \
    extern "C" __global__ void NAME(const float* part_acc, const float* part_ml, O* out,       \
                                    const u32* row_meta, int rows, int n_heads, int head_dim, \
                                    int splits) {                                             \
        attn_decode_reduce_t<O>(part_acc, part_ml, out, row_meta, rows, n_heads, head_dim,    \
                                splits);                                                      \
    }
THAW_ATTN_REDUCE(float, attn_decode_reduce)
THAW_ATTN_REDUCE(bf16_t, attn_decode_reduce_out_bf16)
THAW_ATTN_REDUCE(f16_t, attn_decode_reduce_out_f16)

#define THAW_ATTN_SPLIT(T, S)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * THAW_SPLIT_WARPS) attn_decode_split_##S( \
        const float* q, const T* kc, const T* vc, float* part_acc, float* part_ml,            \
        const u32* block_tables, const u32* row_meta, int rows, int n_heads, int n_kv_heads,  \
        int head_dim, int block_size, int window, float scale, int splits, int chunk) {       \
        attn_decode_split<T>(q, kc, vc, part_acc, part_ml, block_tables, row_meta, rows,      \
                             n_heads, n_kv_heads, head_dim, block_size, window, scale,        \
                             splits, chunk);                                                  \
    }
THAW_FOR_EACH_DTYPE(THAW_ATTN_SPLIT)
