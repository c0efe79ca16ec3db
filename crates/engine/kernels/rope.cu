// RoPE in place on [rows, heads·hd] bf16; row i sits at position pos0 + i. inv_freq holds
// hd/2 inverse frequencies (Llama 3 scaling already applied). interleaved = 1 rotates
// (2j, 2j+1) (GGUF llama order), 0 rotates (j, j + hd/2) (Hugging Face order).
// One thread per rotated pair. CPU reference: backend/cpu/ops.rs rope.
#include "common.cuh"

extern "C" __global__ void rope(bf16_t* __restrict__ x, const float* __restrict__ inv_freq, int rows,
                                int heads, int hd, int pos0, float linear, int interleaved) {
    int half = hd / 2;
    long total = (long)rows * heads * half;
    for (long t = blockIdx.x * (long)blockDim.x + threadIdx.x; t < total; t += (long)gridDim.x * blockDim.x) {
        int j = t % half;
        long rh = t / half;
        int row = rh / heads;
        bf16_t* h = x + rh * hd;
        float a = ((float)(pos0 + row) / linear) * inv_freq[j];
        float s, c;
        sincosf(a, &s, &c);
        int i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + half;
        float x0 = bf2f(h[i0]), x1 = bf2f(h[i1]);
        h[i0] = f2bf(x0 * c - x1 * s);
        h[i1] = f2bf(x0 * s + x1 * c);
    }
}
