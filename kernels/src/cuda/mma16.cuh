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

