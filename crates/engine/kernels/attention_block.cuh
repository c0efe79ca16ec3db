// The attention half of a decode layer as one launch (ATTN_BLOCK=1 variant of gemv.cu, NW 4;
// backend/cuda/attn_block.rs, `FERROLM_ATTN_BLOCK`):
//     q/k/v = W·n(x) │ RoPE, cache write, attention │ x += o·att
// Thread-block clusters of CS blocks (ranks r), HS clusters per kv group, cluster c taking
// qc = group / HS of the group's query heads: the cluster computes its heads' q rows and
// the group's k/v rows (gemv() with the steps dealt over the ranks; the op path's row
// sums; the HS clusters of a group write the same k/v values), then after a cluster
// barrier runs attention with split r of the positions on rank r (attention_decode.cuh's
// attend, QB_MAX = qc: K/V rows read once for the cluster's heads; the splits merge
// through DSMEM into rank 0, which writes the heads' output), then after a second barrier
// each rank multiplies its slice of o's rows by the heads' columns: a partial sum. The
// last cluster to finish a rank's row slice (a counter per rank) adds the clusters'
// partials into x in cluster order: deterministic. Three kernel boundaries of the op path
// (q/k/v → attention → o → the MLP) become one, and the barriers between the phases are a
// cluster's (~0.25 µs).
//
// Where the time goes: a 1B layer's q/k/v and o are 3.1 and 2.4 MB, ~1.3 µs at copy
// bandwidth, yet the three op-path launches take ~16 µs. Here each warp runs every phase in
// turn, so the step is the sum of its phases' latency chains: they must stay as short as
// the op path's, which spreads each phase over 512-1024 warps. Two blocks of 4 warps per
// SM (HS = 2 at the 1B: 256 blocks) keep a warp's share of the q/k/v rows, of the
// positions and query heads, and of the o rows at the op path's. (A first version, one
// cluster per kv group with L2 prefetches, ran 9.3K instructions per warp at 0.12 IPC:
// 48 µs per launch in ncu; docs/perf.md, session 9.)
//
// grid: n_kv · HS · CS blocks (clusters of CS along x) of 128 threads; dynamic shared
// memory: the x staging of hidden (and of the heads' o columns) values. part: [n_kv · HS]
// [hidden] floats; done: CS counters, zeroed (reset by each launch).
#pragma once
#include "attention_decode.cuh"
#undef TRACE_FILE
#define TRACE_FILE 7
#if NW != 4 || AW != 4
#error "the attention block runs gemv() and attend() with the same 4 warps"
#endif

// gemv()'s steps dealt over a cluster's ranks, for the q/k/v phase: it waits for the
// previous kernel (PDL) once its first weight tile is in flight.
struct RankSteps {
    int rank, size;
    __device__ __forceinline__ void trigger() const {}
    __device__ __forceinline__ void wait() const { pdl_wait(); }
    __device__ __forceinline__ int first_step() const { return rank; }
    __device__ __forceinline__ int next_step(int b) const { return b + size; }
};

// Matrix rows [first, first + rows) as a Mat of their own (row-major weights, scales and
// biases), writing out[0..rows).
__device__ __forceinline__ Mat row_slice(const u32* w, const scale_t* s, const scale_t* b, int first, int rows,
                                         int cols, void* out) {
    size_t words = (size_t)cols * BITS / 32, groups = cols / GROUP;
    return Mat{w + first * words, s + first * groups, b + first * groups, out, rows};
}

extern "C" __global__ void __launch_bounds__(128, 3)
    attention_block(const u32* wq, const scale_t* sq, const scale_t* bq, const u32* wk, const scale_t* sk,
                    const scale_t* bk, const u32* wv, const scale_t* sv, const scale_t* bv, const u32* wo,
                    const scale_t* so, const scale_t* bo, float* __restrict__ x, const float* __restrict__ nw,
                    float eps, int hidden, bf16_t* q, bf16_t* k, bf16_t* v, bf16_t* att, bf16_t* __restrict__ kc,
                    bf16_t* __restrict__ vc, const float* __restrict__ inv_freq, float linear, int interleaved,
                    float* __restrict__ part, int* __restrict__ done, int heads, int n_kv, int hd,
                    const int* __restrict__ pos0p, int chunk, int cs, int hs) {
    TRACE_KERNEL();
    pdl_trigger();
    extern __shared__ uint4 xo[];  // gemv()'s xs: the same dynamic shared memory
    __shared__ int last;
    // Cluster c takes query heads [h0, h0 + qc) of kv group g (hs clusters per group).
    int rank = (int)cluster_rank(), c = blockIdx.x / cs, g = c / hs, qc = heads / n_kv / hs;
    int h0 = g * (heads / n_kv) + (c % hs) * qc;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int ocols = qc * hd, ogroups = heads * hd / GROUP;
    int per = hidden / cs, r0 = rank * per;  // this rank's rows of o (and of x to fold)
    Mat mq = row_slice(wq, sq, bq, h0 * hd, ocols, hidden, q + h0 * hd);
    Mat mk = row_slice(wk, sk, bk, g * hd, hd, hidden, k + g * hd);
    Mat mv = row_slice(wv, sv, bv, g * hd, hd, hidden, v + g * hd);
    // Phase 1: the group's q/k/v rows, from the normalized x.
    gemv<QKV_R, true, 0>(mq, mk, mv, x, nw, eps, hidden, RankSteps{rank, cs});
    pdl_wait();  // ranks without q/k/v steps returned from gemv() before waiting
    cluster_sync();
    // Phase 2: attention, split `rank` of the positions; rank 0 writes the group's output.
    attend(q, k, v, kc, vc, inv_freq, linear, interleaved, nullptr, nullptr, att, nullptr, heads, n_kv, hd, qc,
           *pos0p, chunk, cs, h0 / qc, rank, cs, [] {});
    cluster_sync();
    // Phase 3: this rank's o rows times the cluster's heads' columns, into part[c].
    {
        const uint4* wo4 = reinterpret_cast<const uint4*>(wo);
        int ochunks = ocols / VPC, stride = heads * hd / VPC;
        int oc0 = h0 * hd / VPC, og0 = h0 * hd / GROUP;
        // Lanes per row: the chunks of the group's columns, rounded up to a power of two.
        int lpr = ochunks <= 4 ? 4 : ochunks <= 8 ? 8 : ochunks <= 16 ? 16 : 32, rpw = 32 / lpr;
        int sub = lane / lpr, ci = lane % lpr;  // the row of the warp's round, the chunk
        Shape sh{ochunks, ocols / GROUP, 0, ochunks};
        constexpr int OU = 4;  // rows per lane whose loads are in flight together
        uint4 wq4[OU];
        scale_t ws[OU][NSUB], wb[OU][NSUB];
        auto load = [&](int rbase) {
#pragma unroll
            for (int u = 0; u < OU; u++) {
                int r = rbase + u * 4 * rpw;
                if (r >= per || ci >= ochunks) continue;
                size_t row = r0 + r;
                wq4[u] = ld_weights(wo4 + row * stride + oc0 + ci);
#pragma unroll
                for (int kk = 0; kk < NSUB; kk++) {
                    int gi = og0 + (ci * VPC + kk * SUBG) / GROUP;
                    ws[u][kk] = __ldg(so + row * ogroups + gi);
                    wb[u][kk] = __ldg(bo + row * ogroups + gi);
                }
            }
        };
        int rfirst = warp * rpw + sub;
        load(rfirst);
        NormGains none;
        none.held = false;
        stage_x<false>(xo, att + h0 * hd, nullptr, 0.f, ocols, none);
        XChunk xc;
        if (ci < ochunks) xc.load(xo, ci, sh.chunks);
        for (int rbase = rfirst;; rbase += OU * 4 * rpw) {
            // Every lane of a warp runs every round (the shuffles); rows past `per` skip.
            if (rbase - sub >= per) break;
            float acc[OU];
#pragma unroll
            for (int u = 0; u < OU; u++) {
                acc[u] = 0.f;
                if (ci >= ochunks || rbase + u * 4 * rpw >= per) continue;
                u32 words[4] = {wq4[u].x, wq4[u].y, wq4[u].z, wq4[u].w};
#pragma unroll
                for (int kk = 0; kk < NSUB; kk++) acc[u] = xc.segment(words, kk, s2f(ws[u][kk]), s2f(wb[u][kk]), acc[u]);
            }
            if (rbase + OU * 4 * rpw - sub < per) load(rbase + OU * 4 * rpw);
#pragma unroll
            for (int u = 0; u < OU; u++) {
                float s = acc[u];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1)  // unrolled: lpr is uniform, not constant
                    if (o < lpr) s += __shfl_xor_sync(0xffffffffu, s, o);
                int r = rbase + u * 4 * rpw;
                if (ci == 0 && r < per) part[(size_t)c * hidden + r0 + r] = s;
            }
        }
    }
    // The last cluster to finish this rank's rows adds every cluster's partial, in order.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done + rank, 1) == (int)gridDim.x / cs - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int r = threadIdx.x; r < per; r += 128) {
        float s = 0.f;
        for (int j = 0; j < (int)gridDim.x / cs; j++) s += __ldcg(part + (size_t)j * hidden + r0 + r);
        x[r0 + r] += s;
    }
    if (threadIdx.x == 0) done[rank] = 0;
}
