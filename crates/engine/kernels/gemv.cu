// Decode GEMV (one token) for affine weights, fused with what surrounds it in a layer, so a
// decode step is a handful of launches per layer instead of a dozen:
//   input   b: bf16 x                    n: the f32 residual stream, RMS-normalized (g·x
//                                           staged, 1/rms applied to the row sums)
//           p: n with a post-norm add still pending (x + rmsnorm(y)·w, Gemma 3's)
//   output  b: bf16 store   f: f32 store   a: f32 add into the residual   s: SwiGLU of two
//           matrices (gate = mat 0, up = mat 1), bf16 store
// Up to three matrices share one launch (q/k/v): blocks are dealt out to them in order.
// Compiled per (BITS ∈ {2,4,8}, GROUP, SCALE_T) like affine.cu, and XQ; CPU reference:
// backend/cpu/matmul.rs (and ops.rs for the fused norm / add / SwiGLU).
//
// Where the time goes: a decode GEMV reads each weight byte once, so it must stream at HBM
// speed while spending few instructions per weight.
//  - x is staged once per block in shared memory (normalized there for input n) as bf16, or
//    as int16 with XQ, XOR-swizzled by 16-byte part so the 8 lanes of a shared-memory phase
//    hit distinct banks.
//  - Each warp computes R rows; every lane takes 16-byte weight chunks c = lane, lane+32, …
//    and reuses the x values of chunk c (in registers) for its R rows. A lane's loads for
//    one step (U chunks × R rows, with their scales and biases) form a tile, issued before
//    any of it is used: LIF 16-byte loads in flight per lane.
//  - Latency, not bandwidth, bounds the small matrices of a decode step (a 1B model's q/k/v
//    is 3.6 MB: ~1 µs of HBM time), so the first tile's loads go out before the kernel
//    waits for its input (pdl_wait: they overlap the previous kernel's tail and the launch
//    gap) and before x is staged, and each next tile is loaded before the current one is
//    used (PIPE), so a lane never waits a full DRAM latency between tiles.
//  - No int→float conversions (quarter-rate on sm_90): one byte_perm places a quantized
//    value q in the mantissa of a float v = A + q·B (A = 0.5, B = 2⁻⁸ for 2/4-bit with q in
//    byte 2; A = 1, B = 2⁻¹⁵ for 8-bit with q in byte 1). Per group, with Σ over its values,
//        Σ q·x = (Σ v·x − A·Σx) / B,  so  y += (scale/B)·Σv·x + (bias − scale·A/B)·Σx,
//    one PRMT + one FFMA per weight per row; Σx is shared by the R rows.
//  - XQ (the default): even so the math, not HBM, bounded the big matrices (a variant that
//    skipped it streamed the 1B head at 4.28 TB/s against 2.87 with it). So x is staged as
//    int16 with one f32 scale per 32 values (xd = max|x|/32767: a bf16 x keeps its 8
//    significant bits, unlike int8, which measured 1.4% error), and a DP2A instruction does
//    2 multiply-adds of quantized weight bytes by int16 x: for 4-bit, 3 mask/shift and 4
//    DP2A per 8 weights instead of 8 PRMT + 8 FFMA. Per group segment,
//        y += scale·Σ_blocks xd·Σq·xq + bias·Σx,
//    with Σx the exact f32 sum of the bf16 x (staged per 16 values). The int16 x is packed
//    in pairs in the order the masks take weight bytes out of a word.
#define TRACE_FILE 1
#include "common.cuh"
#include "affine.cuh"
#include "argmax.cuh"

#define VPC (128 / BITS)              // values per 16-byte weight chunk
#define NP (VPC / 8)                  // 16-byte x parts (8 bf16) per chunk
#define SUBG (VPC > GROUP ? GROUP : VPC)  // values per group segment inside a chunk
#define NSUB (VPC / SUBG)             // group segments per chunk
#define PPS (SUBG / 8)                // x parts per segment
#ifndef NW
#define NW 8                          // warps per block (8 measured best; a variant may define NW)
#endif
#ifndef LIF
#define LIF 8                         // 16-byte weight loads per lane per tile (half per matrix for SwiGLU)
#endif
#ifndef PDL_EARLY
#define PDL_EARLY 1                   // let the next kernel start at once (else from our last tile)
#endif
#ifndef PIPE
#define PIPE 1                        // load the next tile before using the current one
#endif
#ifndef XQ
#define XQ 1                          // x as int16 + DP2A (else bf16 x + f32 FMA); see below
#endif
#ifndef NT
#define NT 0                          // batched: NT tokens a block (blockIdx.y: which); 0: one
#endif

#if BITS == 8
#define MAGIC_Y 0x3F800000u
#define MAGIC_A 1.0f
#define MAGIC_INV_B 32768.0f
#else
#define MAGIC_Y 0x3F000000u
#define MAGIC_A 0.5f
#define MAGIC_INV_B 256.0f
#endif

// v = A + q·B from byte k of `bytes` (each byte one quantized value).
__device__ __forceinline__ float qv(u32 bytes, int k) {
#if BITS == 8
    return __uint_as_float(__byte_perm(bytes, MAGIC_Y, 0x7604 | (k << 4)));
#else
    return __uint_as_float(__byte_perm(bytes, MAGIC_Y, 0x7054 | (k << 8)));
#endif
}

// Physical index of 16-byte x part p of chunk c (bank-conflict-free reads, see above).
__device__ __forceinline__ int xpart(int c, int p) { return c * NP + (p ^ ((c * NP / 8) & (NP - 1))); }

// XQ shared-memory layout (cols % 32 == 0): int16 x (2·cols bytes; chunk c is NP 16-byte
// parts, swizzled as xpart), then xd (cols/32 f32 block scales), then xs16 (cols/16 f32
// sums of x). A weight word of 32/BITS values meets XW u32 (int16 pairs) of x.
#define XW (16 / BITS)
__device__ __forceinline__ u32* xq_u32(uint4* xs, int c, int t) {  // u32 t of chunk c
    return reinterpret_cast<u32*>(xs + xpart(c, t / 4)) + t % 4;
}
// acc + x.lo·q.byte0 + x.hi·q.byte1 (lo) or … q.byte2, q.byte3 (hi): x two int16, q bytes.
__device__ __forceinline__ int dp2a_lo(u32 x, u32 q, int acc) {
    int d;
    asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(q), "r"(acc));
    return d;
}
__device__ __forceinline__ int dp2a_hi(u32 x, u32 q, int acc) {
    int d;
    asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(q), "r"(acc));
    return d;
}
__device__ __forceinline__ u32 pair16(u32 a, u32 b) { return (a & 0xffffu) | b << 16; }

// Σ q·xq over weight word w (32/BITS values, value j at bits [BITS·j, BITS·j + BITS)) and
// its XW u32 of packed int16 x, added into (lo, hi); word_sum(lo, hi) is the exact total.
// 4-bit: hi takes the odd values' nibbles in place (w & 0xF0F0F0F0, i.e. 16·q, which the
// unsigned bytes of DP2A hold), so there is no shift per word, and hi, a multiple of 16
// (|hi| ≤ 16·240·32767 < 2³¹ per 32-value x block), is shifted once per x block. The two
// accumulators also halve the dependent DP2A chain. Other widths use lo alone.
__device__ __forceinline__ void word_dot(u32 w, const u32* x, int& lo, int& hi) {
#if BITS == 8  // bytes = values 0..3; x: (0,1) (2,3)
    lo = dp2a_hi(x[1], w, dp2a_lo(x[0], w, lo));
#elif BITS == 4  // lo bytes = values 0,2,4,6, hi bytes = 1,3,5,7; x: (0,2) (4,6) (1,3) (5,7)
    u32 l = w & 0x0F0F0F0Fu, h = w & 0xF0F0F0F0u;
    lo = dp2a_hi(x[1], l, dp2a_lo(x[0], l, lo));
    hi = dp2a_hi(x[3], h, dp2a_lo(x[2], h, hi));
#else  // byte b of (w >> 2k) & 0x03030303 = value 4b + k; x: (k, 4+k) (8+k, 12+k) for k = 0..3
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u32 b = (w >> (2 * k)) & 0x03030303u;
        lo = dp2a_hi(x[2 * k + 1], b, dp2a_lo(x[2 * k], b, lo));
    }
#endif
}
__device__ __forceinline__ int word_sum(int lo, int hi) { return BITS == 4 ? lo + (hi >> 4) : lo; }

// Σ v·x over the 8 values of x part p of a chunk (words = the chunk's 4 weight words).
__device__ __forceinline__ float part_dot(const u32 (&words)[4], int p, const float (&xf)[8]) {
    float d = 0.f;
#if BITS == 8
    u32 w0 = words[2 * p], w1 = words[2 * p + 1];  // values 8p..8p+3, 8p+4..8p+7
#pragma unroll
    for (int k = 0; k < 4; k++) {
        d = fmaf(qv(w0, k), xf[k], d);
        d = fmaf(qv(w1, k), xf[4 + k], d);
    }
#elif BITS == 4
    u32 w = words[p];  // nibble j = value 8p+j
    u32 lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;  // byte k: values 2k, 2k+1
#pragma unroll
    for (int k = 0; k < 4; k++) {
        d = fmaf(qv(lo, k), xf[2 * k], d);
        d = fmaf(qv(hi, k), xf[2 * k + 1], d);
    }
#else  // 2 bits: x part p = half-word (p & 1) of word p / 2
    u32 w = words[p >> 1] >> (16 * (p & 1));
    u32 b0 = w & 0x03030303u, b1 = (w >> 2) & 0x03030303u;  // byte k: values 4k, 4k+1
    u32 b2 = (w >> 4) & 0x03030303u, b3 = (w >> 6) & 0x03030303u;
#pragma unroll
    for (int k = 0; k < 2; k++) {  // a half-word holds bytes 0,1 of each bN
        d = fmaf(qv(b0, k), xf[4 * k], d);
        d = fmaf(qv(b1, k), xf[4 * k + 1], d);
        d = fmaf(qv(b2, k), xf[4 * k + 2], d);
        d = fmaf(qv(b3, k), xf[4 * k + 3], d);
    }
#endif
    return d;
}

struct Mat {
    const u32* w;
    const scale_t* s;
    const scale_t* b;
    void* o;
    int rows;
};

// Weights are read once: stream them past L1, and fetch whole 256-byte L2 sectors.
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

#include "x_stage.cuh"

#if XQ
#include "x_staged.cuh"
#endif

// The shape every tile shares: chunks and groups per row, the row stride in uint4, and
// the chunk a warp's tiles stop at (`end`: chunks, or the end of its K slice).
struct Shape {
    int chunks, groups;
    size_t stride;
    int end;
};

// x of one weight chunk (c), read from shared memory once and used for the R rows (and
// both SwiGLU matrices): segment() adds one group segment's scale·Σq·x + bias·Σx.
#if XQ
struct XChunk {
    static constexpr int NXB = VPC > 32 ? VPC / 32 : 1;  // x blocks per chunk
    static constexpr int WPS = SUBG * BITS / 32;          // weight words per group segment
    u32 xw[4 * NP];                                       // packed int16 x pairs
    float d[NXB], sx[NSUB];                               // x block scales, segment sums of x

    __device__ __forceinline__ void load(const uint4* xs, int c, int chunks) {
        const float* xd = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(xs) + 2 * chunks * VPC);
        const float* xs16 = xd + chunks * VPC / 32;
#pragma unroll
        for (int p = 0; p < NP; p++) {
            uint4 t = xs[xpart(c, p)];
            xw[4 * p] = t.x, xw[4 * p + 1] = t.y, xw[4 * p + 2] = t.z, xw[4 * p + 3] = t.w;
        }
#pragma unroll
        for (int b = 0; b < NXB; b++) d[b] = xd[(c * VPC) / 32 + b];
#pragma unroll
        for (int k = 0; k < NSUB; k++) {
            float t = 0.f;
#pragma unroll
            for (int e = 0; e < SUBG / 16; e++) t += xs16[(c * VPC + k * SUBG) / 16 + e];
            sx[k] = t;
        }
    }

    __device__ __forceinline__ float segment(const u32 (&words)[4], int k, float sc, float bi, float acc) const {
        float ds = 0.f;
        int lo = 0, hi = 0;
#pragma unroll
        for (int i = k * WPS; i < (k + 1) * WPS; i++) {
            word_dot(words[i], xw + i * XW, lo, hi);
            // the last word of an x block (or of the segment): scale it
            if ((i + 1) * NXB / 4 != i * NXB / 4 || i + 1 == (k + 1) * WPS) {
                ds = fmaf(d[i * NXB / 4], (float)word_sum(lo, hi), ds);
                lo = hi = 0;
            }
        }
        return fmaf(sc, ds, fmaf(bi, sx[k], acc));
    }
};
#else
struct XChunk {
    float xv[NP][8], sx[NSUB];  // bf16 x as f32, segment sums of x

    __device__ __forceinline__ void load(const uint4* xs, int c, int) {
#pragma unroll
        for (int p = 0; p < NP; p++) unpack_bf16x8(xs[xpart(c, p)], xv[p]);
#pragma unroll
        for (int k = 0; k < NSUB; k++) {
            float t = 0.f;
#pragma unroll
            for (int p = k * PPS; p < (k + 1) * PPS; p++)
#pragma unroll
                for (int j = 0; j < 8; j++) t += xv[p][j];
            sx[k] = t;
        }
    }

    __device__ __forceinline__ float segment(const u32 (&words)[4], int k, float sc, float bi, float acc) const {
        float d = 0.f;
#pragma unroll
        for (int p = k * PPS; p < (k + 1) * PPS; p++) d += part_dot(words, p, xv[p]);
        return fmaf(sc * MAGIC_INV_B, d, fmaf(bi - sc * (MAGIC_A * MAGIC_INV_B), sx[k], acc));
    }
};
#endif

// Where a Tile's loads come from. Global memory: matrix a (and bm, SwiGLU's second),
// rows clamped to the matrix; weights past L1 (ld_weights).
struct TileFromGlobal {
    const Mat &a, &bm;
    const Shape& sh;
    __device__ __forceinline__ const Mat& mat(int m) const { return m == 0 ? a : bm; }
    __device__ __forceinline__ int row(int m, int r) const { return min(r, mat(m).rows - 1); }
    __device__ __forceinline__ uint4 chunk(int m, int row, int c) const {
        return ld_weights(reinterpret_cast<const uint4*>(mat(m).w) + (size_t)row * sh.stride + c);
    }
    __device__ __forceinline__ scale_t scale(int m, int row, int g) const {
        return __ldg(mat(m).s + (size_t)row * sh.groups + g);
    }
    __device__ __forceinline__ scale_t bias(int m, int row, int g) const {
        return __ldg(mat(m).b + (size_t)row * sh.groups + g);
    }
};

// One lane's loads for one step of one warp: chunks c0 + 32u (u < U) of rows row0..+R-1
// of matrix a (and of matrix b for SwiGLU), with the scale and bias of each group segment.
template <int R, bool TWO, int L = LIF>
struct Tile {
    static constexpr int NM = TWO ? 2 : 1;
    static constexpr int U = L / NM / R > 0 ? L / NM / R : 1;
    uint4 q[NM][U][R];
    scale_t s[NM][U][R][NSUB], b[NM][U][R][NSUB];

    // Load chunks c0 + 32u (u < U) of rows row0 … row0 + R - 1 of each matrix, with the
    // scale and bias of each group segment, from `src` (TileFromGlobal).
    // Chunks past the row end are not loaded (and not used); src.row clamps rows past the
    // end to the last (computed, never stored).
    template <class Src>
    __device__ __forceinline__ void fill(const Src& src, int row0, int c0, const Shape& sh) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + 32 * u;
            if (c >= sh.end) break;
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < R; r++) {
                    int row = src.row(m, row0 + r);
                    q[m][u][r] = src.chunk(m, row, c);
#pragma unroll
                    for (int k = 0; k < NSUB; k++) {
                        int g = (c * VPC + k * SUBG) / GROUP;  // the segment's group in its row
                        s[m][u][r][k] = src.scale(m, row, g);
                        b[m][u][r][k] = src.bias(m, row, g);
                    }
                }
        }
    }

    // acc[m][r] += this tile's part of the dot products (lane-partial sums).
    __device__ __forceinline__ void dot(const uint4* xs, int c0, const Shape& sh, float (&acc)[2][R]) const {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + 32 * u;
            if (c >= sh.end) break;
            XChunk x;
            x.load(xs, c, sh.chunks);
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < R; r++) {
                    u32 words[4] = {q[m][u][r].x, q[m][u][r].y, q[m][u][r].z, q[m][u][r].w};
#pragma unroll
                    for (int k = 0; k < NSUB; k++)
                        acc[m][r] = x.segment(words, k, s2f(s[m][u][r][k]), s2f(b[m][u][r][k]), acc[m][r]);
                }
        }
    }
};

// Which matrix block step `b` falls in (blocks are dealt to m0, m1, m2 in order), and the
// first row of this warp's R rows there.
template <int R, int OUT, int KS = 1>
__device__ __forceinline__ void locate(int b, int b0, int b1, const Mat& m0, const Mat& m1, const Mat& m2, Mat& a,
                                       int& row0) {
    a = m0;
    if (OUT != 3) {
        if (b >= b0 + b1) { a = m2; b -= b0 + b1; }
        else if (b >= b0) { a = m1; b -= b0; }
    }
    row0 = b * (NW / KS) * R + (threadIdx.x >> 5) / KS * R;
}

// The end of a warp's row step: reduce its lane-partial sums (acc) and store rows row0 …
// row0 + R - 1 that exist, as OUT says (0 bf16, 1 f32, 2 f32 added to `resid`, the row's
// x read earlier by lane r, 3 SwiGLU bf16; `vals`, where given: each row's stored value
// as f32 too, for stage_step; `scale`: what every sum is multiplied by first, the RMSNorm
// factor stage_x deferred).
template <int R, int OUT, bool GELU = false>
__device__ __forceinline__ void store_rows(const Mat& a, int row0, float (&acc)[2][R], float resid, int lane,
                                           float* vals = nullptr, float scale = 1.f) {
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[m][r] = warp_sum(acc[m][r]) * scale;
    // Lane r stores row0 + r (every lane holds every sum): R rows in one store instruction
    // instead of R after one another.
    float own = 0.f, own1 = 0.f;
#pragma unroll
    for (int r = 0; r < R; r++)
        if (lane == r) own = acc[0][r], own1 = acc[1][r];
    int row = row0 + lane;
    if (lane >= R || row >= a.rows) return;
    if (OUT == 0) reinterpret_cast<bf16_t*>(a.o)[row] = f2bf(own);
    else if (OUT == 1) reinterpret_cast<float*>(a.o)[row] = own;
    else if (OUT == 2) reinterpret_cast<float*>(a.o)[row] = resid + own;
    else {
        // SwiGLU, or GeGLU with gelu's tanh form (common.cuh).
        float act = GELU ? gelu_tanh(own) : silu(own);
        bf16_t h = f2bf(act * own1);
        reinterpret_cast<bf16_t*>(a.o)[row] = h;
        if (vals) vals[lane] = bf2f(h);
    }
}

// K slices (gemv's KS): warps ks = 1 … KS-1 of a row group leave their lane partials in
// shared memory; after one block barrier warp ks = 0 adds them lane by lane in slice
// order (deterministic) and goes on to the row's warp sum and store. Two buffers taking
// turns by step, so the next step's writes cannot meet this step's reads (a warp writes
// step s + 2 only after the barrier of step s + 1, which the readers of step s reach
// after reading).
template <int R, int KS>
__device__ __forceinline__ void ks_merge(float (&acc)[2][R], int ks, int lane, int buf) {
    __shared__ float part[2][NW][R][32];
    int warp = threadIdx.x >> 5;
    if (ks > 0) {
#pragma unroll
        for (int r = 0; r < R; r++) part[buf][warp][r][lane] = acc[0][r];
    }
    BLOCK_SYNC();
    if (ks == 0) {
#pragma unroll
        for (int j = 1; j < KS; j++)
#pragma unroll
            for (int r = 0; r < R; r++) acc[0][r] += part[buf][warp + j][r][lane];
    }
}

// How a GEMV phase starts once its first weight tile is in flight, and lets the next
// kernel start, and which row steps a block takes. A kernel of its own waits for the
// previous kernel (PDL); a block takes steps blockIdx.x, + gridDim.x, … (persistent blocks:
// x is staged once per block).
struct KernelSync {
    __device__ __forceinline__ void trigger() const { pdl_trigger(); }
    __device__ __forceinline__ void wait() const { pdl_wait(); }
    __device__ __forceinline__ int first_step() const { return blockIdx.x; }
    __device__ __forceinline__ int next_step(int b) const { return b + gridDim.x; }
};

// Batched (NT > 0): token t of this block is blockIdx.y·NT + t, its x, output rows (and
// staged image, pending post-norm) at that token's place in [tokens, …] arrays; one token
// (NT = 0): 0, at the arrays' start. Each token is staged in shared memory on its own
// (x_image uint4 each) and meets each weight tile in registers in turn, its lane sums in
// the one-token order and its warp's tree, so its outputs are the one-token kernel's bits.
__device__ __forceinline__ int tok_at(int t) { return NT > 0 ? blockIdx.y * NT + t : 0; }
__device__ __forceinline__ int x_image(int cols) {
#if XQ
    return (staged_bytes(cols) + 15) / 16;
#else
    return (2 * cols + 15) / 16;
#endif
}

// OUT: 0 bf16 store, 1 f32 store, 2 f32 add, 3 SwiGLU (bf16 store of silu(mat0)·mat1).
// OUT_K 6 and 7 are OUT_K 3 and 4 with GeGLU (gelu(mat0)·mat1) for SwiGLU.
// KS > 1 (not SwiGLU): the KS warps of a row group split each row's chunks into KS
// slices (host: chunks % (32·KS) == 0), so a block step is NW/KS·R rows. For a wide input
// (down: 8192) at R = 2, KS = 2 a block still takes 8 rows, but each x chunk read from
// shared memory serves 2 rows: at R = 1 the int16 x reads were 4× the weight bytes, and
// the shared-memory bandwidth, not the weights, bounded down's math. The slices' lane
// partials meet in shared memory (ks_merge) before the row's warp sum.
// OUT_K 4 is SwiGLU (OUT 3) that also writes its output as the next GEMV's staged x into
// m2.o (x_staged.cuh); PRE: x is such an image, copied in rather than staged. OUT_K 5 is
// the f32 store (OUT 1) of the head, whose argmax goes to `am` (argmax.cuh): each lane
// keeps its warp's best row as the rows are stored, and the blocks' bests meet as
// argmax_finish says, instead of a separate argmax launch reading the logits back.
// POST: x has a pending post-norm add (x_stage.cuh's PostNorm), folded into the staging.
// NT > 0 (batched): the block computes tokens blockIdx.y·NT … + NT - 1 (see tok_at).
template <int R, bool NORM, int OUT_K, class Sync = KernelSync, int KS = 1, bool PRE = false, bool POST = false>
__device__ __forceinline__ void gemv(Mat m0, Mat m1, Mat m2, const void* x, const float* nw, float eps, int cols,
                                     Sync sync = Sync{}, ArgmaxSink am = {}, PostNorm post = {}) {
    constexpr int OUT = OUT_K == 4 || OUT_K >= 6 ? 3 : OUT_K == 5 ? 1 : OUT_K;
    constexpr bool STAGE = OUT_K == 4 || OUT_K == 7, ARGMAX = OUT_K == 5, GELU = OUT_K >= 6;
    constexpr int TB = NT > 0 ? NT : 1;  // tokens this block computes
    static_assert(!ARGMAX || KS == 1, "the argmax rows are whole rows");
    static_assert(!ARGMAX || NT == 0, "the argmax sink is one token's");
    static_assert(!(STAGE || PRE) || XQ, "staged x is the int16 (XQ) layout");
    extern __shared__ uint4 xs[];
    if (PDL_EARLY) sync.trigger();
    static_assert(KS == 1 || (OUT != 3 && NW % KS == 0), "K slices: one matrix per row, whole row groups");
    constexpr int rb = NW / KS * R;  // rows per block step
    using T = Tile<R, OUT == 3, LIF / KS>;  // K slices: a slice's tile, LIF / KS loads
    constexpr int U = T::U;
    int b0 = (m0.rows + rb - 1) / rb, b1 = (m1.rows + rb - 1) / rb, b2 = (m2.rows + rb - 1) / rb;
    int steps = OUT == 3 ? b0 : b0 + b1 + b2;
    int b = sync.first_step(), it = 0, row0;
    float best = -INFINITY;  // ARGMAX: the best row this lane has seen
    int best_i = 0x7fffffff;
    if (b >= steps) {
        if constexpr (ARGMAX) {  // every block's partial counts
            sync.wait();
            argmax_finish(best, best_i, am);
        }
        return;
    }
    int lane = threadIdx.x & 31, ks = KS > 1 ? (threadIdx.x >> 5) % KS : 0;
    int kc = cols / VPC / KS, cb = ks * kc;  // this warp's K slice: chunks cb … cb + kc - 1
    Shape sh{cols / VPC, cols / GROUP, (size_t)cols / (32 / BITS) / 4, cb + kc};
    int tiles = (kc + 32 * U - 1) / (32 * U);  // tiles per row step (uniform per warp)
    const int img = x_image(cols);  // uint4 of one token's x in shared memory
    // Persistent blocks: x is staged once per block (for a 128K-row head, staging it per
    // 16 rows would read as many bytes from L2 as the weights themselves). Each block walks
    // the steps `sync` deals it; each step is `tiles` tiles per warp.
    Mat a;
    locate<R, OUT, KS>(b, b0, b1, m0, m1, m2, a, row0);
    T next;
    next.fill(TileFromGlobal{a, m1, sh}, row0, cb + lane, sh);  // weights only: nothing writes them
    NormGains gains;
    gains.load(nw, cols, NORM, POST ? post.w : nullptr);  // nor the norms' gains
    sync.wait();
    // OUT 2 adds into the residual: lane r < R reads its row's x now, beside the x staging,
    // and the next step's while this one computes, so the store at a step's end is not an
    // L2 round trip (a read-modify-write by lane 0 was). This warp alone writes its rows.
    auto residual = [&](const Mat& m, int first, int t) {
        const float* o = reinterpret_cast<const float*>(m.o);
        if constexpr (NT > 0) o += (size_t)tok_at(t) * m.rows;
        return OUT == 2 && ks == 0 && lane < R && first + lane < m.rows ? o[first + lane] : 0.f;
    };
    float resid[TB];
#pragma unroll
    for (int t = 0; t < TB; t++) resid[t] = residual(a, row0, t);
    // NORM: the norm's factor 1/rms is applied to the row sums (store_rows), not to x as it
    // is staged, so quantizing x does not wait for the block's sum of squares.
    float oscale[TB];
#pragma unroll
    for (int t = 0; t < TB; t++) {
        if (t > 0) BLOCK_SYNC();  // the token before's staging has read its reductions
        const size_t k = tok_at(t);
        oscale[t] = 1.f;
#if XQ
        if constexpr (PRE) copy_staged(xs + t * img, static_cast<const char*>(x) + k * staged_bytes(cols), cols);
        else
#endif
        {
            const void* xt = static_cast<const char*>(x) + k * cols * (NORM ? 4 : 2);
            const PostNorm pt{post.y + k * cols, post.w, post.out + k * cols};
            oscale[t] = stage_x<NORM, true, POST>(xs + t * img, xt, nw, eps, cols, gains, pt);
        }
    }
    __shared__ float stage_vals[STAGE ? 2 : 1][STAGE ? TB : 1][STAGE ? NW * R : 1];  // stage_step's, by step parity
    float acc[TB][2][R];
#pragma unroll
    for (int t = 0; t < TB; t++)
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int r = 0; r < R; r++) acc[t][m][r] = 0.f;
    int parity = 0;  // ks_merge's buffer
    while (true) {
        // The tile after this one (the next step's first when this is a step's last).
        int nit = it + 1, nb = b, nrow0 = row0;
        Mat na = a;
        if (nit == tiles) {
            nit = 0;
            nb = sync.next_step(b);
            if (nb < steps) locate<R, OUT, KS>(nb, b0, b1, m0, m1, m2, na, nrow0);
        }
        T cur = next;
        float nresid[TB];
#pragma unroll
        for (int t = 0; t < TB; t++) nresid[t] = nit == 0 && nb < steps ? residual(na, nrow0, t) : resid[t];
        // Or the next kernel may start once every block is on its last tile (its blocks take
        // the places ours free, and load their weights while we finish). Starting it at
        // once measured faster (1B decode 1 351 vs 1 309 tok/s, perf.md).
        if (!PDL_EARLY && nb >= steps) sync.trigger();
        if (PIPE && nb < steps) next.fill(TileFromGlobal{na, m1, sh}, nrow0, cb + lane + nit * 32 * U, sh);
        // Each token's x meets the tile's weights in turn, with that token's own sums.
#pragma unroll
        for (int t = 0; t < TB; t++) cur.dot(xs + t * img, cb + lane + it * 32 * U, sh, acc[t]);
        if (!PIPE && nb < steps) next.fill(TileFromGlobal{na, m1, sh}, nrow0, cb + lane + nit * 32 * U, sh);
        if (nit == 0) {  // step done: reduce and store this warp's rows, token by token
            if (KS > 1) {
#pragma unroll
                for (int t = 0; t < TB; t++) ks_merge<R, KS>(acc[t], ks, lane, parity ^= 1);
            }
            if (STAGE) parity ^= 1;
#pragma unroll
            for (int t = 0; t < TB; t++) {
                float* vals = STAGE ? stage_vals[parity][t] + (threadIdx.x >> 5) * R : nullptr;
                Mat at = a;
                at.o = static_cast<char*>(a.o) + (size_t)tok_at(t) * a.rows * (OUT == 1 || OUT == 2 ? 4 : 2);
                if (ks == 0) store_rows<R, OUT, GELU>(at, row0, acc[t], resid[t], lane, vals, oscale[t]);
            }
            if constexpr (ARGMAX) {  // store_rows left every row's sum in every lane
#pragma unroll
                for (int r = 0; r < R; r++)
                    if (row0 + r < a.rows) best_of(best, best_i, acc[0][0][r], row0 + r);
            }
#if XQ
            if constexpr (STAGE) {
#pragma unroll
                for (int t = 0; t < TB; t++)
                    stage_step<R>(stage_vals[parity][t], row0 - (threadIdx.x >> 5) * R,
                                  static_cast<uint4*>(m2.o) + (size_t)tok_at(t) * staged_bytes(m0.rows) / 16, m0.rows);
            }
#endif
#pragma unroll
            for (int t = 0; t < TB; t++)
#pragma unroll
                for (int m = 0; m < 2; m++)
#pragma unroll
                    for (int r = 0; r < R; r++) acc[t][m][r] = 0.f;
        }
        if (nb >= steps) break;
        b = nb;
        it = nit;
        a = na;
        row0 = nrow0;
#pragma unroll
        for (int t = 0; t < TB; t++) resid[t] = nresid[t];
    }
    if constexpr (ARGMAX) argmax_finish(best, best_i, am);
}

// grid: up to Σ ceil(rows_i / (NW·R)) blocks of 32·NW threads (fewer: each loops); dynamic
// shared memory cols·2 bytes. Launched with PDL (see pdl_wait in common.cuh).
#define GEMV_ARGS                                                                                            \
    const u32 *w0, const scale_t *s0, const scale_t *b0, void *o0, int n0, const u32 *w1, const scale_t *s1, \
        const scale_t *b1, void *o1, int n1, const u32 *w2, const scale_t *s2, const scale_t *b2, void *o2,  \
        int n2, const void *x, const float *nw, float eps, int cols
#define GEMV_CALL(R, NORM, OUT, KS)                                                                              \
    TRACE_KERNEL();                                                                                                 \
    gemv<R, NORM, OUT, KernelSync, KS>(Mat{w0, s0, b0, o0, n0}, Mat{w1, s1, b1, o1, n1}, Mat{w2, s2, b2, o2, n2}, x, \
                                       nw, eps, cols)
#define GEMV_KERNELS(R)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_bb_r##R(GEMV_ARGS) { GEMV_CALL(R, false, 0, 1); } \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_bf_r##R(GEMV_ARGS) { GEMV_CALL(R, false, 1, 1); } \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_ba_r##R(GEMV_ARGS) { GEMV_CALL(R, false, 2, 1); } \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_nb_r##R(GEMV_ARGS) { GEMV_CALL(R, true, 0, 1); }  \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_nf_r##R(GEMV_ARGS) { GEMV_CALL(R, true, 1, 1); }  \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_ns_r##R(GEMV_ARGS) { GEMV_CALL(R, true, 3, 1); }  \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_ng_r##R(GEMV_ARGS) { GEMV_CALL(R, true, 6, 1); }
// Down (adds, wide input) at R = 2 over two K slices: fused.rs picks it where each row has
// a multiple of 64 chunks. Two K-sliced variants that spread q/k/v (nb, R = 4) and o (ba,
// R = 4) over twice the blocks measured 1B 2 112 and 2 148 tok/s against 2 136 without
// (H200, docs/perf-log.md): not built. ≤ 128 registers (111 at NW = 8: its tile is LIF/2 loads, a
// slice's chunks), so two 8-warp blocks fit per SM.
#define GEMV_KS_KERNELS \
    extern "C" __global__ void __launch_bounds__(32 * NW, 16 / NW) gemv_ba_r2k2(GEMV_ARGS) { GEMV_CALL(2, false, 2, 2); }
// The head with its argmax (head.rs's head_argmax: f32 logits stored, and the argmax
// sink's seven pointers after the GEMV's arguments), at the head's 4 rows per warp.
#define GEMV_ARGMAX_KERNELS                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_nm_r4(                                             \
        GEMV_ARGS, float* am_out, float* am_pv, int* am_pi, int* am_done, int* feed_tok, int* feed_pos,          \
        int* feed_hist) {                                                                                          \
        TRACE_KERNEL();                                                                                            \
        gemv<4, true, 5, KernelSync, 1>(Mat{w0, s0, b0, o0, n0}, Mat{w1, s1, b1, o1, n1}, Mat{w2, s2, b2, o2, n2}, \
                                        x, nw, eps, cols, KernelSync{},                                           \
                                        ArgmaxSink{am_out, am_pv, am_pi, am_done, feed_tok, feed_pos, feed_hist}); \
    }
// Input p: the residual with a pending post-norm add (Gemma 3's, decode.rs), bf16 store
// (q/k/v) or GeGLU (gate/up); py the pending bf16 output, pw its gains, pout where the
// completed residual goes.
#define GEMV_POST_CALL(R, OUT)                                                                                     \
    TRACE_KERNEL();                                                                                                \
    gemv<R, true, OUT, KernelSync, 1, false, true>(Mat{w0, s0, b0, o0, n0}, Mat{w1, s1, b1, o1, n1},               \
                                                   Mat{w2, s2, b2, o2, n2}, x, nw, eps, cols, KernelSync{},         \
                                                   ArgmaxSink{}, PostNorm{py, pw, pout})
#define GEMV_POST_KERNELS(R)                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * NW)                                                          \
        gemv_pb_r##R(GEMV_ARGS, const bf16_t* py, const float* pw, float* pout) { GEMV_POST_CALL(R, 0); }         \
    extern "C" __global__ void __launch_bounds__(32 * NW)                                                          \
        gemv_pg_r##R(GEMV_ARGS, const bf16_t* py, const float* pw, float* pout) { GEMV_POST_CALL(R, 6); }
GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(4)
GEMV_POST_KERNELS(1)
GEMV_POST_KERNELS(2)
GEMV_POST_KERNELS(4)
GEMV_KS_KERNELS
#if NT == 0
GEMV_ARGMAX_KERNELS
#endif
#if XQ && NW >= 8  // a SwiGLU block step (NW·4 rows) must be whole 32-value x blocks
GEMV_STAGED_KERNELS
#endif
