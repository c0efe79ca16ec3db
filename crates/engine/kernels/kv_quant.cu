// Quantized KV caches (--kv affine:B, turbo:kKvV): the store holds kv/rows.rs's rows, one
// per (cached position, KV head), `bytes` each, row (kv_row(p) · n_kv + head), so a KV
// file's payload is the store's bytes on every backend. Compiled per scheme:
//   TURBO 0: affine (MLX's rule, groups of 64, bf16 scale and bias); KBITS = VBITS = 4 or 8.
//   TURBO 1: TurboQuant (kv/turboquant.rs, groups of 32): keys KBITS (KSIGNED 1: int8),
//            values VBITS Lloyd-Max indices of the sign-flipped Walsh-Hadamard rotation.
// The head dim is a run-time argument (64, 128 or 256).
//
// kv_encode writes rows bit for bit as RowCodec::encode does from the same values
// (kv_encode.cuh). attention_q is attention.cu's split-K over the rows, dequantizing in the
// inner loop: a key's dot with q is scale·Σ qᵢ·codeᵢ + offset·Σ qᵢ over a lane's dims (one
// group); turbo values accumulate in the rotated domain and attention_merge_q undoes the
// rotation once per output head. At head dims 64 and 128 both take the scores and value
// sums on the tensor cores (kv_quant_mma.cuh; attend_part is the CUDA-core form the others
// and the bf16 head blocks take). A decode row (head dims up to 128) runs kv_encode's and
// attention_q's work as one kernel, attention_q_decode, then the merge. Deterministic:
// fixed orders.
#include "common.cuh"

#ifndef TURBO
#define TURBO 1
#endif
#ifndef KBITS
#define KBITS 8
#endif
#ifndef KSIGNED
#define KSIGNED 1
#endif
#ifndef VBITS
#define VBITS 3
#endif
#define QG (TURBO ? 32 : 64)  // values per quantization group (keys and values)
#define HD_MAX 256
// The scheme's table (turbo; Cuda::kv_store_scheme uploads it): the sign vector's bits
// (bit i of word i/32: element i negated), then the Lloyd-Max centroids and boundaries of
// VBITS-bit values as f32 bits.
#define TAB_CENT 8
#define TAB_BOUND (8 + 256)

#define QH 4  // most query heads per attention_q block (one GQA group's, sharing each row's decoding)
#include "kv_encode.cuh"

// This call's k and v rows into the store at their positions (kv_write's addressing), and q
// (if q_out) into q_out (which may be q): per head the norm (gains qn/kn, or none), then
// RoPE (inv_freq, or none). grid (rows, heads + n_kv): blocks [0, heads) take q's heads,
// the rest the KV heads; block hd threads. Padding rows (position -1) write nothing. Store
// rows from head_row0 on are head blocks (head_k / head_v: [rows, n_kv·hd] bf16; null:
// none), written as bf16.
extern "C" __global__ void kv_encode(const bf16_t* q, bf16_t* q_out, const bf16_t* __restrict__ k,
                                     const bf16_t* __restrict__ v, u8* __restrict__ store, const u32* __restrict__ tab,
                                     const float* __restrict__ inv_freq, float linear, int interleaved,
                                     const float* __restrict__ qn, const float* __restrict__ kn, float eps, int heads,
                                     int n_kv, int hd, float had_scale, const int* __restrict__ pos,
                                     const int* __restrict__ tables, const int* __restrict__ row_tab,
                                     bf16_t* __restrict__ head_k, bf16_t* __restrict__ head_v, int head_row0) {
    __shared__ float s_x[HD_MAX], s_red[32], s_gp[2 * HD_MAX / 32];
    __shared__ u8 s_code[HD_MAX];
    pdl_trigger();
    pdl_wait();
    int t = blockIdx.x, slot = blockIdx.y, d = threadIdx.x, p = pos[t];
    bool isq = slot < heads;
    if ((isq && !q_out) || (!isq && p < 0)) return;
    int h = isq ? slot : slot - heads;
    const bf16_t* src = isq ? q + ((long)t * heads + h) * hd : k + ((long)t * n_kv + h) * hd;
    if (isq) norm_rope_heads<1>(src, 1, qn, nullptr, nullptr, s_x, s_red, eps, hd, inv_freq, linear, interleaved, p);
    else norm_rope_heads<1>(nullptr, 0, nullptr, src, kn, s_x, s_red, eps, hd, inv_freq, linear, interleaved, p);
    if (isq) {
        q_out[((long)t * heads + h) * hd + d] = f2bf(s_x[d]);
        return;
    }
    EncodeDst D = {store, head_k, head_v, head_row0};
    kv_encode_row(s_x, s_gp, s_code, v + ((long)t * n_kv + h) * hd, D, tab, kv_row(p, tables + row_tab[t]), h, n_kv,
                  hd, had_scale);
}

#define DL 8  // dims per lane in attention_q
#define QR 4  // rows per lane group per round

// A lane's 8 BITS-bit codes of an LSB-first stream s (4-aligned): bytes [off, off + BITS),
// off = j·BITS, within the two aligned words from off rounded down (BITS ≤ 5, or 8 with off
// a multiple of 8). The second word is read only where the bytes reach it; it lies inside
// the row (the group parameters, at least 4 bytes, follow each stream).
template <int BITS>
struct Codes8 {
    unsigned long long x;
    __device__ __forceinline__ void load(const u8* s, int off) {
        const u32* w = reinterpret_cast<const u32*>(s) + (off >> 2);
        unsigned long long v = w[0];
        if (BITS == 3 || BITS == 5 || BITS == 8) v |= (unsigned long long)w[1] << 32;
        x = v >> (8 * (off & 3));
    }
    __device__ __forceinline__ u32 operator[](int i) const {
        return (u32)(x >> (i * BITS)) & ((1u << BITS) - 1);
    }
};

// Where a lane's rows live: the store and the head blocks, this KV head, this lane's dims.
struct QPlace {
    const u8* store;
    const bf16_t *hk, *hv;
    long head_row0;
    const int* table;
    RowLayout L;
    int n_kv, kvh, hd, j, g, d0, grp, groups, lp, qb;
};

// What a lane reads of one cached quantized row, all loads issued together: its key and
// value codes and their groups' parameters (turbo: key scale and zero f16, value scale
// f16; affine: scale and bias bf16, the scale in the low half).
struct QuantRow {
    Codes8<KBITS> k;
    Codes8<VBITS> v;
    u32 kp, vp;
    // Store row `r`'s bytes of this lane's KV head and dims.
    __device__ __forceinline__ void load(const QPlace& P, long r) {
        const RowLayout& L = P.L;
        const int j = P.j, g = P.g, hd = P.hd;
        const u8* row = P.store + (r * P.n_kv + P.kvh) * L.bytes;
        const u8* vrow = row + L.k_bytes;
        k.load(row, j * KBITS);
        v.load(vrow, j * VBITS);
#if TURBO
        kp = *reinterpret_cast<const u32*>(row + L.k_codes + 4 * g);
        vp = ld16(vrow + L.v_codes + 2 * g);
#else
        kp = ld16(row + L.k_codes + 2 * g) | ld16(row + L.k_codes + 2 * (hd / 64 + g)) << 16;
        vp = ld16(vrow + L.v_codes + 2 * g) | ld16(vrow + L.v_codes + 2 * (hd / 64 + g)) << 16;
#endif
    }
    // The key as kf with score = ks·Σ qᵢ·kfᵢ + ko·Σ qᵢ.
    __device__ __forceinline__ void key(float (&kf)[DL], float& ks, float& ko) const {
#pragma unroll
        for (int i = 0; i < DL; i++) kf[i] = KSIGNED ? (float)(int)(signed char)k[i] : (float)k[i];
#if TURBO
        ks = h2f(kp & 0xffff);
        ko = h2f(kp >> 16) * ks;
#else
        ks = bf2f(kp & 0xffff);
        ko = bf2f(kp >> 16);
#endif
    }
    // The value as vs·vfᵢ + vb (TurboQuant: rotated).
    __device__ __forceinline__ void value(float (&vf)[DL], float& vs, float& vb, const float* s_cent) const {
#if TURBO
        vs = h2f(vp & 0xffff);
        vb = 0.f;
#pragma unroll
        for (int i = 0; i < DL; i++) vf[i] = s_cent[v[i]];
#else
        vs = bf2f(vp & 0xffff);
        vb = bf2f(vp >> 16);
#pragma unroll
        for (int i = 0; i < DL; i++) vf[i] = (float)v[i];
#endif
    }
};

// A lane's 8 dims of a head block's row (--kv-start): bf16 key and value, the value already
// in the accumulation domain.
struct HeadRow {
    uint4 k, v;
    // Store row `r` (a head block's) of this lane's KV head and dims.
    __device__ __forceinline__ void load(const QPlace& P, long r) {
        long at = ((r - P.head_row0) * P.n_kv + P.kvh) * P.hd + P.d0;
        k = *reinterpret_cast<const uint4*>(P.hk + at);
        v = *reinterpret_cast<const uint4*>(P.hv + at);
    }
    __device__ __forceinline__ void key(float (&kf)[DL], float& ks, float& ko) const {
        unpack_bf16x8(k, kf);
        ks = 1.f;
        ko = 0.f;
    }
    __device__ __forceinline__ void value(float (&vf)[DL], float& vs, float& vb, const float*) const {
        unpack_bf16x8(v, vf);
        vs = 1.f;
        vb = 0.f;
    }
};

// One block's queries (qb heads, this lane's dims) and their online softmax per head.
struct QState {
    float qv[QH][DL], acc[QH][DL], qsum[QH], bacc[QH], m[QH], l[QH];
};

// The QR · QH = 16 scores summed over a lane group of LP lanes, every lane getting all 16:
// a reduce-scatter (each xor level keeps half the sums, so a lane ends with 16/LP of them, or
// with LP > 16 shares one with LP/16 lanes) then a broadcast: 31 shuffles at LP 16 where a
// butterfly over all 16 takes 64. The additions pair the lanes as the butterfly does.
static_assert(QR * QH == 16, "group_sums sums 16 scores");
#define V(i) sc[(i) / QH][(i) % QH]
// One reduce-scatter level over lanes o apart: of the first N scores, the lower lane keeps
// (and adds its partner's) the first N/2, the upper lane the last N/2, into the first N/2.
template <int N>
__device__ __forceinline__ void scatter_level(float (&sc)[QR][QH], int o) {
    const bool upper = threadIdx.x & o;
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        float send = upper ? V(i) : V(i + N / 2), keep = upper ? V(i + N / 2) : V(i);
        V(i) = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
}
template <int LP>
__device__ __forceinline__ void group_sums(float (&sc)[QR][QH]) {
    scatter_level<16>(sc, LP / 2);
    scatter_level<8>(sc, LP / 4);
    scatter_level<4>(sc, LP / 8);
    if (LP >= 16) scatter_level<2>(sc, LP / 16);
    if (LP == 32) V(0) += __shfl_xor_sync(0xffffffffu, V(0), 1);
    constexpr int held = LP >= 16 ? 1 : 16 / LP;  // sums per lane: index (lane · held + i)
    float sum[16];
#pragma unroll
    for (int idx = 0; idx < 16; idx++)
        sum[idx] = __shfl_sync(0xffffffffu, V(idx % held), LP >= 16 ? idx * (LP / 16) : idx / held, LP);
#pragma unroll
    for (int idx = 0; idx < 16; idx++) V(idx) = sum[idx];
}
#undef V

// Rounds over positions [from, to) (warp-uniform bounds; the group sums shuffle across the
// whole warp): QR positions per lane group per round, all their loads issued first; a
// position past `to` reads `from`'s row and is not counted. R: QuantRow or HeadRow.
template <typename R>
__device__ __forceinline__ void attend_rounds(QState& S, const QPlace& P, int from, int to, const float* s_cent) {
    for (int base = from; base < to; base += QR * P.groups) {
        R r[QR];
#pragma unroll
        for (int k = 0; k < QR; k++) {
            int p = base + P.grp + k * P.groups;
            r[k].load(P, kv_row(p < to ? p : from, P.table));
        }
        float sc[QR][QH];
#pragma unroll
        for (int k = 0; k < QR; k++) {
            float kf[DL], ks, ko;
            r[k].key(kf, ks, ko);
#pragma unroll
            for (int hq = 0; hq < QH; hq++) {
                if (hq >= P.qb) break;
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < DL; i++) dot = fmaf(S.qv[hq][i], kf[i], dot);
                sc[k][hq] = ks * dot + ko * S.qsum[hq];
            }
        }
        if (P.lp == 8) group_sums<8>(sc);
        else if (P.lp == 16) group_sums<16>(sc);
        else group_sums<32>(sc);
        // Each head's new max over the round's rows, and its softmax state rescaled once.
#pragma unroll
        for (int hq = 0; hq < QH; hq++) {
            if (hq >= P.qb) break;
            float mn = S.m[hq];
#pragma unroll
            for (int k = 0; k < QR; k++)
                if (base + P.grp + k * P.groups < to) mn = fmaxf(mn, sc[k][hq]);
            float corr = mn == -INFINITY ? 1.f : __expf(S.m[hq] - mn);
            S.l[hq] *= corr;
            S.bacc[hq] *= corr;
#pragma unroll
            for (int i = 0; i < DL; i++) S.acc[hq][i] *= corr;
            S.m[hq] = mn;
        }
#pragma unroll
        for (int k = 0; k < QR; k++) {
            if (base + P.grp + k * P.groups >= to) continue;
            float vf[DL], vs, vb;
            r[k].value(vf, vs, vb, s_cent);
#pragma unroll
            for (int hq = 0; hq < QH; hq++) {
                if (hq >= P.qb) break;
                float e = __expf(sc[k][hq] - S.m[hq]), w = e * vs;
                S.l[hq] += e;
                S.bacc[hq] = fmaf(e, vb, S.bacc[hq]);
#pragma unroll
                for (int i = 0; i < DL; i++) S.acc[hq][i] = fmaf(w, vf[i], S.acc[hq][i]);
            }
        }
    }
}

// What every block of attention_q and attention_q_decode shares: the layer's rows, the
// call's shape and chunking.
struct QCall {
    const u8* store;
    const bf16_t *hk, *hv;
    long head_row0;
    int heads, n_kv, hd, qb, min_chunk, max_splits, sqrt_k, window;
    float scale;
};

// ⌈k·√span⌉ exactly (the smallest c with c² ≥ k²·span), 0 for k = 0: prefill.rs's
// quant_row_splits repeats it in integers to size the grid.
__device__ __forceinline__ int sqrt_chunk(int k, int span) {
    if (k <= 0) return 0;
    long t = (long)k * k * span, c = (long)ceilf(sqrtf((float)t));
    while (c * c < t) c++;
    while (c > 1 && (c - 1) * (c - 1) >= t) c--;
    return (int)c;
}

// Part z's positions [p0, p1) of a row of len positions (attention_q's chunk rule).
__device__ __forceinline__ void part_range(const QCall& C, int len, int z, int& p0, int& p1) {
    int start = C.window > 0 ? max(0, len - C.window) : 0, span = len - start;
    int chunk = max(max(C.min_chunk * C.qb, (span + C.max_splits - 1) / C.max_splits), sqrt_chunk(C.sqrt_k, span));
    int part = (chunk + C.qb - 1) / C.qb, c0 = start + (z / C.qb) * chunk;
    p0 = c0 + (z % C.qb) * part;
    p1 = min(min(len, c0 + chunk), p0 + part);
}

// A block's partial states of its qb query heads, `groups` of them a head in shared memory
// (s_m, s_l: [head][group]; s_acc: [head][group][hd]), merged in group order into the
// part's slot (row0 + head)·zs + z: max, sum and unnormalized output (after a barrier).
__device__ __forceinline__ void merge_groups(const float* s_m, const float* s_l, const float* s_acc, int groups,
                                             int qb, int hd, long row0, int z, int zs, float* __restrict__ part_ml,
                                             float* __restrict__ part_acc) {
    for (int hq = 0; hq < qb; hq++) {
        const float *hm = s_m + hq * groups, *hl = s_l + hq * groups;
        long slot = (row0 + hq) * zs + z;
        float M = -INFINITY;
        for (int w = 0; w < groups; w++) M = fmaxf(M, hm[w]);
        if (threadIdx.x == 0) {
            float Lsum = 0.f;
            for (int w = 0; w < groups; w++) Lsum += hm[w] == -INFINITY ? 0.f : hl[w] * __expf(hm[w] - M);
            part_ml[2 * slot] = M;
            part_ml[2 * slot + 1] = Lsum;
        }
        for (int dd = threadIdx.x; dd < hd; dd += blockDim.x) {
            float o = 0.f;
            for (int w = 0; w < groups; w++)
                if (hm[w] != -INFINITY) o += s_acc[(hq * groups + w) * hd + dd] * __expf(hm[w] - M);
            part_acc[slot * hd + dd] = o;
        }
    }
}

// One block's part: query heads [h0, h0 + qb) of a row of len positions whose q heads are
// at qrow (bf16, normed and rotated) and whose block table is `table`; part z of zs. Its
// partial per head goes to slot (row0 + hq)·zs + z, row0 = t·heads + h0.
__device__ void attend_part(const QCall& C, const bf16_t* qrow, const int* table, int len, int h0, int z, int zs,
                            long row0, float* __restrict__ part_ml, float* __restrict__ part_acc,
                            const float* s_cent) {
    __shared__ float s_m[16 * QH], s_l[16 * QH], s_acc[QH * 128 * DL];  // groups · qb · (1, 1, hd)
    const int hd = C.hd, qb = C.qb;
    QPlace P;
    P.lp = hd / DL;
    P.grp = threadIdx.x / P.lp;
    P.j = threadIdx.x % P.lp;
    P.groups = blockDim.x / P.lp;
    P.kvh = h0 / (C.heads / C.n_kv);
    P.d0 = P.j * DL;
    P.g = P.d0 / QG;
    P.qb = qb;
    P.n_kv = C.n_kv;
    P.hd = hd;
    P.store = C.store;
    P.hk = C.hk;
    P.hv = C.hv;
    P.head_row0 = C.head_row0;
    P.L = row_layout(hd);
    P.table = table;
    int p0, p1;
    part_range(C, len, z, p0, p1);
    // The leading positions in head blocks (a sequence's first blocks, when it has any).
    int hs = 0;
    if (C.hk)
        while (hs < len && P.table[hs / KV_BLOCK] >= C.head_row0 / KV_BLOCK) hs += KV_BLOCK;
    hs = min(hs, len);
    QState S;
#pragma unroll
    for (int hq = 0; hq < QH; hq++) {
        const bf16_t* qh = qrow + (long)min(hq, qb - 1) * hd + P.d0;
        S.qsum[hq] = 0.f;
#pragma unroll
        for (int i = 0; i < DL; i++) {
            S.qv[hq][i] = bf2f(qh[i]) * C.scale;
            S.qsum[hq] += S.qv[hq][i];
            S.acc[hq][i] = 0.f;
        }
        S.bacc[hq] = 0.f;
        S.m[hq] = -INFINITY;
        S.l[hq] = 0.f;
    }
    attend_rounds<HeadRow>(S, P, p0, min(p1, hs), s_cent);
    attend_rounds<QuantRow>(S, P, max(p0, hs), p1, s_cent);
    int groups = P.groups, grp = P.grp;
#pragma unroll
    for (int hq = 0; hq < QH; hq++) {
        if (hq >= qb) break;
        if (P.j == 0) {
            s_m[hq * groups + grp] = S.m[hq];
            s_l[hq * groups + grp] = S.l[hq];
        }
#pragma unroll
        for (int i = 0; i < DL; i++) s_acc[(hq * groups + grp) * hd + P.d0 + i] = S.acc[hq][i] + S.bacc[hq];
    }
    __syncthreads();
    merge_groups(s_m, s_l, s_acc, groups, qb, hd, row0, z, zs, part_ml, part_acc);
}

#include "kv_quant_mma.cuh"

// attention.cu's attention_split over quantized rows for qb ≤ QH query heads of one KV group
// per block: grid (heads / qb, m, splits · qb), block 128. A row's span is cut into at most
// max_splits splits of max(min_chunk · qb, ⌈span / max_splits⌉, ⌈sqrt_k·√span⌉) positions (a
// function of the row's own span: batch-invariant; the host sets max_splits so that a
// sequence's blocks make one wave, kv_quant.rs; sqrt_k keeps short and middling spans to
// fewer, longer splits, since a split costs its partials and their merge), each cut into qb
// parts of at least min_chunk, z = s·qb + part;
// each query head's partials are its splits · qb parts. (8B shape, turbo:k8v3 at depth
// 1024: parts of at least 64 positions 443.8 tok/s, at least 16 408.5.) A lane group of hd/8
// lanes takes one position (each lane 8 dims, within one quantization group), QR positions per
// group per round with all their loads issued before any is used; each row's codes are
// decoded once for the block's qb heads. Keys: scale·Σ qᵢ·codeᵢ + offset·Σ qᵢ; each head keeps
// an online softmax per group, rescaled once a round; TurboQuant values accumulate in the
// rotated domain, affine values as scale·code with their biases summed apart. A sequence's
// leading positions whose rows are head blocks (store rows from head_row0 on, in head_k /
// head_v: --kv-start; head_k null for none) are read as bf16 first. The groups merge in a
// fixed order through shared memory. Deterministic.
// Not capped for four blocks per SM: at 128 registers (from ~160, three blocks) the 8B
// shape's decode at depth 32768 fell from 146 to 135 tok/s (spills; H200). Rows staged
// through shared memory by cp.async (no register cost for loads in flight) measured slower
// than these direct loads (docs/kv.md, "Speed").
extern "C" __global__ void __launch_bounds__(128)
    attention_q(const bf16_t* __restrict__ q, const u8* __restrict__ store, const u32* __restrict__ tab,
                float* __restrict__ part_ml, float* __restrict__ part_acc, int heads, int n_kv, int hd,
                const int* __restrict__ pos, int min_chunk, int max_splits, int sqrt_k, float scale,
                int window, const int* __restrict__ tables, const int* __restrict__ row_tab, int qb,
                const bf16_t* __restrict__ head_k, const bf16_t* __restrict__ head_v, int head_row0) {
    __shared__ float s_cent[TURBO ? 256 : 1];
    pdl_trigger();
    int t = blockIdx.y, h0 = blockIdx.x * qb;
#if TURBO
    for (int i = threadIdx.x; i < (1 << VBITS); i += blockDim.x) s_cent[i] = __uint_as_float(tab[TAB_CENT + i]);
    __syncthreads();
#endif
    pdl_wait();  // the table is the store's own; q, the rows, positions and tables may be new
    QCall C = {store, head_k, head_v, head_row0, heads, n_kv, hd, qb, min_chunk, max_splits, sqrt_k, window, scale};
    long row0 = (long)t * heads + h0;
    attend_part_mma(C, q + row0 * hd, tables + row_tab[t], pos[t] + 1, h0, blockIdx.z, gridDim.z, row0, part_ml,
                    part_acc, s_cent);
}

// Thread d's value of the head whose thread i holds x (one thread per dim, the whole block)
// after the values' inverse rotation, H(x)·signs in f32 (s_o: hd floats of shared memory).
__device__ __forceinline__ float unrotate(float* s_o, float x, int hd, const u32* __restrict__ tab, float had_scale) {
    int d = threadIdx.x;
    s_o[d] = x;
    __syncthreads();
    for (int hh = 1; hh < hd; hh <<= 1) {
        if (d < hd / 2) {
            int k = d & (hh - 1), j = ((d - k) << 1) + k;
            float a = s_o[j], b = s_o[j + hh];
            s_o[j] = 2 * hh == hd ? (a + b) * had_scale : a + b;
            s_o[j + hh] = 2 * hh == hd ? (a - b) * had_scale : a - b;
        }
        __syncthreads();
    }
    return tab[d / 32] >> (d % 32) & 1 ? -s_o[d] : s_o[d];
}

// One decode row's kv_encode and attention_q in one launch (attention_merge_q follows):
// the same partials, so the same output bits as the three kernels. grid (heads / qb, 1,
// splits · qb), block 128, hd ≤ 128. A block whose part is empty (past the row's span: the
// grid covers the whole store, since a captured step replays at later positions) only
// marks its partials empty. Every other block norms and rotates its qb query heads
// (kv_encode's arithmetic, rounded to bf16 as attention_q reads q); the block whose part
// holds the new position pos[0] also takes its KV head's k and encodes the row (kv_encode's
// bytes), reading it back after a barrier (no other block reads it). k and v are the new
// position's raw rows; store, head_k and head_v are written here, so they are not restrict
// (no non-coherent loads of them). The merge folded in as well (the last block of a KV
// group merging its partials) measured slower: one block's merge of 4 heads took ~26 µs
// against the merge kernel's ~10 (docs/kv.md); so did one cluster per KV group merging
// after a cluster barrier (docs/perf.md's table of designs not taken).
extern "C" __global__ void __launch_bounds__(128)
    attention_q_decode(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
                       u8* store, const u32* __restrict__ tab, const float* __restrict__ inv_freq, float linear,
                       int interleaved, const float* __restrict__ qn, const float* __restrict__ kn, float eps,
                       float* __restrict__ part_ml, float* __restrict__ part_acc, int heads, int n_kv, int hd,
                       const int* __restrict__ pos, int min_chunk, int max_splits, int sqrt_k, float scale,
                       int window, const int* __restrict__ table, int qb, float had_scale, bf16_t* head_k,
                       bf16_t* head_v, int head_row0) {
    __shared__ float s_x[(QH + 1) * 128], s_red[(QH + 1) * 32], s_gp[2 * HD_MAX / 32];
    __shared__ u8 s_code[HD_MAX];
    __shared__ bf16_t s_q[QH * 128];
    __shared__ float s_cent[TURBO ? 256 : 1];
    pdl_trigger();
    const int d = threadIdx.x, z = blockIdx.z, zs = gridDim.z, h0 = blockIdx.x * qb;
#if TURBO
    for (int i = d; i < (1 << VBITS); i += blockDim.x) s_cent[i] = __uint_as_float(tab[TAB_CENT + i]);
#endif
    pdl_wait();
    const int p = pos[0], kvh = h0 / (heads / n_kv);
    QCall C = {store, head_k, head_v, head_row0, heads, n_kv, hd, qb, min_chunk, max_splits, sqrt_k, window, scale};
    int p0, p1;
    part_range(C, p + 1, z, p0, p1);
    if (p0 >= p1) {
        if (d < qb) {
            long slot = (long)(h0 + d) * zs + z;
            part_ml[2 * slot] = -INFINITY;
            part_ml[2 * slot + 1] = 0.f;
        }
    } else {
        const bool has_new = p0 <= p && p < p1;
        const bf16_t* kp = has_new ? k + (long)kvh * hd : nullptr;  // the new k as head qb
        norm_rope_heads<QH + 1>(q + (long)h0 * hd, qb, qn, kp, kn, s_x, s_red, eps, hd, inv_freq, linear, interleaved, p);
        for (int i = d; i < qb * hd; i += blockDim.x) s_q[i] = f2bf(s_x[i]);
        if (has_new) {
            __syncthreads();  // s_q read from s_x before the key moves to its front
            if (d < hd) s_x[d] = s_x[qb * hd + d];
            __syncthreads();
            EncodeDst D = {store, head_k, head_v, head_row0};
            kv_encode_row(s_x, s_gp, s_code, v + (long)kvh * hd, D, tab, kv_row(p, table), kvh, n_kv, hd, had_scale);
        }
        __syncthreads();  // s_q whole before any thread reads it: each reads every thread's dims
        attend_part_mma(C, s_q, table, p + 1, h0, z, zs, h0, part_ml, part_acc, s_cent);
    }
}

// attention.cu's attention_merge, then (turbo) the values' inverse rotation in f32 before
// the bf16 output: the Walsh-Hadamard transform, then the signs. grid (heads, m), block hd.
extern "C" __global__ void attention_merge_q(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                                             bf16_t* __restrict__ out, int heads, int hd, int splits,
                                             const u32* __restrict__ tab, float had_scale) {
    __shared__ float s_o[HD_MAX];
    pdl_trigger();
    pdl_wait();
    int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    long base = ((long)t * heads + h) * splits;
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, part_ml[2 * (base + s)]);
    float Lsum = 0.f, o = 0.f;
    for (int s = 0; s < splits; s++) {
        float m = part_ml[2 * (base + s)];
        if (m == -INFINITY) continue;
        float w = __expf(m - M);
        Lsum += part_ml[2 * (base + s) + 1] * w;
        o += part_acc[(base + s) * hd + d] * w;
    }
    o = Lsum > 0.f ? o / Lsum : 0.f;
#if TURBO
    o = unrotate(s_o, o, hd, tab, had_scale);
#endif
    out[((long)t * heads + h) * hd + d] = f2bf(o);
}

// The values' inverse rotation of rows of bf16 heads in place (flash prefill over TurboQuant
// rows accumulates them rotated): x = H(x)·signs in f32. grid rows·heads, block hd.
extern "C" __global__ void unrotate_rows(bf16_t* __restrict__ x, int hd, const u32* __restrict__ tab,
                                         float had_scale) {
    __shared__ float s_o[HD_MAX];
    int d = threadIdx.x;
    bf16_t* row = x + (long)blockIdx.x * hd;
    row[d] = f2bf(unrotate(s_o, bf2f(row[d]), hd, tab, had_scale));
}
