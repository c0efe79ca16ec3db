// RoPE in place on [rows, heads·hd] bf16; row i sits at position pos[i] (read from device
// memory so a captured decode graph replays at the current position; the rows of a call
// may belong to several sequences). inv_freq holds
// hd/2 inverse frequencies (Llama 3 scaling already applied). interleaved = 1 rotates
// (2j, 2j+1) (GGUF llama order), 0 rotates (j, j + hd/2) (Hugging Face order).
// One thread per rotated pair. CPU reference: backend/cpu/ops.rs rope.
#include "common.cuh"

extern "C" __global__ void rope(bf16_t* __restrict__ x, const float* __restrict__ inv_freq, int rows,
                                int heads, int hd, const int* __restrict__ pos, float linear, int interleaved) {
    int half = hd / 2;
    long total = (long)rows * heads * half;
    for (long t = blockIdx.x * (long)blockDim.x + threadIdx.x; t < total; t += (long)gridDim.x * blockDim.x) {
        int j = t % half;
        long rh = t / half;
        int row = rh / heads;
        bf16_t* h = x + rh * hd;
        int i0, i1;
        rope_pair_index(j, half, interleaved, i0, i1);
        rope_rotate(bf2f(h[i0]), bf2f(h[i1]), pos[row], linear, inv_freq[j], h[i0], h[i1]);
    }
}
