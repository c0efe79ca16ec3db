// Tensor-core and async-copy PTX helpers shared by gemm.cu and flash_attention.cu (NVRTC
// has no CUDA headers, so these wrap the instructions directly). Fragment layouts of
// mma.m16n8k16 and ldmatrix are described where they are used.
#pragma once

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte global → shared copy; valid == false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8×8 b16 matrices from shared memory (lane l gives the address of row l % 8 of
// matrix l / 8); .trans transposes each.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// c += a·b, m16n8k16, bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a·b, m16n8k16 (bf16 in, f32 accumulate) where rows 8-15 of a are zero (a1 = a3 = 0):
// their accumulators enter as a zero and leave into dead registers instead of living across
// a loop (decode attention's query heads fill rows 0-3 at most).
__device__ __forceinline__ void mma_bf16_top(float (&c)[2], u32 a0, u32 a2, u32 b0, u32 b1) {
    float d2, d3;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %5}, {%7, %8}, "
        "{%0, %1, %9, %9};\n"
        : "+f"(c[0]), "+f"(c[1]), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(b0), "r"(b1), "f"(0.f));
}

// Two f32 → bf16x2 (round to nearest even), lo in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// One step of the decode attention MMAs' online softmax (attention_decode_mma.cuh over the
// bf16 cache, kv_quant_mma.cuh over quantized rows): a warp takes 16 positions a step with
// query head g4 = lane / 4 as the MMA row; sc[T][j] is the score of position 8T + 2c4 + j
// (c4 = lane % 4; masked: −∞), m and l the row's running max and sum, oacc its output
// accumulators (per n-tile, the first two are the row's). The sums stay relative to m until
// a score passes it by e^8 (f32 sums cannot overflow): then every row of the warp takes its
// new max (a row that did not grow keeps its m: corr 1). The probabilities come back as the
// P·V A fragment's live registers: pa0 positions 2c4, 2c4 + 1, pa2 positions 8 + 2c4, 9 + 2c4.
template <int NT, int W>
__device__ __forceinline__ void softmax_step_lazy(const float (&sc)[2][2], float& m, float& l, float (&oacc)[NT][W],
                                                  u32& pa0, u32& pa2) {
    float mx = fmaxf(fmaxf(sc[0][0], sc[0][1]), fmaxf(sc[1][0], sc[1][1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const bool grow = mx > m + 8.f;  // (m = −∞: any score)
    if (__any_sync(0xffffffffu, grow)) {
        const float mn = grow ? mx : m;
        const float corr = m == -INFINITY ? 0.f : __expf(m - mn);
        l *= corr;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            oacc[t][0] *= corr;
            oacc[t][1] *= corr;
        }
        m = mn;
    }
    float pr[2][2];
#pragma unroll
    for (int T = 0; T < 2; T++)
#pragma unroll
        for (int j = 0; j < 2; j++) pr[T][j] = m == -INFINITY ? 0.f : __expf(sc[T][j] - m);
    l += pr[0][0] + pr[0][1] + pr[1][0] + pr[1][1];
    pa0 = pack_bf16x2(pr[0][0], pr[0][1]);
    pa2 = pack_bf16x2(pr[1][0], pr[1][1]);
}
