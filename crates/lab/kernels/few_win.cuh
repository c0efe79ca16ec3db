// The few-token GEMM's one-tile chunks (MT = 1: up to 16 tokens, the serving engine's calls at
// 1-16 streams) with their x fragments loaded a window of k16 steps at a time, spliced into
// gemm_small.cuh by scripts/lab/few-win.sh. Same MMAs on the same operands in the same
// order as chunk_mma, so the same bits; only the schedule changes.
//
// Why: in the product's chain every k16 step loads its A registers (x) from global memory
// right before its mma (SASS of qgemm_small_m1: the 4 LDGs of a step sit between its shuffles
// and its HMMA, into the registers the previous step's HMMA read), and the step's `break`
// past kend keeps the next step's shuffles behind the branch. So each of the 16 steps waits
// on an L1/L2 round trip, then on its shuffles, then on its mma in turn (10.6 cycles per
// issued instruction under ncu). Here a full chunk (all 16 steps below kend) issues the
// window's x loads first, has no branch between steps, and its mma is not `volatile`, so
// ptxas may issue the next step's shuffles and dequantization under the current mma.

#ifndef WIN_M1
#define WIN_M1 16  // k16 steps of x fragments loaded at once, plain form (16: the whole chunk)
#endif
#ifndef WIN_GLU_M1
#define WIN_GLU_M1 8  // the same for the gate/up form (two B chains share each A)
#endif

// mma_bf16 without `volatile`: a pure function of its registers, free to move.
__device__ __forceinline__ void mma_bf16_free(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// chunk_mma<1, NM> for a chunk whose 16 steps all lie below kend.
template <int NM>
__device__ __forceinline__ void chunk_mma_win(float (&acc)[NM][1][4], const ChunkW (&cw)[NM],
                                              const bf16_t* __restrict__ x, int c, int cols, int m, int lane) {
    constexpr int WIN = NM == 1 ? WIN_M1 : WIN_GLU_M1;
    static_assert(CHUNK_STEPS % WIN == 0, "whole windows per chunk");
    const int g = lane >> 2, tg = lane & 3;
#pragma unroll
    for (int j0 = 0; j0 < CHUNK_STEPS; j0 += WIN) {
        u32 a[WIN][4];
#pragma unroll
        for (int w = 0; w < WIN; w++) {
            const int k = c * CHUNK_K + 16 * (j0 + w), kl = k + 2 * tg;
            const bool kin = k < cols;  // steps past cols run on zeros (qgemm.cuh)
            a[w][0] = x_pair(x, g, kl, m, kin, cols), a[w][1] = x_pair(x, g + 8, kl, m, kin, cols);
            a[w][2] = x_pair(x, g, kl + 8, m, kin, cols), a[w][3] = x_pair(x, g + 8, kl + 8, m, kin, cols);
        }
#pragma unroll
        for (int w = 0; w < WIN; w++) {
            u32 b[NM][2];
#pragma unroll
            for (int n = 0; n < NM; n++) step_b(cw[n], j0 + w, lane, b[n][0], b[n][1]);
#pragma unroll
            for (int n = 0; n < NM; n++) mma_bf16_free(acc[n][0], a[w], b[n][0], b[n][1]);
        }
    }
}
