#!/usr/bin/env python3
"""The other prefill design issue 3 asks to measure: dequantize a 4-bit weight to bf16 per
layer, then multiply with cuBLAS (through PyTorch), at the 1B shape's prefill GEMMs
(m = 512 tokens). Compare with ferrolm's tensor-core GEMM, which dequantizes tiles in
shared memory (`cuda_parity qgemm_matches_cpu_at_prefill_size` prints its time).

    python3 tools/peers/cublas_gemm.py

Prints one JSON line per shape: the cuBLAS bf16 GEMM alone, the dequantization (PyTorch
element-wise ops on MLX-layout words: 8 nibbles per u32, group 64, bf16 scale and bias;
and the bytes it must move at 4.26 TB/s, what a fused dequant kernel could reach), and
their sum. Times are medians of CUDA-event-timed runs after a warm-up.
"""
import json, statistics

import torch

COPY_BW = 4.26e12  # measured device-to-device copy bandwidth on the H200 (docs/perf-log.md)


def timed(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)  # µs
    return statistics.median(times)


def main():
    torch.manual_seed(0)
    m, group = 512, 64
    shifts = torch.arange(0, 32, 4, device="cuda", dtype=torch.int32)
    for n, k in [(2048, 2048), (8192, 2048), (2048, 8192)]:
        words = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
        scales = torch.rand(n, k // group, device="cuda").to(torch.bfloat16) * 0.02
        biases = -8 * scales
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

        def dequant():
            q = (words.unsqueeze(-1) >> shifts) & 0xF  # [n, k/8, 8], value i of word w at bits 4i
            q = q.reshape(n, k // group, group).to(torch.bfloat16)
            return (q * scales.unsqueeze(-1) + biases.unsqueeze(-1)).reshape(n, k)

        wd = dequant()
        t_dq = timed(dequant)
        t_mm = timed(lambda: torch.matmul(x, wd.t()))
        moved = words.numel() * 4 + 2 * scales.numel() * 2 + n * k * 2  # read packed + scales, write bf16
        print(json.dumps({
            "m": m, "n": n, "k": k,
            "cublas_bf16_gemm_us": round(t_mm, 2),
            "cublas_tflops": round(2 * m * n * k / t_mm / 1e6, 1),
            "torch_dequant_us": round(t_dq, 2),
            "dequant_at_copy_bandwidth_us": round(moved / COPY_BW * 1e6, 2),
            "dequant_then_cublas_us": round(t_dq + t_mm, 2),
            "fused_dequant_bound_then_cublas_us": round(moved / COPY_BW * 1e6 + t_mm, 2),
            "engine": f"torch {torch.__version__}",
        }))


if __name__ == "__main__":
    main()
