// Decode attention for one block's work item: QB query heads (block column bx) over the
// positions of split sp (attention_decode.cu explains the design), run by AW warps:
// ATT_SYNC() is their barrier (the whole block in the attention_decode kernel). `wait()`
// returns when q and the new k/v may be read (the kernel's pdl_wait); the cached
// positions' first loads go out before it.
#pragma once
#include "common.cuh"

#ifndef ATT_SYNC
#define ATT_SYNC() __syncthreads()
#endif


#define AW 4            // warps per block
#ifndef QB_MAX
#define QB_MAX 4        // query heads per block, at most (the host compiles one per qb: attn_decode.rs)
#endif
#define SPLITS_MAX 1024 // splits the merge's shared memory holds (per query head)
#define UNR 4           // positions per lane group whose loads are in flight together
#ifndef SCORE_BATCH     // score a round's UNR positions together (deep caches; see attn_decode.rs)
#define SCORE_BATCH 0
#endif
// Rounds of K/V loads ahead of the scoring (1: the next round's go out as a round is scored;
// 2: the first two rounds' go out before the wait, so a split of up to two rounds pays no
// DRAM latency after its release). 2 where a block takes one query head: with 2 or more
// heads the extra 32 registers spill (ptxas, sm_90, under the 3-blocks-per-SM bound). 1 in
// the register-capped kernel (ATT_CAP, attention_decode.cu), whose long splits pay that
// latency once either way.
#ifndef ATT_CAP
#define ATT_CAP 0
#endif
#ifndef KV_AHEAD
#define KV_AHEAD (QB_MAX == 1 && !ATT_CAP ? 2 : 1)
#endif
#ifndef CS_MAX
#define CS_MAX 8        // blocks per cluster (decode.rs: ATTN_CLUSTER_MAX)
#endif
// The direct cluster merge (below, in attend): one query head per block, at most 8 blocks per
// cluster (a warp's lanes hold the cluster's AW · CS_MAX ≤ 32 partials), head dims of 32,
// 64 or 128.
#ifndef ATT_DIRECT
#define ATT_DIRECT (QB_MAX == 1 && CS_MAX * AW <= 32)
#endif
#define ATT_DIRECT_HD 128

// The weight exp(m − M) of a softmax partial with max m under the overall max M: 0 for a
// partial that saw no position (m = −∞), whatever M is.
__device__ __forceinline__ float partial_weight(float m, float M) { return m == -INFINITY ? 0.f : __expf(m - M); }

// RoPE of the 8 dims [8·gl, 8·gl + 8) of a head held by lane-group lane gl (G lanes per
// head): pairs (2j, 2j+1) when interleaved, else (j, j + hd/2), whose partner dim is in
// lane gl ^ G/2. The angles depend only on the position, so they are computed once per
// lane (before the kernel waits for q/k) and turn every head the lane holds.
struct Rope8 {
    float s[8], c[8];  // interleaved: pair i/2's at even i; else dim i's pair's
    bool first;        // not interleaved: this lane's dims are the pairs' first halves

    __device__ __forceinline__ void init(int gl, int hd, int pos, float linear, const float* __restrict__ inv_freq,
                                         int interleaved) {
        int half = hd / 2;
        first = gl * 8 < half;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int d = gl * 8 + i;
            if (interleaved && i % 2 == 0) rope_angle(pos, linear, inv_freq[d / 2], s[i], c[i]);
            else if (!interleaved) rope_angle(pos, linear, inv_freq[first ? d : d - half], s[i], c[i]);
        }
    }

    // Every lane of the warp must call this (a shuffle).
    __device__ __forceinline__ void apply(float (&x)[8], int G, int interleaved) const {
        float other[8];
#pragma unroll
        for (int i = 0; i < 8; i++) other[i] = __shfl_xor_sync(0xffffffffu, x[i], G / 2);
        if (interleaved) {
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                bf16_t y0, y1;
                rope_turn(x[i], x[i + 1], s[i], c[i], y0, y1);
                x[i] = bf2f(y0);
                x[i + 1] = bf2f(y1);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                bf16_t y0, y1;
                rope_turn(first ? x[i] : other[i], first ? other[i] : x[i], s[i], c[i], y0, y1);
                x[i] = bf2f(first ? y0 : y1);
            }
        }
    }
};

// The q/k norm (Qwen3, Gemma 3) of the 8 values a lane holds of a head: the sum of squares
// over the head's G lanes, then x · rsqrt(mean(x²) + eps) · w (rmsnorm.cu's rmsnorm_heads).
__device__ __forceinline__ void head_norm(float (&v)[8], const float* __restrict__ w, float eps, int hd, int G) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) ss += v[i] * v[i];
    for (int o = G / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    float r = rsqrtf(ss / hd + eps);
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = w[i] * (v[i] * r);
}

// The new position's 8 dims of k (rotated, f32: rounded to bf16 here) and v (as loaded)
// into the cache at element offset o.
__device__ __forceinline__ void store_new_kv(bf16_t* kc, bf16_t* vc, long o, const float (&kn)[8], uint4 vnr) {
    uint4 kw;
    kw.x = (u32)f2bf(kn[0]) | ((u32)f2bf(kn[1]) << 16);
    kw.y = (u32)f2bf(kn[2]) | ((u32)f2bf(kn[3]) << 16);
    kw.z = (u32)f2bf(kn[4]) | ((u32)f2bf(kn[5]) << 16);
    kw.w = (u32)f2bf(kn[6]) | ((u32)f2bf(kn[7]) << 16);
    *reinterpret_cast<uint4*>(kc + o) = kw;
    *reinterpret_cast<uint4*>(vc + o) = vnr;
}

#include "attention_decode_mma.cuh"

template <class Wait>
__device__ __forceinline__ void attend(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_new,
                                       const bf16_t* __restrict__ v_new, bf16_t* __restrict__ kc,
                                       bf16_t* __restrict__ vc, const float* __restrict__ inv_freq, float linear,
                                       int interleaved, float* __restrict__ part_ml, float* __restrict__ part_acc,
                                       bf16_t* __restrict__ out, int* __restrict__ done, int heads, int n_kv, int hd,
                                       int qb, int pos0, int chunk, int cs, int bx, int sp, int splits, float scale,
                                       int window, const float* __restrict__ qn, const float* __restrict__ knw,
                                       float eps, const int* __restrict__ table, Wait wait) {
    __shared__ float s_m[32 * QB_MAX], s_l[32 * QB_MAX], s_acc[QB_MAX * 1024];  // groups · hd ≤ 1024
    __shared__ float s_pm[QB_MAX], s_pl[QB_MAX], s_po[QB_MAX * 256];             // qb · hd ≤ 1024
    __shared__ int last;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int G = hd / 8, PW = 32 / G;  // lanes per position, positions per warp step
    int grp = lane / G, gl = lane % G, gid = warp * PW + grp, groups = AW * PW;
    int h0 = bx * qb;
    int kvh = h0 / (heads / n_kv), width = n_kv * hd;
    int p0 = sp * chunk, p1 = min(pos0 + 1, p0 + chunk);
    if (window > 0) p0 = max(p0, pos0 + 1 - window);  // a sliding-window layer's first position
    int pc = min(p1, pos0);  // cached positions of this split: [p0, pc)
#if ATT_DIRECT
    // The direct merge writes into rank 0's shared memory, which needs rank 0 started: this
    // arrive, with the wait just before the writes, guarantees it (long satisfied by then).
    const bool direct = cs > 1 && hd <= ATT_DIRECT_HD && (hd & (hd - 1)) == 0;  // lane groups: powers of two
    if (direct) cluster_arrive_relaxed();
#endif
    const bf16_t* kb = kc + kvh * hd + gl * 8;
    const bf16_t* vb = vc + kvh * hd + gl * 8;
    // K/V of cached positions: positions past pc reload position pc - 1, unused.
    auto load_kv = [&](int base0, uint4 (&kr)[UNR], uint4 (&vr)[UNR]) {
#pragma unroll
        for (int u = 0; u < UNR; u++) {
            long row = kv_row(min(base0 + u * AW * PW + grp, pc - 1), table) * width;
            kr[u] = *reinterpret_cast<const uint4*>(kb + row);
            vr[u] = *reinterpret_cast<const uint4*>(vb + row);
        }
    };
    int first = p0 + warp * PW;
    uint4 kr[UNR], vr[UNR];
    if (!ATT_MMA_ON && first < pc) load_kv(first, kr, vr);
#if KV_AHEAD > 1
    uint4 kr2[UNR], vr2[UNR];
    if (first + AW * PW * UNR < pc) load_kv(first + AW * PW * UNR, kr2, vr2);
#endif
    Rope8 rope;
    rope.init(gl, hd, pos0, linear, inv_freq, interleaved);
    wait();
    // The new position's k (rotated below) and v, if it is in this split: loaded with q.
    bool has_new = pos0 >= p0 && pos0 < p1 && warp == 0;
    float kn[8], vn[8];
    uint4 vnr;
    if (has_new) {
        load_bf16x8(k_new + kvh * hd + gl * 8, kn);
        vnr = *reinterpret_cast<const uint4*>(v_new + kvh * hd + gl * 8);
        unpack_bf16x8(vnr, vn);
    }
    float qv[QB_MAX][8], acc[QB_MAX][8], m[QB_MAX], l[QB_MAX];
#pragma unroll
    for (int j = 0; j < QB_MAX; j++) {
        if (j < qb) {
            load_bf16x8(q + (long)(h0 + j) * hd + gl * 8, qv[j]);
            if (qn) head_norm(qv[j], qn + gl * 8, eps, hd, G);
            rope.apply(qv[j], G, interleaved);
            ATT_MMA_Q(j);
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            qv[j][i] = j < qb ? qv[j][i] * scale : 0.f;
            acc[j][i] = 0.f;
        }
        m[j] = -INFINITY;
        l[j] = 0.f;
    }
    if (has_new) {
        if (knw) head_norm(kn, knw + gl * 8, eps, hd, G);
        rope.apply(kn, G, interleaved);
    }
    // Score positions p (valid: this lane group's position is real) into the online softmax.
    auto score = [&](const float (&kf)[8], const float (&vf)[8], bool valid) {
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
    };
    if (ATT_MMA_ON) {
        attend_mma_bf16(kc, vc, table, has_new, kn, vnr, pos0, kvh, width, hd, qb, p0, p1, scale, grp, gl);
    } else {
        // Each round's K/V loads go out KV_AHEAD rounds before it is scored (KV_AHEAD + 1 rounds
        // in registers), so a split pays at most one DRAM latency after the release, not one per
        // round (none up to KV_AHEAD rounds: their loads went out before the wait).
        for (int base0 = first; base0 < pc; base0 += AW * PW * UNR) {  // uniform per warp: shuffles
            uint4 kn_r[UNR], vn_r[UNR];
#pragma unroll
            for (int u = 0; u < UNR; u++) kn_r[u] = kr[u], vn_r[u] = vr[u];
#if KV_AHEAD > 1
#pragma unroll
            for (int u = 0; u < UNR; u++) kr[u] = kr2[u], vr[u] = vr2[u];
            if (base0 + 2 * AW * PW * UNR < pc) load_kv(base0 + 2 * AW * PW * UNR, kr2, vr2);
#else
            if (base0 + AW * PW * UNR < pc) load_kv(base0 + AW * PW * UNR, kr, vr);
#endif
#if SCORE_BATCH
            // The round's UNR positions scored together (independent dot products and
            // shuffles), then folded into the online softmax with one rescale.
            float sc[UNR][QB_MAX];
            bool ok[UNR];
#pragma unroll
            for (int u = 0; u < UNR; u++) {
                ok[u] = base0 + u * AW * PW + grp < pc;
                float kf[8];
                unpack_bf16x8(kn_r[u], kf);
#pragma unroll
                for (int j = 0; j < QB_MAX; j++) {
                    float d = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; i++) d = fmaf(qv[j][i], kf[i], d);  // qv is 0 for j ≥ qb
                    sc[u][j] = d;
                }
            }
            for (int o = G / 2; o > 0; o >>= 1)
#pragma unroll
                for (int u = 0; u < UNR; u++)
#pragma unroll
                    for (int j = 0; j < QB_MAX; j++)
                        if (j < qb) sc[u][j] += __shfl_xor_sync(0xffffffffu, sc[u][j], o);
#pragma unroll
            for (int j = 0; j < QB_MAX; j++) {
                if (j >= qb) break;
                float mn = m[j];
#pragma unroll
                for (int u = 0; u < UNR; u++) mn = ok[u] ? fmaxf(mn, sc[u][j]) : mn;
                if (mn == -INFINITY) continue;  // none of the round's positions is this group's
                float corr = __expf(m[j] - mn);
                l[j] *= corr;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[j][i] *= corr;
#pragma unroll
                for (int u = 0; u < UNR; u++) {
                    if (!ok[u]) continue;
                    float e = __expf(sc[u][j] - mn), vf[8];
                    unpack_bf16x8(vn_r[u], vf);
                    l[j] += e;
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[j][i] = fmaf(e, vf[i], acc[j][i]);
                }
                m[j] = mn;
            }
#else
#pragma unroll
            for (int u = 0; u < UNR; u++) {
                int base = base0 + u * AW * PW;
                if (base >= pc) break;
                float kf[8], vf[8];
                unpack_bf16x8(kn_r[u], kf);
                unpack_bf16x8(vn_r[u], vf);
                score(kf, vf, base + grp < pc);
            }
#endif
        }
        // The new position, if it is in this split: scored last by warp 0's lane group 0 (its
        // k/v were loaded with q), written to the cache by the kv group's first block.
        if (has_new) {
            score(kn, vn, grp == 0);
            if (grp == 0 && h0 % (heads / n_kv) == 0)
                store_new_kv(kc, vc, kv_row(pos0, table) * width + kvh * hd + gl * 8, kn, vnr);
        }
    }
    const float *pm = s_pm, *pl = s_pl, *po = s_po;
#if ATT_DIRECT
    if (direct) {
        // The split's lane groups merge by shuffles within each warp (xor over the group
        // index: every group ends with its warp's partial); lane group 0 of each warp stores
        // it into rank 0's shared memory, slot [rank][warp]; after one cluster barrier rank 0
        // merges the cs · AW partials in slot order. Against the two-level merge (lane groups
        // through shared memory into a block partial, two block barriers, then rank 0 reading
        // the blocks' partials between two cluster barriers) this drops two block barriers,
        // a remote read round trip and a cluster barrier from the path (1B decode at 512
        // cached: attention ~5.0 µs after its release; docs/perf-log.md).
        __shared__ __align__(16) float s_dacc[CS_MAX * AW * ATT_DIRECT_HD];
        __shared__ __align__(16) float s_dml[CS_MAX * AW * 4];
        float mw = m[0], lw = l[0], aw[8];
#pragma unroll
        for (int i = 0; i < 8; i++) aw[i] = acc[0][i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            if (o < G) break;  // lanes of one group: the same position set
            float m2 = __shfl_xor_sync(0xffffffffu, mw, o), l2 = __shfl_xor_sync(0xffffffffu, lw, o);
            float mx = fmaxf(mw, m2);
            float w1 = partial_weight(mw, mx), w2 = partial_weight(m2, mx);
            lw = lw * w1 + l2 * w2;
#pragma unroll
            for (int i = 0; i < 8; i++) aw[i] = aw[i] * w1 + __shfl_xor_sync(0xffffffffu, aw[i], o) * w2;
            mw = mx;
        }
        unsigned rank = cluster_rank();
        int slot = rank * AW + warp;
        cluster_wait();  // rank 0 has started (the arrive at the top)
        if (grp == 0) {
            st_cluster4(s_dacc + slot * hd + gl * 8, 0, aw[0], aw[1], aw[2], aw[3]);
            st_cluster4(s_dacc + slot * hd + gl * 8 + 4, 0, aw[4], aw[5], aw[6], aw[7]);
            if (gl == 0) st_cluster4(s_dml + slot * 4, 0, mw, lw, 0.f, 0.f);
        }
        cluster_sync();  // the stores released to rank 0
        if (rank != 0) return;
        // Every warp computes the partials' weights itself (lane p: partial p), so no block
        // barrier: M, then w_p = exp(m_p − M) and L = Σ w_p l_p; each output dim is Σ w_p acc_p.
        int np = cs * AW;
        float mp = lane < np ? s_dml[lane * 4] : -INFINITY, lp = lane < np ? s_dml[lane * 4 + 1] : 0.f;
        float mx = warp_max(mp);
        float wp = partial_weight(mp, mx);
        float lsum = warp_sum(wp * lp);
        int units = splits / cs;
        for (int d = threadIdx.x; d < hd; d += AW * 32) {  // warp-uniform: hd is a multiple of 32
            float o = 0.f;
            for (int p = 0; p < np; p++) o = fmaf(__shfl_sync(0xffffffffu, wp, p), s_dacc[p * hd + d], o);
            if (units == 1) out[(long)h0 * hd + d] = f2bf(o / lsum);
            else s_po[d] = o;
        }
        if (units == 1) return;
        if (threadIdx.x == 0) {
            s_pm[0] = mx;
            s_pl[0] = lsum;
        }
        ATT_SYNC();
    } else {
#endif
    if (ATT_MMA_ON) {
        merge_mma_warps(qb, hd, s_pm, s_pl, s_po);
    } else {
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
    ATT_SYNC();
    // This split's partial per query head: the lane groups merged in group order, into
    // s_pm/s_pl (max, sum) and s_po (unnormalized output).
    // (Unrolled: the shared-memory reads of several groups are in flight together.)
    for (int t = threadIdx.x; t < qb * hd; t += AW * 32) {
        int j = t / hd, d = t % hd;
        float M = -INFINITY;
#pragma unroll 8
        for (int g = 0; g < groups; g++) M = fmaxf(M, s_m[j * 32 + g]);
        float L = 0.f, o = 0.f;
#pragma unroll 8
        for (int g = 0; g < groups; g++) {
            float mg = s_m[j * 32 + g];
            float w = partial_weight(mg, M);
            L += s_l[j * 32 + g] * w;
            o += s_acc[j * 1024 + g * hd + d] * w;
        }
        s_po[t] = o;
        if (d == 0) {
            s_pm[j] = M;
            s_pl[j] = L;
        }
    }
    ATT_SYNC();
    }
    if (cs > 1) {
        // The cluster's splits merged by its rank 0 in rank order, reading the others'
        // partials from their shared memory (no global round trip, no fence), into s_m /
        // s_l / s_acc (free by now). The second barrier keeps every block's shared memory
        // alive until rank 0 has read it.
        cluster_sync();
        bool lead = cluster_rank() == 0;
        if (lead) {
            for (int t = threadIdx.x; t < qb * hd; t += AW * 32) {
                int j = t / hd;
                // Every rank's three values requested at once: one round trip to the other
                // blocks' shared memory instead of one per read.
                float mr[CS_MAX], lr[CS_MAX], orr[CS_MAX];
#pragma unroll
                for (int r = 0; r < CS_MAX; r++) {
                    bool on = r < cs;
                    mr[r] = on ? ld_cluster(s_pm + j, r) : -INFINITY;
                    lr[r] = on ? ld_cluster(s_pl + j, r) : 0.f;
                    orr[r] = on ? ld_cluster(s_po + t, r) : 0.f;
                }
                float M = -INFINITY;
#pragma unroll
                for (int r = 0; r < CS_MAX; r++) M = fmaxf(M, mr[r]);
                float L = 0.f, o = 0.f;
#pragma unroll
                for (int r = 0; r < CS_MAX; r++) {
                    float w = partial_weight(mr[r], M);
                    L += lr[r] * w;
                    o += orr[r] * w;
                }
                s_acc[t] = o;
                if (t % hd == 0) {
                    s_m[j] = M;
                    s_l[j] = L;
                }
            }
        }
        cluster_sync();
        if (!lead) return;
        pm = s_m;
        pl = s_l;
        po = s_acc;
    }
#if ATT_DIRECT
    }
#endif
    // One merge unit (a cluster, or a block when cs = 1) per head covers every position:
    // its partial is the output.
    int units = splits / cs, unit = sp / cs;
    if (units == 1) {
        for (int t = threadIdx.x; t < qb * hd; t += AW * 32)
            out[(long)h0 * hd + t] = f2bf(po[t] / pl[t / hd]);
        return;
    }
    for (int t = threadIdx.x; t < qb * hd; t += AW * 32) {
        int j = t / hd, d = t % hd;
        long slot = (long)(h0 + j) * units + unit;
        part_acc[slot * hd + d] = po[t];
        if (d == 0) {
            part_ml[2 * slot] = pm[j];
            part_ml[2 * slot + 1] = pl[j];
        }
    }
    __threadfence();
    ATT_SYNC();
    if (threadIdx.x == 0) last = atomicAdd(done + bx, 1) == units - 1;
    ATT_SYNC();
    if (!last) return;
    __threadfence();
    // Merge the units with the whole block: a deep cache has ~50-130 units per head, and a
    // warp per head walking them (a chain of dependent L2 round trips per 8 units) took 14 µs
    // of SmolLM2's 24 at 7 424 cached (H200, docs/perf-log.md). Partials come from
    // other blocks: read through L2 with __ldcg. First each head's max M over its units
    // (block reductions through s_m), then the unit weights exp(m_u − M) into shared memory
    // (s_acc's space, free by now) with the sum L, then each output float4 as a dot product
    // over the units, split over R threads whose loads (16 at a time) are independent, and
    // the R partial sums added in order through s_red. Deterministic.
    constexpr int T = AW * 32;
    __shared__ float4 s_red[T];
    const int tid = threadIdx.x;
    // Units outer, heads inner: every head's loads of a pass go out together (heads outer
    // made the 1B's 4 heads 4 rounds of L2 loads and reductions, one after another).
    float mx[QB_MAX];
#pragma unroll
    for (int j = 0; j < QB_MAX; j++) mx[j] = -INFINITY;
    for (int s = tid; s < units; s += T)
#pragma unroll
        for (int j = 0; j < QB_MAX; j++)
            if (j < qb) mx[j] = fmaxf(mx[j], __ldcg(part_ml + 2 * ((long)(h0 + j) * units + s)));
#pragma unroll
    for (int j = 0; j < QB_MAX; j++) {
        if (j >= qb) continue;
        mx[j] = warp_max(mx[j]);
        if (lane == 0) s_m[j * 32 + warp] = mx[j];
    }
    ATT_SYNC();
    float M[QB_MAX], lsum[QB_MAX];
#pragma unroll
    for (int j = 0; j < QB_MAX; j++) {
        M[j] = -INFINITY;
        lsum[j] = 0.f;
        for (int wi = 0; wi < AW && j < qb; wi++) M[j] = fmaxf(M[j], s_m[j * 32 + wi]);
    }
    for (int s = tid; s < units; s += T) {
        float ms[QB_MAX], ls[QB_MAX];
#pragma unroll
        for (int j = 0; j < QB_MAX; j++) {
            long slot = (long)(h0 + j) * units + s;
            ms[j] = j < qb ? __ldcg(part_ml + 2 * slot) : -INFINITY;
            ls[j] = j < qb ? __ldcg(part_ml + 2 * slot + 1) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < QB_MAX; j++) {
            if (j >= qb) continue;
            float ws = partial_weight(ms[j], M[j]);
            s_acc[j * units + s] = ws;
            lsum[j] = fmaf(ws, ls[j], lsum[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < QB_MAX; j++)
        if (j < qb) lsum[j] = warp_sum(lsum[j]);
    ATT_SYNC();  // the weights complete before any thread's dot products read them
#pragma unroll
    for (int j = 0; j < QB_MAX; j++)
        if (j < qb && lane == 0) s_l[j * 32 + warp] = lsum[j];
    int hd4 = hd / 4, ng = qb * hd4, R = max(1, T / ng);  // float4 outputs, threads per output
    for (int g0 = 0; g0 < ng; g0 += T) {  // one pass unless qb · hd > 4 · T
        int g = g0 + tid % ng, r = tid / ng;
        bool on = g < ng && r < R;
        int j = on ? g / hd4 : 0, d4 = g % hd4;
        const float4* pa = reinterpret_cast<const float4*>(part_acc + (long)(h0 + j) * units * hd) + d4;
        const float* w = s_acc + j * units;
        float4 o = {0.f, 0.f, 0.f, 0.f};
        // Units r, r + R, …: 16 loads issued together per round, the last round's past
        // `units` predicated off (a plain unrolled loop left its remainder as a chain of
        // dependent loads: 9 of the 1B's 25 at 8K cached).
        constexpr int LU = 16;
        for (int s0 = r; on && s0 < units; s0 += LU * R) {
            float4 a[LU];
            float ws[LU];
#pragma unroll
            for (int u = 0; u < LU; u++) {
                int s = s0 + u * R;
                bool ok = s < units;
                a[u] = ok ? __ldcg(pa + (long)s * hd4) : float4{0.f, 0.f, 0.f, 0.f};
                ws[u] = ok ? w[s] : 0.f;
            }
#pragma unroll
            for (int u = 0; u < LU; u++) {
                o.x = fmaf(ws[u], a[u].x, o.x);
                o.y = fmaf(ws[u], a[u].y, o.y);
                o.z = fmaf(ws[u], a[u].z, o.z);
                o.w = fmaf(ws[u], a[u].w, o.w);
            }
        }
        ATT_SYNC();  // s_red free (the previous pass's reads), s_l written
        if (on) s_red[r * ng + (g - g0)] = o;
        ATT_SYNC();
        if (tid < min(ng - g0, T)) {
            int gg = g0 + tid, jj = gg / hd4;
            float4 sum = s_red[tid];
            for (int rr = 1; rr < R; rr++) {
                float4 a = s_red[rr * ng + tid];
                sum.x += a.x, sum.y += a.y, sum.z += a.z, sum.w += a.w;
            }
            float L = 0.f;
            for (int wi = 0; wi < AW; wi++) L += s_l[jj * 32 + wi];
            uint2 packed;
            packed.x = (u32)f2bf(sum.x / L) | ((u32)f2bf(sum.y / L) << 16);
            packed.y = (u32)f2bf(sum.z / L) | ((u32)f2bf(sum.w / L) << 16);
            *reinterpret_cast<uint2*>(out + (long)(h0 + jj) * hd + 4 * (gg % hd4)) = packed;
        }
    }
    if (threadIdx.x == 0) done[bx] = 0;
}
