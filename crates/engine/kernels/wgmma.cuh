// Hopper warpgroup MMA (wgmma, sm_90a only) over 128 × 64 bf16 tiles in shared memory:
// the helpers gemm_wgmma.cu's ring is built from (and crates/lab's qgemm_wgmma.cu forms).
// Needs common.cuh, mma.cuh (cp.async) and qgemm.cuh (CHUNK_K) included first.
//
// Tile layout: 128 rows × 64 bf16 (128 bytes a row) in wgmma's 128-byte swizzled K-major
// form: 16-byte chunk c of row r at r·128 + (c ^ r % 8)·16, the tile 1024-byte aligned, so
// a descriptor advances 32 bytes per k16 step. A warpgroup's m64n128k16 takes 64 token rows
// of one tile (A) and all 128 rows of the other (B).
// Accumulator layout (m64nN, f32): warp w of a warpgroup holds rows 16w + lane/4 (d[4j],
// d[4j+1], columns 8j + 2·(lane%4) + {0,1}) and 16w + lane/4 + 8 (d[4j+2], d[4j+3]).
#pragma once

typedef unsigned long long u64;
typedef unsigned char u8;

#define WG_BM 128            // tokens per block (two warpgroups of 64)
#define WG_BN 128            // weight rows per block (the wgmma's n)
#define WG_BK 64             // k values per step: one 128-byte row
#define WG_TILE (128 * 128)  // bytes of one 128-row tile

static_assert(CHUNK_K % WG_BK == 0, "whole steps per chunk");

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
// This thread's generic-proxy shared writes (and completed cp.async copies), visible to the
// tensor cores' async proxy.
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
// (zero-filled past n).
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

// A chunk's end (qgemm.cuh's chunking): its MMAs waited for, its sum added to the totals
// in order, acc restarted from zero.
__device__ __forceinline__ void drain_chunk(float (&acc)[64], float (&tot)[64]) {
    wg_wait0();
    pin(acc);
#pragma unroll
    for (int i = 0; i < 64; i++) tot[i] += acc[i], acc[i] = 0.f;
}

// Each (token, column pair) a thread holds, as f(t, c, i): token t_lane + 8h, columns
// c, c + 1 of the tile (c = 8j + 2·(lane%4)), their totals tot[i], tot[i + 1]. Columns
// 0..N-1 (N a multiple of 8).
template <int N, class F>
__device__ __forceinline__ void for_each_out_pair(int t_lane, int lane, F f) {
#pragma unroll
    for (int j = 0; j < N / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) f(t_lane + 8 * h, 8 * j + 2 * (lane & 3), 4 * j + 2 * h);
}

// A warpgroup's f32 totals into out [m, rows] (tile rows r0..): this thread's tokens t_lane
// and t_lane + 8. OUT_F32 stores f32; ADD (f32 out) adds each total rounded to bf16, as
// storing bf16 and elementwise.cu's add_f32_bf16 after it would; else bf16 is stored.
template <bool OUT_F32, bool ADD = false>
__device__ __forceinline__ void store_out(const float (&tot)[64], void* __restrict__ out, int rows, int m, int r0,
                                          int t_lane, int lane) {
    for_each_out_pair<WG_BN>(t_lane, lane, [&](int t, int c, int i) {
        const int r = r0 + c;
        if (t >= m) return;
        if constexpr (ADD) {
            float* po = reinterpret_cast<float*>(out) + (size_t)t * rows + r;
            if (r < rows) po[0] += bf2f(f2bf(tot[i]));
            if (r + 1 < rows) po[1] += bf2f(f2bf(tot[i + 1]));
        } else if constexpr (OUT_F32) {
            float* po = reinterpret_cast<float*>(out) + (size_t)t * rows + r;
            if (r < rows) po[0] = tot[i];
            if (r + 1 < rows) po[1] = tot[i + 1];
        } else {
            bf16_t* po = reinterpret_cast<bf16_t*>(out) + (size_t)t * rows + r;
            if (r < rows) po[0] = f2bf(tot[i]);
            if (r + 1 < rows) po[1] = f2bf(tot[i + 1]);
        }
    });
}
