// Tensor-core GEMM for affine weights, the prefill path: out[t, r] = Σ_k x[t, k]·w[r, k] with
// w = scale·q + bias (MLX layout, decoded exactly as affine.cu's qmv). Compiled per (BITS ∈
// {2,4,8}, GROUP ∈ {16..128}, SCALE_T) with -D defines. Launcher and limits: backend/cuda/gemm.rs;
// CPU reference: backend/cpu/matmul.rs.
//
// Design. A block of 128 threads (4 warps) owns a tile of BM = 64 tokens × BN = 64 output rows
// and walks K in steps of BK = 64 values, two shared-memory stages deep:
//   - x tile [64 tokens][64 k] bf16: cp.async 16-byte copies straight into shared memory,
//     zero-filled past the last token and past cols (src-size 0).
//   - w tile [64 rows][64 k]: each thread owns 32 consecutive values of one row (BITS u32
//     words: one 8-byte load at 2 bits, one 16-byte load at 4, two at 8) and their 1–2
//     scale/bias pairs; it dequantizes them in f32 (scale·q + bias, q made exact with the
//     2^23 magic-number trick) and stores them as bf16 (round to nearest even, as f2bf).
//     Rows past `rows` and values past cols become zeros.
//   - Step s: issue the x copies and the global weight loads for step s+1, run the MMAs of
//     step s from the other stage, then dequantize step s+1's words into shared memory, wait
//     for the copies and __syncthreads. So global latency hides behind the MMAs.
//   - Warp (wm, wn) = (warp & 1, warp >> 1) computes tokens wm·32.. +32 × rows wn·32.. +32:
//     2 m16 tiles × 4 n8 tiles of mma.sync.m16n8k16 (bf16 in, f32 accumulators, 32 floats per
//     thread), 4 k16 steps per BK.
//   - The accumulators restart from zero every CHUNK_K = 256 values (four steps) and are
//     added into totals in chunk order: qgemm.cuh's arithmetic, which the few-token kernels
//     (gemm_small.cuh, included at the end) share bit for bit.
//   - Shared rows are padded to LDS = 72 bf16 (144 bytes): rows stay 16-byte aligned, and the
//     8 row addresses of each ldmatrix phase fall in 8 distinct 16-byte bank groups (144·i mod
//     128 = 16·i), as do the 16-byte dequant stores (8 lanes = 4 rows × 2 halves).
//   - Epilogue: f32 totals written with bounds checks (t < m, r < rows), as bf16 or f32;
//     pairs of columns go out as one 4/8-byte store where rows is even.
//   - qgemm_glu, the prefill MLP's gate and up in one launch: a block's 64 weight rows are 32
//     rows of gate and the same 32 rows of up, so warps wn = 0 hold gate's sums and wn = 1
//     up's for the same outputs; up's go through shared memory and wn = 0 stores
//     act(gate)·up as bf16 (f32 sums, no bf16 round trip of gate and up, and neither is
//     written out).
//
// Fragment layouts relied on (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type", .bf16; groupID g = lane >> 2, threadID_in_group tg = lane % 4; each .b32 register holds
// two bf16, the lower-indexed element in the low half):
//   A (16×16, row-major, [token][k]): a-reg 0: row g,   k 2tg..2tg+1;   a-reg 1: row g+8, k 2tg..;
//                                     a-reg 2: row g,   k 2tg+8..;      a-reg 3: row g+8, k 2tg+8..
//   B (16×8, "col": element (k, n) stored at [n][k] — exactly the weight layout [row][k]):
//                                     b-reg 0: k 2tg..2tg+1, n g;       b-reg 1: k 2tg+8.., n g
//   C/D (16×8 f32): c0, c1: row g, n 2tg, 2tg+1;  c2, c3: row g+8, n 2tg, 2tg+1.
// ldmatrix.x4 (m8n8, b16): lane 8·j + i supplies the address of row i of matrix j (16 bytes);
// register j of lane l receives row l/4, elements 2·(l%4), 2·(l%4)+1 of matrix j — i.e. the
// A/B register layouts above when matrix j is the 8×8 block that register j covers:
//   A: matrices (rows 0–7, k 0–7), (rows 8–15, k 0–7), (rows 0–7, k 8–15), (rows 8–15, k 8–15)
//      → lane l addresses row (l & 15), k 8·(l >> 4).
//   B, two n8 tiles at once: (n 0–7, k 0–7), (n 0–7, k 8–15), (n 8–15, k 0–7), (n 8–15, k 8–15)
//      → lane l addresses n (l & 7) + 8·(l >> 4), k 8·((l >> 3) & 1).
// cvt.rn.bf16x2.f32 d, a, b puts a in the upper half of d and b in the lower.
#include "common.cuh"
#include "affine.cuh"
#include "mma.cuh"
#include "qgemm.cuh"


#define BN 64       // output rows per block
#define BK 64       // k values per step
#define LDS 72      // shared row stride in bf16 (BK + 8 padding)

static_assert(CHUNK_K % BK == 0 && BK == KSTEP_ALIGN, "whole steps per chunk; steps padded as qgemm.cuh says");

// A block shape: BM_ tokens (64, or 128 for the wide form) by BN rows, 2·BM_ threads (warps
// of 32 tokens × 32 rows: BM_/32 along the tokens, 2 along the rows), each dequantizing a
// SEG-value weight segment per step (32 or 16) and copying four 16-byte x chunks. The wide
// form keeps one weight stage (a barrier before each store) so its shared memory stays
// under the 48 KiB of a static allocation.
template <int BM_>
struct Tile {
    static constexpr int THREADS = 2 * BM_;
    static constexpr int SEG = BN * BK / THREADS;
    static constexpr int SEG_G = GROUP < SEG ? GROUP : SEG;  // values per scale inside a segment
    static constexpr int NSG = SEG / SEG_G;                   // scale/bias pairs per segment (1 or 2)
    static constexpr int WARPS_M = BM_ / 32;
    static constexpr int W_STAGES = BM_ == 64 ? 2 : 1;
    static_assert(BM_ * BK / 8 == 4 * THREADS, "four x copies per thread");
    static_assert(SEG == 32 || SEG == 16, "a segment is whole 16-byte (or 8-byte at 2 bits) loads");
    static_assert((2 * BM_ + W_STAGES * BN) * LDS * 2 <= 48 * 1024, "static shared memory");
};

// One thread's weight segment for a step, as loaded from global memory (dequantized later,
// after the MMAs, so the loads' latency is hidden).
template <int SEG, int NSG>
struct WSeg {
    u32 q[SEG * BITS / 32];
    scale_t s[NSG], b[NSG];
};

template <int SEG, int NSG>
__device__ __forceinline__ void load_wseg(WSeg<SEG, NSG>& ws, const u32* __restrict__ wrow,
                                          const scale_t* __restrict__ srow, const scale_t* __restrict__ brow, int k,
                                          bool valid) {
    constexpr int WORDS = SEG * BITS / 32;
    constexpr int SEG_G = SEG / NSG;
    if (valid) {
        // k is a multiple of SEG: whole words, aligned to the load's size.
        const u32* p = wrow + k / (32 / BITS);
        if constexpr (WORDS == 1) {
            ws.q[0] = *p;
        } else if constexpr (WORDS == 2) {
            uint2 v = *reinterpret_cast<const uint2*>(p);
            ws.q[0] = v.x, ws.q[1] = v.y;
        } else {
#pragma unroll
            for (int u = 0; u < WORDS / 4; u++) {
                uint4 v = *reinterpret_cast<const uint4*>(p + 4 * u);
                ws.q[4 * u] = v.x, ws.q[4 * u + 1] = v.y, ws.q[4 * u + 2] = v.z, ws.q[4 * u + 3] = v.w;
            }
        }
#pragma unroll
        for (int i = 0; i < NSG; i++) {
            int g = (k + i * SEG_G) / GROUP;
            ws.s[i] = srow[g];
            ws.b[i] = brow[g];
        }
    } else {
        // scale = bias = 0: the segment dequantizes to zeros.
#pragma unroll
        for (int i = 0; i < WORDS; i++) ws.q[i] = 0;
#pragma unroll
        for (int i = 0; i < NSG; i++) ws.s[i] = ws.b[i] = (scale_t)0;
    }
}

// Dequantize a segment and store it as bf16 at dst (16-byte aligned).
template <int SEG, int NSG>
__device__ __forceinline__ void store_wseg(const WSeg<SEG, NSG>& ws, bf16_t* dst) {
    constexpr int SEG_G = SEG / NSG;
    float sc[NSG], bi[NSG];
#pragma unroll
    for (int i = 0; i < NSG; i++) sc[i] = s2f(ws.s[i]), bi[i] = s2f(ws.b[i]);
    u32 p[SEG / 2];
#pragma unroll
    for (int j = 0; j < SEG / 2; j++) {
        const int v0 = 2 * j, v1 = 2 * j + 1;  // value indices inside the segment
        const u32 q0 = (ws.q[(v0 * BITS) / 32] >> ((v0 * BITS) % 32)) & MASK;
        const u32 q1 = (ws.q[(v1 * BITS) / 32] >> ((v1 * BITS) % 32)) & MASK;
        const int g = v0 / SEG_G;  // v0 and v1 share a group (SEG_G is even)
        p[j] = dequant_pair(q0, q1, sc[g], bi[g]);
    }
    uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int i = 0; i < SEG / 8; i++) d[i] = make_uint4(p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]);
}

// f(i, j, h, tl, c) for each pair of this thread's accumulators, acc[i][j][2h] and
// [2h + 1]: tile token tl, tile rows c and c + 1 (warp row wm; the layout above).
template <class F>
__device__ __forceinline__ void for_each_pair(int wm, int lane, F f) {
    const int g = lane >> 2, tg = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) f(i, j, h, wm * 32 + i * 16 + g + h * 8, j * 8 + tg * 2);
}

// qgemm_glu's epilogue: warps wn = 1 leave up's sums in shared memory (up_s: BM_ tokens × 32
// rows, padded; the x tiles' space, free after the last step's barrier), then warps wn = 0
// store act(gate)·up for the same tokens and rows. act 0 silu, 1 gelu (tanh).
template <int BM_>
__device__ __forceinline__ void glu_epilogue(const float (&acc)[2][4][4], float* up_s, bf16_t* __restrict__ out,
                                             int t0, int r0, int rows, int m, int act) {
    constexpr int US = BN / 2 + 1;  // padded row stride
    static_assert(BM_ * US * 4 <= 2 * BM_ * LDS * 2, "up's sums fit the x tiles' shared memory");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp % Tile<BM_>::WARPS_M, wn = warp / Tile<BM_>::WARPS_M;
    if (wn == 1) {
        for_each_pair(wm, lane, [&](int i, int j, int h, int tl, int c) {
            up_s[tl * US + c] = acc[i][j][2 * h];
            up_s[tl * US + c + 1] = acc[i][j][2 * h + 1];
        });
    }
    __syncthreads();
    if (wn == 1) return;
    const bool even = (rows & 1) == 0;
    for_each_pair(wm, lane, [&](int i, int j, int h, int tl, int c) {
        const int t = t0 + tl, r = r0 + c;
        if (t >= m) return;
        const float v0 = glu_value(acc[i][j][2 * h], up_s[tl * US + c], act);
        const float v1 = glu_value(acc[i][j][2 * h + 1], up_s[tl * US + c + 1], act);
        bf16_t* po = out + (size_t)t * rows + r;
        if (even) {
            if (r < rows) *reinterpret_cast<u32*>(po) = pack_bf16x2(v0, v1);
        } else {
            if (r < rows) po[0] = f2bf(v0);
            if (r + 1 < rows) po[1] = f2bf(v1);
        }
    });
}

// One affine matrix's arguments.
struct QMat {
    const u32* w;
    const scale_t* s;
    const scale_t* b;
};

// GLU: the gate/up form (see the design notes): `up` is the second matrix, act 0 silu, 1
// gelu (tanh), out bf16 [m, rows].
template <int BM_, bool OUT_F32, bool GLU = false>
__device__ __forceinline__ void qgemm_body(QMat gate, QMat up, const bf16_t* __restrict__ x, void* __restrict__ out,
                                           int rows, int cols, int m, int act = 0) {
    using T = Tile<BM_>;
    constexpr int THREADS = T::THREADS, SEG = T::SEG, WS = T::W_STAGES;
    // The x tiles' and w tiles' stages (uint4 so the rows are 16-byte aligned).
    __shared__ uint4 xs_raw[2][BM_ * LDS / 8];
    __shared__ uint4 ws_raw[WS][BN * LDS / 8];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % T::WARPS_M, wn = warp / T::WARPS_M;
    const int t0 = blockIdx.y * BM_, r0 = blockIdx.x * (GLU ? BN / 2 : BN);
    const int nk = (cols + BK - 1) / BK;

    // This thread's weight segment: row r0 + tid / (BK / SEG), values (tid % (BK / SEG))·SEG..
    // of each step. (GLU: tile rows 32.. are up's.)
    const int seg_row = tid / (BK / SEG), seg_k = (tid % (BK / SEG)) * SEG;
    const QMat& src = GLU && seg_row >= BN / 2 ? up : gate;
    const int wr = r0 + (GLU ? seg_row % (BN / 2) : seg_row);
    const bool wr_ok = wr < rows;
    const int wrc = wr_ok ? wr : 0;  // keep pointers inside the tensor for masked rows
    const int groups = cols / GROUP;
    const u32* wrow = src.w + (size_t)wrc * (size_t)(cols / (32 / BITS));
    const scale_t* srow = src.s + (size_t)wrc * groups;
    const scale_t* brow = src.b + (size_t)wrc * groups;

    // x copies: chunk c = tid + i·THREADS is token row c/8, k 8·(c%8) of the tile.
    auto load_x = [&](int stage, int k0) {
        bf16_t* xs = reinterpret_cast<bf16_t*>(xs_raw[stage]);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = tid + i * THREADS;
            const int row = c >> 3, kc = (c & 7) * 8;
            const int t = t0 + row, k = k0 + kc;
            const bool ok = t < m && k < cols;
            const bf16_t* src = ok ? x + (size_t)t * cols + k : x;
            cp_async16(smem_u32(xs + row * LDS + kc), src, ok);
        }
        cp_async_commit();
    };

    // ldmatrix addresses (bytes, stage 0, k 0) of this lane.
    const u32 xs_base = smem_u32(xs_raw[0]), ws_base = smem_u32(ws_raw[0]);
    const u32 xstage = BM_ * LDS * 2, wstage = WS == 2 ? BN * LDS * 2 : 0;
    u32 a_addr[2], b_addr[2];
#pragma unroll
    for (int i = 0; i < 2; i++)
        a_addr[i] = xs_base + ((wm * 32 + i * 16 + (lane & 15)) * LDS + (lane >> 4) * 8) * 2;
#pragma unroll
    for (int j = 0; j < 2; j++)
        b_addr[j] = ws_base + ((wn * 32 + j * 16 + (lane & 7) + ((lane >> 4) << 3)) * LDS + ((lane >> 3) & 1) * 8) * 2;

    // acc: the current CHUNK_K chunk's mma chain; tot: the chunks' sums in order (qgemm.cuh).
    float acc[2][4][4], tot[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = tot[i][j][e] = 0.f;

    WSeg<SEG, T::NSG> seg;
    // Prologue: stage 0 holds step 0.
    load_x(0, 0);
    load_wseg(seg, wrow, srow, brow, seg_k, wr_ok && seg_k < cols);
    store_wseg(seg, reinterpret_cast<bf16_t*>(ws_raw[0]) + seg_row * LDS + seg_k);
    cp_async_wait_all();
    __syncthreads();

    for (int s = 0; s < nk; s++) {
        const int cur = s & 1, wcur = WS == 2 ? cur : 0;
        const bool more = s + 1 < nk;
        if (more) {
            const int k0 = (s + 1) * BK;
            load_x(cur ^ 1, k0);
            load_wseg(seg, wrow, srow, brow, k0 + seg_k, wr_ok && k0 + seg_k < cols);
        }
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; i++)
                ldsm_x4(a_addr[i] + cur * xstage + kk * 2, a[i][0], a[i][1], a[i][2], a[i][3]);
#pragma unroll
            for (int j = 0; j < 2; j++)
                ldsm_x4(b_addr[j] + wcur * wstage + kk * 2, b[2 * j][0], b[2 * j][1], b[2 * j + 1][0],
                        b[2 * j + 1][1]);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) mma_bf16(acc[i][j], a[i], b[j][0], b[j][1]);
        }
        if (!more || (s + 1) % (CHUNK_K / BK) == 0) {
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) tot[i][j][e] += acc[i][j][e], acc[i][j][e] = 0.f;
        }
        if (WS == 1) __syncthreads();  // one weight stage: every warp has read it
        if (more) store_wseg(seg, reinterpret_cast<bf16_t*>(ws_raw[WS == 2 ? cur ^ 1 : 0]) + seg_row * LDS + seg_k);
        cp_async_wait_all();
        __syncthreads();
    }

    // Epilogue: c0, c1 at (token g, rows 2tg, 2tg+1), c2, c3 at token g + 8.
    const int g = lane >> 2, tg = lane & 3;
    if constexpr (GLU) {
        glu_epilogue<BM_>(tot, reinterpret_cast<float*>(xs_raw), reinterpret_cast<bf16_t*>(out), t0, r0, rows, m,
                          act);
        return;
    }
    const bool even = (rows & 1) == 0;
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int r = r0 + wn * 32 + j * 8 + tg * 2;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int t = t0 + wm * 32 + i * 16 + g + h * 8;
                if (t >= m) continue;
                const float v0 = tot[i][j][2 * h], v1 = tot[i][j][2 * h + 1];
                const size_t o = (size_t)t * rows + r;
                if (OUT_F32) {
                    float* po = reinterpret_cast<float*>(out) + o;
                    if (even) {
                        if (r < rows) *reinterpret_cast<float2*>(po) = make_float2(v0, v1);
                    } else {
                        if (r < rows) po[0] = v0;
                        if (r + 1 < rows) po[1] = v1;
                    }
                } else {
                    bf16_t* po = reinterpret_cast<bf16_t*>(out) + o;
                    if (even) {
                        if (r < rows) *reinterpret_cast<u32*>(po) = pack_bf16x2(v0, v1);
                    } else {
                        if (r < rows) po[0] = f2bf(v0);
                        if (r + 1 < rows) po[1] = f2bf(v1);
                    }
                }
            }
        }
    }
}

// grid (ceil(rows / 64), ceil(m / BM_)), block 2·BM_, static shared memory (36 / 45 KiB).
// Needs cols a multiple of 32 (the launcher checks); x, w, scales 16-byte aligned
// allocations. _w128: the wide form (128 tokens a block).
#define TILED_ENTRIES(SUFFIX, BM_)                                                                            \
    extern "C" __global__ void __launch_bounds__(2 * BM_)                                                     \
        qgemm##SUFFIX(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, bf16_t* out, int rows, \
                      int cols, int m) {                                                                      \
        qgemm_body<BM_, false>(QMat{w, s, b}, QMat{w, s, b}, x, out, rows, cols, m);                          \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(2 * BM_)                                                     \
        qgemm_f32##SUFFIX(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, float* out,        \
                          int rows, int cols, int m) {                                                        \
        qgemm_body<BM_, true>(QMat{w, s, b}, QMat{w, s, b}, x, out, rows, cols, m);                           \
    }                                                                                                         \
    /* out = act(x·gateᵀ) · (x·upᵀ), bf16 [m, rows]; grid (ceil(rows / 32), ceil(m / BM_)). */               \
    extern "C" __global__ void __launch_bounds__(2 * BM_)                                                     \
        qgemm_glu##SUFFIX(const u32* gw, const scale_t* gs, const scale_t* gb, const u32* uw,                 \
                          const scale_t* us, const scale_t* ub, const bf16_t* x, bf16_t* out, int rows,       \
                          int cols, int m, int act) {                                                         \
        qgemm_body<BM_, false, true>(QMat{gw, gs, gb}, QMat{uw, us, ub}, x, out, rows, cols, m, act);         \
    }
TILED_ENTRIES(, 64)
TILED_ENTRIES(_w128, 128)

// out = the affine matrix as bf16, each weight dequant_pair's value (the one every kernel
// here multiplies by), for gemm_wgmma.cu's kernels: one 32-bit word of one row a thread.
// Row r goes to out row r, or where half > 0 (the GLU form's gate and up interleaved by
// half rows) to (r / half)·2·half + up·half + r % half. cols a multiple of 32 / BITS.
extern "C" __global__ void dequant_bf16(const u32* __restrict__ w, const scale_t* __restrict__ ws,
                                        const scale_t* __restrict__ wb, bf16_t* __restrict__ out, int rows,
                                        int cols, int half, int up) {
    constexpr int VPW = 32 / BITS;  // values a word
    const size_t words = (size_t)rows * (cols / VPW);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
        const size_t k = i * VPW, r = k / cols, c = k % cols, g = r * (cols / GROUP) + c / GROUP;
        const size_t ro = half > 0 ? (r / half) * 2 * half + up * half + r % half : r;
        const u32 q = w[i];
        const float sc = s2f(ws[g]), bi = s2f(wb[g]);
        u32 p[VPW / 2];
#pragma unroll
        for (int j = 0; j < VPW / 2; j++)
            p[j] = dequant_pair((q >> (2 * j * BITS)) & MASK, (q >> ((2 * j + 1) * BITS)) & MASK, sc, bi);
        bf16_t* o = out + ro * cols + c;
        if constexpr (VPW == 8) {
            *reinterpret_cast<uint4*>(o) = make_uint4(p[0], p[1], p[2], p[3]);
        } else {
#pragma unroll
            for (int j = 0; j < VPW / 2; j++) reinterpret_cast<u32*>(o)[j] = p[j];
        }
    }
}

// The few-token kernels (m ≤ 64) with this arithmetic.
#include "gemm_small.cuh"
