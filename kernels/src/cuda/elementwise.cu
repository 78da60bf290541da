// Elementwise and row-copy kernels: embedding gather, residual add, SwiGLU, bias, row gather
// (the logits rows), f32 -> 16-bit casts for cuBLAS inputs. CPU twins: kernels/src/cpu/
// activation.rs (swiglu, add_in_place), gemm.rs (add_bias); the gathers are plain copies.

// out[r, :] = table[ids[r], :]. One block per row.
template <typename T>
__device__ void embed_gather(const T* __restrict__ table, const u32* __restrict__ ids,
                             float* __restrict__ out, int rows, int hidden) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const T* src = table + (long)ids[r] * hidden;
    float* dst = out + (long)r * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) dst[j] = to_f32(src[j]);
}

// y[r, :] += bias for `rows` rows of width d.
template <typename T>
__device__ void add_bias(float* __restrict__ y, const T* __restrict__ bias, int rows, int d) {
    const long n = (long)rows * d;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        y[i] += to_f32(bias[i % d]);
}

// out[i] = T(x[i]): activations in the GEMM's input dtype.
template <typename T>
__device__ void cast_from_f32(const float* __restrict__ x, T* __restrict__ out, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        out[i] = from_f32<T>(x[i]);
}

#define THAW_ELEMENTWISE(T, S)                                                             \
    extern "C" __global__ void embed_gather_##S(const T* table, const u32* ids, float* out, \
                                                int rows, int hidden) {                    \
        embed_gather<T>(table, ids, out, rows, hidden);                                    \
    }                                                                                      \
    extern "C" __global__ void add_bias_##S(float* y, const T* bias, int rows, int d) {    \
        add_bias<T>(y, bias, rows, d);                                                     \
    }
THAW_FOR_EACH_DTYPE(THAW_ELEMENTWISE)

extern "C" __global__ void cast_f32_to_bf16(const float* x, bf16_t* out, long n) {
    cast_from_f32<bf16_t>(x, out, n);
}
extern "C" __global__ void cast_f32_to_f16(const float* x, f16_t* out, long n) {
    cast_from_f32<f16_t>(x, out, n);
}

// y[i] += x[i].
extern "C" __global__ void residual_add_f32(float* __restrict__ y, const float* __restrict__ x,
                                            long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        y[i] += x[i];
}

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + e^-g) (IEEE expf, as the CPU twin).
extern "C" __global__ void swiglu_f32(const float* __restrict__ gate, const float* __restrict__ up,
                                      float* __restrict__ out, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// out[i, :] = x[rows[i], :] for i < n: the last row of each sampling sequence before the
// final norm and the LM head. One block per gathered row.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x, const u32* __restrict__ rows,
                                           float* __restrict__ out, int n, int width) {
    const int i = blockIdx.x;
    if (i >= n) return;
    const float* src = x + (long)rows[i] * width;
    float* dst = out + (long)i * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) dst[j] = src[j];
}

// Fused SwiGLU + the down projection's input cast (issue 29), the default (THAW_CUDA_FUSED=0 turns
// it off): out[i] = silu(gate[i]) * up[i] as swiglu_f32 computes it, and out16[i] = the same value
// in the weight dtype, which the down GEMM reads directly instead of running cast_f32_to_T over
// `out` (one launch and one f32 read of the intermediate activations saved). The f32 `out` stays:
// LoRA and the CPU-assist export read it. CPU twin: cpu::swiglu, then the dtype's
// round-to-nearest-even (half::bf16::from_f32 / half::f16::from_f32).
template <typename T>
__device__ void swiglu_x16(const float* __restrict__ gate, const float* __restrict__ up,
                           float* __restrict__ out, T* __restrict__ out16, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const float g = gate[i];
        const float v = g / (1.0f + expf(-g)) * up[i];
        out[i] = v;
        out16[i] = from_f32<T>(v);
    }
}

extern "C" __global__ void swiglu_x16_bf16(const float* gate, const float* up, float* out,
                                           bf16_t* out16, long n) {
    swiglu_x16<bf16_t>(gate, up, out, out16, n);
}
extern "C" __global__ void swiglu_x16_f16(const float* gate, const float* up, float* out,
                                          f16_t* out16, long n) {
    swiglu_x16<f16_t>(gate, up, out, out16, n);
}
