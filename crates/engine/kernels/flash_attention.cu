// Causal prefill attention on tensor cores, flash-attention-2 style (launcher:
// backend/cuda/flash.rs; CPU reference: backend/cpu/attention.rs).
//
// q [m, heads·HD] bf16 at absolute positions pos0.. (pos0 read from device memory); the bf16
// cache [max_seq, n_kv·HD] per layer already holds this call's keys/values (kv_write ran
// first). Query row t of head h sees cached positions 0..=pos0+t of kv head h/(heads/n_kv)
// (with a window > 0, only the last `window` of them: a sliding-window layer).
// out [m, heads·HD] bf16. Scores scaled by `scale`; f32 scores, softmax and accumulators; the
// probabilities go to the P·V product as bf16.
//
// Grid (ceil(m/BQ), heads), block 128 = 4 warps. A block owns BQ = 64 query rows (latest
// block first: it has the most keys), each warp 16 of them. Its Q fragments stay in registers
// for the whole key loop, as do its O accumulators and the running max/sum of its rows. Key
// tiles of BKV positions run from 0 to the block's causal end kend = pos0 + min(m, q0+BQ):
//   wait for K tile; barrier; start the V tile's copy (cp.async)
//   S = Q·Kᵀ (mma), causal mask (key > pos0+t → −inf) where the tile crosses the diagonal,
//   and the window's (key ≤ pos0+t−window → −inf) where it crosses a window's start,
//   online softmax (row max over the quad of lanes holding a row), O *= correction
//   wait for V tile; barrier; start the next K tile's copy
//   O += P·V (mma), P taken straight from S's accumulator registers as bf16 A fragments
// so each copy overlaps the other half's math. Positions ≥ kend are zero-filled in shared
// memory, not read (they may lie past the cache). A warp skips the math of tiles wholly
// after its last row's diagonal or before its first row's window (the block still loads
// them for its other warps); tiles before every row's window are not loaded.
// Shared rows are padded by 8 bf16 (16 B): consecutive rows start 4 banks apart, so the 8
// row addresses of each ldmatrix phase hit all 32 banks once.
//
// Per HD (live fragment registers per thread: Q HD/4, O HD/2, S BKV/2; ptxas for sm_90,
// NVRTC 13.0, no spills):
//   HD 64:  BKV 64, smem 2·64·72·2 = 18 KB,  98 registers
//   HD 128: BKV 64, smem 2·64·136·2 = 34 KB, 176 registers
//   HD 256: BKV 32, smem 2·32·264·2 = 33 KB, 253 registers (O alone is 128; BKV 16 needs
//           as many)
//
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 fragments (PTX ISA, "Matrix Fragments
// for mma.m16n8k16 with floating point type"); g = lane>>2 (groupID), c = lane&3
// (threadID_in_group); each 32-bit register holds two bf16 (PTX's elements a0..a7, b0..b3
// in pairs), the lower column/row index in the low half:
//   A (16×16, row-major): a0 = A[g][2c..2c+1], a1 = A[g+8][2c..], a2 = A[g][2c+8..],
//                         a3 = A[g+8][2c+8..]
//   B (16×8, "col": stored n-major): b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]
//   C/D (16×8 f32): c0,c1 = C[g][2c], C[g][2c+1]; c2,c3 = C[g+8][2c], C[g+8][2c+1]
// Hence:
//   S = Q·Kᵀ: A = Q rows (loaded from global as 32-bit pairs), B(k=d, n=key) = K[key][d]:
//     the stored K row is contiguous in d, exactly B's layout. ldmatrix.x4 (no .trans) gives
//     lane l row l/4, columns 2(l%4)..+1 of each 8×8 matrix i whose row addresses come from
//     lanes 8i..8i+7: with rows = 8 keys and columns = 8 d that is b0 (d chunk base) and b1
//     (base+8); one x4 covers two 16-wide d chunks.
//   O += P·V: the C fragment of S's key columns 8j..8j+7 for j = 2kc, 2kc+1 is exactly the
//     A fragment of P's 16-key chunk kc: a0 = (c0,c1) of j=2kc, a1 = (c2,c3) of j=2kc,
//     a2 = (c0,c1) of j=2kc+1, a3 = (c2,c3) of j=2kc+1. B(k=key, n=d) = V[key][d] is
//     row-major, so ldmatrix.x4.trans (lane l gets stored rows 2(l%4)..+1 of column l/4)
//     with rows = 8 keys gives b0 (keys 16kc..+7), b1 (keys +8..+15) for two 8-wide d blocks.
#include "common.cuh"
#include "mma.cuh"

#ifndef HD
#error "flash_attention.cu is compiled with -D HD=64|128|256"
#endif
#if HD != 64 && HD != 128 && HD != 256
#error "flash_attention.cu: HD must be 64, 128 or 256"
#endif

#define NW 4               // warps per block
#define NT (32 * NW)       // threads per block
#define BQ (16 * NW)       // query rows per block
#if HD == 256
#define BKV 32             // key positions per tile
#else
#define BKV 64
#endif
#define STR (HD + 8)       // shared row stride in bf16

#ifndef KVQ
#define KVQ 0
#endif
#if KVQ
// A quantized store (kv_quant.cu's rows, compiled with its TURBO/KBITS/KSIGNED/VBITS): tiles
// are dequantized into shared memory as bf16 (keys scale·code + bias or (code + zero)·scale;
// TurboQuant values still rotated: Cuda::flash_prefill undoes the rotation of the output
// with kv_quant.cu's unrotate_rows). kc is the store's bytes, vc its table (centroids).
#define QG (TURBO ? 32 : 64)
#define K_CODES (HD * KBITS / 8)
#define K_BYTES (K_CODES + HD / QG * 4)
#define V_CODES (HD * VBITS / 8)
#define ROW_BYTES (K_BYTES + V_CODES + HD / QG * (TURBO ? 2 : 4))
#define KV_ARGS                                                                                \
    const unsigned char* __restrict__ kc, const u32* __restrict__ vc, const bf16_t* __restrict__ hk, \
        const bf16_t* __restrict__ hv, int head_row0
typedef unsigned char u8;

template <int BITS>
__device__ __forceinline__ u32 code_at(const u8* s, int i) {
    if (BITS == 8) return s[i];
    int at = i * BITS;
    u32 w = (u32)s[at >> 3] | ((u32)s[(at >> 3) + 1] << 8);
    return (w >> (at & 7)) & ((1u << BITS) - 1);
}
__device__ __forceinline__ float ld_half(const u8* p, bool bf) {
    unsigned short v = *reinterpret_cast<const unsigned short*>(p);
    return bf ? bf2f(v) : h2f(v);
}

// Rows kv0..kv0+BKV-1 of kv head kvh dequantized into s (keys, or values); rows past kend or
// of given-back blocks zeroed; a head block's row (store rows from head_row0 on, --kv-start;
// hk null: none) copied from hk / hv as it is. Plain loads and stores: the barriers that
// follow a load_tile's cp.async wait order them the same way.
__device__ __forceinline__ void load_tile_q(bf16_t* s, const u8* __restrict__ store, const u32* __restrict__ tab,
                                            const bf16_t* __restrict__ hk, const bf16_t* __restrict__ hv,
                                            int head_row0, bool values, int kv0, int kend, int n_kv, int kvh,
                                            const int* __restrict__ table) {
#pragma unroll 1
    for (int i = threadIdx.x; i < BKV * (HD / 8); i += NT) {
        int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
        int p = kv0 + r;
        int blk = p < kend ? table[p / KV_BLOCK] : -1;
        uint4 w = {0u, 0u, 0u, 0u};
        long rid = (long)blk * KV_BLOCK + p % KV_BLOCK;
        if (blk >= 0 && hk && rid >= head_row0) {
            w = *reinterpret_cast<const uint4*>((values ? hv : hk) + ((rid - head_row0) * n_kv + kvh) * HD + c);
        } else if (blk >= 0) {
            const u8* row = store + (rid * n_kv + kvh) * ROW_BYTES;
            int g = c / QG;
            float x[8];
            if (!values) {
#if TURBO
                float ks = ld_half(row + K_CODES + 4 * g, false), kz = ld_half(row + K_CODES + 4 * g + 2, false);
#else
                float ks = ld_half(row + K_CODES + 2 * g, true), kb = ld_half(row + K_CODES + 2 * (HD / 64 + g), true);
#endif
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    u32 q = code_at<KBITS>(row, c + j);
                    float cf = KSIGNED ? (float)(signed char)q : (float)q;
#if TURBO
                    x[j] = (cf + kz) * ks;
#else
                    x[j] = ks * cf + kb;
#endif
                }
            } else {
                const u8* v = row + K_BYTES;
#if TURBO
                float vs = ld_half(v + V_CODES + 2 * g, false);
#pragma unroll
                for (int j = 0; j < 8; j++) x[j] = __uint_as_float(__ldg(tab + 8 + code_at<VBITS>(v, c + j))) * vs;
#else
                float vs = ld_half(v + V_CODES + 2 * g, true), vb = ld_half(v + V_CODES + 2 * (HD / 64 + g), true);
#pragma unroll
                for (int j = 0; j < 8; j++) x[j] = vs * (float)code_at<VBITS>(v, c + j) + vb;
#endif
            }
            w.x = pack_bf16x2(x[0], x[1]);
            w.y = pack_bf16x2(x[2], x[3]);
            w.z = pack_bf16x2(x[4], x[5]);
            w.w = pack_bf16x2(x[6], x[7]);
        }
        *reinterpret_cast<uint4*>(s + r * STR + c) = w;
    }
}
#define LOAD_K(s, kv0) load_tile_q(s, kc, vc, hk, hv, head_row0, false, kv0, kend, n_kv, kvh, table)
#define LOAD_V(s, kv0) load_tile_q(s, kc, vc, hk, hv, head_row0, true, kv0, kend, n_kv, kvh, table)
#else
#define KV_ARGS const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc
#define LOAD_K(s, kv0) load_tile(s, kc, kv0, kend, width, kvh, table)
#define LOAD_V(s, kv0) load_tile(s, vc, kv0, kend, width, kvh, table)
#endif

// Start copying key/value rows kv0..kv0+BKV-1 of kv head kvh into s; rows ≥ kend, and rows
// of blocks the sequence gave back (a sliding layer's, before every row's window: masked
// anyway), are zeroed.
__device__ __forceinline__ void load_tile(bf16_t* s, const bf16_t* __restrict__ cache, int kv0, int kend,
                                          long width, int kvh, const int* __restrict__ table) {
#pragma unroll 1   // unrolled, the precomputed addresses cost registers (HD 256 spills)
    for (int i = threadIdx.x; i < BKV * (HD / 8); i += NT) {
        int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
        int p = kv0 + r;
        int blk = p < kend ? table[p / KV_BLOCK] : -1;
        bool ok = blk >= 0;
        const bf16_t* src = cache + (ok ? (long)blk * KV_BLOCK + p % KV_BLOCK : 0) * width + (long)kvh * HD + c;
        cp_async16(smem_u32(s + r * STR + c), src, ok);
    }
    cp_async_commit();
}

extern "C" __global__ void __launch_bounds__(NT) flash_prefill(const bf16_t* __restrict__ q, KV_ARGS,
                                                               bf16_t* __restrict__ out, int m, int heads, int n_kv,
                                                               const int* __restrict__ pos0p, float scale,
                                                               int window, const int* __restrict__ table) {
    __shared__ __align__(16) bf16_t sk[BKV * STR];
    __shared__ __align__(16) bf16_t sv[BKV * STR];
    const int h = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const int kvh = h / (heads / n_kv);
    const long width = (long)n_kv * HD;
    const int pos0 = *pos0p;
    const int kend = pos0 + min(m, q0 + BQ);   // keys 0..kend-1 are seen by some row of the block
    const int ntiles = (kend + BKV - 1) / BKV;
    const int ra = q0 + warp * 16 + g;         // this lane's rows: ra and ra + 8
    const int lim_a = pos0 + ra, lim_b = lim_a + 8;    // their last visible key
    const int wfirst = pos0 + q0 + warp * 16;  // the warp's first row's last visible key
    const int wlast = wfirst + 15;             // and its last row's
    const float sl2 = 1.4426950408889634f * scale;   // scale · log2(e): exp via exp2
    // The window: each row's first visible key, the warp's lowest, the block's first tile.
    const int lo_a = window > 0 ? lim_a - window + 1 : 0, lo_b = window > 0 ? lim_b - window + 1 : 0;
    const int wlow = window > 0 ? wfirst - window + 1 : 0, whigh = window > 0 ? wlast - window + 1 : 0;
    const int tile0 = window > 0 ? max(0, pos0 + q0 - window + 1) / BKV : 0;

    // Q fragments for HD/16 chunks of 16 d (rows ≥ m read as zero).
    u32 qf[HD / 16][4];
    {
        const bf16_t* qa = q + ((long)min(ra, m - 1) * heads + h) * HD;
        const bf16_t* qb = q + ((long)min(ra + 8, m - 1) * heads + h) * HD;
        const bool va = ra < m, vb = ra + 8 < m;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            int d = kk * 16 + 2 * c;
            qf[kk][0] = va ? *(const u32*)(qa + d) : 0u;
            qf[kk][1] = vb ? *(const u32*)(qb + d) : 0u;
            qf[kk][2] = va ? *(const u32*)(qa + d + 8) : 0u;
            qf[kk][3] = vb ? *(const u32*)(qb + d + 8) : 0u;
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int dn = 0; dn < HD / 8; dn++) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
    float mx_a = -INFINITY, mx_b = -INFINITY;  // running max of the raw scores, rows ra / ra+8
    float l_a = 0.f, l_b = 0.f;                // this lane's part of the running sums

    // Per-lane ldmatrix row offsets (bf16 elements): K (no .trans): matrix lane>>3 is the
    // 8-d block (lane>>3)·8 of keys lane&7; V (.trans): keys (lane&7) + 8·((lane>>3)&1),
    // d block 8·(lane>>4).
    const int k_off = (lane & 7) * STR + (lane >> 3) * 8;
    const int v_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * STR + (lane >> 4) * 8;
    const u32 sk_base = smem_u32(sk) + 2 * k_off, sv_base = smem_u32(sv) + 2 * v_off;

    LOAD_K(sk, tile0 * BKV);
    for (int it = tile0; it < ntiles; it++) {
        const int kv0 = it * BKV;
        cp_async_wait_all();
        __syncthreads();   // K tile in; every warp is done with the previous V tile
        LOAD_V(sv, kv0);
        // warp-uniform: some row of the warp sees this tile
        const bool active = kv0 <= wlast && kv0 + BKV - 1 >= wlow;
        u32 pf[BKV / 16][4];                // P as A fragments, per 16-key chunk
        if (active) {
            float s[BKV / 8][4];
#pragma unroll
            for (int j = 0; j < BKV / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk += 2) {
#pragma unroll
                for (int j = 0; j < BKV / 8; j++) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(sk_base + 2 * (j * 8 * STR + kk * 16), b0, b1, b2, b3);
                    mma_bf16(s[j], qf[kk], b0, b1);
                    mma_bf16(s[j], qf[kk + 1], b2, b3);
                }
            }
            // the tile crosses the diagonal or the window's start of some row
            if (kv0 + BKV - 1 > wfirst || kv0 < whigh) {
#pragma unroll
                for (int j = 0; j < BKV / 8; j++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        int key = kv0 + j * 8 + 2 * c + e;
                        if (key > lim_a || key < lo_a) s[j][e] = -INFINITY;
                        if (key > lim_b || key < lo_b) s[j][2 + e] = -INFINITY;
                    }
                }
            }
            float mn_a = mx_a, mn_b = mx_b;
#pragma unroll
            for (int j = 0; j < BKV / 8; j++) {
                mn_a = fmaxf(mn_a, fmaxf(s[j][0], s[j][1]));
                mn_b = fmaxf(mn_b, fmaxf(s[j][2], s[j][3]));
            }
            // the 4 lanes of a quad (same g) hold one row
            mn_a = fmaxf(mn_a, __shfl_xor_sync(0xffffffffu, mn_a, 1));
            mn_a = fmaxf(mn_a, __shfl_xor_sync(0xffffffffu, mn_a, 2));
            mn_b = fmaxf(mn_b, __shfl_xor_sync(0xffffffffu, mn_b, 1));
            mn_b = fmaxf(mn_b, __shfl_xor_sync(0xffffffffu, mn_b, 2));
            // a row that has seen no key yet keeps max −inf: subtract 0 so exp2 gives 0, not NaN
            const float ms_a = mn_a == -INFINITY ? 0.f : mn_a * sl2;
            const float ms_b = mn_b == -INFINITY ? 0.f : mn_b * sl2;
            const float corr_a = exp2f(mx_a * sl2 - ms_a), corr_b = exp2f(mx_b * sl2 - ms_b);
            mx_a = mn_a;
            mx_b = mn_b;
            l_a *= corr_a;
            l_b *= corr_b;
#pragma unroll
            for (int dn = 0; dn < HD / 8; dn++) {
                o[dn][0] *= corr_a;
                o[dn][1] *= corr_a;
                o[dn][2] *= corr_b;
                o[dn][3] *= corr_b;
            }
#pragma unroll
            for (int j = 0; j < BKV / 8; j++) {
                float p0 = exp2f(fmaf(s[j][0], sl2, -ms_a)), p1 = exp2f(fmaf(s[j][1], sl2, -ms_a));
                float p2 = exp2f(fmaf(s[j][2], sl2, -ms_b)), p3 = exp2f(fmaf(s[j][3], sl2, -ms_b));
                l_a += p0 + p1;
                l_b += p2 + p3;
                pf[j / 2][(j & 1) * 2] = pack_bf16x2(p0, p1);       // row g: a0 (j even) / a2 (j odd)
                pf[j / 2][(j & 1) * 2 + 1] = pack_bf16x2(p2, p3);   // row g+8: a1 / a3
            }
        }
        cp_async_wait_all();
        __syncthreads();   // V tile in; every warp is done with this K tile
        if (it + 1 < ntiles) LOAD_K(sk, kv0 + BKV);
        if (active) {
#pragma unroll
            for (int kq = 0; kq < BKV / 16; kq++) {
#pragma unroll
                for (int dn = 0; dn < HD / 8; dn += 2) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(sv_base + 2 * (kq * 16 * STR + dn * 8), b0, b1, b2, b3);
                    mma_bf16(o[dn], pf[kq], b0, b1);
                    mma_bf16(o[dn + 1], pf[kq], b2, b3);
                }
            }
        }
    }

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
    if (ra < m) {
        u32* oa = (u32*)(out + ((long)ra * heads + h) * HD + 2 * c);
#pragma unroll
        for (int dn = 0; dn < HD / 8; dn++) oa[dn * 4] = pack_bf16x2(o[dn][0] * inv_a, o[dn][1] * inv_a);
    }
    if (ra + 8 < m) {
        u32* ob = (u32*)(out + ((long)(ra + 8) * heads + h) * HD + 2 * c);
#pragma unroll
        for (int dn = 0; dn < HD / 8; dn++) ob[dn * 4] = pack_bf16x2(o[dn][2] * inv_b, o[dn][3] * inv_b);
    }
}
