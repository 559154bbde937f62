// The few primitives the epilogue kernels use, for CUDA and for the host emulator.
//
// Under nvcc they are the CUDA intrinsics. With FX_EMULATE (a host C++ build) the same kernel
// bodies run on the CPU: each thread of a block is a fiber, __syncthreads and warp shuffles are
// barriers that detect divergence (fx_emulate.h). That lets the tests of a machine without a GPU
// run the exact kernel code that ships, indexing, tails and reductions included.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#if defined(__CUDACC__) && !defined(FX_EMULATE)
#define FX_DEVICE __device__ __forceinline__
#define FX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FX_DEVICE inline
#define FX_HOST_DEVICE inline
#endif

// Shared-memory floats a block has for cross-warp reductions: 16 warps x 16 items at most
// (group sums), then two sets of a slot a warp (Row::allreduce's, alternating)
#define FX_RED_ITEMS_FLOATS 256
#define FX_RED_FLOATS (FX_RED_ITEMS_FLOATS + 2 * 16)

namespace fx {

// 1 / sqrt(x) as eager's CUDA norms compute it (rsqrt); the host emulator rounds correctly
FX_DEVICE float fx_rsqrt(float x) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(x);
#else
  return 1.0f / sqrtf(x);
#endif
}

// x * y + z rounded once, where eager's CUDA kernels contract (the norms' affine step); the
// kernels build with --fmad=false so that no other operation is contracted
FX_DEVICE float fx_fma(float x, float y, float z) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(x, y, z);
#else
  return fmaf(x, y, z);
#endif
}

FX_DEVICE float bits_to_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
#endif
}

FX_DEVICE uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
#endif
}

template <typename P>
FX_DEVICE P load_ro(const P* p) {  // read-only data (parameters, statistics)
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

#if defined(__CUDACC__) && !defined(FX_EMULATE)

// One CUDA thread, as the kernel bodies see it.
struct Thread {
  FX_DEVICE int tid() const { return threadIdx.x; }
  FX_DEVICE int bid() const { return blockIdx.x; }
  FX_DEVICE int bdim() const { return blockDim.x; }
  FX_DEVICE int gdim() const { return gridDim.x; }
  FX_DEVICE void sync() const { __syncthreads(); }
  FX_DEVICE float shfl_xor(float v, int mask) const { return __shfl_xor_sync(0xffffffffu, v, mask); }
  mutable int red_set = 0;  // the set of slots Row::allreduce takes next (it alternates)
};

#endif

}  // namespace fx

#if defined(FX_EMULATE)
#include "fx_emulate.h"
#endif
