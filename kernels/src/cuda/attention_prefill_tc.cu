// Prefill attention on the tensor cores (issue 29): the causal GQA attention of attention.cu's
// attn_prefill (same paged cache, same tile metadata, same sliding window, prompt chunks that
// continue a paged prefix) computed with mma.sync m16n8k16 on 16-bit operands and f32
// accumulators, FlashAttention-2 style. CPU twin: kernels/src/cpu/attention.rs
// (paged_attention). Geometry and shared-memory budget: kernels/src/cuda/prefill_tc_plan.rs.
//
// One block per (tile of up to THAW_TC_Q consecutive query rows of one sequence, query head),
// THAW_TC_WARPS warps; warp w owns the tile's query rows 16w .. 16w + 15. The block stages the
// tile's queries (scaled, rounded to T) once, then walks the keys lo .. last of the tile
// THAW_TC_KC at a time: K as [key][d] and V transposed as [d][key] in shared memory, so every
// mma operand is two adjacent 16-bit values. Per key tile each warp computes S = Q·Kᵀ
// (16 × THAW_TC_KC, f32), masks it (causal, window, rows past the tile), updates its rows'
// running max and sum (online softmax) and adds P·V with P rounded to T, straight from the S
// accumulators (the m16n8 C layout of two adjacent key tiles is the m16k16 A layout).
//
// T is bf16_t or f16_t (an f32 cache keeps attention.cu's kernel); HD (head_dim) is 32, 64 or
// 128: entry points attn_prefill_tc32_bf16, attn_prefill_tc64_bf16, attn_prefill_tc128_bf16 and
// the same with _f16, with attn_prefill_T's signature (head_dim must equal HD). With
// THAW_CUDA_BF16_ACT the output is stored in the weight dtype O where O is the cache's dtype
// (attn_prefill_tcHD_T_out_T, issue 29; rounded once on the store); a cache and weights of
// different 16-bit types keep the f32 entry and o_proj's cast (six entries, not twelve).
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, c = lane % 4):
//   A (16 × 16, row): reg0 (g, 2c..2c+1), reg1 (g+8, 2c..), reg2 (g, 2c+8..), reg3 (g+8, 2c+8..)
//   B (16 × 8, col):  reg0 (k 2c..2c+1, n g), reg1 (k 2c+8..2c+9, n g)
//   C (16 × 8, f32):  c0, c1 (g, 2c..2c+1), c2, c3 (g+8, 2c..2c+1)

#define THAW_TC_WARPS 4
#define THAW_TC_Q 64
#define THAW_TC_KC 32
#define THAW_TC_PAD 8

// tc_mma, tc_pack and u16: mma16.cuh (compiled before this file, registry.rs).

// Two adjacent 16-bit values of a shared-memory row as one register.
__device__ __forceinline__ u32 tc_ld2(const u16* p) { return *reinterpret_cast<const u32*>(p); }

template <typename T, int HD, typename O>
__device__ void attn_prefill_tc(const float* __restrict__ q, const T* __restrict__ kc,
                                const T* __restrict__ vc, O* __restrict__ out,
                                const u32* __restrict__ block_tables, const u32* __restrict__ tiles,
                                int n_tiles, int n_heads, int n_kv_heads, int block_size,
                                int window, float scale) {
    static_assert(HD % 16 == 0 && HD <= 256, "head_dim must be a multiple of 16");
    constexpr int QS = HD + THAW_TC_PAD;       // padded row of qs / ks (16-bit elements)
    constexpr int VS = THAW_TC_KC + THAW_TC_PAD;  // padded row of vt
    constexpr int NT = HD / 8;                 // n8 tiles of the output
    constexpr int KT = THAW_TC_KC / 8;         // n8 tiles of one key tile's scores
    __shared__ __align__(16) u16 qs[THAW_TC_Q * QS];
    __shared__ __align__(16) u16 ks[THAW_TC_KC * QS];
    __shared__ __align__(16) u16 vt[HD * VS];

    const int t = blockIdx.x, h = blockIdx.y;
    if (t >= n_tiles) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int kvh = h / (n_heads / n_kv_heads);
    const int token_len = n_kv_heads * HD;
    const u32* table = block_tables + tiles[4 * t];
    const int pos0 = (int)tiles[4 * t + 1], row0 = (int)tiles[4 * t + 2];
    const int nq = (int)tiles[4 * t + 3];
    const int last = pos0 + nq - 1;
    const int lo = window > 0 ? max(0, pos0 + 1 - window) : 0;

    // Queries, pre-scaled and rounded to T; rows past the tile are zero.
    for (int idx = threadIdx.x; idx < THAW_TC_Q * HD; idx += blockDim.x) {
        const int qi = idx / HD, j = idx % HD;
        const float x = qi < nq ? q[((long)(row0 + qi) * n_heads + h) * HD + j] * scale : 0.0f;
        qs[qi * QS + j] = from_f32<T>(x).bits;
    }
    __syncthreads();
    const int r0 = warp * 16;  // this warp's first row in the tile
    u32 qf[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        qf[kk][0] = tc_ld2(qs + (r0 + g) * QS + kk * 16 + 2 * c);
        qf[kk][1] = tc_ld2(qs + (r0 + g + 8) * QS + kk * 16 + 2 * c);
        qf[kk][2] = tc_ld2(qs + (r0 + g) * QS + kk * 16 + 8 + 2 * c);
        qf[kk][3] = tc_ld2(qs + (r0 + g + 8) * QS + kk * 16 + 8 + 2 * c);
    }
    // This thread's two rows (g and g + 8 of the warp's 16): position, first attended key.
    int rpos[2], rlo[2];
    bool rok[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int qi = r0 + g + 8 * i;
        rok[i] = qi < nq;
        rpos[i] = pos0 + qi;
        rlo[i] = window > 0 ? max(0, rpos[i] + 1 - window) : 0;
    }
    // The keys any of the warp's rows attends to (warp-uniform): skip key tiles outside.
    const int w_hi = min(pos0 + r0 + 15, last);
    const int w_lo = window > 0 ? max(0, pos0 + r0 + 1 - window) : 0;
    const bool w_any = r0 < nq;

    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-THAW_INF, -THAW_INF}, l[2] = {0.0f, 0.0f};

    for (int c0 = lo; c0 <= last; c0 += THAW_TC_KC) {
        __syncthreads();  // every warp is done with the previous key tile
        // Stage K [key][d] and V transposed [d][key], 8 values (16 bytes) per load; keys past
        // `last` are zero (their P is 0, and 0 · a stale NaN would not be). The 32 lanes of a
        // warp take 32 keys of one 8-value column chunk: the transposed V stores of a warp then
        // fill one contiguous vt row (no bank conflict), and the 16-byte K stores of each
        // quarter-warp (8 keys) land in distinct banks (prefill_tc_plan's bank test).
        for (int idx = threadIdx.x; idx < THAW_TC_KC * (HD / 8); idx += blockDim.x) {
            const int kk = idx % THAW_TC_KC, d8 = (idx / THAW_TC_KC) * 8;
            const int p = c0 + kk;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (p <= last) {
                const long off = kv_offset(table, p, block_size, token_len) + (long)kvh * HD + d8;
                kv4 = __ldg(reinterpret_cast<const uint4*>(kc + off));
                vv4 = __ldg(reinterpret_cast<const uint4*>(vc + off));
            }
            *reinterpret_cast<uint4*>(ks + kk * QS + d8) = kv4;
            const u32 vw[4] = {vv4.x, vv4.y, vv4.z, vv4.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                vt[(d8 + 2 * e) * VS + kk] = (u16)(vw[e] & 0xffffu);
                vt[(d8 + 2 * e + 1) * VS + kk] = (u16)(vw[e] >> 16);
            }
        }
        __syncthreads();
        if (!w_any || c0 > w_hi || c0 + THAW_TC_KC - 1 < w_lo) continue;  // warp-uniform

        // S = Q · Kᵀ for the warp's 16 rows and the tile's keys.
        float s[KT][4];
#pragma unroll
        for (int n = 0; n < KT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
            for (int n = 0; n < KT; ++n) {
                const u16* kr = ks + (n * 8 + g) * QS + kk * 16 + 2 * c;
                tc_mma<T>(s[n], qf[kk], tc_ld2(kr), tc_ld2(kr + 8));
            }
        }
        // Mask, then the online softmax of each of this thread's two rows (a row's values are
        // spread over the 4 threads of a quad: reduce with shuffles over lane bits 0 and 1).
        float mt[2] = {-THAW_INF, -THAW_INF};
#pragma unroll
        for (int n = 0; n < KT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1, key = c0 + n * 8 + 2 * c + (e & 1);
                const bool ok = rok[i] && key <= rpos[i] && key >= rlo[i];
                s[n][e] = ok ? s[n][e] : -THAW_INF;
                mt[i] = fmaxf(mt[i], s[n][e]);
            }
        }
        float corr[2], mn[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mt[i] = fmaxf(mt[i], __shfl_xor_sync(0xffffffffu, mt[i], 1));
            mt[i] = fmaxf(mt[i], __shfl_xor_sync(0xffffffffu, mt[i], 2));
            mn[i] = fmaxf(m[i], mt[i]);
            // No key of the row yet: nothing to rescale (and -inf - -inf would be NaN).
            corr[i] = mn[i] == -THAW_INF ? 1.0f : expf(m[i] - mn[i]);
            m[i] = mn[i];
            l[i] *= corr[i];
        }
#pragma unroll
        for (int n = 0; n < KT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1;
                const float p = s[n][e] == -THAW_INF ? 0.0f : expf(s[n][e] - mn[i]);
                s[n][e] = p;
                l[i] += p;  // this thread's share of the row sum; the quad sums at the end
            }
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            o[n][0] *= corr[0];
            o[n][1] *= corr[0];
            o[n][2] *= corr[1];
            o[n][3] *= corr[1];
        }
        // O += P · V, 16 keys per mma: P's A fragment is two adjacent S tiles.
#pragma unroll
        for (int kk = 0; kk < THAW_TC_KC / 16; ++kk) {
            const u32 pa[4] = {
                tc_pack<T>(s[2 * kk][0], s[2 * kk][1]),
                tc_pack<T>(s[2 * kk][2], s[2 * kk][3]),
                tc_pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                tc_pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            };
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const u16* vr = vt + (n * 8 + g) * VS + kk * 16 + 2 * c;
                tc_mma<T>(o[n], pa, tc_ld2(vr), tc_ld2(vr + 8));
            }
        }
    }
    // out = O / l, the row sum completed over the quad.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!rok[i]) continue;
        const float inv = 1.0f / l[i];
        O* orow = out + ((long)(row0 + r0 + g + 8 * i) * n_heads + h) * HD;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            orow[n * 8 + 2 * c] = from_f32<O>(o[n][2 * i] * inv);
            orow[n * 8 + 2 * c + 1] = from_f32<O>(o[n][2 * i + 1] * inv);
        }
    }
}

THAW_PREFILL_ENTRIES(attn_prefill_tc, 32 * THAW_TC_WARPS, attn_prefill_tc)
