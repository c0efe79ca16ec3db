//! Flash-attention prefill vs the CPU reference.
