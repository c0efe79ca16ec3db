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

// Order-preserving u32 key of a float: larger floats get larger keys, -0 < +0, and NaNs
// sort as Rust's f32::total_cmp sorts them (the CPU sampler's order).
__device__ __forceinline__ u32 order_key(float s) {
    u32 u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The k best of s_i = x_i · inv_t by (s desc, i asc) into out[0..2k] as (i, s) f32 pairs,
// for the host to finish sampling (Sampler::sample_candidates: same candidates, same draw
// as the CPU sampler). One block of 1024 threads, no inter-block synchronization:
//  1. radix select, 8 bits a pass from the top: a shared histogram of the key digit among
//     the elements still matching the prefix finds the digit holding the k-th best, four
//     passes give its key T and how many elements equal to T to take;
//  2. an ordered compaction writes every element above T (at positions in index order),
//     then the first elements equal to T by index.
// Each pass reads the vocabulary once from L2 (a 128K vocabulary: 512 KB) through one SM;
// make it multi-block if it shows in the decode step. Launched with PDL.
extern "C" __global__ void __launch_bounds__(1024)
    top_k(const float* __restrict__ x, int n, float inv_t, int k, float* __restrict__ out) {
    __shared__ unsigned hist[256];
    __shared__ u32 s_prefix, s_left;
    __shared__ unsigned wgt[32], weq[32];
    pdl_trigger();
    pdl_wait();
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    u32 prefix = 0, mask = 0, left = (u32)k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int t = tid; t < 256; t += blockDim.x) hist[t] = 0;
        __syncthreads();
        for (int i = tid; i < n; i += blockDim.x) {
            u32 key = order_key(x[i] * inv_t);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 above = 0;
            for (int d = 255; d >= 0; d--) {
                if (above + hist[d] >= left) {
                    prefix |= (u32)d << shift;
                    left -= above;
                    break;
                }
                above += hist[d];
            }
            s_prefix = prefix;
            s_left = left;
        }
        __syncthreads();
        prefix = s_prefix;
        left = s_left;
        mask |= 255u << shift;
    }
    // prefix = T, the k-th best key; `left` elements equal to T are taken, after k - left above it.
    // Tiles without a candidate (most of them: k of n) cost one barrier; in the others a
    // ballot per warp and the warps' counts give every candidate its place. Each thread
    // keeps the running counts itself (all compute the same totals).
    u32 above_t = (u32)k - left, base_gt = 0, base_eq = 0;
    u32 lt_mask = (1u << lane) - 1u;
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {
        int i = i0 + tid;
        float s = i < n ? x[i] * inv_t : 0.f;
        u32 key = order_key(s);
        bool gt = i < n && key > prefix, eq = i < n && key == prefix;
        if (!__syncthreads_or(gt || eq)) continue;  // uniform: every thread takes the same branch
        u32 bg = __ballot_sync(0xffffffffu, gt), be = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) {
            wgt[warp] = __popc(bg);
            weq[warp] = __popc(be);
        }
        __syncthreads();
        u32 og = base_gt + __popc(bg & lt_mask), oe = base_eq + __popc(be & lt_mask);
        for (int w = 0; w < nw; w++) {
            if (w < warp) {
                og += wgt[w];
                oe += weq[w];
            }
            base_gt += wgt[w];
            base_eq += weq[w];
        }
        if (gt) {
            out[2 * og] = (float)i;
            out[2 * og + 1] = s;
        }
        if (eq && oe < left) {
            out[2 * (above_t + oe)] = (float)i;
            out[2 * (above_t + oe) + 1] = s;
        }
        __syncthreads();  // wgt/weq are rewritten by the next candidate tile
    }
}
