// RMSNorm (Llama's LlamaRMSNorm). CPU twin: kernels/src/cpu/norm.rs.
// out[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w. One block per row; the sum of squares
// is accumulated in f32 per thread, then tree-reduced (the CPU twin sums in f64; the difference
// is far below the 1e-4 parity tolerance for d <= 16384).
template <typename T>
__device__ void rms_norm(const float* __restrict__ x, const T* __restrict__ w,
                         float* __restrict__ out, int rows, int d, float eps) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (long)r * d;
    float* orow = out + (long)r * d;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) ss += xr[j] * xr[j];
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) orow[j] = xr[j] * inv * to_f32(w[j]);
}

#define THAW_NORM(T, S)                                                                    \
    extern "C" __global__ void rms_norm_##S(const float* x, const T* w, float* out, int rows, \
                                            int d, float eps) {                            \
        rms_norm<T>(x, w, out, rows, d, eps);                                              \
    }
THAW_FOR_EACH_DTYPE(THAW_NORM)

// Fused residual add + RMSNorm (issue 29; vLLM's fused_add_rms_norm), the default
// (THAW_CUDA_FUSED=0 off). CPU twin: kernels/src/cpu/norm.rs (add_rms_norm).
// residual[r, :] += x[r, :]; out[r, :] = rms_norm(residual[r, :]) * w. One block per row: the
// sum lands in registers and shared memory, so the residual row is read once and written once
// instead of add (read 2, write 1) then norm (read 1). Bit for bit add then rms_norm: the same
// f32 sums in the same order per thread and the same block reduction.
// With `out16` (not null; 16-bit T): out16[r, :] = T(out[r, :]) too, the input of the
// projections that read `out` next (q/k/v, gate/up), so their GEMM skips its cast_f32_to_T
// launch, as swiglu_x16 does for down; bit for bit cast_f32_to_T over `out` (the same
// from_f32 rounding of the same value). The f32 `out` stays: LoRA and the CPU-assist export
// read it.
template <typename T>
__device__ void add_rms_norm(float* __restrict__ residual, const float* __restrict__ x,
                             const T* __restrict__ w, float* __restrict__ out,
                             T* __restrict__ out16, int rows, int d, float eps) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* hr = residual + (long)r * d;
    const float* xr = x + (long)r * d;
    float* orow = out + (long)r * d;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float v = hr[j] + xr[j];
        hr[j] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / (float)d + eps);
    // Each thread reads back only the elements it wrote: no barrier needed.
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float o = hr[j] * inv * to_f32(w[j]);
        orow[j] = o;
        if (out16 != nullptr) out16[(long)r * d + j] = from_f32<T>(o);
    }
}

#define THAW_ADD_NORM(T, S)                                                                \
    extern "C" __global__ void add_rms_norm_##S(float* residual, const float* x, const T* w, \
                                                float* out, T* out16, int rows, int d,     \
                                                float eps) {                               \
        add_rms_norm<T>(residual, x, w, out, out16, rows, d, eps);                         \
    }
THAW_FOR_EACH_DTYPE(THAW_ADD_NORM)
