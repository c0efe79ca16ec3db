// Decode attention (one query row) over the bf16 cache, with the RoPE of q and of the new
// k and the cache write of the new k/v folded in: one launch. CPU reference: rope, rope,
// then attention (backend/cpu/attention.rs), which this matches value for value (the same
// bf16 roundings of rotated q and k).
//
// grid (heads / QB, 1, splits), block 128, clusters of cs blocks along z (cs = 1: none).
// A block takes QB query heads of one kv group (GQA: they share K/V, so each K/V row is
// loaded once for all of them; decode.rs launches QB = 1 on short caches and up to 4 on
// deep ones at head dims 64 and 128, where QB > 1 runs on the tensor cores:
// attention_decode_mma.cuh) and the positions [s·chunk, (s+1)·chunk) ∩ [0, pos0] of split s. Positions are
// spread over lanes, not walked one by one: a group of hd/8 lanes takes one position (each
// lane 8 dims, one 16-byte load of K and of V), so a warp scores 32·8/hd positions at once
// and every iteration's loads are independent. Each lane group keeps an online softmax per
// query head. In a cluster with one head per block (head dims 32-128), the lane groups of a
// warp merge by shuffles and every warp stores its partial into rank 0's shared memory,
// which merges the cluster's partials in slot order (attend's direct merge); otherwise the
// groups merge in a fixed order through shared memory into the split's partial (max, sum,
// unnormalized output), and a cluster's rank 0 merges its cs splits in rank order, reading
// them from the other blocks' shared memory. If one cluster (with cs = 1, one block) covers
// a head's positions, that is the output; else each cluster's (block's) partial goes to
// global memory and the last to finish (counted in done[blockIdx.x], reset for the next
// step) merges them in order with the whole block. Deterministic.
//
// The new position pos0 is not read from the cache: its k and v come from the q/k/v GEMV
// (raw), k is normed (qn/kn: the q/k norms' gains, or null) and rotated here (q too), and it is scored last in its split by lane group 0. The first
// block of each kv group in that split writes it to the cache for later steps.
//
// Where the time goes: at a few hundred cached positions a split is a chain of latencies
// (load K/V, score, merge, then the split merge: through global memory a fence, an atomic
// and dependent L2 reads, ~3 µs; in a cluster two barriers and shared-memory reads). Launched with PDL: the cached
// positions (< pos0) were written by earlier steps, which have finished (a step's first
// kernel, the embedding, triggers its dependents only once the step before it has ended),
// so the first KV_AHEAD rounds' K/V loads (UNR positions per lane
// group each) go out before pdl_wait, overlapping the q/k/v GEMV. Compiled per QB_MAX (the
// launch's query heads per block): registers for 4 heads where a block takes 1 spilled,
// and cost SmolLM2 9% of its decode speed (H200, docs/perf-log.md).
#define TRACE_FILE 2
#include "attention_decode.cuh"

// Registers: 161 for one query head under the 3-blocks-per-SM bound. ATT_CAP (one head, one
// round of K/V ahead: attn_decode.rs picks it for deep caches beside a large q/k/v GEMV)
// holds the kernel to 112 (20 bytes spilled): four blocks per SM, and two beside a q/k/v
// GEMV block (134 registers × 256 threads) instead of one, so more start before q/k/v ends.
// 1B at depth 8192 1 598 against 1 573 tok/s; SmolLM2 (a 960-row q/k/v) 1 396 against
// 1 407, and the short cache's kernel capped the same way lost 1% (H200, docs/perf-log.md).
// Two or more heads a block: 2 blocks an SM (the deep-cache grouped build takes 220
// registers; under the 3-block bound it spilled into local memory every step: 0.93x at the
// 8B's 32768).
#if ATT_CAP
#define ATT_BOUNDS __maxnreg__(112)
#elif QB_MAX > 1
#define ATT_BOUNDS __launch_bounds__(128, 2)
#else
#define ATT_BOUNDS __launch_bounds__(128, 3)
#endif
extern "C" __global__ void ATT_BOUNDS
    attention_decode(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_new, const bf16_t* __restrict__ v_new,
                     bf16_t* __restrict__ kc, bf16_t* __restrict__ vc, const float* __restrict__ inv_freq,
                     float linear, int interleaved, float* __restrict__ part_ml, float* __restrict__ part_acc,
                     bf16_t* __restrict__ out, int* __restrict__ done, int heads, int n_kv, int hd, int qb,
                     const int* __restrict__ pos0p, int chunk, int cs, float scale, int window,
                     const float* __restrict__ qn, const float* __restrict__ kn, float eps, const int* __restrict__ table) {
    TRACE_KERNEL();
    pdl_trigger();
    attend(q, k_new, v_new, kc, vc, inv_freq, linear, interleaved, part_ml, part_acc, out, done, heads, n_kv, hd, qb,
           *pos0p, chunk, cs, blockIdx.x, blockIdx.z, gridDim.z, scale, window, qn, kn, eps, table,
           [] { pdl_wait(); });
}

// Decode attention for several rows at once, one a sequence (the serving engine's generated
// rows): grid (heads / QB, rows, most splits), block 128, clusters of cs blocks along z
// (cs = 1: none; most a multiple of cs). Row y attends at its own position pos[y] (< 0: a
// padding row, nothing done) through its own block table (tables + row_tab[y]); its
// q/k/v/out rows, partials and done counters are row y's. Its positions [0, pos] are cut
// into splits of min_chunk, doubled until at most cs of them cover the row (with clusters,
// one cluster merging in shared memory, as attention_decode's short caches do), past
// 2·min_chunk until at most gridDim.z do (several clusters then merge through global
// memory); without clusters until at most gridDim.z do, as the serving calls' split-K
// attention cuts a span (attention.cu). A function of the row alone, so a row's bits are
// the same in any batch. Blocks past the row's splits (rounded up to whole clusters) exit
// at once; a cluster's blocks past them take empty splits.
extern "C" __global__ void ATT_BOUNDS
    attention_decode_rows(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k_new,
                          const bf16_t* __restrict__ v_new, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
                          const float* __restrict__ inv_freq, float linear, int interleaved,
                          float* __restrict__ part_ml, float* __restrict__ part_acc, bf16_t* __restrict__ out,
                          int* __restrict__ done, int heads, int n_kv, int hd, int qb, const int* __restrict__ pos,
                          int min_chunk, int cs, float scale, int window, const float* __restrict__ qn,
                          const float* __restrict__ kn, float eps, const int* __restrict__ tables,
                          const int* __restrict__ row_tab) {
    TRACE_KERNEL();
    pdl_trigger();
    const int y = blockIdx.y, pos0 = pos[y], most = gridDim.z;
    if (pos0 < 0) return;
    const int first_most = cs > 1 ? cs : most;
    int chunk = min_chunk;
    // ⌈(pos0 + 1) / chunk⌉ splits
    while ((pos0 + chunk) / chunk > (chunk < 2 * min_chunk ? first_most : most)) chunk *= 2;
    const int splits = ((pos0 + chunk) / chunk + cs - 1) / cs * cs;
    if ((int)blockIdx.z >= splits) return;
    const size_t qo = (size_t)y * heads * hd, ko = (size_t)y * n_kv * hd, slots = (size_t)y * heads * most;
    attend(q + qo, k_new + ko, v_new + ko, kc, vc, inv_freq, linear, interleaved, part_ml + 2 * slots,
           part_acc + slots * hd, out + qo, done + (size_t)y * gridDim.x, heads, n_kv, hd, qb, pos0, chunk, cs,
           blockIdx.x, blockIdx.z, splits, scale, window, qn, kn, eps, tables + row_tab[y], [] { pdl_wait(); });
}
