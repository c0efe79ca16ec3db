// The fused layer end (FFN=1 variants of gemv.cu, ffn.rs; `FERROLM_FFN_FUSED=1/2`, off):
// included by gemv.cu, whose gemv(), Mat and staging it runs phase by phase.
#pragma once
// Its kernels' timeline records (trace.cuh) name this header, whose line numbers they carry.
#undef TRACE_FILE
#define TRACE_FILE 8

// The end of a decode layer in one launch (FFN=1 variants, ffn.rs):
//   phase o (FFN_RO > 0): x += o·att                  (as gemv_ba_r<RO>)
//   phase u:              act = silu(gate·n(x)) · up·n(x)  (as gemv_ns_r<RU>)
//   phase d:              x += down·act               (as gemv_ba_r<RD>)
// Every block takes part in every phase, so the grid must be resident at once (the host
// sizes it by occupancy; all blocks trigger PDL at their start, so no later kernel takes
// the place of one not yet resident). Between phases the blocks count themselves in on a
// counter instead of ending the kernel: a block issues its first weight tile of the next
// phase before it waits there, so those weights stream while the last blocks finish (two
// kernels would load them only once the first had ended). The rows' math is the separate
// kernels', so the result is bit-identical. The last counter counts blocks out; the last
// block resets them all for the next launch.
struct CounterSync {
    int* arrived;
    int target;
    __device__ __forceinline__ int first_step() const { return blockIdx.x; }
    __device__ __forceinline__ int next_step(int b) const { return b + gridDim.x; }
    __device__ __forceinline__ void trigger() const {}
    __device__ __forceinline__ void wait() const {
        if (threadIdx.x == 0) {
            int v;
            // A wait is microseconds; seconds mean blocks that can never arrive (not all
            // resident): fail the launch with an error rather than hang the process.
            for (unsigned spins = 0;; spins++) {
                asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(arrived) : "memory");
                if (v >= target) break;
                if (spins > (1u << 23)) __trap();
            }
        }
        __syncthreads();
    }
};

// This block's writes (and reads) of the phase so far happen before it counts itself in.
__device__ __forceinline__ void count_in(int* counter) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(counter, 1);
}

template <int RO, int RU, int RD, int KO, int KD>
__device__ __forceinline__ void layer_end(Mat o, const bf16_t* att, int o_cols, Mat gate, Mat up, Mat down, float* x,
                                          const float* nw, float eps, int hidden, bf16_t* act, int ffn_cols,
                                          int* sync) {
    int G = gridDim.x, c = 0;  // counters used
    if constexpr (RO > 0) {
        Mat none{o.w, o.s, o.b, x, 0};
        gemv<RO, false, 2, KernelSync, KO>(o, none, none, att, nullptr, 0.f, o_cols);
        // A block without rows here returned before waiting for the previous kernel (the
        // attention, which wrote att and whose predecessors wrote x). Once passed, free.
        pdl_wait();
        count_in(sync + c++);
        gemv<RU, true, 3>(gate, up, Mat{gate.w, gate.s, gate.b, act, 0}, x, nw, eps, hidden, CounterSync{sync, G});
    } else {
        gemv<RU, true, 3>(gate, up, Mat{gate.w, gate.s, gate.b, act, 0}, x, nw, eps, hidden);
        pdl_wait();  // as above, for x
    }
    count_in(sync + c);
    Mat none{down.w, down.s, down.b, x, 0};
    gemv<RD, false, 2, CounterSync, KD>(down, none, none, act, nullptr, 0.f, ffn_cols, CounterSync{sync + c, G});
    c++;
    __syncthreads();
    // Every block that waited on a counter is past it once all have counted out.
    if (threadIdx.x == 0 && atomicAdd(sync + c, 1) == G - 1)
        for (int i = 0; i <= c; i++) sync[i] = 0;
}

// One kernel per variant: its rows per warp (FFN_RO for o, 0 without that phase; FFN_RU
// for gate/up; FFN_RD for down) and K slices (FFN_KO, FFN_KD), the separate launches'
// choices, are defines, so a model compiles the one it uses.
extern "C" __global__ void __launch_bounds__(32 * NW, 2)
    ffn(const u32* wo, const scale_t* so, const scale_t* bo, const bf16_t* att, int o_cols, const u32* wg,
        const scale_t* sg, const scale_t* bg, const u32* wu, const scale_t* su, const scale_t* bu, const u32* wd,
        const scale_t* sd, const scale_t* bd, float* x, const float* nw, float eps, int hidden, bf16_t* act,
        int ffn_cols, int* sync) {
    TRACE_KERNEL();
    layer_end<FFN_RO, FFN_RU, FFN_RD, FFN_KO, FFN_KD>(Mat{wo, so, bo, x, hidden}, att, o_cols, Mat{wg, sg, bg, act, ffn_cols},
                                              Mat{wu, su, bu, act, ffn_cols}, Mat{wd, sd, bd, x, hidden}, x, nw, eps,
                                              hidden, act, ffn_cols, sync);
}
