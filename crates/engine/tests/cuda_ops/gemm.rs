//! Tensor-core GEMM (prefill) vs the CPU reference.
