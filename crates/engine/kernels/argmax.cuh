// Greedy selection's reductions: sample.cu's argmax and the head GEMV that fuses it
// (gemv.cu's OUT 5) share them, so both give the same token: the largest f32 value, ties
// to the lowest index (the CPU sampler's rule), blocks' partials reduced in block order.
#pragma once

#define FEED_HIST 64  // device.rs's FEED_HIST

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

// Where an argmax goes: one (max, index) partial per block and the done counter (zeroed
// at allocation, reset by each launch's last block); the index as f32 (exact below 2^24,
// so it comes back through the same f32 path as logits); and for a fed greedy step
// (feed_tok not null: Backend::step_fed) the next step's input token, the token history
// at the step's position (feed_hist[pos % FEED_HIST]: the host reads it from there on a
// side stream while later steps run, Backend::queue_read) and the position, advanced, so
// the next step needs nothing from the host.
struct ArgmaxSink {
    float* out;
    float* part_v;
    int* part_i;
    int* done;
    int* feed_tok;
    int* feed_pos;
    int* feed_hist;
};

// Every thread of every block calls this with its (best, bi): the block's best goes to its
// partial, and the last block to finish reduces the partials and writes the result.
__device__ __forceinline__ void argmax_finish(float best, int bi, const ArgmaxSink& s) {
    __shared__ int last;
    block_best(best, bi);
    if (threadIdx.x == 0) {
        s.part_v[blockIdx.x] = best;
        s.part_i[blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(s.done, 1) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    best = -INFINITY;
    bi = 0x7fffffff;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) best_of(best, bi, __ldcg(s.part_v + b), __ldcg(s.part_i + b));
    block_best(best, bi);
    if (threadIdx.x == 0) {
        *s.out = (float)bi;
        *s.done = 0;
        if (s.feed_tok) {
            *s.feed_tok = bi;
            s.feed_hist[*s.feed_pos % FEED_HIST] = bi;
            *s.feed_pos += 1;
        }
    }
}
