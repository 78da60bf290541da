// Greedy sampling on the device (issue 29; runtime kernel_select: THAW_CUDA_DEVICE_ARGMAX, off
// unless set to 1). A decode step whose rows are all greedy copies one u32 per row to the host
// instead of the row's vocab f32 logits (at batch 32 and a 32000 vocabulary: 128 B, not 4 MB).
//
// argmax_rows_f32: ids[r] = the index of row r's largest logit, exactly the host's
// `sampling::argmax` (runtime/src/sampling.rs), whose rule is a running comparison
// `if x[i] > x[best] { best = i }` from best = 0:
// - the largest value wins, the lowest index among equal values (-0 == +0, so the first of
//   them wins);
// - NaNs are never chosen (every comparison with them is false) ...
// - ... except a NaN first entry: nothing compares greater than it, so the row gives 0;
// - a row of -inf gives 0 (the first of equal values); an empty row (vocab 0) gives 0.
// The comparisons are IEEE (no --use_fast_math in the NVRTC options, so no flush of subnormals
// to zero: a subnormal logit still beats +0 as on the host).
//
// One block of THAW_ARGMAX_THREADS per row: each thread keeps its best (value, index) over a
// strided slice, then a tree reduction over (value, index) pairs (warp shuffles, then one warp
// over the warps' bests) that keeps the larger value and, on equal values, the lower index.
// The reduction is exact (a max, no arithmetic), so the result does not depend on the order.

#define THAW_ARGMAX_THREADS 512

// Whether (v, i) beats (bv, bi): a larger value, or an equal one at a lower index. False when
// v is NaN. The "no candidate yet" state (-inf, INT_MAX) loses to every non-NaN entry.
__device__ __forceinline__ bool argmax_beats(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

// Reduces the (value, index) pairs of a warp into lane 0's.
__device__ __forceinline__ void argmax_warp(float& bv, int& bi) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, bv, o);
        const int oi = __shfl_down_sync(0xffffffffu, bi, o);
        if (argmax_beats(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THAW_ARGMAX_THREADS)
argmax_rows_f32(const float* __restrict__ logits, u32* __restrict__ ids, int rows, int vocab) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (long)r * vocab;
    // Uniform over the block: every thread reads the same first entry.
    if (vocab <= 0 || (__float_as_uint(x[0]) & 0x7fffffffu) > 0x7f800000u) {
        if (threadIdx.x == 0) ids[r] = 0;
        return;
    }
    float bv = -THAW_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        if (argmax_beats(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    argmax_warp(bv, bi);
    __shared__ float wv[THAW_ARGMAX_THREADS / 32];
    __shared__ int wi[THAW_ARGMAX_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        wv[warp] = bv;
        wi[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? wv[lane] : -THAW_INF;
        bi = lane < nw ? wi[lane] : 0x7fffffff;
        argmax_warp(bv, bi);
        // x[0] is not NaN, so thread 0 took it: bi is a real index.
        if (lane == 0) ids[r] = (u32)bi;
    }
}
