// RoPE helpers shared by the kernels that fold RoPE into the paged-cache KV write (wide.cu's
// write_kv_rope_T and rope_wide_f32, attn16.cu's qkv_rope16_A_T): compiled before each of
// those sources (registry.rs concatenates it), so every one rotates with the same angles and
// the same arithmetic.

// Pairs per head staged in shared memory: THAW_MAX_HEAD_DIM / 2.
#define THAW_ROPE_MAX_HALF 128

// cos / sin of position `position` for pairs 0..half into shared memory, as rope_f32 computes
// them: the angle in f32 (like HF), its sincos in f64, rounded once. The caller syncs.
__device__ __forceinline__ void rope_angles(u32 position, const float* __restrict__ inv_freq,
                                            int half, float* c, float* s) {
    const float pos = (float)position;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float angle = pos * inv_freq[i];
        double sd, cd;
        sincos((double)angle, &sd, &cd);
        s[i] = (float)sd;
        c[i] = (float)cd;
    }
}

// Pair (a, b) = (x[i], x[i + half]) of one head rotated by the angle whose cos / sin are c / s.
__device__ __forceinline__ float2 rope_rot(float a, float b, float c, float s) {
    return make_float2(a * c - b * s, b * c + a * s);
}

// Rotates pair (i, i + half) of one head in place; returns the two new values.
__device__ __forceinline__ float2 rope_pair(float* head, int i, int half, float c, float s) {
    const float2 o = rope_rot(head[i], head[i + half], c, s);
    head[i] = o.x;
    head[i + half] = o.y;
    return o;
}
