// Attention over quantized KV rows on the tensor cores (kv_quant.cu's attention_q and
// attention_q_decode, head dims 64 and 128): the scores and the value sums as
// mma.m16n8k16 products (bf16 in, f32 accumulate) over rows dequantized in registers. The
// CUDA-core attend_part spends ~90 warp instructions a row on multiply-adds for 4 query
// heads, which bounded quantized decode by instructions, not bytes (docs/kv.md, "Speed").
//
// Per warp, 16 positions a step, a block's qb ≤ 4 query heads as the MMA's rows (padded to
// 16: rows past qb compute nothing that is stored):
//   scores S = Q·Kᵀ per 8-position tile: A = q (bf16, as attention_q reads it), B = the
//   key codes (exact in bf16), accumulated per quantization group and combined with the
//   group's scale and offset: s = Σ_g ks·(q·code)_g + ko·Σ_g q, times the softmax scale;
//   values O += P·V: A = the probabilities (bf16) straight from the scores' accumulators
//   (the C layout of two 8-position tiles is the A layout of one 16-position step), B =
//   the values dequantized to bf16 (TurboQuant: scale · centroid, in the rotated domain).
// The dot products are order-free, so the dims are permuted within a group for the loads:
// for the scores lane (g4, c4) takes 8 (TurboQuant) or 16 (affine) consecutive key codes of
// each group at position g4 of the tile, the k-slots 2c4, 2c4+1, 2c4+8, 2c4+9 of each
// k-step being 4 consecutive dims; for the values it takes hd/8 consecutive dims (one
// group's) of its 4 positions, n-tile t's column g4 being dim g4·hd/8 + t.
// Not bit-identical to attend_part (other sum orders, bf16 values and probabilities):
// within the parity tests' bars against the CPU, as flash prefill over quantized tiles is.
// Fixed orders, a function of the row alone: batch-invariant as attend_part. Parts over
// bf16 head blocks (--kv-start) and head dim 256 take attend_part.
#include "mma.cuh"

template <int HD>
__device__ __forceinline__ void attend_mma(const QCall& C, const bf16_t* qrow, const int* table, int p0, int p1,
                                           long row0, int z, int zs, float* __restrict__ part_ml,
                                           float* __restrict__ part_acc, const float* s_cent) {
    constexpr int KS = HD / 16, NT = HD / 8, NG = HD / QG, KPG = QG / 16, CPT = QG / 4;
    __shared__ float s_m[4 * QH], s_l[4 * QH], s_acc[4 * QH * HD];  // warps · heads · (1, 1, hd)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g4 = lane >> 2, c4 = lane & 3;
    const int qb = C.qb, kvh = (int)((row0 % C.heads) / (C.heads / C.n_kv));
    const RowLayout L = row_layout(HD);
    const u8* store = C.store;
    // q as the A operand (row g4: query head g4, zero past qb) and each group's Σ q.
    u32 qa[KS][2];
    float qsum[NG];
#pragma unroll
    for (int g = 0; g < NG; g++) {
        qsum[g] = 0.f;
#pragma unroll
        for (int s = 0; s < KPG; s++) {
            int d = g * QG + c4 * CPT + 4 * s;
            u32 lo = 0, hi = 0;
            if (g4 < qb) {
                lo = *reinterpret_cast<const u32*>(qrow + g4 * HD + d);
                hi = *reinterpret_cast<const u32*>(qrow + g4 * HD + d + 2);
            }
            qa[g * KPG + s][0] = lo;
            qa[g * KPG + s][1] = hi;
            qsum[g] += bf2f(lo & 0xffff) + bf2f(lo >> 16) + bf2f(hi & 0xffff) + bf2f(hi >> 16);
        }
        qsum[g] += __shfl_xor_sync(0xffffffffu, qsum[g], 1);
        qsum[g] += __shfl_xor_sync(0xffffffffu, qsum[g], 2);
    }
    float oacc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; t++) oacc[t][0] = oacc[t][1] = oacc[t][2] = oacc[t][3] = 0.f;
    float m = -INFINITY, l = 0.f;
    auto row_of = [&](int p) { return store + (kv_row(p < p1 ? p : p0, table) * C.n_kv + kvh) * L.bytes; };
    for (int base = p0 + 16 * warp; base < p1; base += 64) {
        // The rows: the keys' position g4 of each tile, and the 4 positions whose scores
        // (and values) this lane holds: 2c4, 2c4 + 1, 8 + 2c4, 9 + 2c4.
        const u8* krow[2] = {row_of(base + g4), row_of(base + 8 + g4)};
        const u8* prow[4] = {row_of(base + 2 * c4), row_of(base + 2 * c4 + 1), row_of(base + 8 + 2 * c4),
                             row_of(base + 9 + 2 * c4)};
        Codes8<KBITS> kc[2][NG][CPT / 8];
        u32 kp[4][NG];
        Codes8<VBITS> vc[4][NT / 8];
        u32 vp[4];
        const int vg = g4 * NT / QG;  // the group of this lane's value dims
#pragma unroll
        for (int T = 0; T < 2; T++)
#pragma unroll
            for (int g = 0; g < NG; g++)
#pragma unroll
                for (int h = 0; h < CPT / 8; h++) kc[T][g][h].load(krow[T], (g * QG + c4 * CPT + 8 * h) / 8 * KBITS);
#pragma unroll
        for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int g = 0; g < NG; g++)
#if TURBO
                kp[i][g] = *reinterpret_cast<const u32*>(prow[i] + L.k_codes + 4 * g);
#else
                kp[i][g] = ld16(prow[i] + L.k_codes + 2 * g) | ld16(prow[i] + L.k_codes + 2 * (NG + g)) << 16;
#endif
            const u8* vrow = prow[i] + L.k_bytes;
#pragma unroll
            for (int h = 0; h < NT / 8; h++) vc[i][h].load(vrow, (g4 * NT + 8 * h) / 8 * VBITS);
#if TURBO
            vp[i] = ld16(vrow + L.v_codes + 2 * vg);
#else
            vp[i] = ld16(vrow + L.v_codes + 2 * vg) | ld16(vrow + L.v_codes + 2 * (NG + vg)) << 16;
#endif
        }
        // Scores of the two tiles: sc[T][j], position base + 8T + 2c4 + j, query head g4.
        float sc[2][2];
#pragma unroll
        for (int T = 0; T < 2; T++) {
            sc[T][0] = sc[T][1] = 0.f;
#pragma unroll
            for (int g = 0; g < NG; g++) {
                float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int s = 0; s < KPG; s++) {
                    float k[4];
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        u32 c = kc[T][g][(4 * s + i) / 8][(4 * s + i) % 8];
                        k[i] = KSIGNED ? (float)(int)(signed char)c : (float)c;
                    }
                    const u32 a[4] = {qa[g * KPG + s][0], 0u, qa[g * KPG + s][1], 0u};
                    mma_bf16(acc, a, pack_bf16x2(k[0], k[1]), pack_bf16x2(k[2], k[3]));
                }
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    u32 p = kp[2 * T + j][g];
#if TURBO
                    float ks = h2f(p & 0xffff), ko = h2f(p >> 16) * ks;
#else
                    float ks = bf2f(p & 0xffff), ko = bf2f(p >> 16);
#endif
                    sc[T][j] += ks * acc[j] + ko * qsum[g];
                }
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
                sc[T][j] = base + 8 * T + 2 * c4 + j < p1 ? sc[T][j] * C.scale : -INFINITY;
        }
        // Online softmax per query head (the 4 lanes of a row hold its 16 positions).
        float mx = fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float mn = fmaxf(m, mx);
        float corr = mn == -INFINITY ? 1.f : __expf(m - mn);
        float pr[2][2];
#pragma unroll
        for (int T = 0; T < 2; T++)
#pragma unroll
            for (int j = 0; j < 2; j++) pr[T][j] = mn == -INFINITY ? 0.f : __expf(sc[T][j] - mn);
        l = l * corr + pr[0][0] + pr[0][1] + pr[1][0] + pr[1][1];
        m = mn;
        const u32 pa[4] = {pack_bf16x2(pr[0][0], pr[0][1]), 0u, pack_bf16x2(pr[1][0], pr[1][1]), 0u};
        // Values: each position's scale (and affine bias), then an MMA per 8 dims.
        float vs[4], vb[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
#if TURBO
            vs[i] = h2f(vp[i] & 0xffff);
            vb[i] = 0.f;
#else
            vs[i] = bf2f(vp[i] & 0xffff);
            vb[i] = bf2f(vp[i] >> 16);
#endif
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                u32 c = vc[i][t / 8][t % 8];
#if TURBO
                v[i] = vs[i] * s_cent[c];
#else
                v[i] = fmaf(vs[i], (float)c, vb[i]);
#endif
            }
            oacc[t][0] *= corr;
            oacc[t][1] *= corr;
            mma_bf16(oacc[t], pa, pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]));
        }
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (g4 < qb) {
        if (c4 == 0) {
            s_m[g4 * 4 + warp] = m;
            s_l[g4 * 4 + warp] = l;
        }
        float* o = s_acc + (g4 * 4 + warp) * HD;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            o[(2 * c4) * NT + t] = oacc[t][0];
            o[(2 * c4 + 1) * NT + t] = oacc[t][1];
        }
    }
    __syncthreads();
    merge_groups(s_m, s_l, s_acc, 4, qb, HD, row0, z, zs, part_ml, part_acc);  // the 4 warps' states
}

// attend_part, with the tensor cores where they apply (128 threads, head dims 64 and 128,
// no head blocks in this part).
__device__ void attend_part_mma(const QCall& C, const bf16_t* qrow, const int* table, int len, int h0, int z, int zs,
                                long row0, float* __restrict__ part_ml, float* __restrict__ part_acc,
                                const float* s_cent) {
    int p0, p1;
    part_range(C, len, z, p0, p1);
    bool heads_rows = C.hk && p0 < len && table[p0 / KV_BLOCK] >= C.head_row0 / KV_BLOCK;
    if (blockDim.x != 128 || heads_rows || (C.hd != 64 && C.hd != 128)) {
        attend_part(C, qrow, table, len, h0, z, zs, row0, part_ml, part_acc, s_cent);
        return;
    }
    if (C.hd == 64) attend_mma<64>(C, qrow, table, p0, p1, row0, z, zs, part_ml, part_acc, s_cent);
    else attend_mma<128>(C, qrow, table, p0, p1, row0, z, zs, part_ml, part_acc, s_cent);
}
