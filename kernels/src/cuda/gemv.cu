// Small-batch products y[rows, d_out] = x[rows, d_in] · Wᵀ for rows <= GEMV_MAX_ROWS (issue 29,
// a default, THAW_CUDA_GEMV=0 off; runtime/src/backend/cuda/gemv.rs launches it, kernel_select's
// `gemv_serves` decides where it runs).
//
// Why: at batch 1 the cuBLAS path first casts the f32 activations to the weight dtype (a kernel
// of its own), then runs gemm_ex, which for 4096x4096 bf16 reached 59-63% of the copy roofline
// on an H200 (cuda-h100.md §8). A decode product at a few rows is a pure weight stream: here the
// f32 activations are read directly (no cast kernel) and every weight is loaded once, 16 bytes
// (8 values) a lane at a time, with f32 accumulation, as TensorRT-LLM's and llama.cpp's
// small-batch GEMVs do.
//
// Layout: W is row-major [d_out, d_in] of T in {bf16_t, f16_t}; x is [rows, d_in] f32, y is
// [rows, d_out] f32 (overwritten). Each warp computes OUTS consecutive outputs (rows of W) for
// all `rows` input rows (OUTS = GEMV_OUTS_FEW for rows <= GEMV_FEW_ROWS, else GEMV_OUTS_MANY:
// every 16 bytes of weights a lane loads costs it 32 bytes of x per row from L1, so more rows
// share each x load over more outputs to keep that L1 traffic under the SM's 128 B a cycle): its lanes stride over d_in in groups of 8 (lane, lane + 32, ...; the
// last round is partial where d_in / 8 is not a multiple of 32), keep OUTS x rows partial
// sums in registers, and reduce them with warp shuffles at the end. Warps loop over output
// groups grid-stride, so any grid is correct; the host sizes it to fill the SMs.
//
// The host guarantees (gemv_serves): d_in % 8 == 0, W and x 16-byte aligned (every W row and x
// row then is too), 1 <= rows <= GEMV_MAX_ROWS. Other shapes take the cast + cuBLAS path.
//
// Numerics: f32 products of the exact 16-bit weights and the f32 activations, summed in f32 (per
// lane in d_in order, then a butterfly across lanes). The cuBLAS path rounds x to the weight
// dtype first, so the two differ by that rounding (bf16: ~2^-9 relative per activation); the
// GEMV is the closer one to the CPU oracle, which multiplies f32 activations too.

#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 4
// Rows up to this run gemv_few_T with GEMV_OUTS_FEW outputs a warp; more run gemv_many_T.
#define GEMV_FEW_ROWS 2
#define GEMV_OUTS_FEW 2
#define GEMV_OUTS_MANY 4

// 8 weights from one 16-byte load (read-only path).
template <typename T>
__device__ __forceinline__ void gemv_load8(const T* p, float (&w)[8]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const u32 words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        T v;
        v.bits = (unsigned short)(words[i / 2] >> (16 * (i % 2)));
        w[i] = to_f32(v);
    }
}

template <typename T, int R, int OUTS>
__device__ __forceinline__ void gemv_rows(const float* __restrict__ x, const T* __restrict__ w,
                                          float* __restrict__ y, int d_in, int d_out) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int groups = d_in >> 3;
    const int out_groups = (d_out + OUTS - 1) / OUTS;
    for (int og = blockIdx.x * GEMV_WARPS + warp; og < out_groups;
         og += gridDim.x * GEMV_WARPS) {
        const int o0 = og * OUTS;
        float acc[OUTS][R];
#pragma unroll
        for (int o = 0; o < OUTS; ++o)
#pragma unroll
            for (int r = 0; r < R; ++r) acc[o][r] = 0.0f;
        // Unrolled so that the next rounds' weight loads are in flight during this one's FMAs.
#pragma unroll(R <= 4 ? 4 : 2)
        for (int g = lane; g < groups; g += 32) {
            float wv[OUTS][8];
#pragma unroll
            for (int o = 0; o < OUTS; ++o) {
                if (o0 + o < d_out) {
                    gemv_load8(w + (long)(o0 + o) * d_in + ((long)g << 3), wv[o]);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) wv[o][i] = 0.0f;
                }
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float4* xr =
                    reinterpret_cast<const float4*>(x + (long)r * d_in + ((long)g << 3));
                const float4 a = __ldg(xr);
                const float4 b = __ldg(xr + 1);
#pragma unroll
                for (int o = 0; o < OUTS; ++o) {
                    float s = acc[o][r];
                    s += a.x * wv[o][0];
                    s += a.y * wv[o][1];
                    s += a.z * wv[o][2];
                    s += a.w * wv[o][3];
                    s += b.x * wv[o][4];
                    s += b.y * wv[o][5];
                    s += b.z * wv[o][6];
                    s += b.w * wv[o][7];
                    acc[o][r] = s;
                }
            }
        }
#pragma unroll
        for (int o = 0; o < OUTS; ++o) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float s = warp_sum(acc[o][r]);
                if (lane == 0 && o0 + o < d_out) y[(long)r * d_out + o0 + o] = s;
            }
        }
    }
}

// Two entry points per weight dtype, so that each gets its own register allocation: the few-row
// one (rows <= GEMV_FEW_ROWS, ~48 registers a thread on sm_90) keeps many warps resident; the
// many-row one holds OUTS x rows partial sums (up to ~160 registers). `rows` picks the
// instantiation that keeps every partial sum in registers. Blocks of GEMV_WARPS * 32 threads.
#define GEMV_CASE(T, R)                                                                       \
    case R:                                                                                   \
        gemv_rows<T, R, (R <= GEMV_FEW_ROWS ? GEMV_OUTS_FEW : GEMV_OUTS_MANY)>(x, w, y, d_in,  \
                                                                               d_out);        \
        break;
#define THAW_GEMV(T, S)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                             \
        gemv_few_##S(const float* __restrict__ x, const T* __restrict__ w,                    \
                     float* __restrict__ y, int rows, int d_in, int d_out) {                  \
        switch (rows) {                                                                       \
            GEMV_CASE(T, 1)                                                                   \
            GEMV_CASE(T, 2)                                                                   \
            default:                                                                          \
                break;                                                                        \
        }                                                                                     \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                             \
        gemv_many_##S(const float* __restrict__ x, const T* __restrict__ w,                   \
                      float* __restrict__ y, int rows, int d_in, int d_out) {                 \
        switch (rows) {                                                                       \
            GEMV_CASE(T, 3)                                                                   \
            GEMV_CASE(T, 4)                                                                   \
            GEMV_CASE(T, 5)                                                                   \
            GEMV_CASE(T, 6)                                                                   \
            GEMV_CASE(T, 7)                                                                   \
            GEMV_CASE(T, 8)                                                                   \
            default:                                                                          \
                break;                                                                        \
        }                                                                                     \
    }
THAW_GEMV(bf16_t, bf16)
THAW_GEMV(f16_t, f16)
