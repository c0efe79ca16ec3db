// x staged by its producer (included by gemv.cu after put_x): the SwiGLU GEMV (OUT 4)
// writes its act values as well in the layout the down GEMV's shared memory takes them
// (int16 x swizzled by xpart, block scales xd, sums xs16: put_x's image, in global memory),
// so down's staging (PRE) is one 16-byte copy per piece instead of loading bf16 act and
// quantizing every value in every block: at the 1B shape each of down's 264 blocks
// quantized all 8192 values after its release (phase marks: ~2 µs, docs/perf-log.md).
// Bit-identical by construction: put_x sees the same bf16-rounded values, in the same
// 32-value blocks (a block step of NW·R rows is whole x blocks: host, NW·R % 32 == 0), and
// the consumer and producer are compiled with one BITS (the image's layout).

// Bytes of the image for `cols` inputs: int16 x, cols/32 f32 scales, cols/16 f32 sums.
__device__ __forceinline__ int staged_bytes(int cols) { return 2 * cols + cols / 8 + cols / 4; }

// The producer's side, after a block step's row stores: `vals` holds the step's NW·R act
// values (each warp's lane 0 wrote its R rows at warp·R), bf16-exact; warp 0's lanes put
// one 8-value part each into `img` (the consumer's image for `cols` inputs). One barrier:
// the caller alternates two `vals` buffers by step, so a warp writing step s + 2's values
// has passed step s + 1's barrier, which warp 0 reaches only after reading step s's.
template <int R>
__device__ __forceinline__ void stage_step(const float* vals, int step_row0, uint4* img, int cols) {
    constexpr int PARTS = NW * R / 8;
    static_assert(PARTS % 4 == 0 && PARTS <= 32, "a block step is whole 32-value x blocks, at most one warp's parts");
    BLOCK_SYNC();
    if (threadIdx.x < 32) {  // all of warp 0: put_x shuffles within each 4-lane x block
        int l = threadIdx.x;
        bool on = l < PARTS;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (on) {
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = vals[8 * l + k];
        }
        put_x(img, step_row0 / 8 + l, v, on, cols);
    }
}

// The consumer's staging: copy the image into shared memory, every piece's load issued
// before any store (one L2 round trip; 8192 inputs are 1 216 pieces, under 5 per thread).
// host: cols % 128 == 0, so the image is whole 16-byte pieces.
__device__ __forceinline__ void copy_staged(uint4* xs, const void* img, int cols) {
    constexpr int PER = 8;
    int n = staged_bytes(cols) / 16;
    const uint4* src = reinterpret_cast<const uint4*>(img);
    for (int i0 = threadIdx.x; i0 < n; i0 += PER * BLOCK_THREADS) {
        uint4 t[PER];
#pragma unroll
        for (int u = 0; u < PER; u++) {
            int i = i0 + u * BLOCK_THREADS;
            if (i < n) t[u] = __ldcg(src + i);  // written by the previous kernel: from L2
        }
#pragma unroll
        for (int u = 0; u < PER; u++) {
            int i = i0 + u * BLOCK_THREADS;
            if (i < n) xs[i] = t[u];
        }
    }
    BLOCK_SYNC();
}

// The kernels (expanded by gemv.cu after gemv() and GEMV_ARGS / GEMV_CALL):
// Staged x (x_staged.cuh): SwiGLU (GeGLU: ny) writing the down GEMV's image (nz, at gate/up's R = 4;
// m2.o is the image), and down + add reading it (qa) at the rows per warp and K slices
// fused.rs gives down.
#define GEMV_PRE_CALL(R, KS)                                                                                   \
    TRACE_KERNEL();                                                                                           \
    gemv<R, false, 2, KernelSync, KS, true>(Mat{w0, s0, b0, o0, n0}, Mat{w1, s1, b1, o1, n1},                 \
                                            Mat{w2, s2, b2, o2, n2}, x, nw, eps, cols)
// gemv_nz_r4 at ≤ 128 registers, so two 8-warp blocks fit per SM as gemv_ns_r4's do (the
// staging took it to 143 registers uncapped); 2-bit weights, or several tokens a block
// (NT), would spill there: no cap.
#define NZ_MIN_BLOCKS (BITS == 2 || NT > 0 ? 1 : 16 / NW)
#define GEMV_STAGED_KERNELS                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW, NZ_MIN_BLOCKS) gemv_nz_r4(GEMV_ARGS) { GEMV_CALL(4, true, 4, 1); } \
    extern "C" __global__ void __launch_bounds__(32 * NW, NZ_MIN_BLOCKS) gemv_ny_r4(GEMV_ARGS) { GEMV_CALL(4, true, 7, 1); } \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_qa_r1(GEMV_ARGS) { GEMV_PRE_CALL(1, 1); }             \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_qa_r2(GEMV_ARGS) { GEMV_PRE_CALL(2, 1); }             \
    extern "C" __global__ void __launch_bounds__(32 * NW) gemv_qa_r4(GEMV_ARGS) { GEMV_PRE_CALL(4, 1); }             \
    extern "C" __global__ void __launch_bounds__(32 * NW, 16 / NW) gemv_qa_r2k2(GEMV_ARGS) { GEMV_PRE_CALL(2, 2); }
