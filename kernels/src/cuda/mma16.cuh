// 16-bit tensor-core helpers shared by the prefill attention kernels (attention_prefill_tc.cu,
// attention_prefill_fa.cu): the registry compiles this file in front of each (no #include).
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, c = lane % 4):
//   A (16 × 16, row): reg0 (g, 2c..2c+1), reg1 (g+8, 2c..), reg2 (g, 2c+8..), reg3 (g+8, 2c+8..)
//   B (16 × 8, col):  reg0 (k 2c..2c+1, n g), reg1 (k 2c+8..2c+9, n g)
//   C (16 × 8, f32):  c0, c1 (g, 2c..2c+1), c2, c3 (g+8, 2c..2c+1)

typedef unsigned short u16;

// d += a · b on one m16n8k16 tile, f32 accumulators.
template <typename T>
__device__ __forceinline__ void tc_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <>
__device__ __forceinline__ void tc_mma<bf16_t>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void tc_mma<f16_t>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two values as one mma register: `lo` in the low half (the smaller column / k index).
template <typename T>
__device__ __forceinline__ u32 tc_pack(float lo, float hi) {
    return (u32)from_f32<T>(lo).bits | ((u32)from_f32<T>(hi).bits << 16);
}


// The twelve entry points of a prefill attention family IMPL<T, HD, O> (attn_prefill_tc,
// attn_prefill_fa): PREFIX<HD>_<T> for head dims 32/64/128 and a bf16 or f16 cache, with an f32
// output, and PREFIX<HD>_<T>_out_<T> storing the output in the cache's type (THAW_CUDA_BF16_ACT).
// Each has attention.cu's attn_prefill_T signature; head_dim must equal HD. BOUND: the most
// threads a block of the family has (__launch_bounds__).
#define THAW_PREFILL_ENTRY(IMPL, BOUND, T, O, HD, NAME)                                         \
    extern "C" __global__ void __launch_bounds__(BOUND)                                         \
        NAME(const float* q, const T* kc, const T* vc, O* out, const u32* block_tables,         \
             const u32* tiles, int n_tiles, int n_heads, int n_kv_heads, int head_dim,          \
             int block_size, int window, float scale) {                                         \
        if (head_dim != HD) __trap();                                                           \
        IMPL<T, HD, O>(q, kc, vc, out, block_tables, tiles, n_tiles, n_heads, n_kv_heads,       \
                       block_size, window, scale);                                              \
    }
#define THAW_PREFILL_ENTRIES(IMPL, BOUND, PREFIX)                                              \
    THAW_PREFILL_ENTRY(IMPL, BOUND, bf16_t, float, 32, PREFIX##32_bf16)                         \
    THAW_PREFILL_ENTRY(IMPL, BOUND, bf16_t, float, 64, PREFIX##64_bf16)                         \
    THAW_PREFILL_ENTRY(IMPL, BOUND, bf16_t, float, 128, PREFIX##128_bf16)                       \
    THAW_PREFILL_ENTRY(IMPL, BOUND, f16_t, float, 32, PREFIX##32_f16)                           \
    THAW_PREFILL_ENTRY(IMPL, BOUND, f16_t, float, 64, PREFIX##64_f16)                           \
    THAW_PREFILL_ENTRY(IMPL, BOUND, f16_t, float, 128, PREFIX##128_f16)                         \
    THAW_PREFILL_ENTRY(IMPL, BOUND, bf16_t, bf16_t, 32, PREFIX##32_bf16_out_bf16)               \
    THAW_PREFILL_ENTRY(IMPL, BOUND, bf16_t, bf16_t, 64, PREFIX##64_bf16_out_bf16)               \
    THAW_PREFILL_ENTRY(IMPL, BOUND, bf16_t, bf16_t, 128, PREFIX##128_bf16_out_bf16)             \
    THAW_PREFILL_ENTRY(IMPL, BOUND, f16_t, f16_t, 32, PREFIX##32_f16_out_f16)                   \
    THAW_PREFILL_ENTRY(IMPL, BOUND, f16_t, f16_t, 64, PREFIX##64_f16_out_f16)                   \
    THAW_PREFILL_ENTRY(IMPL, BOUND, f16_t, f16_t, 128, PREFIX##128_f16_out_f16)
