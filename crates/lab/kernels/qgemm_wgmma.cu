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
// qgemm_wg_dense reads the weights from a bf16 copy dequantized beforehand by dequant_bf16
// (the same values), so the consumers issue nothing but copies and MMAs: 1.56-1.91x the
// product's GEMM at the 8B shapes on an H100 through six stages, its bits (perf-log.md
// Session 55). Forms measured and gone: four stages, each step waited for, and a producer
// warpgroup copying for two consumers through mbarriers (perf.md's table).
// Launch: grid (⌈rows/128⌉, ⌈m/128⌉) (the dense form: (⌈m/128⌉, ⌈rows/128⌉)), block 256,
// dynamic shared memory WG_SMEM bytes (past 48 KiB: the function's attribute must allow
// it). cols a multiple of 64.
#include "common.cuh"
#include "affine.cuh"
#include "mma.cuh"
#include "qgemm.cuh"

typedef unsigned long long u64;
typedef unsigned char u8;

#define WG_BM 128                         // tokens per block (two warpgroups of 64)
#define WG_BN 128                         // weight rows per block (the wgmma's n)
#define WG_BK 64                          // k values per step: one 128-byte row
#ifndef STAGES
#define STAGES 4
#endif
#define WG_TILE (128 * 128)               // bytes of one 128-row tile
#define WG_STAGE (2 * WG_TILE)            // x tile, then w tile
#define WG_SMEM (STAGES * WG_STAGE + 1024)  // + alignment slack
#define SEG 32                            // weight values per thread per step (256 threads)

static_assert(WG_BN * WG_BK == 256 * SEG, "one segment per thread per step");
static_assert(CHUNK_K % WG_BK == 0, "whole steps per chunk");
static_assert(STAGES >= 3, "two stages ahead of the MMAs, or one with a step in flight");

// Byte offset of 16-byte chunk c of row r in a swizzled tile.
__device__ __forceinline__ u32 swz(int r, int c) { return (u32)(r * 128 + ((c ^ (r & 7)) << 4)); }

// wgmma's shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024
// bytes apart (the leading offset is unused by this layout).
__device__ __forceinline__ u64 wg_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Pin the accumulators' reads and writes to this point (the wgmma writes them asynchronously).
__device__ __forceinline__ void pin(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// d += A·B over one k16 step: A 64 tokens (descriptor a), B 128 weight rows (descriptor b).
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], u64 a, u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b));
}

// Step s's tile of a bf16 [n, cols] matrix (rows t0.., 64 values) into `tile` by cp.async
// from the block's 256 threads: 16-byte chunk c = tid + 256·i is tile row c/8, chunk c%8
// (zero-filled past n). x's tiles, and the dense form's weight tiles.
__device__ __forceinline__ void copy_tile(u8* tile, const bf16_t* __restrict__ a, int t0, int n, int cols, int s,
                                          int tid) {
    const u32 base = smem_u32(tile);
#pragma unroll
    for (int i = 0; i < WG_BM * 8 / 256; i++) {
        const int c = tid + 256 * i, r = c >> 3, ch = c & 7, t = t0 + r;
        const bool ok = t < n;
        cp_async16(base + swz(r, ch), ok ? a + (size_t)t * cols + s * WG_BK + ch * 8 : a, ok);
    }
}

// A step's four k16 MMAs into acc (the warpgroup's 64 tokens of the x tile at xa, the
// 128 rows of the w tile at wa), committed as one group.
__device__ __forceinline__ void issue_step(float (&acc)[64], u32 xa, u32 wa) {
    pin(acc);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < WG_BK / 16; kk++) wgmma_m64n128k16(acc, wg_desc(xa + 32 * kk), wg_desc(wa + 32 * kk));
    wg_commit();
}

// A chunk's end: its MMAs waited for, its sum added to the totals in order, acc restarted.
__device__ __forceinline__ void drain_chunk(float (&acc)[64], float (&tot)[64]) {
    wg_wait0();
    pin(acc);
#pragma unroll
    for (int i = 0; i < 64; i++) tot[i] += acc[i], acc[i] = 0.f;
}

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

// A warpgroup's f32 totals into out [m, rows]: this thread's tokens t_lane and t_lane + 8.
template <bool OUT_F32>
__device__ __forceinline__ void store_out(const float (&tot)[64], void* __restrict__ out, int rows, int m, int r0,
                                          int t_lane, int lane) {
#pragma unroll
    for (int j = 0; j < 16; j++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int t = t_lane + 8 * h, r = r0 + 8 * j + 2 * (lane & 3);
            if (t >= m) continue;
            const float v0 = tot[4 * j + 2 * h], v1 = tot[4 * j + 2 * h + 1];
            if constexpr (OUT_F32) {
                float* po = reinterpret_cast<float*>(out) + (size_t)t * rows + r;
                if (r < rows) po[0] = v0;
                if (r + 1 < rows) po[1] = v1;
            } else {
                bf16_t* po = reinterpret_cast<bf16_t*>(out) + (size_t)t * rows + r;
                if (r < rows) po[0] = f2bf(v0);
                if (r + 1 < rows) po[1] = f2bf(v1);
            }
        }
    }
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

// The dense form: the weights dequantized once into a bf16 [rows, cols] copy
// (dequant_bf16 below: the same dequant_pair, so the same values the tiles above hold),
// both tiles then by cp.async and nothing on the consumers' issue path but copies and
// MMAs; one step's MMAs in flight across the next (qgemm_wg_if's ring), STAGES - 2 steps
// of copies ahead. The chunked sums and the output are the shared form's.
template <bool OUT_F32>
__device__ __forceinline__ void qgemm_wg_dense_body(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x,
                                                    void* __restrict__ out, int rows, int cols, int m) {
    extern __shared__ u8 smem_raw[];
    u8* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
    // Token tiles fastest (grid (⌈m/128⌉, ⌈rows/128⌉)): the blocks of one weight tile run
    // together, so it comes from HBM about once and from L2 for the others.
    const int t0 = blockIdx.x * WG_BM, r0 = blockIdx.y * WG_BN, nk = cols / WG_BK;
    auto x_tile = [&](int st) { return smem + st * WG_STAGE; };
    auto w_tile = [&](int st) { return smem + st * WG_STAGE + WG_TILE; };
    auto load = [&](int st, int s) {
        copy_tile(x_tile(st), x, t0, m, cols, s, tid);
        copy_tile(w_tile(st), w, r0, rows, cols, s, tid);
    };
    float acc[64], tot[64];
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = tot[i] = 0.f;
    constexpr int P = STAGES - 2;  // a stage is free two steps after its use
#pragma unroll
    for (int st = 0; st < P; st++) {
        if (st < nk) load(st, st);
        cp_async_commit();
    }
    constexpr int SPC = CHUNK_K / WG_BK;
    for (int s0 = 0; s0 < nk; s0 += SPC) {
#pragma unroll
        for (int j = 0; j < SPC; j++) {
            const int s = s0 + j, st = s % STAGES;
            if (s < nk) {
                cp_async_wait<P - 1>();
                fence_async_smem();
                __syncthreads();
                issue_step(acc, smem_u32(x_tile(st)) + wg * 64 * 128, smem_u32(w_tile(st)));
                const int sn = s + P;
                if (sn < nk) load(sn % STAGES, sn);
                cp_async_commit();
                wg_wait1();
                pin(acc);
            }
        }
        drain_chunk(acc, tot);
    }
    store_out<OUT_F32>(tot, out, rows, m, r0, t0 + 64 * wg + 16 * warp + (lane >> 2), lane);
}

extern "C" __global__ void __launch_bounds__(256, 1)
    qgemm_wg_dense(const bf16_t* w, const bf16_t* x, bf16_t* out, int rows, int cols, int m) {
    qgemm_wg_dense_body<false>(w, x, out, rows, cols, m);
}
extern "C" __global__ void __launch_bounds__(256, 1)
    qgemm_wg_dense_f32(const bf16_t* w, const bf16_t* x, float* out, int rows, int cols, int m) {
    qgemm_wg_dense_body<true>(w, x, out, rows, cols, m);
}

// out [rows, cols] bf16 = the affine matrix dequantized as the GEMMs do (dequant_pair): one
// 32-bit word of one row a thread, its 32/BITS values stored as bf16 pairs.
extern "C" __global__ void dequant_bf16(const u32* __restrict__ w, const scale_t* __restrict__ ws,
                                        const scale_t* __restrict__ wb, bf16_t* __restrict__ out, int rows,
                                        int cols) {
    constexpr int VPW = 32 / BITS;  // values a word
    const size_t words = (size_t)rows * (cols / VPW);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
        const size_t k = i * VPW, r = k / cols, c = k % cols, g = r * (cols / GROUP) + c / GROUP;
        const u32 q = w[i];
        const float sc = s2f(ws[g]), bi = s2f(wb[g]);
        u32 p[VPW / 2];
#pragma unroll
        for (int j = 0; j < VPW / 2; j++)
            p[j] = dequant_pair((q >> (2 * j * BITS)) & MASK, (q >> ((2 * j + 1) * BITS)) & MASK, sc, bi);
        if constexpr (VPW == 8) {
            *reinterpret_cast<uint4*>(out + k) = make_uint4(p[0], p[1], p[2], p[3]);
        } else {
            u32* o = reinterpret_cast<u32*>(out + k);
#pragma unroll
            for (int j = 0; j < VPW / 2; j++) o[j] = p[j];
        }
    }
}
