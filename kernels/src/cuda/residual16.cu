// The residual stream in 16 bits (issue 29, default, THAW_CUDA_BF16_ACT=0 off; runtime
// residual16_plan): the hidden state h between layers is stored in the weight dtype T, as
// transformers' bf16 Llama keeps it, instead of f32. Every kernel that touches h is here; the
// f32 kernels they stand in for are norm.cu's, wide.cu's and elementwise.cu's. Sums and sums of
// squares stay f32; h is rounded (round to nearest even, from_f32) once per add, and the norm
// reads the ROUNDED sum, as transformers normalises the bf16 residual it just stored.
// CPU twin: runtime's cpu_residual16.rs (cpu::add then Act16Type::round, then cpu::rms_norm).
//
// - embed16_T: h[r, :] = table[ids[r], :], the 16-bit rows copied without widening.
// - rms_norm_h16_T: out = rms_norm(h) * w (layer 0's input norm), f32 out.
// - add_rms_norm_h16_T: h = T(h + x); out = rms_norm(h) * w; with out16 (not null) out in T
//   too (the next projections' GEMM input, as add_rms_norm_T writes it: bit for bit
//   cast_f32_to_T over out). One block per row, blockDim a multiple of 32 (block_sum); each
//   thread reads back only the h elements it wrote, so no barrier is needed between the passes.
//   Launched with 256 threads a row, or up to 1024 with THAW_CUDA_WIDE_NORM=1 (hence the
//   launch bounds: the compiler must fit 1024 threads).
// - residual_add_h16_T: h = T(h + x) (the last layer's add).
// - gather_rows_h16_T: out[i, :] = f32(h[rows[i], :]) (before the final norm; exact widening).

template <typename T>
__device__ void embed16(const T* __restrict__ table, const u32* __restrict__ ids,
                        T* __restrict__ h, int rows, int d) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const T* src = table + (long)ids[r] * d;
    T* dst = h + (long)r * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
}

// Four consecutive 16-bit values from one 8-byte word, widened, and back (round to nearest
// even): the vector path of the kernels below, as act16.cu's swiglu16 packs them.
template <typename T>
__device__ __forceinline__ void unpack4(uint2 w, float v[4]) {
    const u32 b[4] = {w.x & 0xffffu, w.x >> 16, w.y & 0xffffu, w.y >> 16};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        T t;
        t.bits = (unsigned short)b[e];
        v[e] = to_f32(t);
    }
}

template <typename T>
__device__ __forceinline__ uint2 pack4(const float v[4]) {
    u32 b[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) b[e] = from_f32<T>(v[e]).bits;
    return make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
}

// v[e] = T(v[e] + x): the rounded sum, widened back (what the norm then reads).
template <typename T>
__device__ __forceinline__ uint2 add_round4(float v[4], float4 x) {
    v[0] += x.x;
    v[1] += x.y;
    v[2] += x.z;
    v[3] += x.w;
    const uint2 p = pack4<T>(v);
    unpack4<T>(p, v);
    return p;
}

// ADD: h[r] = T(h[r] + x[r]) first. Either way out[r] = rms_norm(f32(h[r])) * w. Where d is a
// multiple of 4, each thread moves 4 elements at a time (8-byte 16-bit and 16-byte f32
// accesses: every row starts at a multiple of 8 bytes of a cudaMalloc'd buffer); the values and
// the rounding are those of the one-element path, only the order of the f32 sum of squares
// differs.
template <typename T, bool ADD>
__device__ void norm_h16(T* __restrict__ h, const float* __restrict__ x, const T* __restrict__ w,
                         float* __restrict__ out, T* __restrict__ out16, int rows, int d,
                         float eps) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    T* hr = h + (long)r * d;
    const float* xr = ADD ? x + (long)r * d : nullptr;
    float* orow = out + (long)r * d;
    T* o16 = out16 != nullptr ? out16 + (long)r * d : nullptr;
    float ss = 0.0f;
    if ((d & 3) == 0) {
        const int d4 = d >> 2;
        uint2* h4 = reinterpret_cast<uint2*>(hr);
        for (int j = threadIdx.x; j < d4; j += blockDim.x) {
            float v[4];
            unpack4<T>(h4[j], v);
            if (ADD) h4[j] = add_round4<T>(v, reinterpret_cast<const float4*>(xr)[j]);
            ss += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3];
        }
        ss = block_sum(ss);
        const float inv = rsqrtf(ss / (float)d + eps);
        const uint2* w4 = reinterpret_cast<const uint2*>(w);
        for (int j = threadIdx.x; j < d4; j += blockDim.x) {
            float v[4], g[4];
            unpack4<T>(h4[j], v);
            unpack4<T>(w4[j], g);
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = v[e] * inv * g[e];
            reinterpret_cast<float4*>(orow)[j] = make_float4(v[0], v[1], v[2], v[3]);
            if (o16 != nullptr) reinterpret_cast<uint2*>(o16)[j] = pack4<T>(v);
        }
        return;
    }
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float v = to_f32(hr[j]);
        if (ADD) {
            const T s = from_f32<T>(v + xr[j]);
            hr[j] = s;
            v = to_f32(s);
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        const float o = to_f32(hr[j]) * inv * to_f32(w[j]);
        orow[j] = o;
        if (o16 != nullptr) o16[j] = from_f32<T>(o);
    }
}

// h[i] = T(h[i] + x[i]); 4 elements a thread where n is a multiple of 4 (as norm_h16).
template <typename T>
__device__ void residual_add_h16(T* __restrict__ h, const float* __restrict__ x, long n) {
    const long stride = (long)gridDim.x * blockDim.x;
    const long first = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if ((n & 3) == 0) {
        uint2* h4 = reinterpret_cast<uint2*>(h);
        const float4* x4 = reinterpret_cast<const float4*>(x);
        for (long i = first; i < (n >> 2); i += stride) {
            float v[4];
            unpack4<T>(h4[i], v);
            h4[i] = add_round4<T>(v, x4[i]);
        }
        return;
    }
    for (long i = first; i < n; i += stride) h[i] = from_f32<T>(to_f32(h[i]) + x[i]);
}

template <typename T>
__device__ void gather_rows_h16(const T* __restrict__ h, const u32* __restrict__ rows,
                                float* __restrict__ out, int n, int width) {
    const int i = blockIdx.x;
    if (i >= n) return;
    const T* src = h + (long)rows[i] * width;
    float* dst = out + (long)i * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) dst[j] = to_f32(src[j]);
}

#define THAW_R16_BOUNDS __launch_bounds__(1024)
#define THAW_RESIDUAL16(T, S)                                                                 \
    extern "C" __global__ void embed16_##S(const T* table, const u32* ids, T* h, int rows,    \
                                           int d) {                                           \
        embed16<T>(table, ids, h, rows, d);                                                   \
    }                                                                                         \
    extern "C" __global__ void THAW_R16_BOUNDS rms_norm_h16_##S(                              \
        const T* h, const T* w, float* out, int rows, int d, float eps) {                     \
        norm_h16<T, false>(const_cast<T*>(h), nullptr, w, out, nullptr, rows, d, eps);        \
    }                                                                                         \
    extern "C" __global__ void THAW_R16_BOUNDS add_rms_norm_h16_##S(                          \
        T* h, const float* x, const T* w, float* out, T* out16, int rows, int d, float eps) { \
        norm_h16<T, true>(h, x, w, out, out16, rows, d, eps);                                 \
    }                                                                                         \
    extern "C" __global__ void residual_add_h16_##S(T* h, const float* x, long n) {           \
        residual_add_h16<T>(h, x, n);                                                         \
    }                                                                                         \
    extern "C" __global__ void gather_rows_h16_##S(const T* h, const u32* rows, float* out,   \
                                                   int n, int width) {                        \
        gather_rows_h16<T>(h, rows, out, n, width);                                           \
    }
THAW_RESIDUAL16(bf16_t, bf16)
THAW_RESIDUAL16(f16_t, f16)
