// The lab's decode attention over the bf16 cache on the tensor cores: spliced into the
// engine's attention_decode.cuh (crates/lab/src/kernels.rs, `attn_mma_header`), taken by
// the builds of 2-4 query heads a block (QB_MAX > 1, `FERROLM_ATTN_QB=4`) at head dims 64
// and 128. Written for issue 30's "bf16 at 1.3x llama.cpp's f16 at depth 32768": the
// engine's kernel gives each query head its own block (QB_MAX = 1), so each K/V row of a
// GQA group crosses L2 once per head, and each lane's scoring is a CUDA-core chain
// (docs/kv.md, "Speed": ~84 µs a layer at 32768 where ~61 would meet the target).
//
// Here a block takes a GQA group's qb ≤ 4 heads as the rows of mma.m16n8k16 products
// (bf16 in, f32 accumulate), as kv_quant_mma.cuh does over quantized rows, so each row is
// read once: per warp, 16 positions a step,
//   scores S = Q·Kᵀ per 8-position tile: A = q (rotated, bf16-exact; the softmax scale is
//   applied to the f32 scores), B = the key rows as loaded: lane (g4, c4) takes position g4
//   of the tile and the hd/4 dims [c4·hd/4, (c4+1)·hd/4) (k-step s: dims c4·hd/4 + 4s + 0..3
//   as the k-slots 2c4, 2c4+1, 2c4+8, 2c4+9; q's A fragment pairs them the same way);
//   values O += P·V: A = the probabilities (bf16) straight from the scores' accumulators,
//   B = the value rows: lane (g4, c4) takes positions 2c4, 2c4+1, 8+2c4, 9+2c4 and the hd/8
//   dims [g4·hd/8, (g4+1)·hd/8) (n-tile t's column g4: dim g4·hd/8 + t), a B register
//   being two positions' halves of one word (a byte permute).
// 16 B a load, every byte of the step's rows loaded once by the warp (8 KB at hd 128). The
// new position is written to the cache first by each block whose split holds it (the same
// bytes from every block of its group) and attended from there. Each warp's partial (max,
// sum, unnormalized output) goes into lane group 1's state of the engine's CUDA-core
// layout, so the engine's merge (groups in order, then splits) runs unchanged.
// Not bit-identical to the CUDA-core loop (other sum orders, bf16 probabilities): within
// the parity bars against the CPU. Fixed orders: deterministic.

#include "mma.cuh"

// 1: each step's value rows are loaded at its start and the next step's key rows after
// its scores, so each phase's loads are in flight under the other phase's math with the
// same registers. 2: the value rows a whole step ahead (one more buffer of them: 16
// registers at head dim 64, 32 at 128). 0: both at the step's start.
#ifndef ATT_MMA_SPLIT_LOADS
#define ATT_MMA_SPLIT_LOADS 1
#endif

// Whether this build and head dim take the tensor cores (block-uniform).
#define ATT_MMA_ON (QB_MAX > 1 && (hd == 64 || hd == 128))

// The rotated q heads as bf16, for the A fragments (written by warp 0's lane group 0).
__device__ __forceinline__ bf16_t* att_mma_q() {
    __shared__ __align__(16) bf16_t s[QB_MAX * 128];
    return s;
}
#define ATT_MMA_Q(j)                                                                    \
    if (ATT_MMA_ON && warp == 0 && grp == 0) {                                          \
        _Pragma("unroll") for (int i = 0; i < 8; i++) att_mma_q()[(j) * hd + gl * 8 + i] = f2bf(qv[j][i]); \
    }

// c += a·b, m16n8k16 (bf16 in, f32 accumulate) where rows 8-15 of a are zero (the query
// heads fill rows 0-3): the accumulators of rows 8-15 stay zero, so they enter as a zero
// and leave into dead registers instead of living across the loop (32 registers of the
// value sums at head dim 128). a1 = a3 = 0.
__device__ __forceinline__ void mma_bf16_top(float (&c)[2], u32 a0, u32 a2, u32 b0, u32 b1) {
    float d2, d3;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %5}, {%7, %8}, "
        "{%0, %1, %9, %9};\n"
        : "+f"(c[0]), "+f"(c[1]), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(b0), "r"(b1), "f"(0.f));
}

// A warp's partial per query head, [heads][hd] then max and sum per head.
constexpr int ATT_MMA_PART = QB_MAX * 128 + 2 * QB_MAX;

// kc and vc without __restrict__: the block wrote the new position's row just before, so
// their loads must not take the read-only (non-coherent) path.
template <int HD>
__device__ __forceinline__ void attend_mma_bf16_hd(const bf16_t* kc, const bf16_t* vc,
                                                   const int* __restrict__ table, int kvh, int width, int qb, int p0,
                                                   int p1, float scale, float* __restrict__ part) {
    constexpr int KS = HD / 16, NT = HD / 8, KU = HD / 32, VU = HD / 64;  // k-steps, n-tiles, 16-B loads a row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g4 = lane >> 2, c4 = lane & 3;
    const bf16_t* s_q = att_mma_q();
    u32 qa[KS][2];
#pragma unroll
    for (int s = 0; s < KS; s++) {
        const bf16_t* qd = s_q + g4 * HD + c4 * (HD / 4) + 4 * s;
        qa[s][0] = g4 < qb ? *reinterpret_cast<const u32*>(qd) : 0u;
        qa[s][1] = g4 < qb ? *reinterpret_cast<const u32*>(qd + 2) : 0u;
    }
    float oacc[NT][2];
#pragma unroll
    for (int t = 0; t < NT; t++) oacc[t][0] = oacc[t][1] = 0.f;
    float m = -INFINITY, l = 0.f;
    const bf16_t* kb = kc + (long)kvh * HD + c4 * (HD / 4);
    const bf16_t* vb = vc + (long)kvh * HD + g4 * (HD / 8);
    // A step's 16 positions lie in one or two blocks of the table: its entries e (loaded a
    // step ahead, so a row load never waits on the table), and the row of the step's
    // position off from them (positions past p1 read the last one's row; their scores
    // are masked).
    auto entries = [&](int base, int(&e)[2]) {
        const int q0 = base % KV_BLOCK, last = min(15, p1 - 1 - base);
        e[0] = table[base / KV_BLOCK];
        e[1] = q0 + last >= KV_BLOCK ? table[base / KV_BLOCK + 1] : e[0];
    };
    auto row = [&](int base, const int(&e)[2], int off) {
        const int q = base % KV_BLOCK + min(off, p1 - 1 - base);
        return (q < KV_BLOCK ? (long)e[0] * KV_BLOCK + q : (long)e[1] * KV_BLOCK + q - KV_BLOCK) * width;
    };
    auto load_k = [&](int base, const int(&e)[2], uint4(&kr)[2][KU]) {
#pragma unroll
        for (int T = 0; T < 2; T++) {
            const uint4* r = reinterpret_cast<const uint4*>(kb + row(base, e, 8 * T + g4));
#pragma unroll
            for (int u = 0; u < KU; u++) kr[T][u] = r[u];
        }
    };
    auto load_v = [&](int base, const int(&e)[2], uint4(&vr)[4][VU]) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint4* r = reinterpret_cast<const uint4*>(vb + row(base, e, (i / 2) * 8 + 2 * c4 + i % 2));
#pragma unroll
            for (int u = 0; u < VU; u++) vr[i][u] = r[u];
        }
    };
    uint4 kr[2][KU], vr[4][VU];
    int base = p0 + 16 * warp, e[2] = {0, 0};
    if (base < p1) entries(base, e);
#if ATT_MMA_SPLIT_LOADS
    if (base < p1) load_k(base, e, kr);
#endif
#if ATT_MMA_SPLIT_LOADS == 2
    if (base < p1) load_v(base, e, vr);
#endif
    for (; base < p1; base += 64) {
        const bool more = base + 64 < p1;
        int en[2] = {e[0], e[1]};
        if (more) entries(base + 64, en);
#if ATT_MMA_SPLIT_LOADS == 2
        uint4 vn[4][VU];
        if (more) load_v(base + 64, en, vn);  // the next step's values under this whole step
#elif ATT_MMA_SPLIT_LOADS
        load_v(base, e, vr);  // in flight under the scores' math (the keys came a phase ahead)
#else
        load_k(base, e, kr);
        load_v(base, e, vr);
#endif
        // Scores: sc[T][j], position base + 8T + 2c4 + j, query head g4.
        float sc[2][2];
#pragma unroll
        for (int T = 0; T < 2; T++) {
            float c[2] = {0.f, 0.f};
            const u32* w = reinterpret_cast<const u32*>(kr[T]);
#pragma unroll
            for (int s = 0; s < KS; s++) mma_bf16_top(c, qa[s][0], qa[s][1], w[2 * s], w[2 * s + 1]);
#pragma unroll
            for (int j = 0; j < 2; j++) sc[T][j] = base + 8 * T + 2 * c4 + j < p1 ? c[j] * scale : -INFINITY;
        }
        // Online softmax per query head (its 4 lanes hold the step's 16 positions), the sums
        // rescaled only when a score passes the running max by e^8 (f32 cannot overflow).
        float mx = fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const bool grow = mx > m + 8.f;
        if (__any_sync(0xffffffffu, grow)) {
            const float mn = grow ? mx : m;
            const float corr = m == -INFINITY ? 0.f : __expf(m - mn);
            l *= corr;
#pragma unroll
            for (int t = 0; t < NT; t++) {
                oacc[t][0] *= corr;
                oacc[t][1] *= corr;
            }
            m = mn;
        }
        float pr[2][2];
#pragma unroll
        for (int T = 0; T < 2; T++)
#pragma unroll
            for (int j = 0; j < 2; j++) pr[T][j] = m == -INFINITY ? 0.f : __expf(sc[T][j] - m);
        l += pr[0][0] + pr[0][1] + pr[1][0] + pr[1][1];
        const u32 pa0 = pack_bf16x2(pr[0][0], pr[0][1]), pa2 = pack_bf16x2(pr[1][0], pr[1][1]);
#if ATT_MMA_SPLIT_LOADS
        if (more) load_k(base + 64, en, kr);  // the next step's keys under the value math
#endif
        const u32* v0 = reinterpret_cast<const u32*>(vr[0]);
        const u32* v1 = reinterpret_cast<const u32*>(vr[1]);
        const u32* v2 = reinterpret_cast<const u32*>(vr[2]);
        const u32* v3 = reinterpret_cast<const u32*>(vr[3]);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const u32 sel = t % 2 ? 0x7632u : 0x5410u;  // the high or the low halves of two words
            mma_bf16_top(oacc[t], pa0, pa2, __byte_perm(v0[t / 2], v1[t / 2], sel), __byte_perm(v2[t / 2], v3[t / 2], sel));
        }
        e[0] = en[0];
        e[1] = en[1];
#if ATT_MMA_SPLIT_LOADS == 2
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int u = 0; u < VU; u++) vr[i][u] = vn[i][u];
#endif
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    float* o = part + warp * ATT_MMA_PART;
    if (g4 < qb) {
#pragma unroll
        for (int t = 0; t < NT; t++) {
            o[g4 * HD + (2 * c4) * (HD / 8) + t] = oacc[t][0];
            o[g4 * HD + (2 * c4 + 1) * (HD / 8) + t] = oacc[t][1];
        }
        if (c4 == 0) {
            o[QB_MAX * 128 + 2 * g4] = m;
            o[QB_MAX * 128 + 2 * g4 + 1] = l;
        }
    }
    __syncwarp();
}

// The tensor-core form of attend's loop over [p0, p1) (the new position included): first
// the new position's k/v into the cache (lane group 0 of warp 0 where has_new), one block
// barrier (q in shared memory, the new row written), then each warp's partial into lane
// group 1's state (m, l, acc), every other lane group's state emptied.
__device__ __forceinline__ void attend_mma_bf16(bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                                const int* __restrict__ table, bool has_new, const float (&kn)[8],
                                                uint4 vnr, int pos0, int kvh, int width, int hd, int qb, int p0,
                                                int p1, float scale, int grp, int gl, float (&m)[QB_MAX],
                                                float (&l)[QB_MAX], float (&acc)[QB_MAX][8]) {
    __shared__ float s_part[AW * ATT_MMA_PART];
    if (has_new && grp == 0) {
        long o = kv_row(pos0, table) * width + kvh * hd + gl * 8;
        uint4 kw;
        kw.x = (u32)f2bf(kn[0]) | ((u32)f2bf(kn[1]) << 16);
        kw.y = (u32)f2bf(kn[2]) | ((u32)f2bf(kn[3]) << 16);
        kw.z = (u32)f2bf(kn[4]) | ((u32)f2bf(kn[5]) << 16);
        kw.w = (u32)f2bf(kn[6]) | ((u32)f2bf(kn[7]) << 16);
        *reinterpret_cast<uint4*>(kc + o) = kw;
        *reinterpret_cast<uint4*>(vc + o) = vnr;
    }
    ATT_SYNC();
    if (hd == 64) attend_mma_bf16_hd<64>(kc, vc, table, kvh, width, qb, p0, p1, scale, s_part);
    else attend_mma_bf16_hd<128>(kc, vc, table, kvh, width, qb, p0, p1, scale, s_part);
    const float* o = s_part + (threadIdx.x >> 5) * ATT_MMA_PART;
#pragma unroll
    for (int j = 0; j < QB_MAX; j++) {
        const bool mine = grp == 1 && j < qb;
        m[j] = mine ? o[QB_MAX * 128 + 2 * j] : -INFINITY;
        l[j] = mine ? o[QB_MAX * 128 + 2 * j + 1] : 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[j][i] = mine ? o[j * hd + gl * 8 + i] : 0.f;
    }
}
#define ATT_MMA_BODY                                                                                            \
    attend_mma_bf16(kc, vc, table, has_new, kn, vnr, pos0, kvh, width, hd, qb, p0, p1, scale, grp, gl, m, l, acc)
