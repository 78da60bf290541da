// Rotary position embedding, HF rotate_half (non-interleaved). CPU twin: kernels/src/cpu/rope.rs
// (RopeTable::apply). The inverse frequencies (already scaled: linear / Llama 3) are the host
// table's `inv_freq()`, uploaded once. As on the CPU, the angle is rounded to f32
// (pos * inv_freq in f32, like HF) and its sin/cos evaluated in f64, then rounded once.
//
// x is [tokens, n_heads, head_dim], rotated in place. One block per token; thread i < half
// computes the rotation of pair (i, i + half) once and applies it to every head.
extern "C" __global__ void rope_f32(float* __restrict__ x, const u32* __restrict__ positions,
                                    const float* __restrict__ inv_freq, int tokens, int n_heads,
                                    int head_dim) {
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const int half = head_dim / 2;
    const float pos = (float)positions[t];
    float* row = x + (long)t * n_heads * head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float angle = pos * inv_freq[i];
        double sd, cd;
        sincos((double)angle, &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        for (int h = 0; h < n_heads; ++h) {
            float* head = row + h * head_dim;
            const float a = head[i], b = head[i + half];
            head[i] = a * c - b * s;
            head[i + half] = b * c + a * s;
        }
    }
}
