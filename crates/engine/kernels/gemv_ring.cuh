// Decode GEMV fed through a shared-memory ring by the copy engine (TMA bulk copies), for
// the layers of a decode step (`Cuda::gemv_fused` picks it; included by gemv.cu, whose
// x staging, chunk math, Mat and locate it shares, so the rows' math is gemv()'s).
//
// Why: a decode layer is five dependent launches, and each paid ~3 µs beyond its bytes
// (the kernel timeline, docs/perf.md): its blocks could only load one register tile
// (32 KB per block) before the previous kernel finished, then waited for the release,
// staged x, and streamed the rest with one tile in flight. Here a block is a row step's
// worth of shared memory per ring stage, and thread 0 issues every stage's bulk copies
// (weights, scales, biases of the step's rows: contiguous ranges) before the kernel even
// waits for its input: up to `stages` steps (~100 KB) per block stream in during the
// previous kernel and the release. One block per SM with ≤ 128 registers per thread and
// ≤ ~113 KB of shared memory leaves room for the next GEMV's block beside it, so that
// block starts, and issues its copies, while this one still runs (PDL: every block
// triggers at its start).
//
// A step is NW·R rows (of both matrices for SwiGLU); block b takes steps b, b + grid, …;
// step j sits in stage j % stages, whose mbarrier completes phase j / stages when its
// bytes have landed. Warp NW only issues copies: once all NW consumer warps have counted
// themselves out of a stage (its `empty` barrier), it refills it with step j + stages. Host conditions (fused.rs, gemv_ring_fits): 16-byte aligned matrices,
// and each matrix's last, partial step a whole number of 16-byte scale pieces.
#pragma once
// Its kernels' timeline records (trace.cuh) name this header, whose line numbers they carry.
#undef TRACE_FILE
#define TRACE_FILE 5

#ifndef RING_STAGES_MAX
#define RING_STAGES_MAX 8
#endif

#include "mbarrier.cuh"

// Bytes of x staged in shared memory before the ring (as the host sizes it).
__host__ __device__ __forceinline__ int ring_x_bytes(int cols) {
    int b = XQ ? 2 * cols + cols / 32 * 4 + cols / 16 * 4 : 2 * cols;
    return (b + 127) / 128 * 128;
}

// A ring stage: NM matrices' weights (rb rows each), then per matrix its scales and biases.
struct RingStage {
    int rowbytes, srow, rb, nm;
    __device__ __forceinline__ int scales_at(int m) const { return nm * rb * rowbytes + m * 2 * rb * srow; }
    __device__ __forceinline__ int bytes() const { return (scales_at(nm) + 127) / 128 * 128; }
};

// OUT 2: the residual x of this warp's row first + warp·R + lane for lanes r < R (of the n
// rows of the step in the matrix), read before the stage lands (not a round trip at the
// end); 0 elsewhere.
template <int R, int OUT>
__device__ __forceinline__ float stage_resid(const Mat& a, int first, int n) {
    int row = (int)(threadIdx.x >> 5) * R + (int)(threadIdx.x & 31);
    return OUT == 2 && (threadIdx.x & 31) < R && row < n ? reinterpret_cast<const float*>(a.o)[first + row] : 0.f;
}

// This warp's rows of a landed ring stage `s`: a step of NW·R rows from `first` (n of them
// in the matrix; rows past them are past the matrix and not stored). Register tiles are
// loaded from the stage, all of a tile's loads before its math, chunks in gemv()'s order
// (the same sums, bit for bit), then the rows are stored as OUT says. Shared by the ring
// GEMV and the decode megakernel.
template <int R, int OUT>
__device__ __forceinline__ void stage_rows(const unsigned char* s, const RingStage& st, const Shape& sh,
                                           const uint4* xs, const Mat& a, int first, int n, float resid,
                                           float scale) {
    constexpr int rb = NW * R;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp * R >= n) return;
    float acc[2][R];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[m][r] = 0.f;
    using T = Tile<R, OUT == 3>;
    TileFromStage src{s, s + st.scales_at(0), rb * st.rowbytes, 2 * rb * st.srow, rb, n, sh};
    for (int c0 = lane; c0 < sh.chunks; c0 += 32 * T::U) {
        T t;
        t.fill(src, warp * R, c0, sh);
        t.dot(xs, c0, sh, acc);
    }
    store_rows<R, OUT>(a, first + warp * R, acc, resid, lane, nullptr, scale);
}

// OUT as gemv(): 0 bf16 store, 1 f32 store, 2 f32 add, 3 SwiGLU.
template <int R, bool NORM, int OUT>
__device__ __forceinline__ void gemv_ring(Mat m0, Mat m1, Mat m2, const void* x, const float* nw, float eps, int cols,
                                          int stages) {
    extern __shared__ __align__(128) unsigned char ring_smem[];
    // full[s]: stage s's bytes landed; empty[s]: every consumer warp is done with it
    __shared__ __align__(8) unsigned long long full[RING_STAGES_MAX], empty[RING_STAGES_MAX];
    constexpr bool TWO = OUT == 3;
    constexpr int NM = TWO ? 2 : 1;
    constexpr int rb = NW * R;  // rows per step
    if (PDL_EARLY) pdl_trigger();
    int b0 = (m0.rows + rb - 1) / rb, b1 = (m1.rows + rb - 1) / rb, b2 = (m2.rows + rb - 1) / rb;
    int steps = TWO ? b0 : b0 + b1 + b2;
    if ((int)blockIdx.x >= steps) return;
    int chunks = cols / VPC, groups = cols / GROUP;
    RingStage st{chunks * 16, groups * (int)sizeof(scale_t), rb, NM};
    Shape sh{chunks, groups, (size_t)chunks, chunks};
    uint4* xs = reinterpret_cast<uint4*>(ring_smem);
    unsigned char* ring = ring_smem + ring_x_bytes(cols);
    int mine = (steps - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;  // steps of this block
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // Step j of this block: its matrix and first row (locate's row for warp 0).
    auto step_of = [&](int j, Mat& a, int& first) {
        Mat t = m0;
        int b = (int)blockIdx.x + j * (int)gridDim.x;
        if (OUT != 3) {
            if (b >= b0 + b1) { t = m2; b -= b0 + b1; }
            else if (b >= b0) { t = m1; b -= b0; }
        }
        a = t;
        first = b * rb;
    };
    auto issue = [&](int j) {
        Mat a;
        int first;
        step_of(j, a, first);
        int n = min(rb, a.rows - first);
        unsigned char* s = ring + (j % stages) * st.bytes();
        unsigned long long* bj = &full[j % stages];
        mbar_expect(bj, (u32)(NM * n * (st.rowbytes + 2 * st.srow)));
#pragma unroll
        for (int m = 0; m < NM; m++) {
            const Mat& mt = m == 0 ? a : m1;
            bulk_copy(s + m * rb * st.rowbytes, reinterpret_cast<const unsigned char*>(mt.w) + (size_t)first * st.rowbytes,
                      n * st.rowbytes, bj);
            bulk_copy(s + st.scales_at(m), mt.s + (size_t)first * groups, n * st.srow, bj);
            bulk_copy(s + st.scales_at(m) + rb * st.srow, mt.b + (size_t)first * groups, n * st.srow, bj);
        }
    };
    // Warp NW is the producer: it issues the copies, so no consumer warp ever stalls on a
    // full copy queue (an issuing consumer held the whole block back at each step).
    const bool producer = warp == NW;
    if (producer && lane == 0) {
        for (int s = 0; s < stages; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], NW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int j = 0; j < min(stages, mine); j++) issue(j);  // weights only: nothing writes them
    }
    NormGains gains;
    gains.load(nw, cols, NORM);
    pdl_wait();
    // As gemv()'s: g·x staged, the norm's factor on the row sums (so both feeds round alike).
    // Ends with __syncthreads: the barriers are initialized.
    float oscale = stage_x<NORM, true>(xs, x, nw, eps, cols, gains);
    if (producer) {
        // step j refills the stage of step j - stages once every consumer warp is done with it
        if (lane == 0)
            for (int j = stages; j < mine; j++) {
                mbar_wait(&empty[j % stages], (u32)((j / stages - 1) & 1));
                issue(j);
            }
        return;
    }
    for (int j = 0; j < mine; j++) {
        Mat a;
        int first;
        step_of(j, a, first);
        const unsigned char* s = ring + (j % stages) * st.bytes();
        mbar_wait(&full[j % stages], (u32)((j / stages) & 1));
        int n = min(rb, a.rows - first);
        stage_rows<R, OUT>(s, st, sh, xs, a, first, n, stage_resid<R, OUT>(a, first, n), oscale);
        __syncwarp();  // the warp's reads of the stage are done: it may be refilled
        if (lane == 0) mbar_arrive(&empty[j % stages]);
    }
}

// grid: min(steps, SMs) blocks of 32·(NW + 1) threads (NW consumer warps, one producer);
// dynamic shared memory ring_x_bytes(cols) + stages · RingStage::bytes(); the arguments of
// gemv.cu's GEMV_ARGS and the stage count.
#define GEMV_RING_CALL(R, NORM, OUT) \
    TRACE_KERNEL();                  \
    gemv_ring<R, NORM, OUT>(Mat{w0, s0, b0, o0, n0}, Mat{w1, s1, b1, o1, n1}, Mat{w2, s2, b2, o2, n2}, x, nw, eps, \
                            cols, stages)
#define GEMV_RING_KERNEL(name, R, NORM, OUT) \
    extern "C" __global__ void __launch_bounds__(32 * (NW + 1), 2) name##_r##R(GEMV_ARGS, int stages) { GEMV_RING_CALL(R, NORM, OUT); }
#define GEMV_RING_KERNELS(R)                  \
    GEMV_RING_KERNEL(gemvr_bb, R, false, 0)   \
    GEMV_RING_KERNEL(gemvr_bf, R, false, 1)   \
    GEMV_RING_KERNEL(gemvr_ba, R, false, 2)   \
    GEMV_RING_KERNEL(gemvr_nb, R, true, 0)    \
    GEMV_RING_KERNEL(gemvr_nf, R, true, 1)    \
    GEMV_RING_KERNEL(gemvr_ns, R, true, 3)
#if RING  // its own variant (the megakernel and the split-K MLP take only the helpers)
GEMV_RING_KERNELS(1)
GEMV_RING_KERNELS(2)
GEMV_RING_KERNELS(4)
#endif
#undef TRACE_FILE
#define TRACE_FILE 1  // gemv.cu's again
