// The weight stream of a persistent decode kernel, alone (crates/lab/src/probe.rs; the lab's
// `probes stream` prints the table recorded in docs/perf-log.md): how close
// to copy bandwidth one block per SM can stream its share of a token's weights through a
// shared-memory ring while its consumer warps stop at grid barriers between phases.
//
// Why: the op path's layer is five kernels, and each boundary holds its successor's loads
// back (docs/perf-log.md, sessions 5–15: 23 µs per 1B layer against 8 µs of bytes). The design
// that can reach half of copy bandwidth streams weights independently of the phases: a
// producer warp per SM issues bulk copies (TMA) of the SM's next weight bytes as soon as a
// ring stage is free, barriers or not, so the copies run ahead across the consumers' grid
// barriers and their math chains. This probe is that skeleton with no math (or, in dot
// mode below, a GEMV's): the stream's rate with 0, 2, 4 or 5 grid barriers per layer, and
// how long a chain after each barrier (`delay_cycles` of SM clock, a spin standing in for
// x staging and math) the ring hides.
//
// A token is `nseg` segments, in order: segment s is `bytes` per block (a multiple of 16)
// at w + off + block · bytes (only for blocks below `blocks` when that is not 0), then,
// when `barrier` is 1, a grid barrier and the spin; when it is 2, the spin alone (a stall
// of the block's own, to tell the ring's slack from the barriers' alignment across SMs).
//
// The producer (warp NW) copies each segment in `chunk`-byte pieces into `stages` ring
// stages: stage g % stages, whose full[] barrier completes phase g / stages when the bytes
// land. One lane issues a bulk copy per stage, or with `lanes_copy` the 32 lanes copy
// 16-byte pieces with cp.async (to tell the copy engine's queue from the ring's). The NW
// consumer warps wait for each stage, read it when `work` is 1 (a wrapping u32 sum the
// host checks), and count themselves out of it (empty[]), which lets the producer refill
// it; the producer never waits at a barrier. `work` 2 is a free-running stream: the
// consumers never touch the ring and the producer reuses a stage once its last copy has
// landed, the bound a ring decoupled from its consumers could reach. With `poll` every
// stage wait polls (test_wait) instead of try_wait, which may suspend the thread.
//
// grid: one block per SM (the host gives each more than half an SM's shared memory), all
// resident at once; counters: tokens · (barriers per token) · (groups, or 1) ints, zeroed;
// out[0]: the sum.
// trace (or null): for token `trace_token`, per block and per barrier k < trace_max, SP_REC
// u64: %globaltimer before the barrier, after it, after the spin, when the next stage had
// landed (0 if the segment after is empty), the stages the producer had issued ahead of the
// consumers and how many of those had landed, as the barrier released them, then
// %globaltimer as the spin starts and the spin's SM clock cycles (the clock it ran at). After
// the blocks' records, four u64 per block over the whole launch: its start, when its
// producer's last copy had landed, when its consumers were done (which side bounds it), and
// the SM it ran on (%smid: whether the blocks that arrive last are always the same SMs).
//
// `relaxed`: the grid barrier's count and poll without release/acquire (no fence: wrong for
// a kernel whose phases exchange data, timed here to see what the fence costs beside
// bulk copies in flight).
// `group` > 0: each barrier is met by groups of that many consecutive blocks only, a
// counter per group (a phase whose consumers wait for a few producers' flags, not for the
// whole grid: whether a chain after such a wait is hidden as a block's own stall is).
// `cluster` > 0: the grid is launched in clusters of that many blocks, and each barrier is
// the consumers' over their cluster only (sp_cluster_barrier: mbarriers, cluster scope),
// the exchange a phase's blocks would make through DSMEM.
// `producers` (1 or 2, bulk copies only): that many lanes of the producer warp issue the
// copies, stage g by lane g % producers (whether one thread's issuing caps an SM's rate).
// `barrier` 3 (the host's `tagged`): an all-to-all exchange by tagged words instead of a
// grid barrier (sp_tag_exchange), the hand-off a persistent kernel whose phases pass
// vectors would make without a counter or fence (NCCL's LL protocol; docs/perf-log.md,
// session 20: between op-path kernels it lost to the PDL release).
// `work` 3 (the host's `dots`, tagged exchanges or none): the consumers do a 4-bit GEMV's
// math instead of the byte sum, so that the chain after an exchange is a real one (x
// staged, row dots, reductions) rather than a spin. Every SP_ROW bytes of a segment are a
// row of 4096 nibbles; warp w takes rows w, w + 8, … of each landed stage, each lane four
// 16-byte pieces, low and high nibbles against x's int8 words by DP4A, each half group's
// sum scaled and biased (integer stand-ins for the affine group's scale and bias), then a
// warp reduction whose sum lane 0 adds to the checksum. x (1024 words of four int8) comes from
// the exchange's payloads (sp_x_word, probe.rs's x_word) into shared memory after every
// tagged exchange, and each lane loads its 32 words of it and their sums: the x staging.
// `spin_sleep`: the spin is __nanosleep steps until the deadline instead of a busy clock
// loop, so the spinning warps take no issue slots (and little power): a chain bound by
// latency, not by instructions, and whether a busy spin slows the producer beside it.
#include "common.cuh"
#include "mbarrier.cuh"

#define SP_NW 8
#define SP_STAGES_MAX 64
#define SP_REC 8   // u64 per traced barrier (probe.rs's REC)
#define SP_ENDS 4  // u64 per block after the barrier records (probe.rs's ENDS)

#define SP_ROW 2048  // bytes per row in dot mode (probe.rs's DOT_ROW): 4096 nibbles
#define SP_XWORDS (SP_ROW / 2)  // x's int8 words: two per weight word (low, high nibbles)

// x's word k in dot mode, from an exchanged payload (probe.rs's x_word).
__device__ __forceinline__ int sp_x_word(u32 k) { return (int)(k * 2654435761u ^ 0x5bd1e995u); }

// The sum of a word's four int8 lanes.
__device__ __forceinline__ int sp_lane_sum(int x) { return __dp4a(x, 0x01010101, 0); }

// A lane's x in dot mode: for each of its four 16-byte pieces j of a row (weight words
// (j·32 + lane)·4 + q, q < 4), the x words for their low and high nibbles, and the piece's
// x sum (its half group's, for the bias term).
struct SpX {
    int lo[4][4], hi[4][4], sum[4];
    __device__ __forceinline__ void load(const int* xs, int lane) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            sum[j] = 0;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                int wi = (j * 32 + lane) * 4 + q;
                lo[j][q] = xs[2 * wi], hi[j][q] = xs[2 * wi + 1];
                sum[j] += sp_lane_sum(lo[j][q]) + sp_lane_sum(hi[j][q]);
            }
        }
    }
};

// One row's dot in dot mode, summed over the warp (every lane gets it). The scale and bias
// of half group g = (j·32 + lane) / 2 are g % 7 + 1 and g % 5: integers, so that the host's
// checksum is exact in any order.
__device__ __forceinline__ int sp_row_dot(const uint4* row, const SpX& x, int lane) {
    int r = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint4 v = row[j * 32 + lane];
        u32 w4[4] = {v.x, v.y, v.z, v.w};
        int q4 = 0;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            q4 = __dp4a((int)(w4[q] & 0x0F0F0F0Fu), x.lo[j][q], q4);
            q4 = __dp4a((int)((w4[q] >> 4) & 0x0F0F0F0Fu), x.hi[j][q], q4);
        }
        int g = (j * 32 + lane) / 2;
        r += q4 * (g % 7 + 1) + (g % 5) * x.sum[j];
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) r += __shfl_xor_sync(0xffffffffu, r, d);
    return r;
}

struct SpSeg {
    long long off;
    int bytes, barrier;
    int blocks, pad;  // blocks: only blocks below it stream this segment (0: every block)
};

// The consumer warps' grid barrier: they (not the producer) meet with a named barrier,
// thread 0 counts the block in (release) and spins (acquire) until all n blocks have.
__device__ __forceinline__ void sp_grid_barrier(int* c, int relaxed, int n) {
    asm volatile("bar.sync 1, %0;" ::"n"(SP_NW * 32) : "memory");
    if (threadIdx.x == 0) {
        if (relaxed)
            asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(c) : "memory");
        else
            asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(c) : "memory");
        int v;
        for (unsigned spins = 0;; spins++) {
            if (relaxed)
                asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
            else
                asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
            if (v >= n) break;
            if (spins > (1u << 26)) __trap();  // a block that never arrives: fail, not hang
        }
    }
    asm volatile("bar.sync 1, %0;" ::"n"(SP_NW * 32) : "memory");
}

// The consumers' barrier over their cluster (launched in clusters of `cs`): thread 0
// arrives (release, cluster scope) on every block's cbar of barrier k's parity and waits
// (acquire) on its own. Two barriers alternate, so that a block already at barrier k + 1
// cannot arrive on a phase of barrier k that another block's arrivals have not finished.
__device__ __forceinline__ void sp_cluster_barrier(unsigned long long* cbar, int k, int cs) {
    asm volatile("bar.sync 1, %0;" ::"n"(SP_NW * 32) : "memory");
    if (threadIdx.x == 0) {
        unsigned long long* b = &cbar[k & 1];
        for (int r = 0; r < cs; r++)
            asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr(b, r))
                         : "memory");
        u32 done = 0, parity = (k >> 1) & 1;
        while (!done)
            asm volatile(
                "{ .reg .pred p;\n\t"
                "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                "selp.u32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(smem_addr(b)), "r"(parity)
                : "memory");
    }
    asm volatile("bar.sync 1, %0;" ::"n"(SP_NW * 32) : "memory");
}

// The consumers' exchange by tagged words: threads 0-15 store this block's 16 words of
// a vector (payload = the word's index, tag = this exchange's number `k`, one 64-bit store
// each); then every consumer thread polls its share of the whole vector (words
// threadIdx.x + j·256) until each carries tag k, loads all out at once and reloads only
// the stale ones, and checks every payload. Two vectors alternate by exchange: a block
// one exchange ahead never writes the vector a slower block still reads (it cannot finish
// exchange k + 1 before every block has written k + 1, after reading k).
#define SP_XW 16   // words per block (probe.rs's XW)
#define SP_XPER 9  // words per consumer thread at most (probe.rs's XPER; grid ≤ 144 blocks)
__device__ __forceinline__ void sp_tag_exchange(unsigned long long* xv, u32 k, int* xs) {
    unsigned long long* v = xv + (size_t)(k & 1) * SP_XW * gridDim.x;
    int n = SP_XW * gridDim.x;
    if (threadIdx.x < SP_XW) {
        unsigned long long word = (unsigned long long)k << 32 | (blockIdx.x * SP_XW + threadIdx.x);
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(v + blockIdx.x * SP_XW + threadIdx.x), "l"(word)
                     : "memory");
    }
    unsigned long long w[SP_XPER];
#pragma unroll
    for (int j = 0; j < SP_XPER; j++) {
        int i = threadIdx.x + j * SP_NW * 32;
        w[j] = (unsigned long long)k << 32 | (u32)i;
        if (i < n) asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w[j]) : "l"(v + i) : "memory");
    }
    for (unsigned spins = 0;; spins++) {
        bool ok = true;
#pragma unroll
        for (int j = 0; j < SP_XPER; j++) ok = ok && (u32)(w[j] >> 32) == k;
        if (ok) break;
        if (spins > (1u << 24)) __trap();  // a block that never writes: fail, not hang
        __nanosleep(32);
#pragma unroll
        for (int j = 0; j < SP_XPER; j++) {
            int i = threadIdx.x + j * SP_NW * 32;
            if (i < n && (u32)(w[j] >> 32) != k)
                asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w[j]) : "l"(v + i) : "memory");
        }
    }
#pragma unroll
    for (int j = 0; j < SP_XPER; j++)
        if ((u32)w[j] != (u32)(threadIdx.x + j * SP_NW * 32)) __trap();  // a torn or misplaced word
    if (xs) {  // dot mode: the next phase's x, from the payloads just read
#pragma unroll
        for (int j = 0; j < SP_XPER; j++) {
            int i = threadIdx.x + j * SP_NW * 32;
            if (i < SP_XWORDS) xs[i] = sp_x_word((u32)w[j]);
        }
    }
    asm volatile("bar.sync 1, %0;" ::"n"(SP_NW * 32) : "memory");
}

// Wait for `bar`'s phase of `parity`: try_wait (which may suspend the thread until the
// phase completes or a time limit passes), or with `poll` a test_wait loop that never
// suspends (whether the suspension's wake-up is what paces a stage).
__device__ __forceinline__ void sp_wait(unsigned long long* bar, u32 parity, int poll) {
    if (poll) {
        while (!mbar_test(bar, parity)) {
        }
    } else {
        mbar_wait(bar, parity);
    }
}

extern "C" __global__ void __launch_bounds__((SP_NW + 1) * 32, 1)
    stream_probe(const unsigned char* __restrict__ w, const SpSeg* __restrict__ segs, int nseg, int tokens,
                 int chunk, int stages, int work, int delay_cycles, int spin_sleep, int relaxed, int group,
                 int cluster, int lanes_copy, int poll, int producers,
                 int* __restrict__ counters, unsigned long long* __restrict__ xvec,
                 unsigned* __restrict__ out, unsigned long long* __restrict__ trace, int trace_token,
                 int trace_max) {
#if __CUDA_ARCH__ < 900
    __trap();  // bulk copies and expect_tx are sm_90's; the host refuses older devices
#else
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) unsigned long long full[SP_STAGES_MAX], empty[SP_STAGES_MAX];
    __shared__ unsigned red[SP_NW];
    __shared__ volatile u32 issued;  // stages the producer has issued (for the trace)
    __shared__ __align__(8) unsigned long long cbar[2];  // the cluster barrier's, by phase parity
    // Dot mode's x, two buffers by exchange parity: a warp that reaches exchange k + 1
    // early writes the other buffer from the one a slower warp may still load after
    // exchange k (exchange k + 1's closing barrier keeps it from getting further ahead).
    __shared__ int xs[2][SP_XWORDS];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; s++) mbar_init(&full[s], lanes_copy ? 32 : 1), mbar_init(&empty[s], SP_NW);
        if (cluster) mbar_init(&cbar[0], cluster), mbar_init(&cbar[1], cluster);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        issued = 0;
    }
    __syncthreads();
    if (cluster) cluster_sync();  // every block's cbar initialized before any remote arrival
    unsigned long long* ends = trace ? trace + (size_t)gridDim.x * trace_max * SP_REC + blockIdx.x * SP_ENDS : nullptr;
    if (ends && threadIdx.x == 0) {
        u32 sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        ends[0] = globaltimer_ns(), ends[3] = sm;
    }
    if (warp == SP_NW) {  // the producer: one lane's bulk copies (TMA), or 32 lanes' cp.async
        if (!lanes_copy && lane >= producers) return;
        u32 g = 0;
        for (int t = 0; t < tokens; t++)
            for (int s = 0; s < nseg; s++) {
                SpSeg sg = segs[s];
                if (sg.blocks && (int)blockIdx.x >= sg.blocks) sg.bytes = 0;
                const unsigned char* src = w + sg.off + (long long)blockIdx.x * sg.bytes;
                for (int o = 0; o < sg.bytes; o += chunk, g++) {
                    if (!lanes_copy && (int)(g % producers) != lane) continue;  // another lane's stage
                    u32 st = g % stages, n = min(chunk, sg.bytes - o);
                    unsigned char* dst = ring + (size_t)st * chunk;
                    // work 2: free-running, a stage is reused once its last copy has landed
                    if (g >= (u32)stages) sp_wait(work == 2 ? &full[st] : &empty[st], (g / stages - 1) & 1, poll);
                    if (lanes_copy) {
                        for (u32 i = lane * 16; i < n; i += 32 * 16)
                            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst + i)),
                                         "l"(src + o + i)
                                         : "memory");
                        // This lane's arrival on the stage once its copies have landed.
                        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(
                                         smem_addr(&full[st]))
                                     : "memory");
                    } else {
                        mbar_expect(&full[st], n);
                        bulk_copy(dst, src + o, n, &full[st]);
                    }
                    if (lanes_copy ? lane == 0 : lane == producers - 1) issued = g + 1;
                }
            }
        if (ends && lane == 0) {
            // The last copy into each stage, landed (the consumers wait for them too,
            // except in a free-running stream, which nothing else waits for).
            for (u32 st = 0; st < (u32)stages && st < g; st++) {
                u32 last = st + (u32)stages * ((g - 1 - st) / stages);
                mbar_wait(&full[st], (last / stages) & 1);
            }
            ends[1] = globaltimer_ns();
        }
        return;
    }
    const bool dots = work == 3;
    SpX x;
    if (dots) {  // the first phase's x (later ones come from the exchanges)
        for (int i = threadIdx.x; i < SP_XWORDS; i += SP_NW * 32) xs[0][i] = sp_x_word(i);
        asm volatile("bar.sync 1, %0;" ::"n"(SP_NW * 32) : "memory");
        x.load(xs[0], lane);
    }
    u32 g = 0, acc = 0, xk = 0;  // xk: tagged exchanges so far (their tags are 1, 2, …)
    int bar = 0, pending = -1;  // pending: the trace record whose next landed stage is due
    for (int t = 0; t < tokens; t++) {
        bool tracing = trace && t == trace_token && threadIdx.x == 0;
        int kb = 0;  // this token's barriers so far
        for (int s = 0; s < nseg; s++) {
            SpSeg sg = segs[s];
            if (sg.blocks && (int)blockIdx.x >= sg.blocks) sg.bytes = 0;
            for (int o = 0; o < sg.bytes && work != 2; o += chunk, g++) {
                u32 st = g % stages, n = min(chunk, sg.bytes - o);
                sp_wait(&full[st], (g / stages) & 1, poll);
                if (pending >= 0 && threadIdx.x == 0) {
                    trace[((size_t)blockIdx.x * trace_max + pending) * SP_REC + 3] = globaltimer_ns();
                    pending = -1;
                }
                if (dots) {
                    for (int rr = warp; rr < (int)(n / SP_ROW); rr += SP_NW) {
                        const uint4* row = reinterpret_cast<const uint4*>(ring + (size_t)st * chunk + rr * SP_ROW);
                        int r = sp_row_dot(row, x, lane);
                        if (lane == 0) acc += (u32)r;
                    }
                } else if (work) {
                    const uint4* p = reinterpret_cast<const uint4*>(ring + (size_t)st * chunk);
                    for (u32 i = threadIdx.x; i < n / 16; i += SP_NW * 32) {
                        uint4 v = p[i];
                        acc += v.x + v.y + v.z + v.w;
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[st]);
            }
            if (sg.barrier) {
                unsigned long long* rec =
                    tracing && kb < trace_max ? trace + ((size_t)blockIdx.x * trace_max + kb) * SP_REC : nullptr;
                if (rec) rec[0] = globaltimer_ns();
                if (sg.barrier == 3) {
                    xk++;
                    sp_tag_exchange(xvec, xk, dots ? xs[xk & 1] : nullptr);
                    if (dots) x.load(xs[xk & 1], lane);  // the x staging after the hand-off
                } else if (sg.barrier == 1 && cluster) {
                    sp_cluster_barrier(cbar, bar++, cluster);
                } else if (sg.barrier == 1) {
                    // A group's barrier: only its `group` blocks meet (a counter each).
                    int groups = group ? (gridDim.x + group - 1) / group : 1, gi = group ? blockIdx.x / group : 0;
                    int n = group ? min(group, (int)gridDim.x - gi * group) : gridDim.x;
                    sp_grid_barrier(counters + bar++ * groups + gi, relaxed, n);
                }
                if (rec) {  // how far ahead the stream is as the consumers go on
                    rec[1] = globaltimer_ns();
                    u32 ahead = issued - g, landed = 0;
                    while (landed < ahead && landed < (u32)stages &&
                           mbar_test(&full[(g + landed) % stages], ((g + landed) / stages) & 1))
                        landed++;
                    rec[4] = ahead;
                    rec[5] = landed;
                }
                if (rec) rec[6] = globaltimer_ns();
                long long t0 = clock64();
                if (delay_cycles > 0) {  // the chain after a barrier: x staging and math
                    while (clock64() - t0 < delay_cycles) {
                        if (spin_sleep) __nanosleep(64);
                    }
                }
                if (rec) rec[7] = clock64() - t0;
                if (rec) rec[2] = globaltimer_ns(), pending = kb;
                kb++;
            }
        }
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, d);
    if (lane == 0) red[warp] = acc;
    asm volatile("bar.sync 1, %0;" ::"n"(SP_NW * 32) : "memory");
    if (threadIdx.x == 0) {
        if (ends) ends[2] = globaltimer_ns();
        u32 sum = 0;
        for (int i = 0; i < SP_NW; i++) sum += red[i];
        atomicAdd(out, sum);  // wrapping u32 sums: the same total in any order
    }
#endif
}
