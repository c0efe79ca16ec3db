// Few-token GEMM, included by gemm.cu (the same -D variants): out[t, r] for m ≤ 16·MT tokens
// with qgemm.cuh's arithmetic, so every element has the bits the tiled kernel gives it at any
// token count. Launcher: backend/cuda/gemm.rs.
//
// Design. A block of NW warps (the launcher's: one per CHUNK_K chunk of K, at most
// SMALL_WARPS) owns SMALL_ROWS = 8 output rows (one n8 tile) and all m tokens (MT m16
// tiles). Warp w computes the chunks w, w + NW, ...: each chunk's 16 k16 steps as one mma
// chain per m16 tile from zero; the chunk sums go to shared memory and the block adds them
// in chunk order into totals (in shared memory, each output owned by one thread), a round
// of NW chunks at a time. So the weights stream through rows/8 × NW warps at once, instead
// of the tiled kernel's rows/64 blocks each walking all of K (at one token, the 1B's down
// projection was 32 blocks of 128 serial steps). The warp count changes no bit.
//   - Lane (g, tg) = (lane >> 2, lane & 3) multiplies weight row r0 + g (the B fragment's
//     column g). The four lanes of a row load its chunk a quarter each (64 values: 2·BITS
//     words, 16-byte loads or 8-byte ones at 2 bits), and the chunk's scales and biases
//     (group i held by lane i % 4, as f32); a step's words and scale come from the holding
//     lane by shuffles, and each lane dequantizes its four values (k 2tg, 2tg+1, 2tg+8,
//     2tg+9: the B registers' layout, gemm.cu's notes) with qgemm.cuh's dequant_pair.
//   - A warp issues its next chunk's loads before the current chunk's MMAs.
//   - A fragments are read straight from global memory (a few cached rows), zero past m and
//     past cols.

#define SMALL_WARPS 8                          // the most warps a block has
#define SMALL_THREADS (SMALL_WARPS * 32)
#define SMALL_ROWS 8                           // output rows per block: one n8 tile
#define CHUNK_STEPS (CHUNK_K / 16)             // k16 steps per chunk
#define LANE_WORDS (2 * BITS)                  // a lane's quarter of a row's chunk: 64 values
#define CHUNK_GROUPS (CHUNK_K / GROUP)         // scale groups per chunk
#define LANE_GROUPS ((CHUNK_GROUPS + 3) / 4)   // of which a lane holds (group i: lane i % 4)
#define FULL_MASK 0xffffffffu

static_assert(CHUNK_STEPS == 16 && LANE_WORDS * 32 / BITS == 64, "a lane holds a quarter of a chunk");
static_assert(GROUP >= 16 && CHUNK_K % GROUP == 0, "a k16 step has one scale group; chunks hold whole groups");

// A lane's share of one weight row's chunk.
struct ChunkW {
    u32 q[LANE_WORDS];
    float s[LANE_GROUPS], b[LANE_GROUPS];
};

// Load this lane's quarter of `row`'s chunk c and the scale groups it holds; zeros where the
// row is past the end (row_ok false) or the values past cols (as the tiled kernel's).
__device__ __forceinline__ void load_chunk(ChunkW& cw, const QMat& w, int row, bool row_ok, int c, int cols,
                                           int tg) {
    const int k0 = c * CHUNK_K + tg * 64;
    const u32* wr = w.w + (size_t)row * (size_t)(cols / (32 / BITS)) + k0 / (32 / BITS);
#pragma unroll
    for (int h = 0; h < 2; h++) {  // two 32-value halves of BITS words each
        const bool ok = row_ok && k0 + 32 * h < cols;
        const u32* p = wr + h * BITS;
#if BITS == 2
        const uint2 v = ok ? *reinterpret_cast<const uint2*>(p) : make_uint2(0u, 0u);
        cw.q[2 * h] = v.x, cw.q[2 * h + 1] = v.y;
#else
#pragma unroll
        for (int u = 0; u < BITS / 4; u++) {
            const uint4 v = ok ? *reinterpret_cast<const uint4*>(p + 4 * u) : make_uint4(0u, 0u, 0u, 0u);
            u32* d = cw.q + h * BITS + 4 * u;
            d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
        }
#endif
    }
    const int groups = cols / GROUP;
#pragma unroll
    for (int i = 0; i < LANE_GROUPS; i++) {
        const int gi = tg + 4 * i, kg = c * CHUNK_K + gi * GROUP;
        const bool ok = row_ok && gi < CHUNK_GROUPS && kg < cols;
        const size_t at = (size_t)row * groups + kg / GROUP;
        cw.s[i] = ok ? s2f(w.s[at]) : 0.f;
        cw.b[i] = ok ? s2f(w.b[at]) : 0.f;
    }
}

// The lane's B registers for step j of the chunk (j a compile-time constant after
// unrolling): its row's values k 2tg, 2tg+1 (b0) and 2tg+8, 2tg+9 (b1), dequantized.
__device__ __forceinline__ void step_b(const ChunkW& cw, int j, int lane, u32& b0, u32& b1) {
    const int row_lanes = lane & ~3, tg = lane & 3;
    const int src = row_lanes | (j / 4);  // the lane holding step j's words (64 values each)
    const int gi = (16 * j) / GROUP;      // the step's scale group in the chunk
    const float sc = __shfl_sync(FULL_MASK, cw.s[gi / 4], row_lanes | (gi % 4));
    const float bi = __shfl_sync(FULL_MASK, cw.b[gi / 4], row_lanes | (gi % 4));
#if BITS == 2
    const u32 w = __shfl_sync(FULL_MASK, cw.q[j % 4], src);  // value v at bits 2v
    const int sh = 4 * tg;
    b0 = dequant_pair((w >> sh) & MASK, (w >> (sh + 2)) & MASK, sc, bi);
    b1 = dequant_pair((w >> (sh + 16)) & MASK, (w >> (sh + 18)) & MASK, sc, bi);
#elif BITS == 4
    const u32 w0 = __shfl_sync(FULL_MASK, cw.q[(2 * j) % 8], src);  // values 0-7, 8-15
    const u32 w1 = __shfl_sync(FULL_MASK, cw.q[(2 * j) % 8 + 1], src);
    const int sh = 8 * tg;
    b0 = dequant_pair((w0 >> sh) & MASK, (w0 >> (sh + 4)) & MASK, sc, bi);
    b1 = dequant_pair((w1 >> sh) & MASK, (w1 >> (sh + 4)) & MASK, sc, bi);
#elif BITS == 8
    const int at = (4 * j) % 16;  // four words: values 0-3, 4-7, 8-11, 12-15
    const u32 v0 = __shfl_sync(FULL_MASK, cw.q[at], src), v1 = __shfl_sync(FULL_MASK, cw.q[at + 1], src);
    const u32 v2 = __shfl_sync(FULL_MASK, cw.q[at + 2], src), v3 = __shfl_sync(FULL_MASK, cw.q[at + 3], src);
    const u32 w0 = (tg & 2) ? v1 : v0, w1 = (tg & 2) ? v3 : v2;
    const int sh = 16 * (tg & 1);
    b0 = dequant_pair((w0 >> sh) & MASK, (w0 >> (sh + 8)) & MASK, sc, bi);
    b1 = dequant_pair((w1 >> sh) & MASK, (w1 >> (sh + 8)) & MASK, sc, bi);
#else
#error "gemm_small.cuh: BITS must be 2, 4 or 8"
#endif
}

// x's bf16 pair at (token t, k) as one A register; zero past m or cols.
__device__ __forceinline__ u32 x_pair(const bf16_t* __restrict__ x, int t, int k, int m, bool kin, int cols) {
    return (t < m && kin) ? *reinterpret_cast<const u32*>(x + (size_t)t * cols + k) : 0u;
}

// Chunk c's mma chains (NM matrices: gate and up for the GLU form) into acc, from zero.
template <int MT, int NM>
__device__ __forceinline__ void chunk_mma(float (&acc)[NM][MT][4], const ChunkW (&cw)[NM],
                                          const bf16_t* __restrict__ x, int c, int kend, int cols, int m, int lane) {
    const int g = lane >> 2, tg = lane & 3;
#pragma unroll
    for (int j = 0; j < CHUNK_STEPS; j++) {
        const int k = c * CHUNK_K + 16 * j;
        if (k >= kend) break;  // warp-uniform: the shuffles below stay converged
        u32 b[NM][2];
#pragma unroll
        for (int n = 0; n < NM; n++) step_b(cw[n], j, lane, b[n][0], b[n][1]);
        const bool kin = k < cols;  // steps past cols run on zeros (qgemm.cuh)
#pragma unroll
        for (int i = 0; i < MT; i++) {
            const int t = 16 * i + g, kl = k + 2 * tg;
            const u32 a[4] = {x_pair(x, t, kl, m, kin, cols), x_pair(x, t + 8, kl, m, kin, cols),
                              x_pair(x, t, kl + 8, m, kin, cols), x_pair(x, t + 8, kl + 8, m, kin, cols)};
#pragma unroll
            for (int n = 0; n < NM; n++) mma_bf16(acc[n][i], a, b[n][0], b[n][1]);
        }
    }
}

// chunk_mma<1, NM> for a chunk whose steps all lie below kend, its x fragments loaded
// FEW_WIN steps at a time ahead of their MMAs: the same MMAs on the same operands in the
// same order, so the same bits. In chunk_mma each k16 step loads its A registers from
// global memory right before its mma and the step's `break` keeps the next step's shuffles
// behind a branch, so at one tile (1-16 tokens, the serving path's calls at few streams)
// a chunk was 16 serialized round trips (10.6 cycles per issued instruction under ncu).
// Windows of 4 steps measured best (docs/perf.md, "One stream through the server"): the
// 1B q/o matrix at one token 4.45 µs against 5.94, down 13.5 against 20.9.
constexpr int FEW_WIN = 4;
static_assert(CHUNK_STEPS % FEW_WIN == 0, "whole windows per chunk");

// mma_bf16 without `volatile`: a pure function of its registers, which ptxas may schedule
// (the next step's shuffles and dequantization under the current mma).
__device__ __forceinline__ void mma_bf16_free(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int NM>
__device__ __forceinline__ void chunk_mma_win(float (&acc)[NM][1][4], const ChunkW (&cw)[NM],
                                              const bf16_t* __restrict__ x, int c, int cols, int m, int lane) {
    const int g = lane >> 2, tg = lane & 3;
#pragma unroll
    for (int j0 = 0; j0 < CHUNK_STEPS; j0 += FEW_WIN) {
        u32 a[FEW_WIN][4];
#pragma unroll
        for (int w = 0; w < FEW_WIN; w++) {
            const int k = c * CHUNK_K + 16 * (j0 + w), kl = k + 2 * tg;
            const bool kin = k < cols;  // steps past cols run on zeros (qgemm.cuh)
            a[w][0] = x_pair(x, g, kl, m, kin, cols), a[w][1] = x_pair(x, g + 8, kl, m, kin, cols);
            a[w][2] = x_pair(x, g, kl + 8, m, kin, cols), a[w][3] = x_pair(x, g + 8, kl + 8, m, kin, cols);
        }
#pragma unroll
        for (int w = 0; w < FEW_WIN; w++) {
            u32 b[NM][2];
#pragma unroll
            for (int n = 0; n < NM; n++) step_b(cw[n], j0 + w, lane, b[n][0], b[n][1]);
#pragma unroll
            for (int n = 0; n < NM; n++) mma_bf16_free(acc[n][0], a[w], b[n][0], b[n][1]);
        }
    }
}

// grid (ceil(rows / 8)), block 32·min(SMALL_WARPS, ceil(cols / CHUNK_K)), m ≤ 16·MT. GLU:
// gate and up of the same rows, out bf16 act(gate)·up (glu_value), act 0 silu, 1 gelu (tanh).
template <int MT, bool OUT_F32, bool GLU>
__device__ __forceinline__ void qgemm_small_body(QMat gate, QMat up, const bf16_t* __restrict__ x,
                                                 void* __restrict__ out, int rows, int cols, int m, int act) {
    constexpr int NM = GLU ? 2 : 1;
    constexpr int NOUT = 16 * MT * SMALL_ROWS;  // a block's outputs, token-major: o = t·8 + n
    __shared__ float part[NM][SMALL_WARPS][NOUT];
    __shared__ float tot[NM][NOUT];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tg = lane & 3;
    const int nt = blockDim.x, nw = nt >> 5;
    const int r0 = blockIdx.x * SMALL_ROWS;
    const bool row_ok = r0 + g < rows;
    const int row = row_ok ? r0 + g : 0;  // pointers stay inside the tensor
    const int kend = (cols + KSTEP_ALIGN - 1) / KSTEP_ALIGN * KSTEP_ALIGN;
    const int nchunk = (kend + CHUNK_K - 1) / CHUNK_K;
    const QMat mats[2] = {gate, up};

    for (int o = tid; o < NOUT; o += nt)
#pragma unroll
        for (int n = 0; n < NM; n++) tot[n][o] = 0.f;  // read after the round's barriers

    ChunkW cur[NM], nxt[NM];
    if (warp < nchunk)
#pragma unroll
        for (int n = 0; n < NM; n++) load_chunk(cur[n], mats[n], row, row_ok, warp, cols, tg);

    for (int base = 0; base < nchunk; base += nw) {
        const int c = base + warp, cn = c + nw;
        if (cn < nchunk)
#pragma unroll
            for (int n = 0; n < NM; n++) load_chunk(nxt[n], mats[n], row, row_ok, cn, cols, tg);
        float acc[NM][MT][4];
#pragma unroll
        for (int n = 0; n < NM; n++)
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[n][i][e] = 0.f;
        if (c < nchunk) {
            if constexpr (MT == 1) {
                if ((c + 1) * CHUNK_K <= kend) chunk_mma_win<NM>(acc, cur, x, c, cols, m, lane);
                else chunk_mma<MT, NM>(acc, cur, x, c, kend, cols, m, lane);
            } else {
                chunk_mma<MT, NM>(acc, cur, x, c, kend, cols, m, lane);
            }
        }
        __syncthreads();  // the previous round's totals have read `part`
        if (c < nchunk) {
#pragma unroll
            for (int n = 0; n < NM; n++)
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    // C layout: c0, c1 at token g, columns 2tg, 2tg+1; c2, c3 at token g + 8.
                    float* p = part[n][warp] + (16 * i + g) * SMALL_ROWS + 2 * tg;
                    *reinterpret_cast<float2*>(p) = make_float2(acc[n][i][0], acc[n][i][1]);
                    *reinterpret_cast<float2*>(p + 8 * SMALL_ROWS) = make_float2(acc[n][i][2], acc[n][i][3]);
                }
        }
        __syncthreads();
        const int here = min(nw, nchunk - base);
        for (int o = tid; o < NOUT; o += nt)
#pragma unroll
            for (int n = 0; n < NM; n++) {
                float t = tot[n][o];
                for (int w = 0; w < here; w++) t += part[n][w][o];  // chunk order
                tot[n][o] = t;
            }
        if (cn < nchunk)
#pragma unroll
            for (int n = 0; n < NM; n++) cur[n] = nxt[n];
    }

    // Each thread stores the totals it summed (no other thread wrote them).
    for (int o = tid; o < NOUT; o += nt) {
        const int t = o / SMALL_ROWS, r = r0 + o % SMALL_ROWS;
        if (t >= m || r >= rows) continue;
        const size_t at = (size_t)t * rows + r;
        if constexpr (GLU) {
            reinterpret_cast<bf16_t*>(out)[at] = f2bf(glu_value(tot[0][o], tot[1][o], act));
        } else if constexpr (OUT_F32) {
            reinterpret_cast<float*>(out)[at] = tot[0][o];
        } else {
            reinterpret_cast<bf16_t*>(out)[at] = f2bf(tot[0][o]);
        }
    }
}

// m ≤ 16 (_m1) or ≤ 64 (_m4) tokens; arguments as qgemm / qgemm_f32 / qgemm_glu.
#define SMALL_ENTRY(NAME, MT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(SMALL_THREADS)                                                \
        NAME(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, bf16_t* out, int rows, int cols, \
             int m) {                                                                                          \
        qgemm_small_body<MT, false, false>(QMat{w, s, b}, QMat{w, s, b}, x, out, rows, cols, m, 0);            \
    }
#define SMALL_ENTRY_F32(NAME, MT)                                                                              \
    extern "C" __global__ void __launch_bounds__(SMALL_THREADS)                                                \
        NAME(const u32* w, const scale_t* s, const scale_t* b, const bf16_t* x, float* out, int rows, int cols,  \
             int m) {                                                                                          \
        qgemm_small_body<MT, true, false>(QMat{w, s, b}, QMat{w, s, b}, x, out, rows, cols, m, 0);             \
    }
#define SMALL_ENTRY_GLU(NAME, MT)                                                                              \
    extern "C" __global__ void __launch_bounds__(SMALL_THREADS)                                                \
        NAME(const u32* gw, const scale_t* gs, const scale_t* gb, const u32* uw, const scale_t* us,            \
             const scale_t* ub, const bf16_t* x, bf16_t* out, int rows, int cols, int m, int act) {            \
        qgemm_small_body<MT, false, true>(QMat{gw, gs, gb}, QMat{uw, us, ub}, x, out, rows, cols, m, act);     \
    }
SMALL_ENTRY(qgemm_small_m1, 1)
SMALL_ENTRY(qgemm_small_m4, 4)
SMALL_ENTRY_F32(qgemm_small_f32_m1, 1)
SMALL_ENTRY_F32(qgemm_small_f32_m4, 4)
SMALL_ENTRY_GLU(qgemm_small_glu_m1, 1)
SMALL_ENTRY_GLU(qgemm_small_glu_m4, 4)
