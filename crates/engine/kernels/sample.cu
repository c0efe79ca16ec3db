// Greedy sampling on the device: the index of the largest f32 logit (ties → lowest index,
// as the CPU sampler), so a decode step copies back one token id, not the vocabulary.
#define TRACE_FILE 3
#include "common.cuh"

#include "argmax.cuh"

// grid: any number of blocks of 256 threads, each taking a contiguous slice; the blocks'
// (max, index) partials meet as argmax.cuh's argmax_finish says. Launched with PDL.
extern "C" __global__ void argmax(const float* __restrict__ logits, int n, float* __restrict__ out,
                                  float* __restrict__ part_v, int* __restrict__ part_i, int* __restrict__ done,
                                  int* __restrict__ feed_tok, int* __restrict__ feed_pos, int* __restrict__ feed_hist) {
    TRACE_KERNEL();
    pdl_trigger();
    pdl_wait();
    int per = (n + gridDim.x - 1) / gridDim.x;
    int lo = blockIdx.x * per, hi = min(n, lo + per);
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) best_of(best, bi, logits[i], i);
    argmax_finish(best, bi, ArgmaxSink{out, part_v, part_i, done, feed_tok, feed_pos, feed_hist});
}

// One argmax per row of logits [rows, n] into out[row] (the index as f32): the serving
// engine's greedy rows, read back as one float each. grid (rows), block 1024; the same
// (max, lowest index) rule as argmax above (NaNs never win).
// A thread keeps four (max, index) pairs over interleaved strides, so four of its loads are
// in flight at once (one pair made the head row's 128K logits a 50 µs serial walk); any
// merge order gives the same result.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int n, float* __restrict__ out) {
    const float* row = logits + (long)blockIdx.x * n;
    const int st = blockDim.x;
    float b[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int bi4[4] = {0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff};
    int i = threadIdx.x;
    for (; i + 3 * st < n; i += 4 * st) {
        const float v0 = row[i], v1 = row[i + st], v2 = row[i + 2 * st], v3 = row[i + 3 * st];
        best_of(b[0], bi4[0], v0, i);
        best_of(b[1], bi4[1], v1, i + st);
        best_of(b[2], bi4[2], v2, i + 2 * st);
        best_of(b[3], bi4[3], v3, i + 3 * st);
    }
    for (; i < n; i += st) best_of(b[0], bi4[0], row[i], i);
    float best = b[0];
    int bi = bi4[0];
#pragma unroll
    for (int j = 1; j < 4; j++) best_of(best, bi, b[j], bi4[j]);
    block_best(best, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = (float)(bi == 0x7fffffff ? 0 : bi);
}

// Order-preserving u32 key of a float: larger floats get larger keys, -0 < +0, and NaNs
// sort as Rust's f32::total_cmp sorts them (the CPU sampler's order).
__device__ __forceinline__ u32 order_key(float s) {
    u32 u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The k best of s_i = x_i · inv_t by (s desc, i asc) into out[0..2k] as (i, s) f32 pairs,
// for the host to finish sampling (Sampler::sample_candidates: same candidates, same draw
// as the CPU sampler). Two phases in one launch (grid: B blocks of 512 threads, dynamic
// shared memory for `cap` u32 keys):
//  1. block b takes the slice [b·per, (b+1)·per) and writes its own k best (a radix select
//     and an ordered compaction) to cand_key/cand_idx[b·k, (b+1)·k), in index order; the
//     host makes per > k unless there is one block, so only the last slice can be shorter
//     than k (it writes all its values) and the candidates are a prefix with no gaps;
//  2. the last block to finish (counted in *done, reset for the next launch) selects the k
//     best of those candidates the same way and writes them out.
// The global k best are among the slices' k best (one strict order, ties by index), and
// the candidates lie in index order, so phase 2's compaction keeps the lowest indices on
// ties, as the CPU's heap does.
// Radix select, 8 bits a pass from the top: a shared histogram of the key digit among the
// keys still matching the prefix finds the digit holding the k-th best; four passes give
// its key T and how many keys equal to T are taken. Logits share their top bits (sign and
// exponent), so most keys of a pass hit a few bins: each warp adds one count per distinct
// digit (__match_any_sync) instead of one atomic per key, which serialized the first
// one-block version (223 µs for 128K values). A slice's keys live in shared memory when
// they fit (`cap`), else they are recomputed each pass; the candidates always fit (the
// host keeps blocks · k ≤ cap: fused.rs's top_k_split). Launched with PDL.
#define TK_THREADS 512

// The float whose order_key is `key` (exact inverse).
__device__ __forceinline__ float key_value(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// hist[digit] += 1 for every active lane, one shared atomic per distinct digit of the warp.
// Every lane of the warp must call this.
__device__ __forceinline__ void hist_count(unsigned* hist, u32 digit, bool active) {
    unsigned am = __ballot_sync(0xffffffffu, active);
    if (!active) return;
    unsigned peers = __match_any_sync(am, digit);
    if ((int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[digit], (unsigned)__popc(peers));
}

// Keys of one phase: from shared memory when staged, else computed from the slice.
struct TkKeys {
    const u32* smem;  // staged keys, or null
    const float* x;   // the slice (keys of x · inv_t), when not staged
    float inv_t;
    __device__ __forceinline__ u32 get(int i) const {
        return smem ? smem[i] : order_key(x[i] * inv_t);
    }
};

// dst[j] = key(j) for j < n, 8 loads in flight per thread: ~5K candidates come from L2 in
// about one round trip instead of ten dependent ones.
template <typename Key>
__device__ __forceinline__ void stage_keys(u32* dst, int n, Key key) {
    for (int j0 = threadIdx.x; j0 < n; j0 += 8 * blockDim.x) {
        u32 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = j0 + u * (int)blockDim.x < n ? key(j0 + u * blockDim.x) : 0u;
#pragma unroll
        for (int u = 0; u < 8; u++)
            if (j0 + u * (int)blockDim.x < n) dst[j0 + u * blockDim.x] = v[u];
    }
}

// The k-th best key T of keys[0, n) and how many keys equal to T the k best take (`left`).
__device__ void radix_select(const TkKeys& keys, int n, u32 k, unsigned* hist, u32& T, u32& left) {
    __shared__ u32 s_digit, s_left;
    int tid = threadIdx.x, lane = tid & 31;
    u32 prefix = 0, mask = 0;
    left = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int t = tid; t < 256; t += blockDim.x) hist[t] = 0;
        __syncthreads();
        for (int i0 = 0; i0 < n; i0 += blockDim.x) {  // uniform trip count: hist_count's ballot
            u32 key = i0 + tid < n ? keys.get(i0 + tid) : 0u;
            bool act = i0 + tid < n && (key & mask) == prefix;
            hist_count(hist, (key >> shift) & 255, act);
        }
        __syncthreads();
        if (tid < 32) {
            // Lane l sums bins [248 − 8l, 256 − 8l); a prefix sum over lanes (top bins first)
            // finds the lane, then the bin, where the count of better keys reaches `left`.
            unsigned c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) sum += c[j] = hist[255 - 8 * lane - j];
            unsigned incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                unsigned t = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += t;
            }
            unsigned above = incl - sum;
            if (above < left && left <= incl) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (above + c[j] >= left) {
                        s_digit = 255 - 8 * lane - j;
                        s_left = left - above;
                        break;
                    }
                    above += c[j];
                }
            }
        }
        __syncthreads();
        prefix |= s_digit << shift;
        left = s_left;
        mask |= 255u << shift;
        __syncthreads();  // s_digit / s_left are rewritten by the next pass
    }
    T = prefix;
}

// Every key above T and the first `left` keys equal to T (by position), in position order:
// emit(slot, position, key) with slots [0, k). Tiles without a candidate cost one barrier;
// in the others a ballot per warp and the warps' counts give each its slot.
template <typename Emit>
__device__ void compact(const TkKeys& keys, int n, u32 k, u32 T, u32 left, Emit emit) {
    __shared__ unsigned wgt[32], weq[32];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    u32 above_t = k - left, base_gt = 0, base_eq = 0, lt_mask = (1u << lane) - 1u;
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {
        int i = i0 + tid;
        u32 key = i < n ? keys.get(i) : 0u;
        bool gt = i < n && key > T, eq = i < n && key == T;
        if (!__syncthreads_or(gt || eq)) continue;  // uniform: every thread takes the same branch
        u32 bg = __ballot_sync(0xffffffffu, gt), be = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) {
            wgt[warp] = __popc(bg);
            weq[warp] = __popc(be);
        }
        __syncthreads();
        u32 og = base_gt + __popc(bg & lt_mask), oe = base_eq + __popc(be & lt_mask);
        for (int w = 0; w < nw; w++) {
            if (w < warp) {
                og += wgt[w];
                oe += weq[w];
            }
            base_gt += wgt[w];
            base_eq += weq[w];
        }
        if (gt) emit(og, i, key);
        if (eq && oe < left) emit(above_t + oe, i, key);
        __syncthreads();  // wgt/weq are rewritten by the next candidate tile
    }
}

extern "C" __global__ void __launch_bounds__(TK_THREADS)
    top_k(const float* __restrict__ x, int n, float inv_t, int k, int per, int cap, u32* __restrict__ cand_key,
          int* __restrict__ cand_idx, int* __restrict__ done, float* __restrict__ out) {
    TRACE_KERNEL();
    extern __shared__ u32 s_keys[];
    __shared__ unsigned hist[256];
    __shared__ int last;
    pdl_trigger();
    pdl_wait();
    int tid = threadIdx.x, b = blockIdx.x;
    int lo = b * per, len = max(0, min(n, lo + per) - lo);
    u32* ck = cand_key + (long)b * k;
    int* ci = cand_idx + (long)b * k;
    if (len <= k) {  // the whole slice is candidates
        for (int j = tid; j < len; j += blockDim.x) {
            ck[j] = order_key(x[lo + j] * inv_t);
            ci[j] = lo + j;
        }
    } else {
        bool staged = len <= cap;
        if (staged) stage_keys(s_keys, len, [&](int j) { return order_key(x[lo + j] * inv_t); });
        __syncthreads();
        TkKeys keys{staged ? s_keys : nullptr, x + lo, inv_t};
        u32 T, left;
        radix_select(keys, len, (u32)k, hist, T, left);
        compact(keys, len, (u32)k, T, left, [&](u32 slot, int i, u32 key) {
            ck[slot] = key;
            ci[slot] = lo + i;
        });
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(done, 1) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Candidates: k per block, the last block's slice possibly fewer; c ≤ cap (see above).
    int c = (gridDim.x - 1) * k + min(k, n - (int)(gridDim.x - 1) * per);
    stage_keys(s_keys, c, [&](int j) { return __ldcg(cand_key + j); });
    __syncthreads();
    TkKeys keys{s_keys, nullptr, inv_t};
    u32 T, left;
    radix_select(keys, c, (u32)k, hist, T, left);
    compact(keys, c, (u32)k, T, left, [&](u32 slot, int i, u32 key) {
        out[2 * slot] = (float)__ldcg(cand_idx + i);
        out[2 * slot + 1] = key_value(key);
    });
    if (tid == 0) *done = 0;
}
