// Decode attention over the bf16 cache on the tensor cores, for attention_decode.cuh's
// builds of 2-4 query heads a block (QB_MAX > 1) at head dims 64 and 128: the host takes it
// for caches of at least `CudaConfig::attention_mma_positions` (decode.rs). The one-head
// blocks read each K/V row of a GQA group once per head (through L2) with a CUDA-core
// scoring chain a lane; here a block takes a group's qb ≤ 4 heads as the rows of
// mma.m16n8k16 products (bf16 in, f32 accumulate), as kv_quant_mma.cuh does over quantized
// rows, so each row is read once: per warp, 16 positions a step,
//   scores S = Q·Kᵀ per 8-position tile: A = q (rotated, bf16-exact; the softmax scale is
//   applied to the f32 scores), B = the key rows as loaded: lane (g4, c4) takes position g4
//   of the tile and the hd/4 dims [c4·hd/4, (c4+1)·hd/4) (k-step s: dims c4·hd/4 + 4s + 0..3
//   as the k-slots 2c4, 2c4+1, 2c4+8, 2c4+9; q's A fragment pairs them the same way);
//   values O += P·V: A = the probabilities (bf16) straight from the scores' accumulators,
//   B = the value rows: lane (g4, c4) takes positions 2c4, 2c4+1, 8+2c4, 9+2c4 and the hd/8
//   dims [g4·hd/8, (g4+1)·hd/8) (n-tile t's column g4: dim g4·hd/8 + t), a B register
//   being two positions' halves of one word (a byte permute).
// 16 B a load, every byte of the step's rows loaded once by the warp (8 KB at hd 128), all
// at the step's start. The new position is written to the cache first by the block whose
// split holds it and attended from there. Steps start 16-aligned, so a step's rows lie in
// one block of the table (one entry a step, no second-block select per row). Each warp's
// partial (max, sum, unnormalized output) goes to shared memory and the split's partial is
// their merge in warp order (merge_mma_warps), straight into the cross-split merge's input.
// Two blocks an SM (attention_decode.cu's bound for QB_MAX > 1: 220 registers in the
// deep-cache build, no spills).
// Measured on an H100, 8B shape (docs/kv.md, "Speed"): decode 1.15x the one-head blocks at
// depth 32768 (235.8 against 204.1 tok/s), 1.03x at 16384, 0.95x at 8192, 0.92x at 1024
// (there a group's blocks are a quarter of the one-head grid: too few to fill the GPU).
// The aligned steps with the direct merge: +2.6% at 32768 (244.7 against 238.5; the direct
// merge alone 243.0, SASS 346 instructions a step against 389).
// Variants measured and not taken (perf.md): three blocks an SM (register-bound at 168,
// local memory in the loop: 218.9), the value rows loaded after the scores' MMAs or a whole
// step ahead (231.1-235.0, 231.8).
// Not bit-identical to the CUDA-core loop (other sum orders, bf16 probabilities): within
// the parity bars against the CPU. Fixed orders, a function of the row alone: deterministic.
#include "mma.cuh"

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
    // Steps start 16-aligned (positions before p0 are loaded and masked), so a step's 16
    // rows lie in one block of the table: one entry a step, loaded a step ahead (a row load
    // never waits on the table); positions past p1 read the last one's row (masked).
    static_assert(KV_BLOCK % 16 == 0, "a 16-aligned step within one block");
    auto row = [&](int base, int e, int off) {
        return ((long)e * KV_BLOCK + base % KV_BLOCK + min(off, p1 - 1 - base)) * width;
    };
    auto load_k = [&](int base, int e, uint4(&kr)[2][KU]) {
#pragma unroll
        for (int T = 0; T < 2; T++) {
            const uint4* r = reinterpret_cast<const uint4*>(kb + row(base, e, 8 * T + g4));
#pragma unroll
            for (int u = 0; u < KU; u++) kr[T][u] = r[u];
        }
    };
    auto load_v = [&](int base, int e, uint4(&vr)[4][VU]) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint4* r = reinterpret_cast<const uint4*>(vb + row(base, e, (i / 2) * 8 + 2 * c4 + i % 2));
#pragma unroll
            for (int u = 0; u < VU; u++) vr[i][u] = r[u];
        }
    };
    int base = (p0 & ~15) + 16 * warp;
    int e = base < p1 ? table[base / KV_BLOCK] : 0;
    for (; base < p1; base += 64) {
        const int en = base + 64 < p1 ? table[(base + 64) / KV_BLOCK] : e;
        uint4 kr[2][KU], vr[4][VU];
        load_k(base, e, kr);
        load_v(base, e, vr);
        // Scores: sc[T][j], position base + 8T + 2c4 + j, query head g4.
        float sc[2][2];
#pragma unroll
        for (int T = 0; T < 2; T++) {
            float c[2] = {0.f, 0.f};
            const u32* w = reinterpret_cast<const u32*>(kr[T]);
#pragma unroll
            for (int s = 0; s < KS; s++) mma_bf16_top(c, qa[s][0], qa[s][1], w[2 * s], w[2 * s + 1]);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int p = base + 8 * T + 2 * c4 + j;
                sc[T][j] = p >= p0 && p < p1 ? c[j] * scale : -INFINITY;
            }
        }
        u32 pa0, pa2;
        softmax_step_lazy(sc, m, l, oacc, pa0, pa2);
        const u32* v0 = reinterpret_cast<const u32*>(vr[0]);
        const u32* v1 = reinterpret_cast<const u32*>(vr[1]);
        const u32* v2 = reinterpret_cast<const u32*>(vr[2]);
        const u32* v3 = reinterpret_cast<const u32*>(vr[3]);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const u32 sel = t % 2 ? 0x7632u : 0x5410u;  // the high or the low halves of two words
            mma_bf16_top(oacc[t], pa0, pa2, __byte_perm(v0[t / 2], v1[t / 2], sel), __byte_perm(v2[t / 2], v3[t / 2], sel));
        }
        e = en;
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

// A warp's partials, [warp][ATT_MMA_PART] (block-wide: attend_mma_bf16 writes, merge_mma_warps reads).
__device__ __forceinline__ float* att_mma_part() {
    __shared__ float s[AW * ATT_MMA_PART];
    return s;
}

// The tensor-core form of attend's loop over [p0, p1) (the new position included): first
// the new position's k/v into the cache (lane group 0 of warp 0 where has_new), one block
// barrier (q in shared memory, the new row written), then each warp's partial into
// att_mma_part().
__device__ __forceinline__ void attend_mma_bf16(bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                                const int* __restrict__ table, bool has_new, const float (&kn)[8],
                                                uint4 vnr, int pos0, int kvh, int width, int hd, int qb, int p0,
                                                int p1, float scale, int grp, int gl) {
    if (has_new && grp == 0) store_new_kv(kc, vc, kv_row(pos0, table) * width + kvh * hd + gl * 8, kn, vnr);
    ATT_SYNC();
    if (hd == 64) attend_mma_bf16_hd<64>(kc, vc, table, kvh, width, qb, p0, p1, scale, att_mma_part());
    else attend_mma_bf16_hd<128>(kc, vc, table, kvh, width, qb, p0, p1, scale, att_mma_part());
}

// The split's partial per query head from the AW warps' (attend's s_pm / s_pl / s_po), merged
// in warp order: the sums the CUDA-core layout's group merge gave (its other lane groups
// were empty, adding exact zeros), without the round trip through that layout.
__device__ __forceinline__ void merge_mma_warps(int qb, int hd, float* __restrict__ s_pm, float* __restrict__ s_pl,
                                                float* __restrict__ s_po) {
    const float* part = att_mma_part();
    ATT_SYNC();  // every warp's partial written
    for (int t = threadIdx.x; t < qb * hd; t += AW * 32) {
        const int j = t / hd, d = t % hd;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < AW; w++) M = fmaxf(M, part[w * ATT_MMA_PART + QB_MAX * 128 + 2 * j]);
        float L = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < AW; w++) {
            const float* pw = part + w * ATT_MMA_PART;
            const float wt = partial_weight(pw[QB_MAX * 128 + 2 * j], M);
            L += pw[QB_MAX * 128 + 2 * j + 1] * wt;
            o += pw[j * hd + d] * wt;
        }
        s_po[t] = o;
        if (d == 0) {
            s_pm[j] = M;
            s_pl[j] = L;
        }
    }
    ATT_SYNC();
}
