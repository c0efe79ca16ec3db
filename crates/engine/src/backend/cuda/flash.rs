//! Flash-attention prefill on tensor cores (kernels/flash_attention.cu).
