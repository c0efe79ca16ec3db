// Decode attention (one query row) over the bf16 cache, one launch. CPU reference:
// backend/cpu/attention.rs.
//
// grid (heads / QB, 1, splits), block 128. A block takes QB query heads of one kv group
// (GQA: they share K/V, so each K/V row is loaded once for all of them) and the cached
// positions [s·chunk, (s+1)·chunk) ∩ [0, *pos0p] of split s. Positions are spread over
// lanes, not walked one by one: a group of hd/8 lanes takes one position (each lane 8
// dims, one 16-byte load of K and of V), so a warp scores 32·8/hd positions at once and
// every iteration's loads are independent. Each lane group keeps an online softmax per
// query head; groups merge in a fixed order through shared memory into the split's
// partial (max, sum, unnormalized output). The last block of the kv group to finish
// (counted in done[blockIdx.x], reset for the next step) merges the splits in split order,
// one warp per query head. Deterministic.
#include "common.cuh"

#define AW 4            // warps per block
#define QB_MAX 4        // query heads per block
#define SPLITS_MAX 1024 // splits the merge's shared memory holds (per query head)

extern "C" __global__ void __launch_bounds__(128)
    attention_decode(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                     float* __restrict__ part_ml, float* __restrict__ part_acc, bf16_t* __restrict__ out,
                     int* __restrict__ done, int heads, int n_kv, int hd, int qb, const int* __restrict__ pos0p,
                     int chunk) {
    __shared__ float s_m[32 * QB_MAX], s_l[32 * QB_MAX], s_acc[QB_MAX * 1024];  // groups · hd ≤ 1024
    __shared__ int last;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int G = hd / 8, PW = 32 / G;  // lanes per position, positions per warp step
    int grp = lane / G, gl = lane % G, gid = warp * PW + grp, groups = AW * PW;
    int h0 = blockIdx.x * qb, sp = blockIdx.z, splits = gridDim.z;
    int kvh = h0 / (heads / n_kv), width = n_kv * hd;
    int len = *pos0p + 1;
    int p0 = sp * chunk, p1 = min(len, p0 + chunk);
    float scale = rsqrtf((float)hd);
    float qv[QB_MAX][8], acc[QB_MAX][8], m[QB_MAX], l[QB_MAX];
#pragma unroll
    for (int j = 0; j < QB_MAX; j++) {
        if (j < qb) load_bf16x8(q + (long)(h0 + j) * hd + gl * 8, qv[j]);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            qv[j][i] = j < qb ? qv[j][i] * scale : 0.f;
            acc[j][i] = 0.f;
        }
        m[j] = -INFINITY;
        l[j] = 0.f;
    }
    const bf16_t* kb = kc + kvh * hd + gl * 8;
    const bf16_t* vb = vc + kvh * hd + gl * 8;
    for (int base = p0 + warp * PW; base < p1; base += AW * PW) {  // uniform per warp: shuffles below
        int p = base + grp;
        bool valid = p < p1;
        float kf[8], vf[8];
        load_bf16x8(kb + (long)min(p, p1 - 1) * width, kf);
        load_bf16x8(vb + (long)min(p, p1 - 1) * width, vf);
#pragma unroll
        for (int j = 0; j < QB_MAX; j++) {
            if (j >= qb) break;
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++) s = fmaf(qv[j][i], kf[i], s);
            for (int o = G / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (valid) {
                float mn = fmaxf(m[j], s), corr = __expf(m[j] - mn), e = __expf(s - mn);
                l[j] = l[j] * corr + e;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[j][i] = acc[j][i] * corr + e * vf[i];
                m[j] = mn;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < QB_MAX; j++) {
        if (j >= qb) break;
        if (gl == 0) {
            s_m[j * 32 + gid] = m[j];
            s_l[j * 32 + gid] = l[j];
        }
#pragma unroll
        for (int i = 0; i < 8; i++) s_acc[j * 1024 + gid * hd + gl * 8 + i] = acc[j][i];
    }
    __syncthreads();
    // This split's partial per query head: the lane groups merged in group order.
    for (int t = threadIdx.x; t < qb * hd; t += blockDim.x) {
        int j = t / hd, d = t % hd;
        float M = -INFINITY;
        for (int g = 0; g < groups; g++) M = fmaxf(M, s_m[j * 32 + g]);
        float L = 0.f, o = 0.f;
        for (int g = 0; g < groups; g++) {
            float mg = s_m[j * 32 + g];
            if (mg == -INFINITY) continue;
            float w = __expf(mg - M);
            L += s_l[j * 32 + g] * w;
            o += s_acc[j * 1024 + g * hd + d] * w;
        }
        long slot = (long)(h0 + j) * splits + sp;
        part_acc[slot * hd + d] = o;
        if (d == 0) {
            part_ml[2 * slot] = M;
            part_ml[2 * slot + 1] = L;
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done + blockIdx.x, 1) == splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Merge the splits: warp j takes query head j (qb ≤ 4 warps), so the heads merge in
    // parallel with warp-level reductions only. Partials come from other blocks: read
    // through L2 with __ldcg. The split weights exp(m_s − M) go once into shared memory
    // (s_acc's space, free by now), then each output dim is a dot product over the splits
    // whose loads are all independent.
    if (warp < qb) {
        int j = warp;
        long base = (long)(h0 + j) * splits;
        float* w = s_acc + j * 1024;
        float M = -INFINITY;
        for (int s = lane; s < splits; s += 32) M = fmaxf(M, __ldcg(part_ml + 2 * (base + s)));
        M = warp_max(M);
        float L = 0.f;
        for (int s = lane; s < splits; s += 32) {
            float ms = __ldcg(part_ml + 2 * (base + s));
            float ws = ms == -INFINITY ? 0.f : __expf(ms - M);
            w[s] = ws;
            L += ws * __ldcg(part_ml + 2 * (base + s) + 1);
        }
        L = warp_sum(L);
        __syncwarp();
        for (int d = lane; d < hd; d += 32) {
            const float* pa = part_acc + base * hd + d;
            float o = 0.f;
#pragma unroll 8
            for (int s = 0; s < splits; s++) o = fmaf(__ldcg(pa + (long)s * hd), w[s], o);
            out[(long)(h0 + j) * hd + d] = f2bf(o / L);
        }
    }
    if (threadIdx.x == 0) done[blockIdx.x] = 0;
}
