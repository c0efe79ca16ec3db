// Lab: the product's dense wgmma ring (crates/engine/kernels/gemm_wgmma.cu: a bf16 copy of
// the weights, 128 tokens × 128 rows a block, six cp.async stages, one step's MMAs in
// flight) with two accumulator sets, for issue 29's 8B prefill at 512 tokens.
//
// Why: the product keeps qgemm.cuh's chunking (f32 sums restarted every CHUNK_K values and
// added in order into the totals, which gives the tiled kernel's bits). At each chunk's
// end it waits for every MMA group (wgmma.wait_group 0), adds the chunk into the totals and
// only then issues the next chunk's first step: the tensor cores idle for the group's
// latency, the 64 adds, a barrier and the issue, once every four steps. Here chunk c runs
// on accumulator set c % 2: the next chunk's first step is issued before the previous
// chunk is added (after a wait that leaves only that step's group in flight), so the adds
// run under the MMAs, for every other chunk (the design note in the body says why not
// every one). The same sums added in the same order: the product's bits. 238 registers
// (the product's 168), no spills (NVRTC 13.0, sm_90a); four chunks an iteration spill.
//
// Launch: as gemm_wgmma.cu's qgemm_wgmma / qgemm_wgmma_f32 (grid (⌈m/128⌉, ⌈rows/128⌉),
// block 256, dynamic shared memory WG_SMEM bytes). cols a multiple of 2 · CHUNK_K (512).
#include "common.cuh"
#include "mma.cuh"
#include "qgemm.cuh"
#include "wgmma.cuh"

#define STAGES 6
#define WG_STAGE (2 * WG_TILE)              // x tile, then w tile
#define WG_SMEM (STAGES * WG_STAGE + 1024)  // + alignment slack

// A finished chunk's sums into the totals, in order; acc restarted from zero. Every group
// writing acc must have been waited for.
__device__ __forceinline__ void fold(float (&acc)[64], float (&tot)[64]) {
    pin(acc);
#pragma unroll
    for (int i = 0; i < 64; i++) tot[i] += acc[i], acc[i] = 0.f;
}

template <bool OUT_F32>
__device__ __forceinline__ void acc2_body(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x,
                                          void* __restrict__ out, int rows, int cols, int m) {
    extern __shared__ u8 smem_raw[];
    u8* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
    const int t0 = blockIdx.x * WG_BM, w0 = blockIdx.y * WG_BN, nk = cols / WG_BK;
    auto x_tile = [&](int st) { return smem + st * WG_STAGE; };
    auto w_tile = [&](int st) { return smem + st * WG_STAGE + WG_TILE; };
    auto load = [&](int st, int s) {
        copy_tile(x_tile(st), x, t0, m, cols, s, tid);
        copy_tile(w_tile(st), w, w0, rows, cols, s, tid);
    };
    float a0[64], a1[64], tot[64];
#pragma unroll
    for (int i = 0; i < 64; i++) a0[i] = a1[i] = tot[i] = 0.f;
    constexpr int P = STAGES - 2;  // steps of copies ahead
#pragma unroll
    for (int st = 0; st < P; st++) {
        if (st < nk) load(st, st);
        cp_async_commit();
    }
    // Step s into acc: its copies waited for, its MMAs issued, step s + P's copies sent,
    // and every group but this step's waited for.
    auto step = [&](float (&acc)[64], int s) {
        const int st = s % STAGES;
        cp_async_wait<P - 1>();
        fence_async_smem();
        __syncthreads();  // every thread's copies in, and step s-2's MMAs done everywhere
        issue_step(acc, smem_u32(x_tile(st)) + wg * 64 * 128, smem_u32(w_tile(st)));
        const int sn = s + P;
        if (sn < nk) load(sn % STAGES, sn);
        cp_async_commit();
        wg_wait1();
        pin(acc);
    };
    constexpr int SPC = CHUNK_K / WG_BK;
    // Two chunks an iteration: chunk c on a0, folded after chunk c + 1's first step on a1,
    // whose sums are folded after every group is waited for at the iteration's end. No
    // group stays in flight across the loop's back edge, and no step is skipped: ptxas
    // serializes every wgmma (C7514) where accumulators of another set are read in a loop
    // that carries groups in flight, or along paths that skip steps. Hence cols a multiple
    // of 2 · CHUNK_K, and half the product's chunk-end waits.
    static_assert(SPC >= 1, "whole steps a chunk");
    for (int s0 = 0; s0 < nk; s0 += 2 * SPC) {
#pragma unroll
        for (int j = 0; j < SPC; j++) step(a0, s0 + j);
#pragma unroll
        for (int j = 0; j < SPC; j++) {
            step(a1, s0 + SPC + j);
            if (j == 0) fold(a0, tot);
        }
        wg_wait0();
        fold(a1, tot);
    }
    store_out<OUT_F32>(tot, out, rows, m, w0, t0 + 64 * wg + 16 * warp + (lane >> 2), lane);
}

extern "C" __global__ void __launch_bounds__(256, 1)
    wgmma_acc2(const bf16_t* w, const bf16_t* x, bf16_t* out, int rows, int cols, int m) {
    acc2_body<false>(w, x, out, rows, cols, m);
}
extern "C" __global__ void __launch_bounds__(256, 1)
    wgmma_acc2_f32(const bf16_t* w, const bf16_t* x, float* out, int rows, int cols, int m) {
    acc2_body<true>(w, x, out, rows, cols, m);
}
