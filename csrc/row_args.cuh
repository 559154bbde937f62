// The row kernels' arguments (one struct for every kernel of a program, passed by value) and
// the reduction operators of their statistics.
#pragma once

#include "row_memory.cuh"

namespace fx {

// ---------------------------------------------------------------------------------------------
// Kernel arguments (one struct for every kernel of a program; passed by value)

template <int P>
struct Args {
  const void* y;
  void* out;
  void* kept;            // the keep() stage's value (Prog::Kept), when the program has one
  float* stats;
  float* bn_mean;        // BatchNorm training, per column: the mean, weight / sqrt(var + eps), the bias
  float* bn_scale;
  float* bn_bias;
  float* part_mean;      // BatchNorm training: per-chunk column moments, [chunks][n]
  float* part_m2;
  const void* pptr[P];
  int32_t pdtype[P];
  int32_t prows[P];      // a head table's rows (FX_PARAM_HEAD), a broadcast full operand's (FX_PARAM_FULL)
  int64_t m;
  int64_t chunks;
  int32_t n;
  int32_t rt;            // threads a row (a row segment)
  int32_t rpc;           // rows (row segments) a block
  int32_t segs;          // segments a row: 1, or more where a row-local program splits wide rows
  int32_t scratch_stride;  // shared-memory floats a row (group norm)
  int32_t flags;           // FxFlags
  // the backward of a norm or reduction program (row_grad.cuh): the output's gradient (Out), the GEMM
  // output's gradient (T, written) and the column sums' partials [1 + P][chunks][n]
  const void* g;
  void* dy;
  float* partial;
};

// A launch's parameters into a kernel's arguments (Args or GradArgs)
template <class Prog, class A>
inline void set_params(A& a, const FxParam* params) {
  for (int k = 0; k < Prog::kNumParams; ++k) {
    a.pptr[k] = params[k].ptr;
    a.pdtype[k] = params[k].dtype;
    a.prows[k] = params[k].rows;
  }
}

struct OpAdd {
  FX_DEVICE float operator()(float a, float b) const { return a + b; }
};
struct OpMax {  // NaN-propagating, as torch.amax
  FX_DEVICE float operator()(float a, float b) const { return (a > b || a != a) ? a : b; }
};
struct OpMin {
  FX_DEVICE float operator()(float a, float b) const { return (a < b || a != a) ? a : b; }
};

}  // namespace fx
