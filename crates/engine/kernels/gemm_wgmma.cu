// The prefill GEMM on Hopper's warpgroup MMA (sm_90a only) over weights dequantized
// beforehand: out[t, r] = Σ_k x[t, k]·w[r, k], x bf16 [m, cols], w a bf16 [rows, cols]
// copy of an affine matrix written by gemm.cu's dequant_bf16 (the values qgemm.cuh's
// dequant_pair gives every quantized GEMM), out bf16 or f32 [m, rows] (or added into an
// f32 [m, rows] as bf16 values: qgemm_wgmma_add, a residual's update). No per-format
// defines: one build serves every weight format. Launcher: backend/cuda/gemm_wgmma.rs.
//
// Why: the tiled mma.sync kernels (gemm.cu) dequantize inside the loop and reach about a
// quarter of the bf16 dense rate at the 8B shapes; a dequantized copy (one pass at ~2.5
// TB/s) lets the block issue nothing but copies and MMAs: 1.56-1.91x gemm.cu's kernel at
// the 8B shapes on an H100 (docs/perf.md).
//
// Design. A block of 256 threads (two warpgroups) owns 128 tokens × 128 weight rows and
// walks K in steps of 64 values through a ring of STAGES shared-memory stages, each an x
// tile and a w tile (wgmma.cuh's swizzled layout), both filled by cp.async (zero past m and
// past the copy's rows). Step s: wait for its copies, fence them to the async proxy,
// barrier, then warpgroup g issues four wgmma.m64n128k16 (tokens 64g.., all 128 rows) and
// commits; step s + STAGES - 2's copies go out, and the group of step s - 1 is waited for
// (one step's MMAs stay in flight, so a stage is reused two steps after its MMAs).
// Chunking as qgemm.cuh: the accumulators restart from zero every CHUNK_K values and the
// chunk sums are added in order into f32 totals, and wgmma's k16 arithmetic is mma.sync's,
// so the outputs have gemm.cu's bits (cuda_parity's gemm tests hold them to it).
// Where cols is a multiple of 2·CHUNK_K, chunks alternate between two accumulator sets and
// a chunk is added into the totals under the next chunk's first MMAs, instead of the ring
// waiting for every group at each chunk's end (the tensor cores idle once every four
// steps): +3-6% end to end on the 8B prefill (docs/perf.md). Only every other chunk, with
// a wait for all groups at each iteration's end: where a loop carries a group in flight
// while the other set is read, ptxas serializes every wgmma (C7514). 255 registers, no
// spills: one block an SM and nothing beside it.
// Grid (⌈m/128⌉, ⌈rows/128⌉): token tiles fastest, so the blocks of one weight tile run
// together and it comes from HBM about once.
// qgemm_wgmma_glu: the copy holds gate and up interleaved by 64 rows (dequant_bf16's
// `half` = 64), so a tile is 64 rows of gate and the same 64 rows of up; the epilogue
// stores act(gate)·up (qgemm.cuh's glu_value on the f32 sums) into out [m, rows].
// Launch: block 256, dynamic shared memory WG_SMEM bytes (the function's attribute must
// allow it). cols a multiple of 64.
#include "common.cuh"
#include "mma.cuh"
#include "qgemm.cuh"
#include "wgmma.cuh"

#define STAGES 6
#define WG_STAGE (2 * WG_TILE)              // x tile, then w tile
#define WG_SMEM (STAGES * WG_STAGE + 1024)  // + alignment slack

// out: 0 bf16 [m, rows], 1 f32 [m, rows], 2 GLU (bf16 [m, rows], rows outputs from a
// copy of 2·⌈rows/64⌉·64 rows), 3 f32 [m, rows] += the bf16-rounded products.
template <int OUT>
__device__ __forceinline__ void qgemm_wgmma_body(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x,
                                                 void* __restrict__ out, int rows, int cols, int m, int act) {
    extern __shared__ u8 smem_raw[];
    u8* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
    const int t0 = blockIdx.x * WG_BM, nk = cols / WG_BK;
    const int w_rows = OUT == 2 ? 2 * ((rows + 63) / 64) * 64 : rows, w0 = blockIdx.y * WG_BN;
    auto x_tile = [&](int st) { return smem + st * WG_STAGE; };
    auto w_tile = [&](int st) { return smem + st * WG_STAGE + WG_TILE; };
    auto load = [&](int st, int s) {
        copy_tile(x_tile(st), x, t0, m, cols, s, tid);
        copy_tile(w_tile(st), w, w0, w_rows, cols, s, tid);
    };
    float acc[64], acc2[64], tot[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = acc2[i] = tot[i] = 0.f;
    constexpr int P = STAGES - 2;  // steps of copies ahead
#pragma unroll
    for (int st = 0; st < P; st++) {
        if (st < nk) load(st, st);
        cp_async_commit();
    }
    // Step s into a: its copies waited for, its MMAs issued, step s + P's copies sent, and
    // every group but this step's waited for.
    auto step = [&](float (&a)[64], int s) {
        const int st = s % STAGES;
        cp_async_wait<P - 1>();
        fence_async_smem();
        __syncthreads();  // every thread's copies in, and step s-2's MMAs done everywhere
        issue_step(a, smem_u32(x_tile(st)) + wg * 64 * 128, smem_u32(w_tile(st)));
        const int sn = s + P;
        if (sn < nk) load(sn % STAGES, sn);
        cp_async_commit();
        wg_wait1();
        pin(a);
    };
    constexpr int SPC = CHUNK_K / WG_BK;
    if (nk % (2 * SPC) == 0) {
        // Two chunks an iteration on two accumulator sets: the first is added into the
        // totals under the second's first MMAs.
        for (int s0 = 0; s0 < nk; s0 += 2 * SPC) {
#pragma unroll
            for (int j = 0; j < SPC; j++) step(acc, s0 + j);
#pragma unroll
            for (int j = 0; j < SPC; j++) {
                step(acc2, s0 + SPC + j);
                if (j == 0) {
                    pin(acc);
#pragma unroll
                    for (int i = 0; i < 64; i++) tot[i] += acc[i], acc[i] = 0.f;
                }
            }
            drain_chunk(acc2, tot);
        }
    } else {
        // A chunk's steps unrolled: the accumulators are touched only by the MMAs between a
        // chunk's first step and its end, so no control flow merges with a group in flight
        // (ptxas would wait for it there).
        for (int s0 = 0; s0 < nk; s0 += SPC) {
#pragma unroll
            for (int j = 0; j < SPC; j++)
                if (s0 + j < nk) step(acc, s0 + j);
            drain_chunk(acc, tot);
        }
    }
    const int t_lane = t0 + 64 * wg + 16 * warp + (lane >> 2);
    if constexpr (OUT == 2) {
        // Columns 0..63 of the tile are gate's rows r0.., 64..127 up's same rows.
        const int r0 = blockIdx.y * (WG_BN / 2);
        bf16_t* o = reinterpret_cast<bf16_t*>(out);
        for_each_out_pair<WG_BN / 2>(t_lane, lane, [&](int t, int c, int i) {
            const int r = r0 + c;
            if (t >= m) return;
            bf16_t* po = o + (size_t)t * rows + r;
            if (r < rows) po[0] = f2bf(glu_value(tot[i], tot[i + 32], act));
            if (r + 1 < rows) po[1] = f2bf(glu_value(tot[i + 1], tot[i + 33], act));
        });
    } else {
        store_out<OUT == 1, OUT == 3>(tot, out, rows, m, w0, t_lane, lane);
    }
}

extern "C" __global__ void __launch_bounds__(256, 1)
    qgemm_wgmma(const bf16_t* w, const bf16_t* x, bf16_t* out, int rows, int cols, int m) {
    qgemm_wgmma_body<0>(w, x, out, rows, cols, m, 0);
}
extern "C" __global__ void __launch_bounds__(256, 1)
    qgemm_wgmma_f32(const bf16_t* w, const bf16_t* x, float* out, int rows, int cols, int m) {
    qgemm_wgmma_body<1>(w, x, out, rows, cols, m, 0);
}
// out += bf16(x·wᵀ) on an f32 out: the same bits as qgemm_wgmma then add_f32_bf16.
extern "C" __global__ void __launch_bounds__(256, 1)
    qgemm_wgmma_add(const bf16_t* w, const bf16_t* x, float* out, int rows, int cols, int m) {
    qgemm_wgmma_body<3>(w, x, out, rows, cols, m, 0);
}
// out = act(x·gateᵀ)·(x·upᵀ), act 0 silu, 1 gelu (tanh); grid (⌈m/128⌉, ⌈rows/64⌉).
extern "C" __global__ void __launch_bounds__(256, 1)
    qgemm_wgmma_glu(const bf16_t* w, const bf16_t* x, bf16_t* out, int rows, int cols, int m, int act) {
    qgemm_wgmma_body<2>(w, x, out, rows, cols, m, act);
}
