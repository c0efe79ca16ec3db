// Attention over quantized KV rows on the tensor cores (kv_quant.cu's attention_q and
// attention_q_decode, head dims 64 and 128): the scores and the value sums as
// mma.m16n8k16 products (f32 accumulate) over rows dequantized in registers. The CUDA-core
// attend_part spends ~90 warp instructions a row on multiply-adds for 4 query heads, which
// bounded quantized decode by instructions, not bytes (docs/kv.md, "Speed").
//
// Per warp, 16 positions a step, a block's qb ≤ 4 query heads as the MMA's rows (padded to
// 16: rows past qb compute nothing that is stored):
//   scores S = Q·Kᵀ per 8-position tile: A = q, B = the key codes, accumulated per
//   quantization group and combined with the group's scale and offset:
//   s = Σ_g ks·(q·code)_g + ko·Σ_g q, times the softmax scale. 8-bit codes and unsigned
//   4-bit ones enter in f16 (q converted once to f16: exact for q's elements in f16's
//   normal range, clamped at ±65504; a code becomes 1024 + code by a byte permute or a nibble mask into the
//   exponent 0x64, then one packed subtract), other widths in bf16 (exact as well);
//   values O += P·V: A = the probabilities (bf16) straight from the scores' accumulators
//   (the C layout of two 8-position tiles is the A layout of one 16-position step), B =
//   the values dequantized to bf16 (TurboQuant: scale · centroid, in the rotated domain,
//   the centroids of a B register's two positions looked up as one pair for values of up
//   to 4 bits).
// The dot products are order-free, so the dims are permuted within a group for the loads:
// for the scores lane (g4, c4) takes 8 (TurboQuant) or 16 (affine) consecutive key codes of
// each group at position g4 of the tile, the k-slots 2c4, 2c4+1, 2c4+8, 2c4+9 of each
// k-step being 4 consecutive dims (4-bit codes in f16: a word's nibbles j and j + 4, q's
// dims paired the same way); for the values it takes hd/8 consecutive dims (one group's)
// of its 4 positions, n-tile t's column g4 being dim g4·hd/8 + t.
// Loads: where the row layout keeps 8-byte alignment (turbo:k8v3 and the affine schemes at
// head dim 128), a lane's run of key codes, a row's group parameters and its value codes
// load as 8-byte words (ncu found the per-word loads L1-bound: 34 loads a step for
// turbo:k8v3 at head dim 128 against 58). The softmax rescales the accumulators only when
// a row's running max grows by more than e^8 (mma.cuh's softmax_step_lazy), and steps
// start 16-aligned so a step's rows come from one block-table entry.
// Measured on an H100 (8B shape, depth 32768, docs/kv.md): 5.0% (turbo:k8v3), 3.7%
// (affine:4) and 5.9% (affine:8) faster decode than one word a load, a bf16 key path and
// eager rescaling; the wide loads alone were 1% slower. Dropping the value accumulators of
// rows 8-15: +2.2% (turbo:k8v3); under a 4-blocks-an-SM bound (128 registers) it spilled
// and lost (0.90x). The 16-aligned steps: +0.8% (282.1 against 279.9, 744 SASS
// instructions a step against 777).
// Not bit-identical to attend_part (other sum orders, roundings of q and of the
// probabilities): within the parity tests' bars against the CPU, as flash prefill over
// quantized tiles is. Fixed orders, a function of the row alone: batch-invariant as
// attend_part. Parts over bf16 head blocks (--kv-start) and head dim 256 take attend_part.
#include "mma.cuh"

typedef unsigned long long u64;

// N 8-byte words from p (8-byte aligned).
template <int N>
__device__ __forceinline__ void load_words(u64 (&w)[N], const u8* p) {
#pragma unroll
    for (int i = 0; i < N; i++) w[i] = reinterpret_cast<const u64*>(p)[i];
}
// The 16-bit half at byte b of the words w.
template <int N>
__device__ __forceinline__ u32 half_of(const u64 (&w)[N], int b) {
    return (u32)(w[b / 8] >> (8 * (b % 8))) & 0xffffu;
}

// c += a·b, m16n8k16, f16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A bf16 pair as an f16 pair (round to nearest; past f16's range ±65504, not infinity:
// a q element that large gives a finite, clamped score instead of NaN).
__device__ __forceinline__ u32 bf16x2_to_f16x2(u32 x) {
    u32 r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(bf2f(x >> 16)), "f"(bf2f(x & 0xffff)));
    return r;
}
__device__ __forceinline__ float f16_lo(u32 x) { return h2f(x & 0xffff); }
__device__ __forceinline__ float f16_hi(u32 x) { return h2f(x >> 16); }
// Two 8-bit codes (bytes b and b + 1 of w, b = 0 or 2) as an f16 pair: 1024 + code by the
// exponent byte 0x64, then 1024 (unsigned) or 1152 (signed, stored + 128 by the XOR) off.
template <int B>
__device__ __forceinline__ u32 codes_f16x2(u32 w) {
    constexpr u32 sel = B == 0 ? 0x4140 : 0x4342;
    u32 r = __byte_perm(w, 0x64646464u, sel), d;
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(r), "r"(KSIGNED ? 0x64806480u : 0x64006400u));
    return d;
}
// Nibbles 0 and 4 of w (two unsigned 4-bit codes) as an f16 pair: 1024 + code by the
// exponent bits 0x6400, then 1024 off.
__device__ __forceinline__ u32 nibbles_f16x2(u32 w) {
    u32 d;
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"((w & 0x000f000fu) | 0x64006400u), "r"(0x64006400u));
    return d;
}

// The centroid pair of code k of xa (low) and of xb (high) in a table of float2 entries:
// the byte offset built from the two fields shifted in place (two shifts and one logic
// operation, k a constant once unrolled).
__device__ __forceinline__ float2 pair_at(const float2* tab, unsigned long long xa, unsigned long long xb, int k) {
    const int sa = k * VBITS - 3, sb = k * VBITS - 3 - VBITS;
    const u32 a = (u32)(sa >= 0 ? xa >> sa : xa << -sa) & (((1u << VBITS) - 1) << 3);
    const u32 b = (u32)(sb >= 0 ? xb >> sb : xb << -sb) & (((1u << VBITS) - 1) << (3 + VBITS));
    return *reinterpret_cast<const float2*>(reinterpret_cast<const char*>(tab) + (a | b));
}

template <int HD>
__device__ __forceinline__ void attend_mma(const QCall& C, const bf16_t* qrow, const int* table, int p0, int p1,
                                           long row0, int z, int zs, float* __restrict__ part_ml,
                                           float* __restrict__ part_acc, const float* s_cent) {
    constexpr int KS = HD / 16, NT = HD / 8, NG = HD / QG, KPG = QG / 16, CPT = QG / 4;
    // The row layout at compile time (kv_encode.cuh's row_layout): where every row starts on
    // 8 bytes, a lane's runs of codes and its rows' group parameters load as 8-byte words.
    constexpr int K_CODES = HD * KBITS / 8, K_BYTES = K_CODES + NG * 4, V_CODES = HD * VBITS / 8;
    constexpr int ROW_BYTES = K_BYTES + V_CODES + NG * (TURBO ? 2 : 4);
    constexpr int KRUN = CPT * KBITS / 8, VRUN = NT * VBITS / 8;  // a lane's bytes: a group's keys, its values
    constexpr bool A8 = ROW_BYTES % 8 == 0;
    constexpr bool WIDE_KEYS = A8 && KRUN % 8 == 0 && (KBITS == 4 || KBITS == 8);
    constexpr bool WIDE_PARAMS = A8 && K_CODES % 8 == 0 && NG % 2 == 0;
    constexpr bool WIDE_VALUES = A8 && K_BYTES % 8 == 0 && VRUN % 8 == 0 && (VBITS == 4 || VBITS == 8);
    constexpr bool PAIR_VALUES = !WIDE_VALUES && NT * VBITS <= 48 && (VRUN <= 5 || VRUN == 6);
    // The scores in f16 (q converted) over 8-bit codes, or over unsigned 4-bit ones paired
    // as a word's nibbles j and j + 4 (q's dims paired the same way).
    constexpr bool F16_KEYS = WIDE_KEYS && (KBITS == 8 || (KBITS == 4 && !KSIGNED));
    __shared__ float s_m[4 * QH], s_l[4 * QH], s_acc[4 * QH * HD];  // warps · heads · (1, 1, hd)
    // TurboQuant's centroids in pairs (low code: the first position), for values of up to 4
    // bits: the same products as one lookup a code.
    constexpr bool PAIR_TABLE = TURBO && VBITS <= 4;
    __shared__ float2 s_cpair[PAIR_TABLE ? 1 << (2 * VBITS) : 1];
    if constexpr (PAIR_TABLE) {
        for (int i = threadIdx.x; i < 1 << (2 * VBITS); i += blockDim.x)
            s_cpair[i] = make_float2(s_cent[i & ((1 << VBITS) - 1)], s_cent[i >> VBITS]);
        __syncthreads();
    }
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
                if (F16_KEYS && KBITS == 4) {
                    // k-step s takes nibbles r, r + 4 and r + 1, r + 5 of word s / 2 (r = 2·(s % 2)).
                    const bf16_t* qd = qrow + g4 * HD + g * QG + c4 * CPT + 8 * (s / 2) + 2 * (s % 2);
                    lo = (u32)qd[0] | (u32)qd[4] << 16;
                    hi = (u32)qd[1] | (u32)qd[5] << 16;
                } else {
                    lo = *reinterpret_cast<const u32*>(qrow + g4 * HD + d);
                    hi = *reinterpret_cast<const u32*>(qrow + g4 * HD + d + 2);
                }
            }
            if constexpr (F16_KEYS) {
                lo = bf16x2_to_f16x2(lo);
                hi = bf16x2_to_f16x2(hi);
                qsum[g] += f16_lo(lo) + f16_hi(lo) + f16_lo(hi) + f16_hi(hi);
            } else {
                qsum[g] += bf2f(lo & 0xffff) + bf2f(lo >> 16) + bf2f(hi & 0xffff) + bf2f(hi >> 16);
            }
            qa[g * KPG + s][0] = lo;
            qa[g * KPG + s][1] = hi;
        }
        qsum[g] += __shfl_xor_sync(0xffffffffu, qsum[g], 1);
        qsum[g] += __shfl_xor_sync(0xffffffffu, qsum[g], 2);
    }
    float oacc[NT][2];
#pragma unroll
    for (int t = 0; t < NT; t++) oacc[t][0] = oacc[t][1] = 0.f;
    float m = -INFINITY, l = 0.f;
    const u8* kvbase = store + (long)kvh * L.bytes;
    const int rs = C.n_kv * L.bytes;  // bytes from a store row to the next
    // Steps start 16-aligned (positions before p0 are read and masked), so a step's 16 rows
    // lie in one block of the table: one entry a step; positions past p1 read the last one's
    // row (masked).
    static_assert(KV_BLOCK % 16 == 0, "a 16-aligned step within one block");
    for (int base = (p0 & ~15) + 16 * warp; base < p1; base += 64) {
        // The rows: the keys' position g4 of each tile, and the 4 positions whose scores
        // (and values) this lane holds: 2c4, 2c4 + 1, 8 + 2c4, 9 + 2c4.
        const int last = min(15, p1 - 1 - base);
        const u8* blk = kvbase + ((long)table[base / KV_BLOCK] * KV_BLOCK + base % KV_BLOCK) * rs;
        auto row_of = [&](int off) { return blk + min(off, last) * rs; };
        const u8* krow[2] = {row_of(g4), row_of(8 + g4)};
        const u8* prow[4] = {row_of(2 * c4), row_of(2 * c4 + 1), row_of(8 + 2 * c4), row_of(9 + 2 * c4)};
        Codes8<KBITS> kc[2][NG][CPT / 8];
        u32 kp[4][NG];
        Codes8<VBITS> vc[4][NT / 8];
        u32 vp[4];
        const int vg = g4 * NT / QG;  // the group of this lane's value dims
#pragma unroll
        for (int T = 0; T < 2; T++)
#pragma unroll
            for (int g = 0; g < NG; g++) {
                const int off = (g * QG + c4 * CPT) / 8 * KBITS;
                if constexpr (WIDE_KEYS) {
                    u64 w[KRUN / 8 ? KRUN / 8 : 1];  // (sized for every scheme: compiled in all)
                    load_words(w, krow[T] + off);
#pragma unroll
                    for (int h = 0; h < CPT / 8; h++) kc[T][g][h].x = w[h * KBITS / 8] >> (h * 8 * KBITS % 64);
                } else {
#pragma unroll
                    for (int h = 0; h < CPT / 8; h++) kc[T][g][h].load(krow[T], off + h * KBITS);
                }
            }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if constexpr (WIDE_PARAMS) {
                u64 w[NG / 2 ? NG / 2 : 1];
                load_words(w, prow[i] + K_CODES);
#pragma unroll
                for (int g = 0; g < NG; g++)
#if TURBO
                    kp[i][g] = (u32)(w[g / 2] >> (32 * (g % 2)));
#else
                    kp[i][g] = half_of(w, 2 * g) | half_of(w, 2 * (NG + g)) << 16;
#endif
            } else {
#pragma unroll
                for (int g = 0; g < NG; g++)
#if TURBO
                    kp[i][g] = *reinterpret_cast<const u32*>(prow[i] + L.k_codes + 4 * g);
#else
                    kp[i][g] = ld16(prow[i] + L.k_codes + 2 * g) | ld16(prow[i] + L.k_codes + 2 * (NG + g)) << 16;
#endif
            }
            const u8* vrow = prow[i] + L.k_bytes;
            if constexpr (WIDE_VALUES) {
                u64 w[VRUN / 8 ? VRUN / 8 : 1];
                load_words(w, vrow + g4 * VRUN);
#pragma unroll
                for (int h = 0; h < NT / 8; h++) vc[i][h].x = w[h * VBITS / 8] >> (h * 8 * VBITS % 64);
            } else if constexpr (PAIR_VALUES) {
                // The lane's VRUN bytes lie within the two words from its offset rounded
                // down to 4: one pair of loads for all its codes (Codes8 loads a pair each).
                const int off = g4 * VRUN;
                const u32* p = reinterpret_cast<const u32*>(vrow) + off / 4;
                const u64 x = ((u64)p[0] | (u64)p[1] << 32) >> (8 * (off % 4));
#pragma unroll
                for (int h = 0; h < NT / 8; h++) vc[i][h].x = x >> (h * 8 * VBITS);
            } else {
#pragma unroll
                for (int h = 0; h < NT / 8; h++) vc[i][h].load(vrow, (g4 * NT + 8 * h) / 8 * VBITS);
            }
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
                    const u32 a[4] = {qa[g * KPG + s][0], 0u, qa[g * KPG + s][1], 0u};
                    if constexpr (F16_KEYS && KBITS == 4) {
                        const u32 w = (u32)kc[T][g][s / 2].x >> (8 * (s % 2));
                        mma_f16(acc, a, nibbles_f16x2(w), nibbles_f16x2(w >> 4));
                    } else if constexpr (F16_KEYS) {
                        u32 w = (u32)(kc[T][g][s / 2].x >> (32 * (s % 2)));
                        if (KSIGNED) w ^= 0x80808080u;
                        mma_f16(acc, a, codes_f16x2<0>(w), codes_f16x2<2>(w));
                    } else {
                        float k[4];
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            u32 c = kc[T][g][(4 * s + i) / 8][(4 * s + i) % 8];
                            k[i] = KSIGNED ? (float)(int)(signed char)c : (float)c;
                        }
                        mma_bf16(acc, a, pack_bf16x2(k[0], k[1]), pack_bf16x2(k[2], k[3]));
                    }
                }
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    u32 p = kp[2 * T + j][g];
#if TURBO
                    sc[T][j] = fmaf(h2f(p & 0xffff), fmaf(h2f(p >> 16), qsum[g], acc[j]), sc[T][j]);
#else
                    sc[T][j] = fmaf(bf2f(p & 0xffff), acc[j], fmaf(bf2f(p >> 16), qsum[g], sc[T][j]));
#endif
                }
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
            {
                const int p = base + 8 * T + 2 * c4 + j;
                sc[T][j] = p >= p0 && p < p1 ? sc[T][j] * C.scale : -INFINITY;
            }
        }
        // Online softmax per query head (the 4 lanes of a row hold its 16 positions).
        u32 pa0, pa2;
        softmax_step_lazy(sc, m, l, oacc, pa0, pa2);
        // Values: each position's scale (and affine bias), then an MMA per 8 dims (rows 8-15
        // of P are zero: their accumulators are not kept, 32 registers fewer at head dim 128,
        // the same bits in rows 0-7).
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
            if constexpr (PAIR_TABLE) {
                // One lookup for the centroids of a B register's two positions.
                const float2 a = pair_at(s_cpair, vc[0][t / 8].x, vc[1][t / 8].x, t % 8);
                const float2 b = pair_at(s_cpair, vc[2][t / 8].x, vc[3][t / 8].x, t % 8);
                v[0] = vs[0] * a.x;
                v[1] = vs[1] * a.y;
                v[2] = vs[2] * b.x;
                v[3] = vs[3] * b.y;
            } else {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    u32 c = vc[i][t / 8][t % 8];
#if TURBO
                    v[i] = vs[i] * s_cent[c];
#else
                    v[i] = fmaf(vs[i], (float)c, vb[i]);
#endif
                }
            }
            mma_bf16_top(oacc[t], pa0, pa2, pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]));
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
