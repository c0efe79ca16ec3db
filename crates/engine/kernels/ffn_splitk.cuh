// A decode layer's MLP as one launch split along the FFN dimension (SPLITK=1 variant of
// gemv.cu, SPLITK_R its gate/up rows per warp; backend/cuda/ffn.rs, `FERROLM_FFN_FUSED=3`):
//     x += down · (silu(gate·n(x)) ⊙ up·n(x))
// Block j computes a contiguous run of gate/up rows (`per` consecutive gemv() steps: the
// op path's row sums, bit for bit, stored to `act`), then multiplies those act values by
// the same columns of down: a partial sum over its slice of the FFN dimension for every
// hidden row. The cluster's blocks reduce their partials through distributed shared memory
// (block r of a cluster sums slice r of the hidden rows over the cluster's blocks, in rank
// order), and the last cluster to finish a slice adds the clusters' sums into x in cluster
// order: deterministic. So the down projection needs no second launch and no wait for
// every gate/up row: each block starts on down as soon as its own act values are done.
// down's columns are its inputs: each block reads only its slice's columns of every row,
// one run of bytes per row, and its scales and biases from a transposed copy ([groups]
// [rows], made once by the host: in down's own [rows][groups] layout every row's one or
// two scales would each cost a 32-byte sector).
//
// grid: NB blocks (a multiple of the cluster size CS along x, NB ≤ SMs, dividing the
// gate/up steps), 32·NW threads; dynamic shared memory ring_x_bytes(hidden) for x, then
// hidden + rows floats (the block's partial sums and its act values) rounded up to 16
// bytes, then hidden · rows · BITS / 8 bytes (its columns of down). part: [NB / CS][hidden]
// floats; done: one counter per cluster rank, zeroed (reset by each launch).
#pragma once
#include "gemv_ring.cuh"

// One 16-byte chunk of a down row against the VPC act values `a` it meets:
// scale·Σq·a + bias·Σa per group segment (gemv.cu's bf16-x math: one PRMT and one FFMA per
// weight, part_dot).
__device__ __forceinline__ float down_chunk(uint4 q4, const scale_t (&sc)[NSUB], const scale_t (&bi)[NSUB],
                                            const float* a) {
    u32 words[4] = {q4.x, q4.y, q4.z, q4.w};
    float y = 0.f;
#pragma unroll
    for (int k = 0; k < NSUB; k++) {
        float d = 0.f, sa = 0.f;
#pragma unroll
        for (int p = k * PPS; p < (k + 1) * PPS; p++) {
            float xf[8];
#pragma unroll
            for (int e = 0; e < 8; e++) {
                xf[e] = a[8 * p + e];
                sa += xf[e];
            }
            d += part_dot(words, p, xf);
        }
        float s = s2f(sc[k]);
        y += fmaf(s * MAGIC_INV_B, d, (s2f(bi[k]) - s * (MAGIC_A * MAGIC_INV_B)) * sa);
    }
    return y;
}

// Rows a thread takes together in the down pass: their loads go out before any math.
#define DOWN_ROWS 8

// gemv()'s step dealing for the split: block j takes `per` consecutive steps, so its
// gate/up rows, and the columns of down they meet, are one contiguous run.
struct SliceSteps : KernelSync {
    int per;
    __device__ __forceinline__ int first_step() const { return blockIdx.x * per; }
    __device__ __forceinline__ int next_step(int b) const { return b + 1 < first_step() + per ? b + 1 : 0x7fffffff; }
};

template <int R>
__device__ __forceinline__ void ffn_splitk(Mat gate, Mat up, Mat down, float* x, const float* nw, float eps,
                                           int hidden, int ffn, bf16_t* act, float* part, int* done) {
    extern __shared__ __align__(16) unsigned char fs_smem[];
    constexpr int rb = NW * R;  // rows per gemv() step
    int steps = (ffn + rb - 1) / rb, nb = gridDim.x, j = blockIdx.x;
    int per = steps / nb, f0 = j * per * rb, fr = min(per * rb, ffn - f0);  // host: steps % nb == 0
    float* partial = reinterpret_cast<float*>(fs_smem + ring_x_bytes(hidden));
    float* a = partial + hidden;
    // The block's columns of down (every hidden row's run [f0, f0 + fr): runb bytes) copied
    // into shared memory now, before the kernel waits (weights), so they stream during
    // gate/up and the down pass reads them on chip.
    int runb = fr * BITS / 8, rowb = ffn * BITS / 8;
    unsigned char* wsm = fs_smem + ring_x_bytes(hidden) + (4 * (hidden + per * rb) + 15) / 16 * 16;
    const unsigned char* wsrc = reinterpret_cast<const unsigned char*>(down.w) + (size_t)f0 * BITS / 8;
    for (int i = threadIdx.x; i < hidden * (runb / 16); i += blockDim.x) {
        int row = i / (runb / 16), p = i % (runb / 16);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(wsm + row * runb + 16 * p)),
                     "l"(wsrc + (size_t)row * rowb + 16 * p)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    // This block's gate/up rows [f0, f0 + fr), stored to act (pdl_wait inside).
    gemv<R, true, 3>(gate, up, Mat{gate.w, gate.s, gate.b, act, 0}, x, nw, eps, hidden, SliceSteps{{}, per});
    __syncthreads();  // the block's act stores are done (and x staging's shared memory free)
    for (int i = threadIdx.x; i < fr; i += blockDim.x) a[i] = bf2f(act[f0 + i]);  // this block wrote them
    asm volatile("cp.async.wait_all;" ::: "memory");  // this thread's copies of down landed
    __syncthreads();                                  // and every thread's
    // Partial sums of every hidden row over columns [f0, f0 + fr): DOWN_ROWS rows per thread
    // at a time, each chunk's loads for all of them issued before its math. (The copies are
    // 16-byte cp.async of each row's run: gemv's ld_weights would ask L2 for 256-byte lines,
    // 8-16 times a run's bytes at a row stride of kilobytes.)
    for (int row0 = threadIdx.x; row0 < hidden; row0 += DOWN_ROWS * blockDim.x) {
        float y[DOWN_ROWS];
#pragma unroll
        for (int u = 0; u < DOWN_ROWS; u++) y[u] = 0.f;
        for (int c = 0; c < fr / VPC; c++) {
            uint4 q[DOWN_ROWS];
            scale_t sc[DOWN_ROWS][NSUB], bi[DOWN_ROWS][NSUB];
#pragma unroll
            for (int u = 0; u < DOWN_ROWS; u++) {
                int row = min(row0 + u * (int)blockDim.x, hidden - 1);  // past the end: computed, not stored
                q[u] = *reinterpret_cast<const uint4*>(wsm + row * runb + 16 * c);
#pragma unroll
                for (int k = 0; k < NSUB; k++) {  // transposed: [groups][rows], a warp's rows adjacent
                    size_t g = (size_t)((f0 + c * VPC + k * SUBG) / GROUP) * hidden + row;
                    sc[u][k] = __ldg(down.s + g);
                    bi[u][k] = __ldg(down.b + g);
                }
            }
#pragma unroll
            for (int u = 0; u < DOWN_ROWS; u++) y[u] += down_chunk(q[u], sc[u], bi[u], a + c * VPC);
        }
#pragma unroll
        for (int u = 0; u < DOWN_ROWS; u++)
            if (row0 + u * (int)blockDim.x < hidden) partial[row0 + u * blockDim.x] = y[u];
    }
    // The cluster's partials reduced through DSMEM: rank r sums rows [r·sl, (r+1)·sl).
    cluster_sync();
    unsigned cs = 1, r = cluster_rank();
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(cs));
    int sl = hidden / cs, c = j / cs, nc = nb / cs;
    for (int i = threadIdx.x; i < sl; i += blockDim.x) {
        float s = 0.f;
        for (unsigned p = 0; p < cs; p++) s += ld_cluster(partial + r * sl + i, p);
        part[(size_t)c * hidden + r * sl + i] = s;
    }
    cluster_sync();  // every block's partials stay until the cluster has read them
    // The last cluster to finish slice r adds all clusters' sums into x, in cluster order.
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done + r, 1) == nc - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < sl; i += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < nc; k++) s += __ldcg(part + (size_t)k * hidden + r * sl + i);
        x[r * sl + i] += s;
    }
    if (threadIdx.x == 0) done[r] = 0;
}

extern "C" __global__ void __launch_bounds__(32 * NW, 1)
    ffn_splitk_r(const u32* wg, const scale_t* sg, const scale_t* bg, const u32* wu, const scale_t* su,
                 const scale_t* bu, const u32* wd, const scale_t* sd, const scale_t* bd, float* x, const float* nw,
                 float eps, int hidden, int ffn, bf16_t* act, float* part, int* done) {
    TRACE_KERNEL();
    ffn_splitk<SPLITK_R>(Mat{wg, sg, bg, act, ffn}, Mat{wu, su, bu, act, ffn}, Mat{wd, sd, bd, x, hidden}, x, nw, eps,
                       hidden, ffn, act, part, done);
}
