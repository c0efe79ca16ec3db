// What the synchronization a persistent decode kernel is built from costs on this GPU
// (crates/lab/src/probe.rs; the lab's `probes sync` prints the table recorded in
// docs/perf-log.md). One block of 256 threads per SM (the host gives each more than half an
// SM's shared memory), `iters` rounds of one primitive:
//   mode 0  grid barrier: every block counts in on round `it`'s counter (red.release),
//           thread 0 spins (ld.acquire) until all have, then a block barrier;
//   mode 1  the same barrier, then the block reads a 2048-float vector and `parts` partial
//           vectors through L2 (as a phase's x staging after a barrier reads what other SMs
//           wrote), sums them and reduces the squares over the block;
//   mode 2  cluster barrier (barrier.cluster arrive/wait);
//   mode 3  cluster exchange: each block writes 2048 floats to its shared memory, cluster
//           barrier, each reduces its 1/cs slice over the cluster's blocks (DSMEM reads),
//           cluster barrier (the split-K reduction of a cluster's partial sums).
// out[block] = thread 0's running sum (modes 1 and 3), which the host checks.
#include "common.cuh"

__device__ __forceinline__ unsigned cluster_blocks() {
    unsigned n = 1;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}

extern "C" __global__ void __launch_bounds__(256, 1)
    sync_probe(int mode, int iters, int* __restrict__ counters, const float* __restrict__ vecs, int parts,
               float* __restrict__ out) {
    extern __shared__ float sm[];
    __shared__ float red[32];
    unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
    unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    float acc = 0.f;
    for (int it = 0; it < iters; it++) {
        if (mode <= 1) {
            __syncthreads();
            if (threadIdx.x == 0) {
                int* c = counters + it;
                asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(c) : "memory");
                int v;
                do {
                    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
                } while (v < (int)blocks);
            }
            __syncthreads();
            if (mode == 1) {
                float ss = 0.f;
                for (int i = threadIdx.x; i < 2048; i += 256) {
                    float x = __ldcg(vecs + i), p[8];
                    for (int q0 = 1; q0 <= parts; q0 += 8) {  // up to 8 loads in flight
#pragma unroll
                        for (int q = 0; q < 8; q++) p[q] = q0 + q <= parts ? __ldcg(vecs + (q0 + q) * 2048 + i) : 0.f;
#pragma unroll
                        for (int q = 0; q < 8; q++) x += p[q];
                    }
                    ss += x * x;
                }
                acc += block_sum(ss, red);
            }
        } else if (mode == 2) {
            cluster_sync();
        } else {
            for (int i = threadIdx.x; i < 2048; i += 256) sm[i] = (float)i;
            cluster_sync();
            unsigned cs = cluster_blocks(), r = cluster_rank(), slice = 2048 / cs;
            for (unsigned i = threadIdx.x; i < slice; i += 256) {
                float s = 0.f;
                for (unsigned p = 0; p < cs; p++) s += ld_cluster(sm + r * slice + i, p);
                acc += s;
            }
            cluster_sync();  // no block overwrites its shared memory while others read it
        }
    }
    if (threadIdx.x == 0) out[block] = acc;
}

// The PDL release against the dependent kernel's own loads in flight (session 20; probe.rs's
// pdl_release_probe). pdl_primary: one block per SM spins until `end_ns` (globaltimer) and
// records when it ends. pdl_dependent, launched right after it with PDL, is resident beside
// it (it triggers at once, as the decode kernels do): each block waits until `lead_ns`
// before the primary's end, issues `loads` 16-byte loads per thread (4 KB per block each)
// of cold memory (mode 0 into registers, as a GEMV's first tile; mode 1 prefetch.global.L2,
// which returns nothing to the SM), then griddepcontrol.wait, and records when it was
// released. Whether the release waits for the SM's loads in flight decides whether a
// deeper prefetch before the wait can pay. times[2·block]: the release, [2·block + 1]: the
// loads landed.

extern "C" __global__ void __launch_bounds__(256) pdl_primary(unsigned long long end_ns, unsigned long long* ends) {
    pdl_trigger();
    while (globaltimer_ns() < end_ns) {
    }
    __syncthreads();
    if (threadIdx.x == 0) ends[blockIdx.x] = globaltimer_ns();
}

#define PDL_PROBE_LOADS 16
extern "C" __global__ void __launch_bounds__(256) pdl_dependent(const uint4* __restrict__ junk, int loads, int mode,
                                                                 unsigned long long issue_ns,
                                                                 unsigned long long* __restrict__ times,
                                                                 unsigned* __restrict__ out) {
    pdl_trigger();
    const uint4* p = junk + (size_t)blockIdx.x * 256 * PDL_PROBE_LOADS + threadIdx.x;
    while (globaltimer_ns() < issue_ns) {
    }
    uint4 v[PDL_PROBE_LOADS];
#pragma unroll
    for (int i = 0; i < PDL_PROBE_LOADS; i++) {
        v[i] = make_uint4(0, 0, 0, 0);
        if (i < loads) {
            if (mode == 0)
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(v[i].x), "=r"(v[i].y), "=r"(v[i].z), "=r"(v[i].w)
                             : "l"(p + i * 256));
            else
                asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i * 256));
        }
    }
#if __CUDA_ARCH__ >= 900  // the host runs this probe only with PDL (sm_90+)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    unsigned long long t1 = globaltimer_ns();
    unsigned s = 0;
#pragma unroll
    for (int i = 0; i < PDL_PROBE_LOADS; i++) s += v[i].x + v[i].y + v[i].z + v[i].w;
    unsigned long long t2 = globaltimer_ns();  // the loads have landed (s depends on them)
    if (threadIdx.x == 0) {
        times[2 * blockIdx.x] = t1;
        times[2 * blockIdx.x + 1] = t2;
    }
    atomicAdd(out, s);
}
