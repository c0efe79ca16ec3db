//! Compute backends. The CPU backend is the reference; CUDA comes later.
