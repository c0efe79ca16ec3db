// The quantized rows' layout and their encoding (kv_quant.cu's kv_encode and
// attention_q_decode): MLX's affine rule and TurboQuant's keys and values, bit for bit as
// kv/rows.rs's RowCodec::encode, every operation rounded as the CPU's (__f*_rn keeps NVRTC
// from contracting a multiply and an add into one fma). Included by kv_quant.cu after its
// scheme's defines (TURBO, KBITS, KSIGNED, VBITS, QG, HD_MAX, TAB_*) and QH.
#pragma once

typedef unsigned char u8;

struct RowLayout {
    int k_codes, k_bytes, v_codes, bytes;
};
__device__ __forceinline__ RowLayout row_layout(int hd) {
    RowLayout r;
    r.k_codes = hd * KBITS / 8;
    r.k_bytes = r.k_codes + hd / QG * 4;  // affine: scales then biases (bf16); turbo: (scale, zero) f16 pairs
    r.v_codes = hd * VBITS / 8;
    r.bytes = r.k_bytes + r.v_codes + hd / QG * (TURBO ? 2 : 4);
    return r;
}

__device__ __forceinline__ f16_t f2h(float f) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ u32 ld16(const u8* p) { return *reinterpret_cast<const unsigned short*>(p); }
__device__ __forceinline__ void st16(u8* p, u32 v) { *reinterpret_cast<unsigned short*>(p) = (unsigned short)v; }

// The hd codes in s_code packed LSB first into out (hd·bits/8 bytes), a byte per thread.
__device__ __forceinline__ void pack_codes(const u8* s_code, int bits, int hd, u8* out) {
    int d = threadIdx.x;
    if (d >= hd * bits / 8) return;
    if (bits == 8) {
        out[d] = s_code[d];
        return;
    }
    u32 byte = 0, mask = (1u << bits) - 1;
    for (int i = 8 * d / bits; i <= (8 * d + 7) / bits; i++) {
        int shift = i * bits - 8 * d;
        u32 c = s_code[i] & mask;
        byte |= shift >= 0 ? c << shift : c >> -shift;
    }
    out[d] = (u8)byte;
}

// MLX's affine_quantize of a group of 64 (quant::affine::quantize_group): its f32 scale and
// bias (the codes use them unrounded; the row stores them as bf16).
__device__ void affine_group(const float* x, int bits, float& scale, float& bias) {
    float n_bins = (float)((1 << bits) - 1), eps = 1e-7f;
    float wmin = INFINITY, wmax = -INFINITY;
    for (int i = 0; i < 64; i++) {
        if (wmax < x[i]) wmax = x[i];
        if (x[i] < wmin) wmin = x[i];
    }
    bool mask = fabsf(wmin) > fabsf(wmax);
    float range = __fdiv_rn(__fsub_rn(wmax, wmin), n_bins);
    scale = range < eps ? eps : range;
    scale = mask ? scale : -scale;
    float edge = mask ? wmin : wmax;
    float q0 = rintf(__fdiv_rn(edge, scale));
    bias = 0.f;
    if (q0 != 0.f) {
        scale = __fdiv_rn(edge, q0);
        bias = edge;
    }
}

// One head's hd values in s_x encoded as affine: codes, then bf16 scales, then bf16 biases.
__device__ void encode_affine(const float* s_x, float* s_gp, u8* s_code, int bits, int hd, u8* out) {
    int d = threadIdx.x, g = d / 64, groups = hd / 64, codes = hd * bits / 8;
    if (d < hd && d % 64 == 0) {
        float s, b;
        affine_group(s_x + d, bits, s, b);
        s_gp[2 * g] = s;
        s_gp[2 * g + 1] = b;
        st16(out + codes + 2 * g, f2bf(s));
        st16(out + codes + 2 * (groups + g), f2bf(b));
    }
    __syncthreads();
    float n_bins = (float)((1 << bits) - 1);
    float c = rintf(__fdiv_rn(__fsub_rn(s_x[d], s_gp[2 * g + 1]), s_gp[2 * g]));
    s_code[d] = (u8)fminf(fmaxf(c, 0.f), n_bins);
    __syncthreads();
    pack_codes(s_code, bits, hd, out);
    __syncthreads();
}

// TurboQuant keys (turboquant.rs encode_key_group): per 32-group an asymmetric affine index
// with f16 scale and zero point; a group the rule cannot hold (no range, a zero point past
// f16) stores index 0, zero point 1 and its midpoint as the scale.
__device__ void encode_turbo_keys(const float* s_x, float* s_gp, u8* s_code, int hd, u8* out) {
    int d = threadIdx.x, g = d / 32, codes = hd * KBITS / 8;
    const float mv = KSIGNED ? (float)((1 << (KBITS - 1)) - 1) : (float)((1 << KBITS) - 1);
    if (d < hd && d % 32 == 0) {
        float lo = INFINITY, hi = -INFINITY;
        for (int i = 0; i < 32; i++) {
            lo = fminf(lo, s_x[d + i]);
            hi = fmaxf(hi, s_x[d + i]);
        }
        float range = __fsub_rn(hi, lo), scale, zero, se;
        if (KSIGNED) {
            scale = __fdiv_rn(range, 2.f * mv);
            se = __fadd_rn(scale, 1e-8f);
            zero = rintf(__fdiv_rn(__fadd_rn(hi, lo), 2.f * se));
        } else {
            scale = __fdiv_rn(range, mv);
            se = __fadd_rn(scale, 1e-8f);
            zero = rintf(__fdiv_rn(lo, se));
        }
        bool constant = range == 0.f || !(fabsf(zero) < 65520.f);  // f16(zero) not finite
        if (constant) {
            float mid = (float)(0.5 * ((double)lo + (double)hi));
            mid = fminf(fmaxf(mid, -65504.f), 65504.f);
            st16(out + codes + 4 * g, f2h(mid));
            st16(out + codes + 4 * g + 2, 0x3c00);  // 1.0
        } else {
            st16(out + codes + 4 * g, f2h(scale));
            st16(out + codes + 4 * g + 2, f2h(zero));
        }
        s_gp[2 * g] = constant ? 0.f : se;
        s_gp[2 * g + 1] = zero;
    }
    __syncthreads();
    float se = s_gp[2 * g];
    int idx = 0;
    if (se != 0.f) {
        float c = rintf(__fsub_rn(__fdiv_rn(s_x[d], se), s_gp[2 * g + 1]));
        idx = (int)fminf(fmaxf(c, KSIGNED ? -mv : 0.f), mv);
    }
    s_code[d] = (u8)idx;  // int8 as its byte
    __syncthreads();
    pack_codes(s_code, KBITS, hd, out);
    __syncthreads();
}

// TurboQuant values (turboquant.rs encode_values): rotated, then per 32-group the RMS scale
// (f16) and each value's Lloyd-Max index over it.
// TurboQuant's value rotation of the head in s_x, in place (turboquant.rs rotate): signs,
// then the orthonormal Walsh-Hadamard transform (butterflies stage by stage; the last
// stage's results times 1/√hd), every operation rounded as the CPU's.
__device__ void rotate_values(float* s_x, int hd, float had_scale, const u32* __restrict__ tab) {
    int d = threadIdx.x;
    if (tab[d / 32] >> (d % 32) & 1) s_x[d] = -s_x[d];
    __syncthreads();
    for (int h = 1; h < hd; h <<= 1) {
        if (d < hd / 2) {
            int k = d & (h - 1), j = ((d - k) << 1) + k;
            float a = s_x[j], b = s_x[j + h];
            float x0 = __fadd_rn(a, b), x1 = __fsub_rn(a, b);
            if (2 * h == hd) {
                x0 = __fmul_rn(x0, had_scale);
                x1 = __fmul_rn(x1, had_scale);
            }
            s_x[j] = x0;
            s_x[j + h] = x1;
        }
        __syncthreads();
    }
}

__device__ void encode_turbo_values(float* s_x, float* s_gp, u8* s_code, int hd, float had_scale,
                                    const u32* __restrict__ tab, u8* out) {
    int d = threadIdx.x, g = d / 32, codes = hd * VBITS / 8;
    rotate_values(s_x, hd, had_scale, tab);
    if (d < hd && d % 32 == 0) {
        float sum = 0.f;
        for (int i = 0; i < 32; i++) sum = __fadd_rn(sum, __fmul_rn(s_x[d + i], s_x[d + i]));
        float scale = __fsqrt_rn(__fmul_rn(sum, 1.f / 32.f));
        s_gp[g] = __fadd_rn(scale, 1e-8f);
        st16(out + codes + 2 * g, f2h(scale));
    }
    __syncthreads();
    float xn = __fdiv_rn(s_x[d], s_gp[g]);
    // The count of boundaries below xn (sorted ascending): a binary search.
    const float* bounds = reinterpret_cast<const float*>(tab + TAB_BOUND);
    int lo = 0, hi = (1 << VBITS) - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (xn > bounds[mid]) lo = mid + 1;
        else hi = mid;
    }
    s_code[d] = (u8)lo;
    __syncthreads();
    pack_codes(s_code, VBITS, hd, out);
}

// Where kv_encode_row writes: the store and the head blocks of one layer.
struct EncodeDst {
    u8* store;
    bf16_t *head_k, *head_v;
    long head_row0;
};

// KV head h's key (normed and rotated, in s_x) and value (vsrc, hd bf16) encoded into store
// row r (a head block's row from head_row0 on: bf16, the value in the accumulation domain).
// A block of hd threads or more, all taking part; the row is written when it returns.
__device__ void kv_encode_row(float* s_x, float* s_gp, u8* s_code, const bf16_t* vsrc, const EncodeDst& D,
                              const u32* __restrict__ tab, long r, int h, int n_kv, int hd, float had_scale) {
    int d = threadIdx.x;
    if (D.head_k && r >= D.head_row0) {
        long at = ((r - D.head_row0) * n_kv + h) * hd + d;
        if (d < hd) D.head_k[at] = f2bf(s_x[d]);
        __syncthreads();
        s_x[d] = d < hd ? bf2f(vsrc[d]) : 0.f;
        __syncthreads();
#if TURBO
        rotate_values(s_x, hd, had_scale, tab);
#endif
        if (d < hd) D.head_v[at] = f2bf(s_x[d]);
        __syncthreads();
        return;
    }
    RowLayout L = row_layout(hd);
    u8* row = D.store + (r * n_kv + h) * L.bytes;
#if TURBO
    encode_turbo_keys(s_x, s_gp, s_code, hd, row);
#else
    encode_affine(s_x, s_gp, s_code, KBITS, hd, row);
#endif
    s_x[d] = d < hd ? bf2f(vsrc[d]) : 0.f;
    __syncthreads();
#if TURBO
    encode_turbo_values(s_x, s_gp, s_code, hd, had_scale, tab, row + L.k_bytes);
#else
    encode_affine(s_x, s_gp, s_code, VBITS, hd, row + L.k_bytes);
#endif
    __syncthreads();
}

// nq query heads (q0, hd bf16 values apart, gains qn or none) and, with kp, one key head
// (gains kn or none) after them, nq + 1 ≤ N, each after its norm and RoPE (inv_freq, or none) at
// position p with attention.cu's math and bf16 roundings, into s_x + i·hd (head i) as f32.
// One thread per dim, a block of hd threads or more, all taking part; each head's sum of
// squares as block_sum's (threads past hd adding 0), the barriers and RoPE angles shared.
// s_red: N · 32 floats.
template <int N>
__device__ void norm_rope_heads(const bf16_t* q0, int nq, const float* __restrict__ qn, const bf16_t* kp,
                                const float* __restrict__ kn, float* s_x, float* s_red, float eps, int hd,
                                const float* __restrict__ inv_freq, float linear, int interleaved, int p) {
    const int d = threadIdx.x, lane = d & 31, warp = d >> 5, n = nq + (kp ? 1 : 0);
    float x[N];
#pragma unroll
    for (int i = 0; i < N; i++) {
        const bf16_t* src = i < nq ? q0 + (long)i * hd : kp;
        x[i] = i < n && d < hd ? bf2f(src[d]) : 0.f;
    }
    if (qn || (kp && kn)) {  // block_sum of each head's squares, all heads through one barrier
        float ss[N];
#pragma unroll
        for (int i = 0; i < N; i++) {
            ss[i] = warp_sum(x[i] * x[i]);
            if (lane == 0) s_red[i * 32 + warp] = ss[i];
        }
        __syncthreads();
        const int warps = (blockDim.x + 31) >> 5;
#pragma unroll
        for (int i = 0; i < N; i++) {
            ss[i] = warp_sum(lane < warps ? s_red[i * 32 + lane] : 0.f);
            const float* g = i < nq ? qn : kn;
            if (i < n && g && d < hd) x[i] = g[d] * (x[i] * rsqrtf(ss[i] / hd + eps));
        }
    }
#pragma unroll
    for (int i = 0; i < N; i++)
        if (i < n && d < hd) s_x[i * hd + d] = x[i];
    __syncthreads();
    if (inv_freq && d < hd / 2) {
        int i0, i1;
        rope_pair_index(d, hd / 2, interleaved, i0, i1);
        float sn, cs;
        rope_angle(p, linear, inv_freq[d], sn, cs);
#pragma unroll
        for (int i = 0; i < N; i++) {
            if (i >= n) break;
            bf16_t y0, y1;
            rope_turn(s_x[i * hd + i0], s_x[i * hd + i1], sn, cs, y0, y1);
            s_x[i * hd + i0] = bf2f(y0);
            s_x[i * hd + i1] = bf2f(y1);
        }
    }
    __syncthreads();
}

