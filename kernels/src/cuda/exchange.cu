// CPU-assist exchange kernels (DESIGN §4, CaraServe's fused copy-and-signal). The exchange
// segment (thaw-ipc ExchangeLayout) is host shared memory registered with cuMemHostRegister
// (DEVICEMAP), so these kernels read and write it directly over PCIe. CPU twin: the CPU
// backend's row copy + Exchange::post_step, and the add of Exchange::output.

// Copies rows[i] of x ([*, d_in] f32) to row i of the mapped input buffer `dst` (row stride
// dst_stride floats), then publishes `seq` in the mapped sequence word the workers spin on.
// Every thread fences its own stores system-wide; the last block to finish (a device counter,
// reset by that block for the next launch) fences again and stores the word with a volatile
// store, so a worker that sees `seq` sees every row. No host synchronisation is involved: the
// next kernels queue behind this one.
extern "C" __global__ void export_rows(const float* __restrict__ x, int d_in,
                                       const u32* __restrict__ rows, int n_rows,
                                       float* __restrict__ dst, int dst_stride,
                                       volatile u32* seq_word, u32 seq, u32* done_blocks) {
    for (int i = blockIdx.x; i < n_rows; i += gridDim.x) {
        const float* src = x + (long)rows[i] * d_in;
        float* out = dst + (long)i * dst_stride;
        for (int j = threadIdx.x; j < d_in; j += blockDim.x) out[j] = src[j];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 ticket = atomicAdd(done_blocks, 1u);
        if (ticket == gridDim.x - 1) {
            __threadfence_system();
            *done_blocks = 0u;
            *seq_word = seq;
            __threadfence_system();
        }
    }
}

// y[rows[i], :] += delta[i, :] for i < n_rows, where delta ([n_rows, delta_stride] f32, already
// scaled by the workers) is the mapped output buffer of one module. Launched after the stream
// waited (cuStreamWaitValue32, GEQ) on every involved worker's result word, so the rows are
// complete; loads are volatile so no stale cached line of host memory is used.
extern "C" __global__ void merge_deltas(float* __restrict__ y, int d_out,
                                        const u32* __restrict__ rows, int n_rows,
                                        const volatile float* delta, int delta_stride) {
    for (int i = blockIdx.x; i < n_rows; i += gridDim.x) {
        float* yr = y + (long)rows[i] * d_out;
        const volatile float* dr = delta + (long)i * delta_stride;
        for (int j = threadIdx.x; j < d_out; j += blockDim.x) yr[j] += dr[j];
    }
}
