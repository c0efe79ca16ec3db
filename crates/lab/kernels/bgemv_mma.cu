// Lab: the decode GEMV's arithmetic over many tokens on integer tensor cores, the second
// form of the batched decode GEMV that docs/perf.md ("One stream through the server")
// describes (kernels/bgemv.cuh is the first, on DP2A). 4-bit weights, groups of 32 or more;
// each token's output must be gemv.cu's gemv_bf_r* bits for that token alone (XQ: int16 x).
//
// Why the bits can match. gemv.cu sums a chunk of 32 values (one x block) exactly, as the
// integer Σq·xq; then, in floats, ds = d·Σq·xq (d the x block's scale), a lane's
// accumulator acc = fmaf(scale, ds, fmaf(bias, Σx, acc)) over its chunks c = lane,
// lane + 32, … in order, and the row's sum is warp_sum's butterfly over the 32 lanes.
//   - The integer is order-free: here x = 256·hi + lo (hi s8, lo u8) and Σq·xq =
//     256·Σq·hi + Σq·lo from two mma.m16n8k32 (u8 weights × s8 hi, × u8 lo), exact in s32.
//     The 32 k slots of a chunk are permuted so that a lane's A registers are its weight
//     word's low and high nibbles (two ANDs) and its B registers the matching x bytes,
//     prepared once per token by bq_quant.
//   - The float steps are the GEMV's, in its order: the chunks of lane class l (c ≡ l mod
//     32) make one chain; the butterfly (xor 16, 8, 4, 2, 1) is the pairwise tree whose
//     leaves, taken in bit-reversed order of l, merge as a binary counter: a 5-level stack.
// Layouts. bq_quant (one thread per token and 32-value block, put_x's arithmetic): xd
// [mp, chunks] f32 the block's scale, xsx [mp, chunks] f32 its Σx (the GEMV's segment sum
// of two 16-value sums), xb [mp, chunks, 4] uint4: for lane tg of a chunk, the hi bytes of
// values 8tg + 0, 2, 4, 6 | 8tg + 1, 3, 5, 7, then the lo bytes of the same. mp: tokens
// rounded up to 8·TT (padding tokens zero).
// bgemv_mma: grid (⌈rows / 16⌉, mp / (8·TT)), block 128 (below). out f32 [m, rows].
#include "common.cuh"

#ifndef TT
#define TT 2  // token tiles of 8 per warp (each tile's weights reuse the A registers)
#endif
static_assert(BITS == 4 && GROUP % 32 == 0, "4-bit weights, groups of whole 32-value chunks");

__device__ __forceinline__ void mma_u8s8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}
__device__ __forceinline__ void mma_u8u8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %10, %10, %10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// x_stage.cuh's put_x for one 32-value block, by one thread: the same scale, rounding and
// sums (each 8-value part summed in order, part sums paired, then the GEMV's segment sum).
extern "C" __global__ void bq_quant(const bf16_t* __restrict__ x, uint4* __restrict__ xb, float* __restrict__ xd,
                                    float* __restrict__ xsx, int m, int mp, int cols) {
    const int chunks = cols / 32;
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)mp * chunks) return;
    const int t = (int)(i / chunks), c = (int)(i % chunks);
    float v[32];
    if (t < m) {
#pragma unroll
        for (int p = 0; p < 4; p++) unpack_bf16x8(*reinterpret_cast<const uint4*>(x + (size_t)t * cols + 32 * c + 8 * p), v + 8 * p);
    } else {
#pragma unroll
        for (int k = 0; k < 32; k++) v[k] = 0.f;
    }
    float am = 0.f, part[4];
#pragma unroll
    for (int p = 0; p < 4; p++) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            am = fmaxf(am, fabsf(v[8 * p + k]));
            s += v[8 * p + k];
        }
        part[p] = s;
    }
    float inv = am > 0.f ? 32767.f / am : 0.f;
    int q[32];
#pragma unroll
    for (int k = 0; k < 32; k++) q[k] = (int)(short)(__float_as_uint(__fadd_rn(__fmul_rn(v[k], inv), 12582912.f)) & 0xffffu);
    float sx = 0.f;
    sx += part[0] + part[1];
    sx += part[2] + part[3];
    xd[i] = am / 32767.f;
    xsx[i] = sx;
#pragma unroll
    for (int tg = 0; tg < 4; tg++) {
        u32 h0 = 0, h1 = 0, l0 = 0, l1 = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int e = q[8 * tg + 2 * j], o = q[8 * tg + 2 * j + 1];
            h0 |= (u32)((e >> 8) & 0xff) << (8 * j), l0 |= (u32)(e & 0xff) << (8 * j);
            h1 |= (u32)((o >> 8) & 0xff) << (8 * j), l1 |= (u32)(o & 0xff) << (8 * j);
        }
        xb[i * 4 + tg] = make_uint4(h0, h1, l0, l1);
    }
}

// The butterfly's tree, leaf by leaf in bit-reversed lane order: level k holds the sum of
// the last 2^k leaves while it waits for its partner. A warp takes 8 leaves (3 levels);
// the block's 4 warps' subtotals meet as the butterfly's last two levels.
struct Tree {
    float lv[3];
    __device__ __forceinline__ void push(float v, int leaf) {  // leaf: 0, 1, … 7
#pragma unroll
        for (int k = 0; k < 3; k++) {
            if (!((leaf >> k) & 1)) {
                lv[k] = v;
                return;
            }
            v = lv[k] + v;
        }
        lv[0] = v;  // the 8th leaf: v is the subtotal
    }
};

// Block: 4 warps over the same 16 rows × 8·TT tokens, warp w on lane classes
// brev(8w .. 8w + 7): 32 MMA chains' worth of parallelism per row tile at any token count.
extern "C" __global__ void __launch_bounds__(128) bgemv_mma(const u32* __restrict__ w, const scale_t* __restrict__ ws,
                                                          const scale_t* __restrict__ wb, const uint4* __restrict__ xb,
                                                          const float* __restrict__ xd, const float* __restrict__ xsx,
                                                          float* __restrict__ out, int rows, int cols, int m) {
    __shared__ float sub[4][TT][4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tg = lane & 3;
    const int chunks = cols / 32, groups = cols / GROUP, wpr = cols / 8;  // words per row
    const int r0 = blockIdx.x * 16, tok0 = blockIdx.y * 8 * TT;
    const int ra = min(r0 + g, rows - 1), rb = min(r0 + g + 8, rows - 1);
    Tree tree[TT][4];
#pragma unroll
    for (int leaf = 0; leaf < 8; leaf++) {  // unrolled: the tree's levels stay in registers
        const int l = __brev(8 * warp + leaf) >> 27;  // bit-reversed: 0, 16, 8, 24, …
        float acc[TT][4];
#pragma unroll
        for (int j = 0; j < TT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        for (int c = l; c < chunks; c += 32) {
            const u32 wa = __ldg(w + (size_t)ra * wpr + 4 * c + tg), wr = __ldg(w + (size_t)rb * wpr + 4 * c + tg);
            const u32 a[4] = {wa & 0x0F0F0F0Fu, wr & 0x0F0F0F0Fu, (wa >> 4) & 0x0F0F0F0Fu, (wr >> 4) & 0x0F0F0F0Fu};
            const int gr = c * 32 / GROUP;
            const float sa = s2f(ws[(size_t)ra * groups + gr]), ba = s2f(wb[(size_t)ra * groups + gr]);
            const float sr = s2f(ws[(size_t)rb * groups + gr]), br = s2f(wb[(size_t)rb * groups + gr]);
#pragma unroll
            for (int j = 0; j < TT; j++) {
                const int tb = tok0 + 8 * j;  // this tile's first token; the lane's B column is token tb + g
                const uint4 xv = xb[((size_t)(tb + g) * chunks + c) * 4 + tg];
                int hi[4], lo[4];
                mma_u8s8(hi, a, xv.x, xv.y);
                mma_u8u8(lo, a, xv.z, xv.w);
                // C: (row g, tokens tb + 2tg, +1), (row g + 8, the same tokens)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int tok = tb + 2 * tg + (e & 1);
                    const float d = xd[(size_t)tok * chunks + c], sx = xsx[(size_t)tok * chunks + c];
                    const float ds = fmaf(d, (float)(256 * hi[e] + lo[e]), 0.f);
                    const bool upper = e >= 2;
                    acc[j][e] = fmaf(upper ? sr : sa, ds, fmaf(upper ? br : ba, sx, acc[j][e]));
                }
            }
        }
#pragma unroll
        for (int j = 0; j < TT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) tree[j][e].push(acc[j][e], leaf);
    }
#pragma unroll
    for (int j = 0; j < TT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) sub[warp][j][e][lane] = tree[j][e].lv[0];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int j = 0; j < TT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float v = (sub[0][j][e][lane] + sub[1][j][e][lane]) + (sub[2][j][e][lane] + sub[3][j][e][lane]);
            const int tok = tok0 + 8 * j + 2 * tg + (e & 1), row = r0 + g + (e >= 2 ? 8 : 0);
            if (tok < m && row < rows) out[(size_t)tok * rows + row] = v;
        }
}
