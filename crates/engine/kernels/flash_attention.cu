// Flash-attention prefill: see backend/cuda/flash.rs.
#include "common.cuh"
