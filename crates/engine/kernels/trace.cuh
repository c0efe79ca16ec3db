// Decode kernel timeline (FERROLM_TRACE, backend/cuda/trace.rs). With TRACE=1, thread 0
// of sampled blocks (every 16th by linear block index, and the last) of each kernel that
// opens with TRACE_KERNEL() (in a file that defines TRACE_FILE) records three events: start, pdl_wait returned, end (when
// thread 0 leaves the kernel). A record is two u64: %globaltimer (ns), then
//   bits 36..63  %gridid (the launch; low 28 bits)   bits 32..35  TRACE_FILE (the .cu)
//   bits 22..31  source line of TRACE_KERNEL()      bits 20..21  event (0 start, 1 waited, 2 end)
//   bits 12..19  %smid                              bits 0..11   linear block index (≤ 4095)
// trace_buf is set per module by the host; [0] counts records, [1] is the capacity, records
// follow from [2]. Without TRACE (the default) all of this compiles to nothing.
#pragma once

#ifndef TRACE
#define TRACE 0
#endif
#ifndef TRACE_FILE
#define TRACE_FILE 0
#endif
// TRACE_ALL (FERROLM_TRACE_ALL=1): every block is sampled, and its end is recorded by lane
// 0 of every warp, so a launch's end is its last warp's, not thread 0's of every 16th
// block (whether a kernel boundary's wait is the release or the previous kernel's tail).
#ifndef TRACE_ALL
#define TRACE_ALL 0
#endif

// %globaltimer (ns): the trace's clock, and the probes' (sync_probe.cu, stream_probe.cu).
__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

#if TRACE
__device__ unsigned long long* trace_buf;

__device__ __forceinline__ unsigned trace_block() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

__device__ __forceinline__ bool trace_sampled(unsigned ev) {
    unsigned blk = trace_block(), blocks = gridDim.x * gridDim.y * gridDim.z;
    bool t0 = threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0;
    if (TRACE_ALL) return ev == 2 ? threadIdx.y == 0 && threadIdx.z == 0 && (threadIdx.x & 31) == 0 : t0;
    return t0 && (blk % 16 == 0 || blk == blocks - 1);
}

// `file`: TRACE_FILE where the event's macro is expanded (a header may set its own).
__device__ __forceinline__ void trace_event(unsigned line, unsigned ev, unsigned file) {
    unsigned long long* b = trace_buf;
    // Files without TRACE_FILE have no TRACE_KERNEL: their pdl_wait records nothing.
    if (file == 0 || b == nullptr || !trace_sampled(ev)) return;
    unsigned long long t = globaltimer_ns(), grid;
    unsigned sm;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    unsigned blk = trace_block();
    unsigned long long i = atomicAdd(b, 1ull);
    if (i >= b[1]) return;
    b[2 + 2 * i] = t;
    b[3 + 2 * i] = (grid & 0xfffffffull) << 36 | (unsigned long long)(file & 0xf) << 32 |
                   (unsigned long long)(line & 0x3ff) << 22 | (unsigned long long)(ev & 3) << 20 |
                   (unsigned long long)(sm & 0xff) << 12 | (blk < 4095 ? blk : 4095);
}

// Start now, end when the kernel's thread 0 leaves (every return path).
struct TraceKernel {
    unsigned line, file;
    __device__ TraceKernel(unsigned l, unsigned f) : line(l), file(f) { trace_event(line, 0, file); }
    __device__ ~TraceKernel() { trace_event(line, 2, file); }
};
#define TRACE_KERNEL() TraceKernel trace_kernel_scope(__LINE__, TRACE_FILE)
#define TRACE_WAITED() trace_event(0, 1, TRACE_FILE)
#else
#define TRACE_KERNEL() \
    do {               \
    } while (0)
#define TRACE_WAITED() \
    do {               \
    } while (0)
#endif
