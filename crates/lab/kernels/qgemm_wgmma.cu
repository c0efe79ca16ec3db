// Lab: the quantized prefill GEMM on Hopper's warpgroup MMA (wgmma, sm_90a), for issue 29's
// 8B prefill target (the product's gemm.cu reaches 22-26% of the bf16 dense rate with
// mma.sync over 64×64 tiles). out[t, r] = Σ_k x[t, k]·w[r, k], x bf16 [m, cols], w affine
// (BITS, GROUP, SCALE_T as gemm.cu's variants), out bf16 or f32 [m, rows].
//
// Design. A block of 256 threads (two warpgroups) owns 128 tokens × 128 weight rows and
// walks K in steps of 64 values through a ring of STAGES shared-memory stages, each an x
// tile and a w tile of 128 rows × 128 bytes in wgmma's 128-byte swizzled K-major layout
// (16-byte chunk c of row r at r·128 + (c ^ r % 8)·16; 1024-byte aligned, so a descriptor
// advances 32 bytes per k16 step):
//   - x: cp.async 16-byte copies (zero-filled past m), STAGES - 1 steps ahead;
//   - w: each thread loads one 32-value segment of one row STAGES steps ahead into
//     registers and dequantizes it (qgemm.cuh's dequant_pair: f32 fmaf, one bf16 rounding)
//     into its stage one iteration later, under the tensor cores' work;
//   - step s: wait for its copies, fence them to the async proxy, barrier, then warpgroup g
//     issues four wgmma.m64n128k16 (tokens 64g.., all 128 rows) and commits; the next
//     stages' copies and dequantization go out before the wait.
//   - qgemm.cuh's chunking: the accumulators restart from zero every CHUNK_K values and the
//     chunk sums are added in order into f32 totals, so where wgmma's k16 arithmetic is
//     mma.sync's the bits are gemm.cu's (the lab's check says whether they are).
// Accumulator layout (m64nN, f32): warp w of a warpgroup holds rows 16w + lane/4 (d[4j],
// d[4j+1], columns 8j + 2·(lane%4) + {0,1}) and 16w + lane/4 + 8 (d[4j+2], d[4j+3]).
// qgemm_wg_if keeps one step's MMAs in flight across the next step (the ring then runs a
// step shorter ahead): within 1.5% of qgemm_wg (H100, docs/perf.md's prefill ceiling). A
// warp-specialized form (a producer warpgroup loading and dequantizing for two consumers,
// stages handed over by mbarriers) measured slower than both and is gone (perf.md's
// "Designs measured and not taken").
// The dense form over a dequantized copy, the measured best, is the product's
// (crates/engine/kernels/gemm_wgmma.cu); the ring's helpers are its wgmma.cuh.
// Launch: grid (⌈rows/128⌉, ⌈m/128⌉), block 256, dynamic shared memory WG_SMEM bytes (past
// 48 KiB: the function's attribute must allow it). cols a multiple of 64.
#include "common.cuh"
#include "affine.cuh"
#include "mma.cuh"
#include "qgemm.cuh"
#include "wgmma.cuh"

#ifndef STAGES
#define STAGES 4
#endif
#define WG_STAGE (2 * WG_TILE)              // x tile, then w tile
#define WG_SMEM (STAGES * WG_STAGE + 1024)  // + alignment slack
#define SEG 32                              // weight values per thread per step (256 threads)

static_assert(WG_BN * WG_BK == 256 * SEG, "one segment per thread per step");
static_assert(STAGES >= 3, "two stages ahead of the MMAs, or one with a step in flight");

// One thread's weight segment of a step, N values of one row, as loaded (dequantized one
// iteration later). Whole values in each 32-bit word (BITS 2, 4 or 8, the GPU's widths).
static_assert(32 % BITS == 0, "values within 32-bit words");
template <int N>
struct Seg {
    static constexpr int WORDS = N * BITS / 32, G = GROUP < N ? GROUP : N, NG = N / G;
    u32 q[WORDS];
    float s[NG], b[NG];
};

template <int N>
__device__ __forceinline__ void load_seg(Seg<N>& sg, const u32* __restrict__ wrow, const scale_t* __restrict__ srow,
                                         const scale_t* __restrict__ brow, int k, bool ok) {
    const u32* p = wrow + k / (32 / BITS);
    if constexpr (Seg<N>::WORDS == 2) {
        const uint2 v = ok ? *reinterpret_cast<const uint2*>(p) : make_uint2(0u, 0u);
        sg.q[0] = v.x, sg.q[1] = v.y;
    } else {
#pragma unroll
        for (int u = 0; u < Seg<N>::WORDS / 4; u++) {
            const uint4 v = ok ? *reinterpret_cast<const uint4*>(p + 4 * u) : make_uint4(0u, 0u, 0u, 0u);
            sg.q[4 * u] = v.x, sg.q[4 * u + 1] = v.y, sg.q[4 * u + 2] = v.z, sg.q[4 * u + 3] = v.w;
        }
    }
#pragma unroll
    for (int i = 0; i < Seg<N>::NG; i++) {
        const int g = (k + i * Seg<N>::G) / GROUP;
        sg.s[i] = ok ? s2f(srow[g]) : 0.f;
        sg.b[i] = ok ? s2f(brow[g]) : 0.f;
    }
}

// Dequantize a segment (values k0.. of tile row r) into the swizzled w tile at `tile`.
template <int N>
__device__ __forceinline__ void store_seg(const Seg<N>& sg, u8* tile, int r, int k0) {
    u32 p[N / 2];
#pragma unroll
    for (int j = 0; j < N / 2; j++) {
        const int v0 = 2 * j, v1 = 2 * j + 1;
        const u32 q0 = (sg.q[(v0 * BITS) / 32] >> ((v0 * BITS) % 32)) & MASK;
        const u32 q1 = (sg.q[(v1 * BITS) / 32] >> ((v1 * BITS) % 32)) & MASK;
        const int g = v0 / Seg<N>::G;
        p[j] = dequant_pair(q0, q1, sg.s[g], sg.b[g]);
    }
#pragma unroll
    for (int i = 0; i < N / 8; i++)
        *reinterpret_cast<uint4*>(tile + swz(r, k0 / 8 + i)) = make_uint4(p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]);
}

template <bool OUT_F32, bool IN_FLIGHT>
__device__ __forceinline__ void qgemm_wg_body(const u32* __restrict__ w, const scale_t* __restrict__ ws,
                                              const scale_t* __restrict__ wb, const bf16_t* __restrict__ x,
                                              void* __restrict__ out, int rows, int cols, int m) {
    extern __shared__ u8 smem_raw[];
    u8* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
    const int r0 = blockIdx.x * WG_BN, t0 = blockIdx.y * WG_BM, nk = cols / WG_BK;

    // This thread's weight segment: tile row tid / 2, values (tid % 2)·32.. of each step.
    const int seg_r = tid >> 1, seg_k = (tid & 1) * SEG;
    const bool row_ok = r0 + seg_r < rows;
    const int wr = row_ok ? r0 + seg_r : 0;
    const int groups = cols / GROUP;
    const u32* wrow = w + (size_t)wr * (size_t)(cols / (32 / BITS));
    const scale_t* srow = ws + (size_t)wr * groups;
    const scale_t* brow = wb + (size_t)wr * groups;

    auto x_tile = [&](int st) { return smem + st * WG_STAGE; };
    auto w_tile = [&](int st) { return smem + st * WG_STAGE + WG_TILE; };
    auto load_x = [&](int st, int s) { copy_tile(x_tile(st), x, t0, m, cols, s, tid); };

    float acc[64], tot[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = tot[i] = 0.f;

    // The ring runs P steps ahead: STAGES - 1 where each step's MMAs are waited for before
    // the next step; STAGES - 2 where one step's group stays in flight (IN_FLIGHT), since a
    // stage is then free only two steps after its use. Prologue: steps 0 .. P-1 in their
    // stages (one copy group each), step P's weights in registers.
    constexpr int P = IN_FLIGHT ? STAGES - 2 : STAGES - 1;
    static_assert(P >= 1, "a step ahead at least");
    Seg<SEG> sg;
#pragma unroll
    for (int st = 0; st < P; st++) {
        if (st < nk) {
            load_x(st, st);
            load_seg(sg, wrow, srow, brow, st * WG_BK + seg_k, row_ok);
            store_seg(sg, w_tile(st), seg_r, seg_k);
        }
        cp_async_commit();
    }
    if (P < nk) load_seg(sg, wrow, srow, brow, P * WG_BK + seg_k, row_ok);

    // A chunk's steps unrolled: the accumulators are touched only by the MMAs between a
    // chunk's first step and its end, so no control flow merges with a group in flight
    // (ptxas would wait for it there).
    constexpr int SPC = CHUNK_K / WG_BK;  // steps a chunk
    for (int s0 = 0; s0 < nk; s0 += SPC) {
#pragma unroll
        for (int j = 0; j < SPC; j++) {
            const int s = s0 + j, st = s % STAGES;
            if (s < nk) {
                cp_async_wait<P - 1>();  // step s's copies (groups of later steps may be in flight)
                fence_async_smem();      // this thread's tile writes, visible to the tensor cores
                __syncthreads();         // and every warpgroup's MMAs of stage (s + P) % STAGES done
                issue_step(acc, smem_u32(x_tile(st)) + wg * 64 * 128, smem_u32(w_tile(st)));
                // Under the MMAs: step s+P's weights (loaded last iteration) into the stage
                // step s+P-STAGES used, its x copies, and step s+P+1's weights into registers.
                const int sn = s + P, stn = sn % STAGES;
                if (sn < nk) {
                    store_seg(sg, w_tile(stn), seg_r, seg_k);
                    load_x(stn, sn);
                }
                cp_async_commit();
                if (sn + 1 < nk) load_seg(sg, wrow, srow, brow, (sn + 1) * WG_BK + seg_k, row_ok);
                if (IN_FLIGHT) wg_wait1();  // step s-1's group (this step's stays in flight)
                else wg_wait0();
                pin(acc);
            }
        }
        drain_chunk(acc, tot);
    }

    store_out<OUT_F32>(tot, out, rows, m, r0, t0 + 64 * wg + 16 * warp + (lane >> 2), lane);
}

#define QGEMM_WG(name, in_flight)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                       \
        name(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, bf16_t* out, int rows, int cols, \
             int m) {                                                                                          \
        qgemm_wg_body<false, in_flight>(w, s, b, x, out, rows, cols, m);                                        \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                       \
        name##_f32(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, float* out, int rows,     \
                   int cols, int m) {                                                                          \
        qgemm_wg_body<true, in_flight>(w, s, b, x, out, rows, cols, m);                                         \
    }
QGEMM_WG(qgemm_wg, false)
QGEMM_WG(qgemm_wg_if, true)
