// Tensor-core GEMM for affine weights (prefill): see backend/cuda/gemm.rs.
#include "common.cuh"
