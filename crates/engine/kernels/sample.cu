// Greedy sampling on the device: the index of the largest f32 logit (ties → lowest index,
// as the CPU sampler), so a decode step copies back one token id, not the vocabulary.
#include "common.cuh"

__device__ __forceinline__ void best_of(float& best, int& bi, float ov, int oi) {
    if (ov > best || (ov == best && oi < bi)) {
        best = ov;
        bi = oi;
    }
}

// Block-wide (max, lowest index) into thread 0's (best, bi).
__device__ __forceinline__ void block_best(float& best, int& bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best_of(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : -INFINITY;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            best_of(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
    }
}

// grid: any number of blocks of 256 threads, each taking a contiguous slice; every block
// writes its (max, index) to part[], and the last block to finish (counted in *done, reset
// for the next launch) reduces them in block order. Launched with PDL. The index is written as f32 (exact
// below 2^24) so it comes back through the same f32 path as logits.
extern "C" __global__ void argmax(const float* __restrict__ logits, int n, float* __restrict__ out,
                                  float* __restrict__ part_v, int* __restrict__ part_i, int* __restrict__ done) {
    __shared__ int last;
    pdl_trigger();
    pdl_wait();
    int per = (n + gridDim.x - 1) / gridDim.x;
    int lo = blockIdx.x * per, hi = min(n, lo + per);
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) best_of(best, bi, logits[i], i);
    block_best(best, bi);
    if (threadIdx.x == 0) {
        part_v[blockIdx.x] = best;
        part_i[blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(done, 1) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    best = -INFINITY;
    bi = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) best_of(best, bi, __ldcg(part_v + b), __ldcg(part_i + b));
    block_best(best, bi);
    if (threadIdx.x == 0) {
        *out = (float)bi;
        *done = 0;
    }
}
