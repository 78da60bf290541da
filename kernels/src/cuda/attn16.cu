// The attention's input half over 16-bit activations (issue 29, default, THAW_CUDA_BF16_ACT=0 off):
// the q, k and v GEMMs store their outputs in the weight dtype A (cuBLAS accumulates in f32 and
// rounds once on the store); qkv_rope16_A_T reads the three A buffers, rotates q and k in f32
// with write_kv_rope_T's angles and arithmetic (rope_fold.cuh, compiled before this file),
// writes the rotated q in f32 (what every attention kernel reads) and the rotated k and v into
// the paged cache in the KV dtype T. It is write_kv_rope_T with 16-bit inputs: bit for bit
// write_kv_rope_T over the widened q, k, v (the same rope_rot, the same from_f32<T> stores).
// CPU twin: cpu_attn16.rs (the products rounded to A, then rope and the KV write in f32).

// One block per row r (cache layout [slots, n_kv_heads, head_dim]), one thread per (head,
// pair) of q and k, then the V copy.
template <typename A, typename T>
__device__ void qkv_rope16(const A* __restrict__ q16, const A* __restrict__ k16,
                           const A* __restrict__ v16, float* __restrict__ q, T* __restrict__ kc,
                           T* __restrict__ vc, const u32* __restrict__ slots,
                           const u32* __restrict__ positions, const float* __restrict__ inv_freq,
                           int rows, int n_heads, int n_kv_heads, int head_dim) {
    __shared__ float cs[THAW_ROPE_MAX_HALF], sn[THAW_ROPE_MAX_HALF];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int half = head_dim / 2;
    rope_angles(positions[r], inv_freq, half, cs, sn);
    __syncthreads();
    const int token_len = n_kv_heads * head_dim;
    const long dst = (long)slots[r] * token_len;
    const long q0 = (long)r * n_heads * head_dim;
    const A* qs = q16 + q0;
    float* qr = q + q0;
    const A* ks = k16 + (long)r * token_len;
    const A* vs = v16 + (long)r * token_len;
    const int qp = n_heads * half, kp = n_kv_heads * half;
    for (int e = threadIdx.x; e < qp + kp; e += blockDim.x) {
        const bool is_q = e < qp;
        const int f = is_q ? e : e - qp;
        const int h = f / half, i = f - h * half;
        const int a = h * head_dim + i;
        if (is_q) {
            const float2 o = rope_rot(to_f32(qs[a]), to_f32(qs[a + half]), cs[i], sn[i]);
            qr[a] = o.x;
            qr[a + half] = o.y;
        } else {
            const float2 o = rope_rot(to_f32(ks[a]), to_f32(ks[a + half]), cs[i], sn[i]);
            kc[dst + a] = from_f32<T>(o.x);
            kc[dst + a + half] = from_f32<T>(o.y);
        }
    }
    for (int j = threadIdx.x; j < token_len; j += blockDim.x)
        vc[dst + j] = from_f32<T>(to_f32(vs[j]));
}

// Every entry point may launch 1024 threads a block (the host sizes it as write_kv_rope's).
#define THAW_QKV_ROPE16(NAME, A, T)                                                           \
    extern "C" __global__ void __launch_bounds__(1024) NAME(                                  \
        const A* q16, const A* k16, const A* v16, float* q, T* kc, T* vc, const u32* slots,   \
        const u32* positions, const float* inv_freq, int rows, int n_heads, int n_kv_heads,   \
        int head_dim) {                                                                       \
        qkv_rope16<A, T>(q16, k16, v16, q, kc, vc, slots, positions, inv_freq, rows, n_heads, \
                         n_kv_heads, head_dim);                                               \
    }
// qkv_rope16_<weight dtype>_<KV dtype>.
#define THAW_QKV_ROPE16_KV(T, ST)                                                             \
    THAW_QKV_ROPE16(qkv_rope16_bf16_##ST, bf16_t, T)                                          \
    THAW_QKV_ROPE16(qkv_rope16_f16_##ST, f16_t, T)
THAW_FOR_EACH_DTYPE(THAW_QKV_ROPE16_KV)
