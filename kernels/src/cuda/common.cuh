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
