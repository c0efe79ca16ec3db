// RMSNorm, one block per row: out = x · rsqrt(mean(x²) + eps) · w, f32 math, bf16 out.
// The residual stream x is f32 (rmsnorm) or bf16 (rmsnorm_bf16). CPU reference:
// backend/cpu/ops.rs rms_norm.
#include "common.cuh"

__device__ __forceinline__ float ld(const float* p, int i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, int i) { return bf2f(p[i]); }

// rsqrt(mean(row²) + eps) over the block's n values of `row`, in every thread.
template <typename T>
__device__ __forceinline__ float inv_rms(const T* row, int n, float eps) {
    __shared__ float red[32];
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = ld(row, i);
        ss += v * v;
    }
    return rsqrtf(block_sum(ss, red) / n + eps);
}

template <typename T>
__device__ __forceinline__ void rmsnorm_body(const T* __restrict__ x, const float* __restrict__ w,
                                             bf16_t* __restrict__ out, int cols, float eps) {
    const T* xr = x + (size_t)blockIdx.x * cols;
    bf16_t* orow = out + (size_t)blockIdx.x * cols;
    float r = inv_rms(xr, cols, eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) orow[i] = f2bf(w[i] * (ld(xr, i) * r));
}

extern "C" __global__ void rmsnorm(const float* x, const float* w, bf16_t* out, int cols, float eps) {
    rmsnorm_body(x, w, out, cols, eps);
}
extern "C" __global__ void rmsnorm_bf16(const bf16_t* x, const float* w, bf16_t* out, int cols, float eps) {
    rmsnorm_body(x, w, out, cols, eps);
}

// The q/k norms: each hd-wide head of a bf16 activation normalized in place, one block per
// head (rows · heads blocks). Each value is read and written by the same thread, the
// writes after the block's sum.
extern "C" __global__ void rmsnorm_heads(bf16_t* x, const float* __restrict__ w, int hd, float eps) {
    bf16_t* xr = x + (size_t)blockIdx.x * hd;
    float r = inv_rms(static_cast<const bf16_t*>(xr), hd, eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) xr[i] = f2bf(w[i] * (bf2f(xr[i]) * r));
}

// Gemma's post-norms: the f32 residual out = x + rmsnorm(y)·w for a bf16 block output y
// (the attention's or the MLP's projection), one block per row: the norm and the add in
// one launch, y normed in f32 without a bf16 round trip. out may be x. Launched with PDL:
// y is the previous kernel's output, so everything waits for it; the next kernel may start
// loading weights.
extern "C" __global__ void rmsnorm_add(float* out, const float* x, const bf16_t* __restrict__ y,
                                       const float* __restrict__ w, int cols, float eps) {
    pdl_trigger();
    pdl_wait();
    const bf16_t* yr = y + (size_t)blockIdx.x * cols;
    const float* xr = x + (size_t)blockIdx.x * cols;
    float* orow = out + (size_t)blockIdx.x * cols;
    float r = inv_rms(yr, cols, eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) orow[i] = xr[i] + w[i] * (bf2f(yr[i]) * r);
}
