// SwiGLU over 16-bit activations (issue 29, default, THAW_CUDA_BF16_ACT=0 off): the gate and up
// GEMMs store their outputs in the weight dtype T (cuBLAS accumulates in f32 and rounds once
// on the store); this kernel reads the two T buffers, computes silu(g) * u in f32 exactly as
// swiglu_f32 does (IEEE expf), and stores the result in T (the down GEMM's input, read without
// a cast) and, where `out` is not null, in f32 (what the down LoRA's shrink reads). Each thread
// handles 4 consecutive elements with 8-byte loads and stores where n is a multiple of 4
// (buffers come from cudaMalloc, 256-byte aligned), one at a time otherwise.
// CPU twin: cpu::swiglu over the widened inputs, then the dtype's round to nearest even.

template <typename T>
__device__ __forceinline__ float swiglu16_one(T g, T u) {
    const float gf = to_f32(g);
    return gf / (1.0f + expf(-gf)) * to_f32(u);
}

template <typename T>
__device__ void swiglu16(const T* __restrict__ gate, const T* __restrict__ up,
                         T* __restrict__ out16, float* __restrict__ out, long n) {
    const long stride = (long)gridDim.x * blockDim.x;
    const long first = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if ((n & 3) == 0) {
        const long n4 = n >> 2;
        const uint2* g4 = reinterpret_cast<const uint2*>(gate);
        const uint2* u4 = reinterpret_cast<const uint2*>(up);
        uint2* o4 = reinterpret_cast<uint2*>(out16);
        for (long i = first; i < n4; i += stride) {
            const uint2 gw = g4[i];
            const uint2 uw = u4[i];
            const u32 gs[4] = {gw.x & 0xffffu, gw.x >> 16, gw.y & 0xffffu, gw.y >> 16};
            const u32 us[4] = {uw.x & 0xffffu, uw.x >> 16, uw.y & 0xffffu, uw.y >> 16};
            float v[4];
            u32 b[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                T g, u;
                g.bits = (unsigned short)gs[e];
                u.bits = (unsigned short)us[e];
                v[e] = swiglu16_one(g, u);
                b[e] = from_f32<T>(v[e]).bits;
            }
            o4[i] = make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
            if (out) reinterpret_cast<float4*>(out)[i] = make_float4(v[0], v[1], v[2], v[3]);
        }
        return;
    }
    for (long i = first; i < n; i += stride) {
        const float v = swiglu16_one(gate[i], up[i]);
        out16[i] = from_f32<T>(v);
        if (out) out[i] = v;
    }
}

extern "C" __global__ void swiglu16_bf16(const bf16_t* gate, const bf16_t* up, bf16_t* out16,
                                         float* out, long n) {
    swiglu16<bf16_t>(gate, up, out16, out, n);
}
extern "C" __global__ void swiglu16_f16(const f16_t* gate, const f16_t* up, f16_t* out16,
                                        float* out, long n) {
    swiglu16<f16_t>(gate, up, out16, out, n);
}
