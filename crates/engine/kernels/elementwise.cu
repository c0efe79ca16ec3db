// Element-wise ops on bf16 activations (f32 math): residual add, SwiGLU/GeGLU, bias add.
// CPU references: backend/cpu/ops.rs add, glu, add_bias.
#include "common.cuh"

extern "C" __global__ void add_inplace(bf16_t* __restrict__ x, const bf16_t* __restrict__ y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}

// The f32 residual stream += a bf16 block output.
extern "C" __global__ void add_f32_bf16(float* __restrict__ x, const bf16_t* __restrict__ y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] += bf2f(y[i]);
}

extern "C" __global__ void silu_mul(const bf16_t* __restrict__ gate, const bf16_t* __restrict__ up,
                                    bf16_t* __restrict__ out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float g = bf2f(gate[i]);
        out[i] = f2bf(silu(g) * bf2f(up[i]));
    }
}

extern "C" __global__ void gelu_mul(const bf16_t* __restrict__ gate, const bf16_t* __restrict__ up,
                                    bf16_t* __restrict__ out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = f2bf(gelu_tanh(bf2f(gate[i])) * bf2f(up[i]));
}

// x[r, c] += b[c] for an [rows, cols] activation.
extern "C" __global__ void add_bias(bf16_t* __restrict__ x, const float* __restrict__ b, int cols, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + b[i % cols]);
}

// out row i = x row sel[i], rows of `width` 16-bit units (a bf16 row, or an f32 row as two
// units per value): one copy for both activation types. grid-stride over rows × width.
extern "C" __global__ void gather_rows(const unsigned short* __restrict__ x, const int* __restrict__ sel,
                                       unsigned short* __restrict__ out, int rows, int width) {
    long n = (long)rows * width;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = x[(long)sel[i / width] * width + i % width];
}
