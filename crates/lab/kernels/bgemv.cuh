// Lab: the decode GEMV over several tokens at once (a batched GEMV), for the serving design
// docs/perf.md names under "One stream through the server": generated rows keep the
// decode GEMV's arithmetic (int16 x, DP2A, each lane's chunks in order, then the warp's
// sum), so one row is the bench's GEMV and a batch of rows gives each row those same bits.
// The question this kernel answers is its cost at 2-64 tokens against the tensor-core
// kernels serving calls run today (`timings bgemv`).
//
// crates/lab/src/bgemv.rs compiles this text appended to gemv.cu (its Tile, XChunk,
// stage_x and warp_sum), with BG_NT = tokens per block. Each block takes BG_NT tokens
// (blockIdx.y: which ones) and stages each token's x as the GEMV stages its one x (int16 +
// block scales + sums: one image per token, BG_NT images in shared memory); then it walks
// row steps exactly as gemv.cu does for one matrix (NW warps of R rows, lane chunks c =
// lane + 32·(u + U·it), tiles loaded one ahead), and every tile's weights, once in
// registers, meet each token's x in turn: Tile::dot per token, the GEMV's own sums. A
// step's end reduces each token's lane partials by warp_sum and lane r stores row r, as
// store_rows does for an f32 store (its factor 1 is exact). So each token's output is
// gemv_bf_r{R}'s for that token alone, bit for bit, whatever BG_NT or the token count.
#if XQ
#ifndef BG_NT
#define BG_NT 8
#endif

template <int R>
__device__ __forceinline__ void bgemv(const Mat& a, const bf16_t* __restrict__ x, int cols, int ntok) {
    extern __shared__ uint4 xs[];
    constexpr int rb = NW * R;  // rows per block step
    using T = Tile<R, false>;
    constexpr int U = T::U;
    const int t0 = blockIdx.y * BG_NT, nt = min(BG_NT, ntok - t0);
    const int steps = (a.rows + rb - 1) / rb;
    int b = blockIdx.x;
    if (b >= steps || nt <= 0) return;  // the whole block: before any barrier
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = cols / VPC, img = staged_bytes(cols) / 16;  // uint4 per token image
    Shape sh{chunks, cols / GROUP, (size_t)cols / (32 / BITS) / 4, chunks};
    const int tiles = (chunks + 32 * U - 1) / (32 * U);
    int it = 0, row0 = b * rb + warp * R;
    T next;
    next.fill(TileFromGlobal{a, a, sh}, row0, lane, sh);
    NormGains none;
    none.held = false;
    // Tokens past the last of a partial group stage the last one again (computed, never stored).
#pragma unroll 1
    for (int t = 0; t < BG_NT; t++)
        stage_x<false>(xs + t * img, x + (size_t)(t0 + min(t, nt - 1)) * cols, nullptr, 0.f, cols, none);
    float acc[BG_NT][2][R];
#pragma unroll
    for (int t = 0; t < BG_NT; t++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[t][0][r] = acc[t][1][r] = 0.f;
    while (true) {
        int nit = it + 1, nb = b, nrow0 = row0;
        if (nit == tiles) {
            nit = 0;
            nb = b + gridDim.x;
            nrow0 = nb * rb + warp * R;
        }
        T cur = next;
        if (nb < steps) next.fill(TileFromGlobal{a, a, sh}, nrow0, lane + nit * 32 * U, sh);
#pragma unroll
        for (int t = 0; t < BG_NT; t++) cur.dot(xs + t * img, lane + it * 32 * U, sh, acc[t]);
        if (nit == 0) {  // step done: each token's rows reduced and stored
#pragma unroll
            for (int t = 0; t < BG_NT; t++) {
                float own = 0.f;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const float v = warp_sum(acc[t][0][r]) * 1.f;
                    if (lane == r) own = v;
                    acc[t][0][r] = 0.f;
                }
                const int row = row0 + lane;
                if (t < nt && lane < R && row < a.rows) reinterpret_cast<float*>(a.o)[(size_t)(t0 + t) * a.rows + row] = own;
            }
        }
        if (nb >= steps) break;
        b = nb;
        it = nit;
        row0 = nrow0;
    }
}

// grid (row-step blocks, ⌈ntok / BG_NT⌉), block 32·NW, dynamic shared memory BG_NT ·
// staged_bytes(cols). out f32 [ntok, rows]; x bf16 [ntok, cols].
#define BGEMV_KERNEL(R)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * NW) bgemv_r##R(const u32* w, const scale_t* s,       \
                                                                      const scale_t* bi, float* out, int rows, \
                                                                      const bf16_t* x, int cols, int ntok) { \
        bgemv<R>(Mat{w, s, bi, out, rows}, x, cols, ntok);                                                 \
    }
BGEMV_KERNEL(1)
BGEMV_KERNEL(2)
BGEMV_KERNEL(4)
#endif
