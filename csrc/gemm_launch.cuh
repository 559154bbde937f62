// How an in-GEMM module's kernels follow each other in the stream. A GEMM kernel of a menu entry
// with programmatic dependent launch (fxg::Config's Pdl; units compiled with
// CUTLASS_ENABLE_GDC_FOR_SM90) may start while the kernel before it drains, its producer warps
// waiting for that kernel before their first load, and lets the kernels after it (a row
// reduction's finalize, a row map's pass, a training BatchNorm's finalize and normalize) start
// while its last tiles run. Those kernels wait for the kernel before them first, in every build:
// griddepcontrol.wait returns at once where a kernel was launched without the attribute, and a
// kernel template is compiled alike in every unit of a module (its host stub is shared by them).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace fxg {

// Before a kernel's first read of what the kernel before it wrote
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), allowed to start before the kernel before it in
// the stream ends where `dependent` (the kernel must begin with wait_for_prior_grid)
template <class... Params, class... Args>
inline void launch_after(bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args&&... args) {
  if (!dependent) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace fxg
