// gemv.cu's x staging: a block puts its input x into shared memory (bf16, or int16 with
// per-32 scales and per-16 sums under XQ), RMS-normalized on load for a residual input.
// Included by gemv.cu after its layout helpers (xpart, xq_u32, pair16, VPC/NP).
#pragma once
// Put the 8 values v of x part i (values 8i..8i+7, bf16-exact) into shared memory. Every
// thread of the block calls this together (XQ shuffles across the 4 parts of a 32-block);
// `on`: part i exists.
__device__ __forceinline__ void put_x(uint4* xs, int i, const float (&v)[8], bool on, int cols) {
#if XQ
    float am = 0.f, sum = 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        am = fmaxf(am, fabsf(v[k]));
        sum += v[k];
    }
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (!on) return;
    float inv = am > 0.f ? 32767.f / am : 0.f;
    u32 q[8];
#pragma unroll
    // round(v·inv) to the nearest integer (ties to even, as __float2int_rn) by adding 1.5·2²³:
    // the sum's low mantissa bits are the integer's two's complement (|v·inv| ≤ 32767 <
    // 2²²), and pair16 keeps their low 16 bits. Two full-rate FP32 instructions instead of
    // a quarter-rate F2I; the _rn intrinsics keep them from fusing into one FMA (a
    // different rounding). Bit-identical to the F2I.
    for (int k = 0; k < 8; k++) q[k] = __float_as_uint(__fadd_rn(__fmul_rn(v[k], inv), 12582912.f));
    float* xd = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(xs) + 2 * cols);
    if (i % 4 == 0) xd[i / 4] = am / 32767.f;
    if (i % 2 == 0) xd[cols / 32 + i / 2] = sum;  // xs16
#if BITS == 4  // part i = word p = i % 4 of chunk i / 4
    int c = i / 4, t = 4 * (i % 4);
    *xq_u32(xs, c, t) = pair16(q[0], q[2]);
    *xq_u32(xs, c, t + 1) = pair16(q[4], q[6]);
    *xq_u32(xs, c, t + 2) = pair16(q[1], q[3]);
    *xq_u32(xs, c, t + 3) = pair16(q[5], q[7]);
#elif BITS == 8  // part i = words 2(i % 2) and 2(i % 2) + 1 of chunk i / 2
    int c = i / 2, t = 4 * (i % 2);
    *xq_u32(xs, c, t) = pair16(q[0], q[1]);
    *xq_u32(xs, c, t + 1) = pair16(q[2], q[3]);
    *xq_u32(xs, c, t + 2) = pair16(q[4], q[5]);
    *xq_u32(xs, c, t + 3) = pair16(q[6], q[7]);
#else  // 2 bits: part i = values 8h..8h+7 (h = i % 2) of word w = (i % 8) / 2 of chunk i / 8,
       // which fill x u32 2k + h = (8h + k, 8h + 4 + k) of the word
    int c = i / 8, w = (i % 8) / 2, h = i % 2;
#pragma unroll
    for (int k = 0; k < 4; k++) *xq_u32(xs, c, 8 * w + 2 * k + h) = pair16(q[k], q[k + 4]);
#endif
#else
    if (!on) return;
    uint4 o;
    o.x = (u32)f2bf(v[0]) | ((u32)f2bf(v[1]) << 16);
    o.y = (u32)f2bf(v[2]) | ((u32)f2bf(v[3]) << 16);
    o.z = (u32)f2bf(v[4]) | ((u32)f2bf(v[5]) << 16);
    o.w = (u32)f2bf(v[6]) | ((u32)f2bf(v[7]) << 16);
    xs[xpart(i / NP, i % NP)] = o;
#endif
}

// Parts u·threads + thread (8 floats each, two float4) of f32 vector p, for u < GP, where
// they exist (< nparts).
#define GP 2
__device__ __forceinline__ void load_parts(const float* p, int nparts, float4 (&d)[GP][2]) {
    const float4* p4 = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int u = 0; u < GP; u++) {
        int i = u * BLOCK_THREADS + threadIdx.x;
        if (i < nparts) {
            d[u][0] = p4[2 * i];
            d[u][1] = p4[2 * i + 1];
        }
    }
}

// The 8 normalized values of one x part: gain · (x · r), bf16-rounded as the unfused rmsnorm
// kernel writes them.
__device__ __forceinline__ void norm_part(float4 a, float4 b, float4 ga, float4 gb, float r, float (&v)[8]) {
    float t[8] = {ga.x * (a.x * r), ga.y * (a.y * r), ga.z * (a.z * r), ga.w * (a.w * r),
                  gb.x * (b.x * r), gb.y * (b.y * r), gb.z * (b.z * r), gb.w * (b.w * r)};
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = bf2f(f2bf(t[k]));
}

__device__ __forceinline__ float sum_sq(float4 a) { return a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w; }

// The RMSNorm gains of the x parts a thread stages, when every thread stages at most GP
// parts (hidden ≤ 8·GP·threads: 4096 at 256 threads): loaded before the kernel waits for
// its input (nothing writes them), so staging a normalized x is one L2 round trip (x)
// instead of two (x for the sum of squares, then the gains).
struct NormGains {
    float4 g[GP][2], pg[GP][2];  // pg: the pending post-norm's gains (PostNorm)
    bool held;

    __device__ __forceinline__ void load(const float* __restrict__ nw, int cols, bool norm,
                                         const float* __restrict__ pw = nullptr) {
        held = norm && cols / 8 <= GP * BLOCK_THREADS;
        if (held) load_parts(nw, cols / 8, g);
        if (held && pw) load_parts(pw, cols / 8, pg);
    }
};

// A residual add still pending when a GEMV starts (Gemma's post-norms): the residual its
// input x holds is x + rmsnorm(y)·w, y the bf16 output of the block before. Each block
// forms it while staging; block 0 also writes it to `out` (not x: other blocks still read
// x), the residual from here on. Needs the gains held (hidden ≤ 8·GP·threads).
struct PostNorm {
    const bf16_t* y;
    const float* w;
    float* out;
};

// x += w · (y · r), elementwise (rmsnorm_add's expression).
__device__ __forceinline__ void add_scaled(float4& x, float4 w, float y0, float y1, float y2, float y3, float r) {
    x.x += w.x * (y0 * r);
    x.y += w.y * (y1 * r);
    x.z += w.z * (y2 * r);
    x.w += w.w * (y3 * r);
}

// xv += rmsnorm(y)·w for this thread's parts (rmsnorm_add's math, f32), written to post.out
// by block 0. Every thread of the block calls this together (block_sum).
__device__ __forceinline__ void add_post_norm(float4 (&xv)[GP][2], const PostNorm& post, const NormGains& pre,
                                              int nparts, int cols, float eps, float* red) {
    uint4 yv[GP];
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < GP; u++) {
        int i = u * BLOCK_THREADS + threadIdx.x;
        if (i >= nparts) break;
        yv[u] = reinterpret_cast<const uint4*>(post.y)[i];
        float f[8];
        unpack_bf16x8(yv[u], f);
#pragma unroll
        for (int k = 0; k < 8; k++) ss += f[k] * f[k];
    }
    float r = rsqrtf(block_sum(ss, red) / cols + eps);
#pragma unroll
    for (int u = 0; u < GP; u++) {
        int i = u * BLOCK_THREADS + threadIdx.x;
        if (i >= nparts) break;
        float f[8];
        unpack_bf16x8(yv[u], f);
        add_scaled(xv[u][0], pre.pg[u][0], f[0], f[1], f[2], f[3], r);
        add_scaled(xv[u][1], pre.pg[u][1], f[4], f[5], f[6], f[7], r);
        if (blockIdx.x == 0) {
            reinterpret_cast<float4*>(post.out)[2 * i] = xv[u][0];
            reinterpret_cast<float4*>(post.out)[2 * i + 1] = xv[u][1];
        }
    }
}

// Stage x (cols values) into shared memory. NORM: x is the f32 residual, normalized by
// r = rsqrt(mean(x²) + eps) and the gains nw (bf16-rounded, as the unfused rmsnorm kernel
// writes it); else bf16. `pre`: the gains when loaded ahead (NormGains). Returns the factor
// the caller's dot products take: 1, or with DEFER (and the gains held) r itself, as the
// staged x is then the bf16-rounded g·x: its quantizing starts without waiting for the
// block's sum of squares, whose warp partials meet in the staging's one barrier instead of
// block_sum's two (the dot products are linear in x; the rounding differs from the CPU
// path's bf16 of g·x·r by a bf16 rounding, well inside the parity bar).
//
// POST: x is a residual with a pending post-norm add (PostNorm), added first.
template <bool NORM, bool DEFER = false, bool POST = false>
__device__ __forceinline__ float stage_x(uint4* xs, const void* x, const float* __restrict__ nw, float eps, int cols,
                                         const NormGains& pre, const PostNorm& post = {}) {
    int nparts = cols / 8;
    float r = 1.f;
    const float4* xf = reinterpret_cast<const float4*>(x);
    __shared__ float red[32];
    if (NORM && pre.held) {  // each thread's parts of x in registers: one pass over x
        float4 xv[GP][2];
        float ss = 0.f;
        load_parts(reinterpret_cast<const float*>(x), nparts, xv);
        if (POST) add_post_norm(xv, post, pre, nparts, cols, eps, red);
#pragma unroll
        for (int u = 0; u < GP; u++) {
            if (u * BLOCK_THREADS + (int)threadIdx.x >= nparts) break;
            float4 a = xv[u][0], b = xv[u][1];  // one sum of eight, in this order (the rounding)
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
        }
        if (DEFER) {
            ss = warp_sum(ss);
            if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
        } else {
            r = rsqrtf(block_sum(ss, red) / cols + eps);
        }
#pragma unroll
        for (int u = 0; u < GP; u++) {
            if (u * BLOCK_THREADS >= nparts) break;  // uniform: put_x shuffles
            int i = u * BLOCK_THREADS + threadIdx.x;
            bool on = i < nparts;
            float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (on) norm_part(xv[u][0], xv[u][1], pre.g[u][0], pre.g[u][1], DEFER ? 1.f : r, v);
            put_x(xs, i, v, on, cols);
        }
        BLOCK_SYNC();
        if (!DEFER) return 1.f;
        float t = 0.f;  // the warps' partials in warp order: the same sum in every thread
#pragma unroll
        for (int w = 0; w < BLOCK_THREADS / 32; w++) t += red[w];
        return rsqrtf(t / cols + eps);
    }
    if (POST) __trap();  // the host launches POST only where the gains are held
    if (NORM) {
        float ss = 0.f;
        for (int i0 = threadIdx.x; i0 < cols / 4; i0 += 4 * BLOCK_THREADS) {  // 4 loads in flight
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                int i = i0 + u * BLOCK_THREADS;
                v[u] = i < cols / 4 ? xf[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) ss += sum_sq(v[u]);
        }
        r = rsqrtf(block_sum(ss, red) / cols + eps);
    }
    const float4* wf = reinterpret_cast<const float4*>(nw);
    // SB parts per thread are loaded before any is converted: x comes from L2 (the previous
    // kernel wrote it), and a loop that loaded one part per trip paid one L2 round trip per
    // part (4 for the 8192-wide input of a 1B model's down projection).
    constexpr int SB = 4;
    for (int i0 = 0; i0 < nparts; i0 += SB * BLOCK_THREADS) {  // uniform trip count: put_x shuffles
        float4 xn[SB][2];  // NORM: 8 f32 of the residual
        uint4 xb[SB];      // else: 8 bf16
#pragma unroll
        for (int u = 0; u < SB; u++) {
            int i = i0 + u * BLOCK_THREADS + threadIdx.x;
            if (i >= nparts) break;
            if (NORM) {
                xn[u][0] = xf[2 * i];
                xn[u][1] = xf[2 * i + 1];
            } else {
                xb[u] = reinterpret_cast<const uint4*>(x)[i];
            }
        }
#pragma unroll
        for (int u = 0; u < SB; u++) {
            if (i0 + u * BLOCK_THREADS >= nparts) break;  // uniform: put_x shuffles
            int i = i0 + u * BLOCK_THREADS + threadIdx.x;
            bool on = i < nparts;
            float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (on && NORM) {
                norm_part(xn[u][0], xn[u][1], wf[2 * i], wf[2 * i + 1], r, v);
            } else if (on) {
                unpack_bf16x8(xb[u], v);
            }
            put_x(xs, i, v, on, cols);
        }
    }
    BLOCK_SYNC();
    return 1.f;
}
