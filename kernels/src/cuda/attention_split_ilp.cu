// Flash-decoding with keys in flight (issue 29, a default: THAW_CUDA_ATTN_OCCUPANCY=0 off). Same
// cache layout, GQA mapping, sliding window, row metadata and scratch as attention_split.cu,
// whose attn_decode_reduce merges the splits; two differences:
// - the split count is planned, not the chunk (kernels/src/cuda/decode_plan.rs,
//   occupancy_splits): a row whose attended context is len positions uses
//   rs = clamp(len / min_chunk, 1, splits) of the launch's splits (decode_plan::row_splits), split
//   s < rs covering [s·len/rs, (s+1)·len/rs) (decode_plan::split_range), so every row tiles its
//   own context and no used split is empty; splits s ≥ rs write a neutral partial (m = -inf,
//   l = 0) that the reduce skips. A CUDA graph launches a split count fixed per bucket and
//   each row takes what its context allows. With splits == 1 the block writes the normalised
//   output itself (no scratch, no reduce launch);
// - a warp loads the K and V slices of 4 keys (its keys p, p + stride, p + 2·stride,
//   p + 3·stride) before it computes their dots, so 8 independent loads are in flight where
//   attention.cu's loop has one dependent load at a time. The per-key f32 math (dot order,
//   warp_sum, online-softmax update in key order) is exactly attn_warp_keys's, so a warp's
//   (m, l, acc) over the same keys is the same (bit for bit unless the compiler contracts a
//   multiply-add into an FMA differently); only the split boundaries (hence the merge's
//   summation order) differ from attention_split.cu.
// The one-split output is stored as O: f32 (attn_decode_split_ilp_T), or with
// THAW_CUDA_BF16_ACT the weight dtype (attn_decode_split_ilp_T_out_O, issue 29; the reduce's
// attn_decode_reduce_out_O then stores the merged splits in it): rounded once on the store.

#define THAW_ILP_WARPS 4
#define THAW_ILP_MAX_HEAD_DIM 256
#define THAW_ILP_HPL (THAW_ILP_MAX_HEAD_DIM / 32)
#define THAW_ILP_KEYS 4

// attn_warp_keys over keys first, first + stride, ... < end, THAW_ILP_KEYS at a time.
template <int HPL, typename T>
__device__ __forceinline__ void attn_warp_keys_ilp(const float (&qv)[HPL],
                                                   const T* __restrict__ kc,
                                                   const T* __restrict__ vc,
                                                   const u32* __restrict__ table, int block_size,
                                                   int token_len, long head_off, int head_dim,
                                                   int first, int end, int stride, float& m,
                                                   float& l, float (&acc)[HPL]) {
    const int lane = threadIdx.x & 31;
    int p = first;
    for (; p + (THAW_ILP_KEYS - 1) * stride < end; p += THAW_ILP_KEYS * stride) {
        long off[THAW_ILP_KEYS];
#pragma unroll
        for (int u = 0; u < THAW_ILP_KEYS; ++u)
            off[u] = kv_offset(table, p + u * stride, block_size, token_len) + head_off;
        T kr[THAW_ILP_KEYS][HPL], vr[THAW_ILP_KEYS][HPL];
#pragma unroll
        for (int u = 0; u < THAW_ILP_KEYS; ++u) {
#pragma unroll
            for (int e = 0; e < HPL; ++e) {
                const int j = lane + 32 * e;
                if (j < head_dim) {
                    kr[u][e] = kc[off[u] + j];
                    vr[u][e] = vc[off[u] + j];
                }
            }
        }
        float s[THAW_ILP_KEYS];
#pragma unroll
        for (int u = 0; u < THAW_ILP_KEYS; ++u) {
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < HPL; ++e) {
                const int j = lane + 32 * e;
                if (j < head_dim) dot += qv[e] * to_f32(kr[u][e]);
            }
            s[u] = warp_sum(dot);
        }
#pragma unroll
        for (int u = 0; u < THAW_ILP_KEYS; ++u) {
            const float m_new = fmaxf(m, s[u]);
            const float corr = expf(m - m_new), pe = expf(s[u] - m_new);
            l = l * corr + pe;
#pragma unroll
            for (int e = 0; e < HPL; ++e) {
                const int j = lane + 32 * e;
                const float vj = j < head_dim ? to_f32(vr[u][e]) : 0.0f;
                acc[e] = acc[e] * corr + pe * vj;
            }
            m = m_new;
        }
    }
    attn_warp_keys<HPL, T>(qv, kc, vc, table, block_size, token_len, head_off, head_dim, p, end,
                           stride, m, l, acc);
}

// Grid (rows, n_heads, splits), THAW_ILP_WARPS warps.
template <typename T, typename O>
__device__ void attn_decode_split_ilp(const float* __restrict__ q, const T* __restrict__ kc,
                                      const T* __restrict__ vc, float* __restrict__ part_acc,
                                      float* __restrict__ part_ml, O* __restrict__ out,
                                      const u32* __restrict__ block_tables,
                                      const u32* __restrict__ row_meta, int rows, int n_heads,
                                      int n_kv_heads, int head_dim, int block_size, int window,
                                      float scale, int splits, int min_chunk) {
    const int i = blockIdx.x, h = blockIdx.y, sp = blockIdx.z;
    if (i >= rows || sp >= splits) return;
    const int warp = threadIdx.x >> 5;
    const DecodeRow d =
        decode_row(block_tables, row_meta, i, h, n_heads, n_kv_heads, head_dim, window);
    const long len = d.pos + 1 - d.lo;
    const int rs = (int)max(1L, min((long)splits, len / min_chunk));
    const long part = ((long)i * n_heads + h) * splits + sp;
    if (sp >= rs) {
        if (threadIdx.x == 0) {
            part_ml[2 * part] = -THAW_INF;
            part_ml[2 * part + 1] = 0.0f;
        }
        return;
    }
    const int p0 = d.lo + (int)(sp * len / rs), p1 = d.lo + (int)((sp + 1) * len / rs);

    float qv[THAW_ILP_HPL], acc[THAW_ILP_HPL];
    attn_load_q<THAW_ILP_HPL>(q + (d.r * n_heads + h) * head_dim, head_dim, scale, qv, acc);
    float m = -THAW_INF, l = 0.0f;
    attn_warp_keys_ilp<THAW_ILP_HPL, T>(qv, kc, vc, d.table, block_size, d.token_len,
                                        (long)d.kvh * head_dim, head_dim, p0 + warp, p1,
                                        THAW_ILP_WARPS, m, l, acc);
    float mx, denom;
    if (splits == 1) {
        // One split: attention.cu's attn_decode over the same keys in the same warps (same
        // THAW_ATTN_WARPS, same per-lane layout), so its output up to FMA contraction.
        // Position pos is always attended, so denom > 0.
        O* orow = out + (d.r * n_heads + h) * head_dim;
        attn_merge_warps<THAW_ILP_WARPS, THAW_ILP_HPL>(
            m, l, acc, head_dim, mx, denom,
            [&](int j, float s) { orow[j] = from_f32<O>(s / denom); });
        return;
    }
    float* pa = part_acc + part * head_dim;
    attn_merge_warps<THAW_ILP_WARPS, THAW_ILP_HPL>(m, l, acc, head_dim, mx, denom,
                                                   [&](int j, float s) { pa[j] = s; });
    if (threadIdx.x == 0) {
        part_ml[2 * part] = mx;
        part_ml[2 * part + 1] = denom;
    }
}

#define THAW_ATTN_SPLIT_ILP_OUT(T, O, NAME)                                                     \
    extern "C" __global__ void __launch_bounds__(32 * THAW_ILP_WARPS)                           \
        NAME(const float* q, const T* kc, const T* vc, float* part_acc, float* part_ml, O* out, \
             const u32* block_tables, const u32* row_meta, int rows, int n_heads,               \
             int n_kv_heads, int head_dim, int block_size, int window, float scale,             \
             int splits, int min_chunk) {                                                       \
        attn_decode_split_ilp<T, O>(q, kc, vc, part_acc, part_ml, out, block_tables, row_meta,  \
                                    rows, n_heads, n_kv_heads, head_dim, block_size, window,    \
                                    scale, splits, min_chunk);                                  \
    }
#define THAW_ATTN_SPLIT_ILP(T, S) THAW_ATTN_SPLIT_ILP_OUT(T, float, attn_decode_split_ilp_##S)
THAW_FOR_EACH_DTYPE(THAW_ATTN_SPLIT_ILP)
THAW_ATTN_SPLIT_ILP_OUT(float, bf16_t, attn_decode_split_ilp_f32_out_bf16)
THAW_ATTN_SPLIT_ILP_OUT(float, f16_t, attn_decode_split_ilp_f32_out_f16)
THAW_ATTN_SPLIT_ILP_OUT(bf16_t, bf16_t, attn_decode_split_ilp_bf16_out_bf16)
THAW_ATTN_SPLIT_ILP_OUT(bf16_t, f16_t, attn_decode_split_ilp_bf16_out_f16)
THAW_ATTN_SPLIT_ILP_OUT(f16_t, bf16_t, attn_decode_split_ilp_f16_out_bf16)
THAW_ATTN_SPLIT_ILP_OUT(f16_t, f16_t, attn_decode_split_ilp_f16_out_f16)
