// Shared device helpers. No CUDA headers: NVRTC compiles these without a toolkit install
// (bf16 is carried as its 16 bits; f16 converts through one PTX instruction).
#pragma once

#include "trace.cuh"

typedef unsigned short bf16_t;
typedef unsigned short f16_t;
typedef unsigned int u32;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float bf2f(bf16_t v) { return __uint_as_float(((u32)v) << 16); }

// Round to nearest even, NaN kept quiet.
__device__ __forceinline__ bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float h2f(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}

// Scales/biases keep the model file's precision: SCALE_T 0 = f16, 1 = bf16, 2 = f32.
#ifndef SCALE_T
#define SCALE_T 0
#endif
#if SCALE_T == 2
typedef float scale_t;
__device__ __forceinline__ float s2f(float v) { return v; }
#elif SCALE_T == 1
typedef bf16_t scale_t;
__device__ __forceinline__ float s2f(bf16_t v) { return bf2f(v); }
#else
typedef f16_t scale_t;
__device__ __forceinline__ float s2f(f16_t v) { return h2f(v); }
#endif

// Eight bf16 (one 16-byte load) to f32: a bf16 is the high half of its f32.
__device__ __forceinline__ void unpack_bf16x8(uint4 v, float* f) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ void load_bf16x8(const bf16_t* p, float* f) {
    unpack_bf16x8(*reinterpret_cast<const uint4*>(p), f);
}

// Positions per KV block (kv::BLOCK).
#define KV_BLOCK 32

// The store row of cached position p of a sequence whose block table (for this layer's
// kind) is `table`: block table[p / KV_BLOCK], row p % KV_BLOCK of it (kv/mod.rs row_of).
__device__ __forceinline__ long kv_row(long p, const int* __restrict__ table) {
    return (long)table[p / KV_BLOCK] * KV_BLOCK + p % KV_BLOCK;
}

// RoPE (rope.cu, and attention.cu's rope_kv): pair j of a head is (2j, 2j+1) when
// interleaved (GGUF llama order), else (j, j + half) (Hugging Face order); the pair at
// position pos turns by pos / linear · inv_freq_j.
__device__ __forceinline__ void rope_pair_index(int j, int half, int interleaved, int& i0, int& i1) {
    i0 = interleaved ? 2 * j : j;
    i1 = interleaved ? 2 * j + 1 : j + half;
}
__device__ __forceinline__ void rope_angle(int pos, float linear, float inv_freq, float& s, float& c) {
    sincosf(((float)pos / linear) * inv_freq, &s, &c);
}
__device__ __forceinline__ void rope_turn(float x0, float x1, float s, float c, bf16_t& y0, bf16_t& y1) {
    y0 = f2bf(x0 * c - x1 * s);
    y1 = f2bf(x0 * s + x1 * c);
}
__device__ __forceinline__ void rope_rotate(float x0, float x1, int pos, float linear, float inv_freq, bf16_t& y0,
                                            bf16_t& y1) {
    float s, c;
    rope_angle(pos, linear, inv_freq, s, c);
    rope_turn(x0, x1, s, c, y0, y1);
}

// Programmatic dependent launch (Cuda::launch with the PDL attribute, sm_90+): the next
// kernel may start once every block of this one has called pdl_trigger(); it runs until
// its pdl_wait(), which returns when the previous kernel has finished and its writes are
// visible. Before pdl_wait() a kernel may only touch what no kernel writes (weights).
// Without the attribute (or before sm_90) both are no-ops.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    TRACE_WAITED();
}

// Thread-block clusters (Cuda::launch_clustered, sm_90+): the blocks of a cluster run at
// once on one GPC and read each other's shared memory. cluster_sync() is a barrier over
// every thread of the cluster that also orders shared-memory writes before it with reads
// after it; ld_cluster reads a float at the same shared-memory offset in the cluster's
// block `rank`. Before sm_90 the host never launches clusters and these trap.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#else
    __trap();
#endif
    return r;
}
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();
#endif
}
// The cluster shared-memory address of p's offset in the cluster's block `rank` (sm_90+).
__device__ __forceinline__ unsigned cluster_addr(const void* p, int rank) {
    unsigned remote = 0;
#if __CUDA_ARCH__ >= 900
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
#else
    __trap();
#endif
    return remote;
}
// A cluster barrier in two halves: arrive (relaxed: orders nothing) early, wait later. One
// use: a block may write another's shared memory only once that block has started, which
// an arrive at the kernel's start and a wait before the first remote write guarantee.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#else
    __trap();
#endif
}
// Store 4 floats at the same shared-memory offset as p in the cluster's block `rank`.
__device__ __forceinline__ void st_cluster4(float* p, int rank, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(cluster_addr(p, rank)), "f"(a), "f"(b),
                 "f"(c), "f"(d)
                 : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ float ld_cluster(const float* p, int rank) {
    float v = 0.f;
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(p, rank)) : "memory");
#else
    __trap();
#endif
    return v;
}

// The gated MLPs' activations: silu, and gelu's tanh approximation (PyTorch's
// gelu(approximate="tanh")).
__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }
__device__ __forceinline__ float gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The threads that stage and reduce together, and their barrier: the whole block (a kernel
// whose warps split into roles may define both before including this file).
#ifndef BLOCK_THREADS
#define BLOCK_THREADS ((int)blockDim.x)
#endif
#ifndef BLOCK_SYNC
#define BLOCK_SYNC() __syncthreads()
#endif

// Sum over BLOCK_THREADS (≤ 1024) threads; every one of them gets the result.
__device__ __forceinline__ float block_sum(float v, float* smem32) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) smem32[warp] = v;
    BLOCK_SYNC();
    int nw = (BLOCK_THREADS + 31) >> 5;
    v = lane < nw ? smem32[lane] : 0.f;
    v = warp_sum(v);
    BLOCK_SYNC();
    return v;
}
