// Causal attention over a bf16 KV cache laid out [max_seq, n_kv·hd] per layer, GQA.
// kv_write stores this call's k/v rows at positions pos0.. (pos0 read from device memory); attention then runs one block
// per (query row, head): its 4 warps take every 4th cached position, each keeps an online
// softmax (running max, sum, and hd/32 accumulators per lane), and the warps merge in a
// fixed order, so results are deterministic. f32 math. CPU reference:
// backend/cpu/attention.rs.
#include "common.cuh"

#define AW 4          // warps per block
#define MAXD 8        // hd / 32 ≤ 8 (hd ≤ 256)

extern "C" __global__ void kv_write(bf16_t* __restrict__ kc, bf16_t* __restrict__ vc, const bf16_t* __restrict__ k,
                                    const bf16_t* __restrict__ v, int rows, int width, const int* __restrict__ pos0p) {
    long pos0 = *pos0p;
    long n = (long)rows * width;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        kc[(long)pos0 * width + i] = k[i];
        vc[(long)pos0 * width + i] = v[i];
    }
}

// Flash-decoding split-K: grid (heads, m, splits), block 128. Split s covers cached
// positions [s·chunk, (s+1)·chunk) of query row t (causal length *pos0 + t + 1); its 4 warps
// take every 4th position with an online softmax each, merged in warp order, and the split
// writes its running max, sum and unnormalized accumulator to scratch. Splits past the
// length write an empty partial. The split count is fixed by the cache size, so a captured
// decode graph stays valid as the position grows.
__device__ __forceinline__ void split_partial(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                                              const bf16_t* __restrict__ vc, float* __restrict__ part_ml,
                                              float* __restrict__ part_acc, int heads, int n_kv, int hd,
                                              const int* __restrict__ pos0p, int chunk) {
    __shared__ float s_m[AW], s_l[AW], s_acc[AW][MAXD * 32];
    int h = blockIdx.x, t = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int kvh = h / (heads / n_kv), width = n_kv * hd, per = hd / 32;
    int len = *pos0p + t + 1;
    int p0 = sp * chunk, p1 = min(len, p0 + chunk);
    long slot = ((long)t * heads + h) * splits + sp;
    float scale = rsqrtf((float)hd);
    const bf16_t* qh = q + ((long)t * heads + h) * hd;
    float qv[MAXD], acc[MAXD];
#pragma unroll
    for (int d = 0; d < MAXD; d++) {
        qv[d] = d < per ? bf2f(qh[lane + 32 * d]) * scale : 0.f;
        acc[d] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int p = p0 + warp; p < p1; p += AW) {
        const bf16_t* kr = kc + (long)p * width + kvh * hd;
        float s = 0.f;
#pragma unroll
        for (int d = 0; d < MAXD; d++)
            if (d < per) s = fmaf(qv[d], bf2f(kr[lane + 32 * d]), s);
        s = warp_sum(s);
        float mn = fmaxf(m, s), corr = __expf(m - mn), e = __expf(s - mn);
        l = l * corr + e;
        const bf16_t* vr = vc + (long)p * width + kvh * hd;
#pragma unroll
        for (int d = 0; d < MAXD; d++)
            if (d < per) acc[d] = acc[d] * corr + e * bf2f(vr[lane + 32 * d]);
        m = mn;
    }
    if (lane == 0) { s_m[warp] = m; s_l[warp] = l; }
#pragma unroll
    for (int d = 0; d < MAXD; d++)
        if (d < per) s_acc[warp][lane + 32 * d] = acc[d];
    __syncthreads();
    if (warp == 0) {
        float M = -INFINITY;
        for (int w = 0; w < AW; w++) M = fmaxf(M, s_m[w]);
        float L = 0.f;
        for (int w = 0; w < AW; w++) L += s_m[w] == -INFINITY ? 0.f : s_l[w] * __expf(s_m[w] - M);
        if (lane == 0) { part_ml[2 * slot] = M; part_ml[2 * slot + 1] = L; }
        for (int d = 0; d < per; d++) {
            float o = 0.f;
            for (int w = 0; w < AW; w++)
                if (s_m[w] != -INFINITY) o += s_acc[w][lane + 32 * d] * __expf(s_m[w] - M);
            part_acc[slot * hd + lane + 32 * d] = o;
        }
    }
}

extern "C" __global__ void attention_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                                           const bf16_t* __restrict__ vc, float* __restrict__ part_ml,
                                           float* __restrict__ part_acc, int heads, int n_kv, int hd,
                                           const int* __restrict__ pos0p, int chunk) {
    split_partial(q, kc, vc, part_ml, part_acc, heads, n_kv, hd, pos0p, chunk);
}

// Merge splits base..base+splits of one (row, head) in split order (deterministic) into
// out (hd values); threads stride over d. `__ldcg`: partials written by other blocks.
__device__ __forceinline__ void merge_splits(const float* part_ml, const float* part_acc, bf16_t* out, long base,
                                             int hd, int splits) {
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float M = -INFINITY;
        for (int s = 0; s < splits; s++) M = fmaxf(M, __ldcg(part_ml + 2 * (base + s)));
        float L = 0.f, o = 0.f;
        for (int s = 0; s < splits; s++) {
            float m = __ldcg(part_ml + 2 * (base + s));
            if (m == -INFINITY) continue;
            float w = __expf(m - M);
            L += __ldcg(part_ml + 2 * (base + s) + 1) * w;
            o += __ldcg(part_acc + (base + s) * hd + d) * w;
        }
        out[d] = f2bf(o / L);
    }
}

// Decode (one query row), one launch: grid (heads, 1, splits), block 128. Split s covers
// cached positions [s·chunk, (s+1)·chunk) ∩ [0, *pos0p]. Positions are spread over lanes,
// not walked one by one: a group of hd/8 lanes takes one position (each lane 8 dims, one
// 16-byte load of K and of V), so a warp scores 32·8/hd positions at once and every
// iteration's loads are independent. Each group keeps an online softmax; groups merge in
// a fixed order through shared memory into the split's partial, and the last split block
// of each head to finish (counted in done[h], reset for the next step) merges the
// partials in split order. Deterministic.
__device__ __forceinline__ void ld8(const bf16_t* p, float* f) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

extern "C" __global__ void attention_decode(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                                            const bf16_t* __restrict__ vc, float* __restrict__ part_ml,
                                            float* __restrict__ part_acc, bf16_t* __restrict__ out,
                                            int* __restrict__ done, int heads, int n_kv, int hd,
                                            const int* __restrict__ pos0p, int chunk) {
    __shared__ float s_m[32], s_l[32], s_acc[1024];  // ≤ 32 groups; groups · hd = 1024
    __shared__ int last;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int G = hd / 8, PW = 32 / G;  // lanes per position, positions per warp step
    int grp = lane / G, gl = lane % G, gid = warp * PW + grp;
    int h = blockIdx.x, sp = blockIdx.z, splits = gridDim.z;
    int kvh = h / (heads / n_kv), width = n_kv * hd;
    int len = *pos0p + 1;
    int p0 = sp * chunk, p1 = min(len, p0 + chunk);
    float scale = rsqrtf((float)hd);
    float qv[8], acc[8];
    ld8(q + (long)h * hd + gl * 8, qv);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        qv[j] *= scale;
        acc[j] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    const bf16_t* kb = kc + kvh * hd + gl * 8;
    const bf16_t* vb = vc + kvh * hd + gl * 8;
    for (int base = p0 + warp * PW; base < p1; base += AW * PW) {  // uniform per warp: shuffles below
        int p = base + grp;
        bool valid = p < p1;
        float kf[8], vf[8];
        ld8(kb + (long)min(p, p1 - 1) * width, kf);
        ld8(vb + (long)min(p, p1 - 1) * width, vf);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) s = fmaf(qv[j], kf[j], s);
        for (int o = G / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (valid) {
            float mn = fmaxf(m, s), corr = __expf(m - mn), e = __expf(s - mn);
            l = l * corr + e;
#pragma unroll
            for (int j = 0; j < 8; j++) acc[j] = acc[j] * corr + e * vf[j];
            m = mn;
        }
    }
    if (gl == 0) {
        s_m[gid] = m;
        s_l[gid] = l;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) s_acc[gid * hd + gl * 8 + j] = acc[j];
    __syncthreads();
    int groups = AW * PW;
    long slot = (long)h * splits + sp;
    float M = -INFINITY;
    for (int g = 0; g < groups; g++) M = fmaxf(M, s_m[g]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float L = 0.f, o = 0.f;
        for (int g = 0; g < groups; g++) {
            if (s_m[g] == -INFINITY) continue;
            float w = __expf(s_m[g] - M);
            L += s_l[g] * w;
            o += s_acc[g * hd + d] * w;
        }
        part_acc[slot * hd + d] = o;
        if (d == 0) {
            part_ml[2 * slot] = M;
            part_ml[2 * slot + 1] = L;
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done + h, 1) == splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    merge_splits(part_ml, part_acc, out + (long)h * hd, (long)h * splits, hd, splits);
    if (threadIdx.x == 0) done[h] = 0;
}

// RoPE on this call's q (in place) and k, then k and v into the cache at positions
// *pos0p.. (rope.cu's math; kv_write's layout). q [rows, heads·hd], k/v [rows, n_kv·hd].
// One thread per rotated pair of q or k, and per v element.
extern "C" __global__ void rope_kv(bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                   const bf16_t* __restrict__ v, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                   const float* __restrict__ inv_freq, int rows, int heads, int n_kv, int hd,
                                   const int* __restrict__ pos0p, float linear, int interleaved) {
    int pos0 = *pos0p, half = hd / 2, width = n_kv * hd;
    long nq = (long)rows * heads * half, nk = (long)rows * n_kv * half, nv = (long)rows * width;
    for (long t = blockIdx.x * (long)blockDim.x + threadIdx.x; t < nq + nk + nv; t += (long)gridDim.x * blockDim.x) {
        if (t >= nq + nk) {
            long i = t - nq - nk;
            vc[(long)pos0 * width + i] = v[i];
            continue;
        }
        bool isq = t < nq;
        long u = isq ? t : t - nq;
        int j = u % half;
        long rh = u / half;
        int row = rh / (isq ? heads : n_kv);
        float a = ((float)(pos0 + row) / linear) * inv_freq[j];
        float sn, cs;
        sincosf(a, &sn, &cs);
        int i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + half;
        const bf16_t* src = isq ? q + rh * hd : k + rh * hd;
        float x0 = bf2f(src[i0]), x1 = bf2f(src[i1]);
        bf16_t y0 = f2bf(x0 * cs - x1 * sn), y1 = f2bf(x0 * sn + x1 * cs);
        if (isq) {
            q[rh * hd + i0] = y0;
            q[rh * hd + i1] = y1;
        } else {
            bf16_t* dst = kc + (long)pos0 * width + rh * hd;  // rh = row·n_kv + head
            dst[i0] = y0;
            dst[i1] = y1;
        }
    }
}

// Merge the splits of each (row, head) in split order (deterministic). grid (heads, m),
// block hd. out: [m, heads·hd] bf16.
extern "C" __global__ void attention_merge(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                                           bf16_t* __restrict__ out, int heads, int hd, int splits) {
    int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    long base = ((long)t * heads + h) * splits;
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, part_ml[2 * (base + s)]);
    float L = 0.f, o = 0.f;
    for (int s = 0; s < splits; s++) {
        float m = part_ml[2 * (base + s)];
        if (m == -INFINITY) continue;
        float w = __expf(m - M);
        L += part_ml[2 * (base + s) + 1] * w;
        o += part_acc[(base + s) * hd + d] * w;
    }
    out[((long)t * heads + h) * hd + d] = f2bf(o / L);
}
