// Prefill attention on the tensor cores, FlashAttention-2 style (issue 29, opt-in with
// THAW_CUDA_PREFILL_FA=1): computes exactly what attention_prefill_tc.cu computes (same
// arguments, paged cache, tile metadata, causal mask, sliding window, prompt chunks that continue
// a paged prefix; S and the online softmax in f32, P rounded to the cache's type T for P·V, f32
// accumulators), built for speed. CPU twin: kernels/src/cpu/attention.rs (paged_attention).
// Geometry, shared-memory budget and the pure launch plan: kernels/src/cuda/prefill_fa_plan.rs.
//
// What differs from attention_prefill_tc.cu, and why:
// - GQA sharing. One block serves a query tile (THAW_FA_Q rows of one sequence) for
//   `hpb = blockDim.x / (32 · THAW_FA_ROW_WARPS)` query heads of one KV head: warp w owns head
//   slot w / THAW_FA_ROW_WARPS and the tile's rows 16 (w % THAW_FA_ROW_WARPS) ..+15. Each K/V
//   tile staged in shared memory then serves every head of the block (the plan picks hpb, a
//   divisor of the GQA group: 4 q heads per KV head read K/V from L2 twice, not four times).
// - cp.async (sm_80+), double-buffered: key tile i + 1 is in flight while the warps multiply
//   tile i; no register round trip for the staging.
// - K and V both stay [key][d] in shared memory (rows padded by THAW_FA_PAD elements, so the 8
//   rows an ldmatrix phase reads start 16 bytes apart modulo 128: no bank conflict). ldmatrix
//   (no .trans) of K rows gives the mma B fragments of Kᵀ for S = Q·Kᵀ; ldmatrix.trans of V rows
//   gives those of V for P·V. No scalar transpose.
// - Q is read once from global memory (f32, scaled, rounded to T, as the TC kernel does) straight
//   into the warp's A fragments, which stay in registers for the whole key walk; P goes from the
//   S accumulators (m16n8 C layout) to P·V's A fragments without leaving registers.
// - Key tiles of THAW_FA_KC: fully masked tiles are skipped (the block walks keys from its first
//   row's window start to its last row's position; a warp skips a tile none of its rows
//   attends), and only tiles that cross a row's causal or window edge (or hold keys past the
//   tile's last position, zero-filled) are masked (fa_tile<true>); the rest run unmasked.
// - Tiles are walked last first (blockIdx.x 0 takes the last tile): blocks start in blockIdx.x
//   order, and a prompt's later tiles walk more keys, so the longest blocks start first.
// - A 16-byte cp.async chunk is 8 consecutive head_dim values of one key: a key's row of one KV
//   head lies inside one cache page (kv_offset), so a chunk never straddles a page, whatever the
//   block_size; zero-filled (src-size 0) for keys past the tile's last position.
//
// T is bf16_t or f16_t, HD (head_dim) 32, 64 or 128; the output O is f32, or T under
// THAW_CUDA_BF16_ACT (the _out_T entries, rounded once on the store, as the TC kernel's).
// Shared memory is dynamic: 2 stages × (K, V) × THAW_FA_KC × (HD + THAW_FA_PAD) 16-bit values;
// above 48 KiB (HD 128) the host raises the function's dynamic shared-memory limit.

#define THAW_FA_KC 64
#define THAW_FA_PAD 8
#define THAW_FA_Q 64
#define THAW_FA_ROW_WARPS 4
#define THAW_FA_MAX_WARPS 8

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 fa_smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes global → shared, asynchronously; `src_bytes` 0 zero-fills (nothing is read).
__device__ __forceinline__ void fa_cp16(u16* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fa_smem_addr(dst)),
                 "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void fa_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void fa_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8×8 16-bit matrices from shared memory; lanes 8i .. 8i+7 give matrix i's row addresses.
// The "memory" clobber keeps the compiler from moving the read across the barrier that follows
// the cp.async wait (ptxas still schedules the instruction by its register dependencies).
__device__ __forceinline__ void fa_ldsm4(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_smem_addr(p))
                 : "memory");
}
// The same, each matrix transposed (lane 4g + c gets rows 2c, 2c + 1 of column g).
__device__ __forceinline__ void fa_ldsm4_t(u32 (&r)[4], const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fa_smem_addr(p))
                 : "memory");
}

// Two values as one mma register, `lo` in the low half, rounded to nearest even by one sm_80
// cvt: the bits of tc_pack's from_f32 for every finite value (the operands here are finite: Q
// and P), in one instruction instead of bf16's integer rounding.
template <typename T>
__device__ __forceinline__ u32 fa_pack(float lo, float hi);
template <>
__device__ __forceinline__ u32 fa_pack<bf16_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <>
__device__ __forceinline__ u32 fa_pack<f16_t>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Two adjacent output values (column 2c, 2c + 1 of a row) in one store.
__device__ __forceinline__ void fa_store2(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void fa_store2(bf16_t* p, float a, float b) {
    *reinterpret_cast<u32*>(p) = tc_pack<bf16_t>(a, b);
}
__device__ __forceinline__ void fa_store2(f16_t* p, float a, float b) {
    *reinterpret_cast<u32*>(p) = tc_pack<f16_t>(a, b);
}

// One warp's rows: the online-softmax state and what masking needs.
struct FaRows {
    int pos[2], lo[2];  // this thread's rows g and g + 8: position, first attended key
    bool ok[2];         // the row is in the tile
    float m[2], l[2];   // running max (of S, scaled) and this thread's share of the row sum
};

// One key tile for one warp: S = Q·Kᵀ (16 rows × KC keys, f32), masked when MASK, the online
// softmax, then O += P·V with P rounded to T. `ks` / `vs` are the stage's [key][HD + PAD] tiles.
template <typename T, int HD, bool MASK>
__device__ __forceinline__ void fa_tile(const u32 (&qf)[HD / 16][4], float (&o)[HD / 8][4],
                                        FaRows& r, const u16* ks, const u16* vs, int c0,
                                        int lane) {
    constexpr int KS = HD + THAW_FA_PAD;
    constexpr int NK = THAW_FA_KC / 8;  // n8 tiles of scores
    constexpr float L2E = 1.4426950408889634f;
    const int c = lane & 3;
    // ldmatrix row addresses: lane l gives row l % 8 of matrix l / 8 (prefill_fa_plan's k_ldsm
    // and v_ldsm, whose test checks them against the mma fragment layouts).
    const int mi = lane >> 3, mr = lane & 7;
    float s[NK][4];
#pragma unroll
    for (int n = 0; n < NK; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    // Matrices (keys 16np + 0..7 | 8..15) × (d 16kk + 0..7 | 8..15): b0, b1 of score tile 2np,
    // then of 2np + 1.
    const u16* krow = ks + (((mi >> 1) << 3) + mr) * KS + ((mi & 1) << 3);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < NK / 2; ++np) {
            u32 b[4];
            fa_ldsm4(b, krow + np * 16 * KS + kk * 16);
            tc_mma<T>(s[2 * np], qf[kk], b[0], b[1]);
            tc_mma<T>(s[2 * np + 1], qf[kk], b[2], b[3]);
        }
    }
    float mt[2] = {-THAW_INF, -THAW_INF};
#pragma unroll
    for (int n = 0; n < NK; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = e >> 1;
            if (MASK) {
                const int key = c0 + n * 8 + 2 * c + (e & 1);
                const bool ok = r.ok[i] && key <= r.pos[i] && key >= r.lo[i];
                s[n][e] = ok ? s[n][e] : -THAW_INF;
            }
            mt[i] = fmaxf(mt[i], s[n][e]);
        }
    }
    float corr[2], ml[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mt[i] = fmaxf(mt[i], __shfl_xor_sync(0xffffffffu, mt[i], 1));
        mt[i] = fmaxf(mt[i], __shfl_xor_sync(0xffffffffu, mt[i], 2));
        const float mn = fmaxf(r.m[i], mt[i]);
        // No key of the row yet: nothing to rescale (and -inf - -inf would be NaN).
        corr[i] = mn == -THAW_INF ? 1.0f : exp2f((r.m[i] - mn) * L2E);
        ml[i] = mn * L2E;
        r.m[i] = mn;
        r.l[i] *= corr[i];
    }
#pragma unroll
    for (int n = 0; n < NK; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = e >> 1;
            float p = exp2f(fmaf(s[n][e], L2E, -ml[i]));
            if (MASK) p = s[n][e] == -THAW_INF ? 0.0f : p;
            s[n][e] = p;
            r.l[i] += p;  // this thread's share; the quad sums at the end
        }
    }
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
    }
    // O += P · V, 16 keys per mma: P's A fragment is two adjacent S tiles. Matrices (keys
    // 16kk + 0..7 | 8..15) × (d 16dp + 0..7 | 8..15), transposed: b0, b1 of output tile 2dp,
    // then of 2dp + 1.
    const u16* vrow = vs + (((mi & 1) << 3) + mr) * KS + ((mi >> 1) << 3);
#pragma unroll
    for (int kk = 0; kk < THAW_FA_KC / 16; ++kk) {
        const u32 pa[4] = {
            fa_pack<T>(s[2 * kk][0], s[2 * kk][1]),
            fa_pack<T>(s[2 * kk][2], s[2 * kk][3]),
            fa_pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
            fa_pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]),
        };
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
            u32 b[4];
            fa_ldsm4_t(b, vrow + kk * 16 * KS + dp * 16);
            tc_mma<T>(o[2 * dp], pa, b[0], b[1]);
            tc_mma<T>(o[2 * dp + 1], pa, b[2], b[3]);
        }
    }
}

template <typename T, int HD, typename O>
__device__ void attn_prefill_fa(const float* __restrict__ q, const T* __restrict__ kc,
                                const T* __restrict__ vc, O* __restrict__ out,
                                const u32* __restrict__ block_tables, const u32* __restrict__ tiles,
                                int n_tiles, int n_heads, int n_kv_heads, int block_size,
                                int window, float scale) {
    static_assert(HD % 16 == 0 && HD <= 256, "head_dim must be a multiple of 16");
    static_assert(THAW_FA_KC % 16 == 0, "P·V takes keys 16 at a time");
    static_assert(THAW_FA_Q == 16 * THAW_FA_ROW_WARPS, "a warp owns 16 rows of one head");
    constexpr int KS = HD + THAW_FA_PAD;  // padded shared row (16-bit elements)
    constexpr int STAGE = 2 * THAW_FA_KC * KS;  // one stage: K then V
    extern __shared__ __align__(16) u16 fa_smem[];

    // Tiles in reverse: blocks start in blockIdx.x order, and a prompt's later tiles walk more
    // keys (causal), so the longest blocks start first and the short ones fill the tail.
    if ((int)blockIdx.x >= n_tiles) return;
    const int t = n_tiles - 1 - (int)blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    // Heads: the block serves hpb consecutive q heads of KV head kvh (blockIdx.y = kvh · chunks
    // + chunk, chunks = group / hpb; the plan makes hpb divide the group).
    const int group = n_heads / n_kv_heads;
    const int hpb = blockDim.x / (32 * THAW_FA_ROW_WARPS);
    const int chunks = group / hpb;
    const int kvh = blockIdx.y / chunks;
    const int h = kvh * group + (blockIdx.y % chunks) * hpb + warp / THAW_FA_ROW_WARPS;
    const int r0 = 16 * (warp % THAW_FA_ROW_WARPS);  // this warp's first row in the tile
    const int token_len = n_kv_heads * HD;
    const u32* table = block_tables + tiles[4 * t];
    const int pos0 = (int)tiles[4 * t + 1], row0 = (int)tiles[4 * t + 2];
    const int nq = (int)tiles[4 * t + 3];
    const int last = pos0 + nq - 1;
    const int lo = window > 0 ? max(0, pos0 + 1 - window) : 0;
    const int n_kt = (last - lo) / THAW_FA_KC + 1;

    // Stage the key tile at c0 into stage `st`: 16-byte chunks, consecutive threads along a
    // key's row (coalesced global reads, consecutive shared stores).
    auto stage = [&](int c0, int st) {
        u16* ks = fa_smem + st * STAGE;
        u16* vs = ks + THAW_FA_KC * KS;
        for (int idx = threadIdx.x; idx < THAW_FA_KC * (HD / 8); idx += blockDim.x) {
            const int kk = idx / (HD / 8), d8 = (idx % (HD / 8)) * 8;
            const int p = c0 + kk;
            long off = 0;
            if (p <= last) off = kv_offset(table, p, block_size, token_len) + (long)kvh * HD + d8;
            const int bytes = p <= last ? 16 : 0;
            fa_cp16(ks + kk * KS + d8, kc + off, bytes);
            fa_cp16(vs + kk * KS + d8, vc + off, bytes);
        }
        fa_commit();
    };
    stage(lo, 0);

    // Q fragments (the warp's 16 rows of head h), scaled and rounded to T; rows past the tile 0.
    u32 qf[HD / 16][4];
    FaRows r;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int qi = r0 + g + 8 * i;
        r.ok[i] = qi < nq;
        r.pos[i] = pos0 + qi;
        r.lo[i] = window > 0 ? max(0, r.pos[i] + 1 - window) : 0;
        r.m[i] = -THAW_INF;
        r.l[i] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = j & 1, col = kk * 16 + 2 * c + 8 * (j >> 1);
            float2 x = make_float2(0.0f, 0.0f);
            if (r.ok[i]) {
                const long row = (long)(row0 + r0 + g + 8 * i) * n_heads + h;
                x = *reinterpret_cast<const float2*>(q + row * HD + col);
            }
            qf[kk][j] = fa_pack<T>(x.x * scale, x.y * scale);
        }
    }
    // The keys any of the warp's rows attends to (warp-uniform), and where masking is needed:
    // keys past the first row's position (causal; also the zero-filled keys past `last`) or
    // before the last row's window start.
    const int rl = min(r0 + 15, nq - 1);  // the warp's last row in the tile
    const bool w_any = r0 < nq;
    const int w_hi = pos0 + rl;
    const int w_lo = window > 0 ? max(0, pos0 + r0 + 1 - window) : 0;
    const int w_lo_max = window > 0 ? max(0, pos0 + rl + 1 - window) : 0;

    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

    for (int it = 0; it < n_kt; ++it) {
        const int c0 = lo + it * THAW_FA_KC;
        // The next tile's copies go out before this one is used (its stage was released by the
        // previous iteration's closing barrier).
        if (it + 1 < n_kt) {
            stage(c0 + THAW_FA_KC, (it + 1) & 1);
            fa_wait<1>();
        } else {
            fa_wait<0>();
        }
        __syncthreads();  // this tile's copies, from every thread, have landed
        const u16* ks = fa_smem + (it & 1) * STAGE;
        const u16* vs = ks + THAW_FA_KC * KS;
        const int c1 = c0 + THAW_FA_KC - 1;
        if (w_any && c0 <= w_hi && c1 >= w_lo) {  // warp-uniform
            if (c1 > pos0 + r0 || c0 < w_lo_max || r0 + 16 > nq) {
                fa_tile<T, HD, true>(qf, o, r, ks, vs, c0, lane);
            } else {
                fa_tile<T, HD, false>(qf, o, r, ks, vs, c0, lane);
            }
        }
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    // out = O / l, the row sum completed over the quad.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        r.l[i] += __shfl_xor_sync(0xffffffffu, r.l[i], 1);
        r.l[i] += __shfl_xor_sync(0xffffffffu, r.l[i], 2);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (!r.ok[i]) continue;
        const float inv = 1.0f / r.l[i];
        O* orow = out + ((long)(row0 + r0 + g + 8 * i) * n_heads + h) * HD;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            fa_store2(orow + n * 8 + 2 * c, o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
        }
    }
}

THAW_PREFILL_ENTRIES(attn_prefill_fa, 32 * THAW_FA_MAX_WARPS, attn_prefill_fa)
