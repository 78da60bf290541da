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
