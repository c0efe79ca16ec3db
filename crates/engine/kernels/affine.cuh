// Affine-quantized weight layout shared by affine.cu, gemv.cu and gemm.cu: each row a
// LSB-first bit stream of BITS-bit q in u32 words, scale and bias per GROUP values, w =
// scale·q + bias. BITS, GROUP (and SCALE_T, common.cuh) come as -D defines per variant;
// the defaults only let a file compile on its own.
#pragma once

#ifndef BITS
#define BITS 4
#endif
#ifndef GROUP
#define GROUP 32
#endif
#define MASK ((1u << BITS) - 1u)
