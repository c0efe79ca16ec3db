// Causal attention over a paged bf16 KV store laid out [blocks·KV_BLOCK, n_kv·hd] per layer
// (position p of the sequence in row kv_row(p, table), through its block table), GQA.
// A call's rows may belong to several sequences: row r sits at position pos[r] and its
// sequence's block table (of the layer's kind) starts at tables + row_tab[r] (both read from
// device memory, staged per call; a captured call's padding rows sit at position -1: they
// write nothing and attend nothing). kv_write stores the call's k/v rows; attention then runs one block
// per (query row, head): its 4 warps take every 4th cached position, each keeps an online
// softmax (running max, sum, and hd/32 accumulators per lane), and the warps merge in a
// fixed order, so results are deterministic. f32 math. CPU reference:
// backend/cpu/attention.rs.
#include "common.cuh"

#define AW 4          // warps per block
#define MAXD 8        // hd / 32 ≤ 8 (hd ≤ 256)

extern "C" __global__ void kv_write(bf16_t* __restrict__ kc, bf16_t* __restrict__ vc, const bf16_t* __restrict__ k,
                                    const bf16_t* __restrict__ v, int rows, int width, const int* __restrict__ pos,
                                    const int* __restrict__ tables, const int* __restrict__ row_tab) {
    long n = (long)rows * width;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        long r = i / width;
        if (pos[r] < 0) continue;  // a padding row of a captured call
        long o = kv_row(pos[r], tables + row_tab[r]) * width + i % width;
        kc[o] = k[i];
        vc[o] = v[i];
    }
}

// Flash-decoding split-K: grid (heads, m, splits), block 128. Query row t attends the span
// of its last `span` cached positions (its causal length pos[t] + 1, or a window > 0's last
// `window` of them); split s covers the span's positions [s·chunk, (s+1)·chunk), where
// chunk = min_chunk·2^k is the smallest such size that covers the span in max_splits splits.
// The chunk is a function of the row's own span, so its bits do not depend on the call's
// other rows, while a short decode row still spreads over several blocks. Scores are scaled
// by `scale`. A split's 4 warps take every 4th position with an online softmax each, merged
// in warp order, and the split writes its running max, sum and unnormalized accumulator to
// scratch. Splits past the span write an empty partial, so a call (or a captured graph) may
// launch more splits than its rows need.
extern "C" __global__ void attention_split(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                                           const bf16_t* __restrict__ vc, float* __restrict__ part_ml,
                                           float* __restrict__ part_acc, int heads, int n_kv, int hd,
                                           const int* __restrict__ pos, int min_chunk, int max_splits, float scale, int window,
                                           const int* __restrict__ tables, const int* __restrict__ row_tab) {
    __shared__ float s_m[AW], s_l[AW], s_acc[AW][MAXD * 32];
    int h = blockIdx.x, t = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int kvh = h / (heads / n_kv), width = n_kv * hd, per = hd / 32;
    int len = pos[t] + 1;
    const int* table = tables + row_tab[t];
    int start = window > 0 ? max(0, len - window) : 0, span = len - start;
    int chunk = min_chunk;
    while ((long)chunk * max_splits < span) chunk *= 2;
    int p0 = start + sp * chunk, p1 = min(len, p0 + chunk);
    long slot = ((long)t * heads + h) * splits + sp;
    const bf16_t* qh = q + ((long)t * heads + h) * hd;
    float qv[MAXD], acc[MAXD];
#pragma unroll
    for (int d = 0; d < MAXD; d++) {
        qv[d] = d < per ? bf2f(qh[lane + 32 * d]) * scale : 0.f;
        acc[d] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int p = p0 + warp; p < p1; p += AW) {
        long row = kv_row(p, table) * width + kvh * hd;
        const bf16_t* kr = kc + row;
        float s = 0.f;
#pragma unroll
        for (int d = 0; d < MAXD; d++)
            if (d < per) s = fmaf(qv[d], bf2f(kr[lane + 32 * d]), s);
        s = warp_sum(s);
        float mn = fmaxf(m, s), corr = __expf(m - mn), e = __expf(s - mn);
        l = l * corr + e;
        const bf16_t* vr = vc + row;
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


// RoPE on this call's q (in place) and k, then k and v into the cache at the rows'
// positions (rope.cu's math; kv_write's layout). q [rows, heads·hd], k/v [rows, n_kv·hd].
// One thread per rotated pair of q or k, and per v element.
extern "C" __global__ void rope_kv(bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
                                   const bf16_t* __restrict__ v, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                                   const float* __restrict__ inv_freq, int rows, int heads, int n_kv, int hd,
                                   const int* __restrict__ pos, float linear, int interleaved,
                                   const int* __restrict__ tables, const int* __restrict__ row_tab) {
    pdl_trigger();  // launched with PDL: nothing to load before the wait
    pdl_wait();
    int half = hd / 2, width = n_kv * hd;
    long nq = (long)rows * heads * half, nk = (long)rows * n_kv * half, nv = (long)rows * width;
    for (long t = blockIdx.x * (long)blockDim.x + threadIdx.x; t < nq + nk + nv; t += (long)gridDim.x * blockDim.x) {
        if (t >= nq + nk) {
            long i = t - nq - nk;
            long r = i / width;
            if (pos[r] >= 0) vc[kv_row(pos[r], tables + row_tab[r]) * width + i % width] = v[i];
            continue;
        }
        bool isq = t < nq;
        long u = isq ? t : t - nq;
        int j = u % half;
        long rh = u / half;
        int row = rh / (isq ? heads : n_kv);
        int i0, i1;
        rope_pair_index(j, half, interleaved, i0, i1);
        const bf16_t* src = isq ? q + rh * hd : k + rh * hd;
        bf16_t y0, y1;
        rope_rotate(bf2f(src[i0]), bf2f(src[i1]), pos[row], linear, inv_freq[j], y0, y1);
        if (isq) {
            q[rh * hd + i0] = y0;
            q[rh * hd + i1] = y1;
        } else if (pos[row] >= 0) {  // padding rows (position -1) write nothing
            bf16_t* dst = kc + kv_row(pos[row], tables + row_tab[row]) * width + (rh - (long)row * n_kv) * hd;  // rh = row·n_kv + head
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
    // L = 0: a padding row (position -1) attended nothing; 0 keeps its later rows finite.
    out[((long)t * heads + h) * hd + d] = f2bf(L > 0.f ? o / L : 0.f);
}
