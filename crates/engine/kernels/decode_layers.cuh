// The decode megakernel: every layer of a one-token decode step in one persistent launch
// (FERROLM_MEGAKERNEL=1; backend/cuda/megakernel.rs). Included by gemv.cu under MEGA=1: it
// runs gemv()'s x staging, chunk math and row stores, so each GEMV row is the op path's sum
// bit for bit, and attention_decode.cuh's attention.
//
// Why: the op path's layer is five launches, and each boundary costs a release (~1 µs), a
// ramp-up and a tail, while a launch's weights start streaming only once the launch before
// lets its blocks in (docs/perf.md, session 6: 28 µs per 1B layer against 8 µs of bytes).
// Here one block per SM runs every phase of every layer,
//     q/k/v = W·norm(x) │ attention (RoPE, cache write) │ x += o·att │
//     act = silu(gate·norm(x))·up·norm(x) │ x += down·act,
// with a grid barrier between phases (a counter per boundary), while every weight row step
// this block will use is bulk-copied, in the order it will use them, into a shared-memory
// ring. The copies run ahead across phase boundaries and attention (which reads no
// weights) as far as the ring holds, so a phase finds its weights on chip.
//
// Work: a GEMV phase's row steps (NW·R rows; of both matrices for SwiGLU) are dealt to
// blocks round robin; the NW warps walk this block's sequence of steps, step g in ring
// stage g % stages (full[s] completes when its bytes land). The warp that is last done
// with a stage refills it with step g + stages (mk_issue finds that step from its number
// alone): no producer warp, whose 9th warp would cap every thread at 168 registers (ptxas
// budgets registers per 4 warps) and made the GEMV tiles spill. Attention items (a block of
// query heads, a split of the positions) go to blocks in turn, run by the first AW warps;
// splits follow the position (about 64 positions each), at most one item per block.
//
// The grid must be resident at once (one block per SM: the host gives each block more than
// half an SM's shared memory and launches one per SM); a wait that lasts seconds traps
// rather than hang. The host zeroes the counters once; the last block out resets them.
#pragma once
#include "gemv_ring.cuh"
#include "attention_decode.cuh"
#undef TRACE_FILE
#define TRACE_FILE 6

#define MK_STAGES_MAX 16

struct MkMat {
    const u32* w;
    const scale_t* s;
    const scale_t* b;
    int rows, pad_;
};

// One layer's weights and its KV cache (megakernel.rs writes these, #[repr(C)]).
struct MkLayer {
    MkMat q, k, v, o, gate, up, down;
    const float* attn_norm;
    const float* mlp_norm;
    bf16_t* kc;
    bf16_t* vc;
};

struct MkParams {
    const MkLayer* layers;
    float* x;  // the f32 residual stream
    bf16_t *q, *k, *v, *att, *act;
    const float* inv_freq;
    float* part_ml;  // attention split partials: [heads · max_splits] (max, sum) and outputs
    float* part_acc;
    int* done;        // attention merge counters, one per query-head block
    const int* pos0p; // the position on the device
    int* sync;        // grid barrier counters (5 per layer), then the exit count
    int n_layers, hidden, ffn, heads, n_kv, hd, qb, max_splits;
    int stages, stage_bytes, x_bytes, interleaved;
    int r[4];  // rows per warp of the q/k/v, o, gate/up and down phases
    float eps, linear;
};

static_assert(sizeof(MkLayer) == 256, "megakernel.rs writes 256 bytes per layer");
static_assert(sizeof(MkParams) == 176, "megakernel.rs writes 176 bytes of parameters");

// The matrices of GEMV phase ph (0 q/k/v, 1 o, 2 gate/up, 3 down) with their outputs.
__device__ __forceinline__ void mk_mats(const MkParams& P, const MkLayer& L, int ph, Mat (&m)[3]) {
    auto mat = [](const MkMat& a, void* o) { return Mat{a.w, a.s, a.b, o, a.rows}; };
    if (ph == 0) {
        m[0] = mat(L.q, P.q), m[1] = mat(L.k, P.k), m[2] = mat(L.v, P.v);
        return;
    }
    if (ph == 2) m[0] = mat(L.gate, P.act), m[1] = mat(L.up, P.act);
    else m[0] = mat(ph == 1 ? L.o : L.down, P.x), m[1] = m[0], m[1].rows = 0;
    m[2] = m[0];
    m[2].rows = 0;
}

__device__ __forceinline__ int mk_cols(const MkParams& P, int ph) {
    return ph == 1 ? P.heads * P.hd : ph == 3 ? P.ffn : P.hidden;
}

__device__ __forceinline__ int mk_steps(const Mat (&m)[3], int rb, bool two) {
    int b0 = (m[0].rows + rb - 1) / rb;
    return two ? b0 : b0 + (m[1].rows + rb - 1) / rb + (m[2].rows + rb - 1) / rb;
}

// Step b of a phase: its matrix and first row (blocks dealt to m0, m1, m2 in order).
__device__ __forceinline__ void mk_step(int b, int rb, bool two, const Mat (&m)[3], Mat& a, int& first) {
    int b0 = (m[0].rows + rb - 1) / rb, b1 = (m[1].rows + rb - 1) / rb;
    a = m[0];
    if (!two) {
        if (b >= b0 + b1) a = m[2], b -= b0 + b1;
        else if (b >= b0) a = m[1], b -= b0;
    }
    first = b * rb;
}

// This block's phase is done (its rows stored): count it in. The release publishes every
// thread's writes before the barrier (bar.sync orders them before thread 0's add).
__device__ __forceinline__ void grid_arrive(int* c) {
    BLOCK_SYNC();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(c) : "memory");
}

// Every block has counted in on c (none: nothing to wait for); then its writes are visible.
__device__ __forceinline__ void grid_wait(const int* c) {
    if (c && threadIdx.x == 0) {
        int v;
        for (unsigned spins = 0;; spins++) {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
            if (v >= (int)gridDim.x) break;
            if (spins > (1u << 24)) __trap();  // blocks that can never arrive: fail, not hang
        }
    }
    BLOCK_SYNC();
}

// Bulk-copy step n of this block's sequence (the layers' phases in order, each phase's
// steps b = blockIdx.x, + gridDim.x, …; per layer c[ph] of them) into stage n % stages.
__device__ __forceinline__ void mk_issue(const MkParams& P, u32 n, const int* c, unsigned char* ring,
                                         unsigned long long* full) {
    if (c[4] == 0 || n / c[4] >= (u32)P.n_layers) return;  // past the last step
    int l = n / c[4], j = n % c[4], ph = 0;
    while (j >= c[ph]) j -= c[ph++];
    Mat m[3];
    mk_mats(P, P.layers[l], ph, m);
    int cols = mk_cols(P, ph), groups = cols / GROUP;
    bool two = ph == 2;
    int nm = two ? 2 : 1, rb = NW * P.r[ph];
    RingStage st{cols / VPC * 16, groups * (int)sizeof(scale_t), rb, nm};
    Mat a;
    int first;
    mk_step(blockIdx.x + j * gridDim.x, rb, two, m, a, first);
    int rows = min(rb, a.rows - first), s = n % P.stages;
    unsigned char* d = ring + s * P.stage_bytes;
    mbar_expect(&full[s], (u32)(nm * rows * (st.rowbytes + 2 * st.srow)));
    for (int k = 0; k < nm; k++) {
        const Mat& mt = k == 0 ? a : m[1];
        bulk_copy(d + k * rb * st.rowbytes, reinterpret_cast<const unsigned char*>(mt.w) + (size_t)first * st.rowbytes,
                  rows * st.rowbytes, &full[s]);
        bulk_copy(d + st.scales_at(k), mt.s + (size_t)first * groups, rows * st.srow, &full[s]);
        bulk_copy(d + st.scales_at(k) + rb * st.srow, mt.b + (size_t)first * groups, rows * st.srow, &full[s]);
    }
}

// The ring's shared state: per stage its full barrier and how many warps are done with it,
// and this block's steps per phase of a layer (c[4]: their sum).
struct MkRing {
    unsigned char* ring;
    unsigned long long* full;
    int* freed;
    const int* c;
};

// A GEMV phase: once `wait` has passed, x (cols values; NORM: the f32 residual,
// RMS-normalized with gains nw) is staged, then each of this block's steps is taken from
// the ring as the ring GEMV takes it (gemv_ring.cuh's stage_rows).
template <int R, bool NORM, int OUT>
__device__ __noinline__ void mk_gemv(const MkParams& P, Mat m0, Mat m1, Mat m2, const void* x, const float* nw, int cols,
                                     uint4* xs, MkRing rg, u32& g, const int* wait) {
    const Mat m[3] = {m0, m1, m2};  // by value: a call's arrays by reference live in local memory
    constexpr bool TWO = OUT == 3;
    constexpr int rb = NW * R;
    int lane = threadIdx.x & 31;
    NormGains gains;
    gains.load(nw, cols, NORM);  // nothing writes the gains: before the wait
    grid_wait(wait);
    stage_x<NORM>(xs, x, nw, P.eps, cols, gains);
    int chunks = cols / VPC, groups = cols / GROUP;
    RingStage st{chunks * 16, groups * (int)sizeof(scale_t), rb, TWO ? 2 : 1};
    Shape sh{chunks, groups, (size_t)chunks, chunks};
    int steps = mk_steps(m, rb, TWO);
    for (int b = blockIdx.x; b < steps; b += gridDim.x, g++) {
        Mat a;
        int first;
        mk_step(b, rb, TWO, m, a, first);
        int n = min(rb, a.rows - first), s = g % P.stages;
        const unsigned char* d = rg.ring + s * P.stage_bytes;
        float resid = stage_resid<R, OUT>(a, first, n);  // while the stage lands
        mbar_wait(&rg.full[s], (g / P.stages) & 1);
        stage_rows<R, OUT>(d, st, sh, xs, a, first, n, resid, 1.f);  // x staged normalized: factor 1
        __syncwarp();  // the warp's reads of the stage are done
        if (lane == 0) {
            __threadfence_block();
            if (atomicAdd(&rg.freed[s], 1) == NW - 1) {  // the last warp out refills it
                rg.freed[s] = 0;
                __threadfence_block();
                mk_issue(P, g + P.stages, rg.c, rg.ring, rg.full);
            }
        }
    }
}

// mk_gemv with the phase's rows per warp (the host's choice: 1, 2 or 4).
template <bool NORM, int OUT>
__device__ __forceinline__ void mk_gemv_r(int r, const MkParams& P, const Mat (&m)[3], const void* x, const float* nw,
                                          int cols, uint4* xs, const MkRing& rg, u32& g, const int* wait) {
    if (r == 4) mk_gemv<4, NORM, OUT>(P, m[0], m[1], m[2], x, nw, cols, xs, rg, g, wait);
    else if (r == 2) mk_gemv<2, NORM, OUT>(P, m[0], m[1], m[2], x, nw, cols, xs, rg, g, wait);
    else mk_gemv<1, NORM, OUT>(P, m[0], m[1], m[2], x, nw, cols, xs, rg, g, wait);
}

// The attention phase: this block's items (query-head block, split) on warps 0..AW-1.
__device__ __forceinline__ void mk_attention(const MkParams& P, const MkLayer& L, const int* wait) {
    grid_wait(wait);
    if ((int)(threadIdx.x >> 5) >= AW) return;
    int pos0 = *P.pos0p, hb = P.heads / P.qb;
    int splits = max(1, min(min(P.max_splits, (int)gridDim.x / hb), (pos0 + 64) / 64));
    int chunk = (pos0 + splits) / splits;  // ⌈(pos0 + 1) / splits⌉
    for (int it = blockIdx.x; it < hb * splits; it += gridDim.x)
        attend(P.q, P.k, P.v, L.kc, L.vc, P.inv_freq, P.linear, P.interleaved, P.part_ml, P.part_acc, P.att, P.done,
               P.heads, P.n_kv, P.hd, P.qb, pos0, chunk, 1, it % hb, it / hb, splits, [] {});
}

// grid: one block per SM; block 32·NW threads; dynamic shared memory x_bytes + stages ·
// stage_bytes. Launched with PDL: the first stages' copies go out at once (weights), the
// warps wait for the embedding before they read x.
extern "C" __global__ void __launch_bounds__(32 * NW, 1) decode_layers(const MkParams* __restrict__ pp) {
    TRACE_KERNEL();
    extern __shared__ __align__(128) unsigned char mk_smem[];
    __shared__ __align__(8) unsigned long long full[MK_STAGES_MAX];
    __shared__ int freed[MK_STAGES_MAX], c[5];
    const MkParams& P = *pp;
    uint4* xs = reinterpret_cast<uint4*>(mk_smem);
    MkRing rg{mk_smem + P.x_bytes, full, freed, c};
    if (threadIdx.x == 0) {
        c[4] = 0;
        for (int ph = 0; ph < 4; ph++) {  // this block's steps per phase (every layer alike)
            Mat m[3];
            mk_mats(P, P.layers[0], ph, m);
            int steps = mk_steps(m, NW * P.r[ph], ph == 2);
            c[ph] = max(0, (steps - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x);
            c[4] += c[ph];
        }
        for (int s = 0; s < P.stages; s++) {
            mbar_init(&full[s], 1);
            freed[s] = 0;
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < P.stages; s++) mk_issue(P, s, c, rg.ring, full);  // weights: before the wait
    }
    __syncthreads();
    pdl_wait();  // x (the embedding) and the position are written
    u32 g = 0;
    int k = 0;  // grid barriers counted in
    const int* wait = nullptr;
    auto arrive = [&]() {
        grid_arrive(P.sync + k);
        wait = P.sync + k++;
    };
    for (int l = 0; l < P.n_layers; l++) {
        const MkLayer& L = P.layers[l];
        Mat m[3];
        mk_mats(P, L, 0, m);
        mk_gemv_r<true, 0>(P.r[0], P, m, P.x, L.attn_norm, P.hidden, xs, rg, g, wait);
        arrive();
        mk_attention(P, L, wait);
        arrive();
        mk_mats(P, L, 1, m);
        mk_gemv_r<false, 2>(P.r[1], P, m, P.att, nullptr, P.heads * P.hd, xs, rg, g, wait);
        arrive();
        mk_mats(P, L, 2, m);
        mk_gemv_r<true, 3>(P.r[2], P, m, P.x, L.mlp_norm, P.hidden, xs, rg, g, wait);
        arrive();
        mk_mats(P, L, 3, m);
        mk_gemv_r<false, 2>(P.r[3], P, m, P.act, nullptr, P.ffn, xs, rg, g, wait);
        if (l + 1 < P.n_layers) arrive();
    }
    // Every block is past every wait once all have counted out: the last resets the counters.
    BLOCK_SYNC();
    int* out = P.sync + 5 * P.n_layers;
    if (threadIdx.x == 0 && atomicAdd(out, 1) == (int)gridDim.x - 1) {
        for (int i = 0; i < 5 * P.n_layers; i++) P.sync[i] = 0;
        __threadfence();
        *out = 0;
    }
}
