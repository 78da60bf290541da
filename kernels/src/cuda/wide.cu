// Issue 29's wide elementwise kernels (runtime kernel_select: THAW_CUDA_WIDE_NORM,
// THAW_CUDA_ROPE_FOLD, THAW_CUDA_GROUP_GEMM; defaults, off where set to 0).
//
// Why: at batch 1 the classic rms_norm / add_rms_norm (one block of 256 threads per row) and
// rope_f32 (one block of 64 threads per token) are chains of dependent global loads: a 4096-wide
// row is 16 rounds of load-then-store per thread, twice, and RoPE walks the heads one after the
// other (32 rounds for Llama-7B). Each round waits a memory latency, so a 16 KB row took 14-17 µs
// on an H200 where its bytes need well under 1 µs. Here every thread issues its loads at once:
//
// - rms_norm_wide_T / add_rms_norm_wide_T: one block of up to 1024 threads per row, float4 loads,
//   the row kept in registers between the sum of squares and the scaling (at most
//   THAW_WIDE_VPT float4 per thread: d <= 16384, d % 4 == 0; the host uses the classic kernel
//   otherwise). CPU twins: kernels/src/cpu/norm.rs (rms_norm, add_rms_norm). The two are bit for
//   bit add then rms_norm (the same per-thread sums in the same order, the same block_sum), like
//   the classic pair; against the classic kernels only the order of the f32 sum differs.
//   add_rms_norm_wide_T given `out16` also writes the output in the weight dtype (the next
//   projections' GEMM input; see norm.cu's add_rms_norm_T).
// - rope_wide_f32: one block per token; the token's angles are computed once into shared memory
//   (the classic kernel's f32 angle, f64 sincos, one rounding), then every (head, pair) of the
//   token is rotated by its own thread. Bit for bit rope_f32.
// - write_kv_rope_T (T = KV cache dtype): RoPE of q (in place) and k (in place and into the
//   cache) and the V copy, in the kernel that writes K/V to the paged cache: write_kv_T after
//   rope_f32 on q and on k, in one launch instead of three.
// - split_cols3_f32: the grouped product's [rows, w0 + w1 + w2] output into its modules' buffers
//   (THAW_CUDA_GROUP_GEMM).

#define THAW_WIDE_VPT 4
// Every entry point below may launch 1024 threads a block: the compiler must fit them (at most
// 64 registers a thread), or the launch fails with "too many resources requested".
#define THAW_WIDE_BOUNDS __launch_bounds__(1024)
// THAW_ROPE_MAX_HALF, rope_angles and rope_pair: rope_fold.cuh, compiled before this file.

// One block per row. ADD: residual[r] += x[r] first and normalise the sum; otherwise normalise
// x[r] (`residual` unused). blockDim.x a multiple of 32, d % 4 == 0, d / 4 <= blockDim.x * VPT.
// With `out16` (not null): the output also in the weight dtype, as add_rms_norm_T writes it
// (norm.cu): the next projections' GEMM input, bit for bit cast_f32_to_T over `out`.
template <typename T, bool ADD>
__device__ void rms_norm_wide(float* __restrict__ residual, const float* __restrict__ x,
                              const T* __restrict__ w, float* __restrict__ out,
                              T* __restrict__ out16, int rows, int d, float eps) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int d4 = d >> 2;
    const float4* xr = reinterpret_cast<const float4*>(x + (long)r * d);
    float4* hr = ADD ? reinterpret_cast<float4*>(residual + (long)r * d) : nullptr;
    float4* orow = reinterpret_cast<float4*>(out + (long)r * d);
    float4 v[THAW_WIDE_VPT];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < THAW_WIDE_VPT; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < d4) {
            float4 a = xr[j];
            if (ADD) {
                const float4 h = hr[j];
                a.x = h.x + a.x;
                a.y = h.y + a.y;
                a.z = h.z + a.z;
                a.w = h.w + a.w;
                hr[j] = a;
            }
            v[k] = a;
            ss += a.x * a.x;
            ss += a.y * a.y;
            ss += a.z * a.z;
            ss += a.w * a.w;
        }
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / (float)d + eps);
#pragma unroll
    for (int k = 0; k < THAW_WIDE_VPT; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < d4) {
            const int e = j << 2;
            float4 o;
            o.x = v[k].x * inv * to_f32(w[e]);
            o.y = v[k].y * inv * to_f32(w[e + 1]);
            o.z = v[k].z * inv * to_f32(w[e + 2]);
            o.w = v[k].w * inv * to_f32(w[e + 3]);
            orow[j] = o;
            if (out16 != nullptr) {
                T* o16 = out16 + (long)r * d + e;
                o16[0] = from_f32<T>(o.x);
                o16[1] = from_f32<T>(o.y);
                o16[2] = from_f32<T>(o.z);
                o16[3] = from_f32<T>(o.w);
            }
        }
    }
}

#define THAW_WIDE_NORM(T, S)                                                                 \
    extern "C" __global__ void THAW_WIDE_BOUNDS rms_norm_wide_##S(                            \
        const float* x, const T* w, float* out, int rows, int d, float eps) {                \
        rms_norm_wide<T, false>(nullptr, x, w, out, nullptr, rows, d, eps);                  \
    }                                                                                        \
    extern "C" __global__ void THAW_WIDE_BOUNDS add_rms_norm_wide_##S(                        \
        float* residual, const float* x, const T* w, float* out, T* out16, int rows, int d,  \
        float eps) {                                                                         \
        rms_norm_wide<T, true>(residual, x, w, out, out16, rows, d, eps);                    \
    }
THAW_FOR_EACH_DTYPE(THAW_WIDE_NORM)

// x is [tokens, n_heads, head_dim]; one block per token, one thread per (head, pair).
extern "C" __global__ void THAW_WIDE_BOUNDS rope_wide_f32(float* __restrict__ x,
                                                          const u32* __restrict__ positions,
                                                          const float* __restrict__ inv_freq,
                                                          int tokens, int n_heads,
                                                          int head_dim) {
    __shared__ float cs[THAW_ROPE_MAX_HALF], sn[THAW_ROPE_MAX_HALF];
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const int half = head_dim / 2;
    rope_angles(positions[t], inv_freq, half, cs, sn);
    __syncthreads();
    float* row = x + (long)t * n_heads * head_dim;
    for (int e = threadIdx.x; e < n_heads * half; e += blockDim.x) {
        const int h = e / half, i = e - h * half;
        rope_pair(row + h * head_dim, i, half, cs[i], sn[i]);
    }
}

// One block per row r: q[r] and k[r] rotated in place for position positions[r]; the rotated k
// and v written to cache slot slots[r] (cache layout [slots, n_kv_heads, head_dim]).
template <typename T>
__device__ void write_kv_rope(float* __restrict__ q, float* __restrict__ k,
                              const float* __restrict__ v, T* __restrict__ kc, T* __restrict__ vc,
                              const u32* __restrict__ slots, const u32* __restrict__ positions,
                              const float* __restrict__ inv_freq, int rows, int n_heads,
                              int n_kv_heads, int head_dim) {
    __shared__ float cs[THAW_ROPE_MAX_HALF], sn[THAW_ROPE_MAX_HALF];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int half = head_dim / 2;
    rope_angles(positions[r], inv_freq, half, cs, sn);
    __syncthreads();
    const int token_len = n_kv_heads * head_dim;
    const long dst = (long)slots[r] * token_len;
    float* qr = q + (long)r * n_heads * head_dim;
    float* kr = k + (long)r * token_len;
    const float* vr = v + (long)r * token_len;
    const int qp = n_heads * half, kp = n_kv_heads * half;
    for (int e = threadIdx.x; e < qp + kp; e += blockDim.x) {
        if (e < qp) {
            const int h = e / half, i = e - h * half;
            rope_pair(qr + h * head_dim, i, half, cs[i], sn[i]);
        } else {
            const int f = e - qp;
            const int h = f / half, i = f - h * half;
            const float2 o = rope_pair(kr + h * head_dim, i, half, cs[i], sn[i]);
            kc[dst + h * head_dim + i] = from_f32<T>(o.x);
            kc[dst + h * head_dim + i + half] = from_f32<T>(o.y);
        }
    }
    for (int j = threadIdx.x; j < token_len; j += blockDim.x) vc[dst + j] = from_f32<T>(vr[j]);
}

#define THAW_WRITE_KV_ROPE(T, S)                                                              \
    extern "C" __global__ void THAW_WIDE_BOUNDS write_kv_rope_##S(                            \
        float* q, float* k, const float* v, T* kc, T* vc, const u32* slots,                   \
        const u32* positions, const float* inv_freq, int rows, int n_heads, int n_kv_heads,   \
        int head_dim) {                                                                       \
        write_kv_rope<T>(q, k, v, kc, vc, slots, positions, inv_freq, rows, n_heads,          \
                         n_kv_heads, head_dim);                                               \
    }
THAW_FOR_EACH_DTYPE(THAW_WRITE_KV_ROPE)

// src is [rows, w0 + w1 + w2]; d0[r, :] = src[r, 0..w0], d1[r, :] = src[r, w0..w0 + w1],
// d2[r, :] = src[r, w0 + w1..] (w2 may be 0: a pair). Grid-stride over every element.
extern "C" __global__ void split_cols3_f32(const float* __restrict__ src, int rows,
                                           float* __restrict__ d0, int w0,
                                           float* __restrict__ d1, int w1,
                                           float* __restrict__ d2, int w2) {
    const int width = w0 + w1 + w2;
    const long n = (long)rows * width;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const long r = i / width;
        const int c = (int)(i - r * width);
        const float x = src[i];
        if (c < w0) {
            d0[r * w0 + c] = x;
        } else if (c < w0 + w1) {
            d1[r * w1 + (c - w0)] = x;
        } else {
            d2[r * w2 + (c - w0 - w1)] = x;
        }
    }
}
