// mbarrier and bulk-copy (TMA) helpers for kernels that stream global memory into shared
// memory by the copy engine: the stream probe (stream_probe.cu), which has this text
// spliced in where it includes it (crates/lab/src/kernels.rs: the engine's NVRTC wrapper
// knows only the engine's headers).
#pragma once

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// The next phase of `bar` completes when `bytes` have arrived (and this one arrival).
__device__ __forceinline__ void mbar_expect(unsigned long long* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    }
}

// Whether `bar`'s phase of `parity` has completed, without waiting (test_wait never
// suspends the thread, where try_wait may).
__device__ __forceinline__ bool mbar_test(unsigned long long* bar, u32 parity) {
    u32 done;
    asm volatile(
        "{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    return done;
}

// Copy `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory into
// this block's shared memory by the copy engine; counted on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
