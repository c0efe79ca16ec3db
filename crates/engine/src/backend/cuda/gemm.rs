//! Tensor-core GEMM for affine weights, the prefill path (kernels/gemm.cu).
