// Thaw kernel prelude: prepended to every kernel source by the registry (registry.rs), so no
// source needs an #include and NVRTC needs no headers (its bundled cuda_fp16.h / cuda_bf16.h
// differ between releases). Storage types for 16-bit floats are plain structs over the bit
// pattern; conversions go through PTX `cvt` (f16) or bit arithmetic (bf16, round to nearest
// even, like `half::bf16::from_f32`).
//
// Conventions shared by every kernel: activations are f32, row-major; weights are T in
// {float, bf16_t, f16_t}; accumulation is f32; sizes are int (the host checks they fit);
// entry points are `extern "C"` with the weight dtype as a suffix (`_f32`, `_bf16`, `_f16`).

// +inf without <math_constants.h>.
#define THAW_INF __int_as_float(0x7f800000)

typedef unsigned int u32;
typedef unsigned long long u64;

struct bf16_t { unsigned short bits; };
struct f16_t { unsigned short bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16_t x) {
    return __uint_as_float(((u32)x.bits) << 16);
}
__device__ __forceinline__ float to_f32(f16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float x) {
    u32 u = __float_as_uint(x);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);  // quiet NaN, sign kept
    } else {
        u32 rounding = 0x7fffu + ((u >> 16) & 1u);   // round to nearest, ties to even
        r.bits = (unsigned short)((u + rounding) >> 16);
    }
    return r;
}
template <> __device__ __forceinline__ f16_t from_f32<f16_t>(float x) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `partial` may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    float t = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(t);
}

// ---- Online-softmax attention over the paged cache, shared by attention.cu's decode and
// attention_split.cu (flash-decoding). Each lane of a warp holds HPL = max_head_dim / 32 values
// of the query row and of the output accumulator (elements lane, lane + 32, ...).

// Offset of position `pos`'s [n_kv_heads, head_dim] row in a paged cache whose block table is
// `table` (cache layout [num_blocks, block_size, n_kv_heads, head_dim]).
__device__ __forceinline__ long kv_offset(const u32* table, int pos, int block_size,
                                          int token_len) {
    return ((long)table[pos / block_size] * block_size + pos % block_size) * token_len;
}

// Decode row i, query head h, as attention_split.cu's and attention_split_ilp.cu's kernels
// read them: row_meta[3i..3i+3] = (offset of the row's block table in `block_tables`, position,
// row of q / out); the KV head of h (GQA), one position's row length in the cache, and the
// first position attended (the sliding window's start, or 0).
struct DecodeRow {
    const u32* table;
    int pos;
    long r;
    int lo;
    int kvh;
    int token_len;
};

__device__ __forceinline__ DecodeRow decode_row(const u32* __restrict__ block_tables,
                                                const u32* __restrict__ row_meta, int i, int h,
                                                int n_heads, int n_kv_heads, int head_dim,
                                                int window) {
    DecodeRow d;
    d.kvh = h / (n_heads / n_kv_heads);
    d.token_len = n_kv_heads * head_dim;
    d.table = block_tables + row_meta[3 * i];
    d.pos = (int)row_meta[3 * i + 1];
    d.r = row_meta[3 * i + 2];
    d.lo = window > 0 ? max(0, d.pos + 1 - window) : 0;
    return d;
}

// This lane's share of query row `qr`, pre-scaled, and a zeroed accumulator.
template <int HPL>
__device__ __forceinline__ void attn_load_q(const float* __restrict__ qr, int head_dim,
                                            float scale, float (&qv)[HPL], float (&acc)[HPL]) {
#pragma unroll
    for (int e = 0; e < HPL; ++e) {
        const int j = (threadIdx.x & 31) + 32 * e;
        qv[e] = j < head_dim ? qr[j] * scale : 0.0f;
        acc[e] = 0.0f;
    }
}

// One warp's online softmax over keys p = first, first + stride, ... < end of one KV head
// (`head_off` = kv head · head_dim): running max m, running sum l, unnormalised acc.
template <int HPL, typename T>
__device__ __forceinline__ void attn_warp_keys(const float (&qv)[HPL], const T* __restrict__ kc,
                                               const T* __restrict__ vc,
                                               const u32* __restrict__ table, int block_size,
                                               int token_len, long head_off, int head_dim,
                                               int first, int end, int stride, float& m,
                                               float& l, float (&acc)[HPL]) {
    const int lane = threadIdx.x & 31;
    for (int p = first; p < end; p += stride) {
        const long off = kv_offset(table, p, block_size, token_len) + head_off;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < HPL; ++e) {
            const int j = lane + 32 * e;
            if (j < head_dim) dot += qv[e] * to_f32(kc[off + j]);
        }
        const float s = warp_sum(dot);
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new), pe = expf(s - m_new);
        l = l * corr + pe;
#pragma unroll
        for (int e = 0; e < HPL; ++e) {
            const int j = lane + 32 * e;
            const float vj = j < head_dim ? to_f32(vc[off + j]) : 0.0f;
            acc[e] = acc[e] * corr + pe * vj;
        }
        m = m_new;
    }
}

// Merges the WARPS warps' (m, l, acc) of one block through shared memory: every thread gets
// mx = max_w m_w and denom = Σ_w l_w e^(m_w - mx); then emit(j, Σ_w acc_w[j] e^(m_w - mx)) runs
// for j = threadIdx.x, + blockDim.x, ... < head_dim. Warps that saw no key (m = -inf) are
// skipped; if none did, mx = -inf, denom = 0 and every emitted sum is 0.
template <int WARPS, int HPL, typename Emit>
__device__ __forceinline__ void attn_merge_warps(float m, float l, const float (&acc)[HPL],
                                                 int head_dim, float& mx, float& denom,
                                                 Emit emit) {
    __shared__ float sm_m[WARPS], sm_l[WARPS];
    __shared__ float sm_acc[WARPS][32 * HPL];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < HPL; ++e) {
        const int j = lane + 32 * e;
        if (j < head_dim) sm_acc[warp][j] = acc[e];
    }
    __syncthreads();
    mx = -THAW_INF;
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w]);
    denom = 0.0f;
    for (int w = 0; w < WARPS; ++w)
        if (sm_m[w] > -THAW_INF) denom += sm_l[w] * expf(sm_m[w] - mx);
    for (int j = threadIdx.x; j < head_dim; j += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < WARPS; ++w)
            if (sm_m[w] > -THAW_INF) s += sm_acc[w][j] * expf(sm_m[w] - mx);
        emit(j, s);
    }
}

// One adapter's (layer, module) factors as the device sees them: `a` is [rank, d_in], `b` is
// [d_out, rank], both of the kernel's weight dtype. rank 0 = the adapter does not target the
// module. Mirrors `LoraSlot` in runtime/src/backend/cuda/weights.rs (32 bytes).
struct LoraSlot {
    u64 a;
    u64 b;
    u32 rank;
    float scale;
    u64 reserved;
};

#define THAW_FOR_EACH_DTYPE(M) M(float, f32) M(bf16_t, bf16) M(f16_t, f16)
