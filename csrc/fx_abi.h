// The plain-C boundary between the runtime module (torch binding, built once) and a program
// module (generated CUDA, built per program and dtype). A program module exports
// `fx_program_info()`; the runtime receives its address from Python and calls through it. Keeping
// torch out of program modules makes them compile in seconds, and keeping CUDA kernels out of the
// runtime keeps the per-program part small.
#pragma once

#include <stddef.h>
#include <stdint.h>

#define FX_ABI_VERSION 19

// Widest row the row kernel holds in registers (64 floats a thread, 512 threads a row).
#define FX_MAX_N 32768

enum FxDtype : int32_t { FX_F32 = 0, FX_BF16 = 1, FX_F16 = 2 };

// What a program parameter is: one value, a per-column vector of N values, a tensor of the
// output's shape (M x N row-major: a residual, a gate), read at each element's own position (in
// the row kernels also P x N, broadcast along the leading dims: FxParam.rows = P, P dividing M,
// output row r reading row r mod P, as a (T, N) position embedding against (B, T, N)), or a
// dropout stage's seed (two int64 values, drawn per call; FxParam.dtype is unused for it), or a
// second GEMM's (N, K) weight: the runtime computes x @ weight.T and the kernels read that output
// as they read a tensor of the output's shape (a gated MLP's up projection), or a rotary
// embedding's cos or sin table: P rows of D values (FxParam.rows = P, P dividing M), output row r
// reading table row r mod P, each head of D columns the same row.
enum FxParamKind : int32_t {
  FX_PARAM_SCALAR = 0,
  FX_PARAM_COL = 1,
  FX_PARAM_FULL = 2,
  FX_PARAM_SEED = 3,
  FX_PARAM_ROW = 4,  // one value per row (M values): a per-row scale, an (M, 1) operand
  FX_PARAM_GEMM = 5,
  FX_PARAM_HEAD = 6,
};

// FxLaunch.flags: how the eager implementation of this torch build rounds, where builds differ.
enum FxFlags : int32_t {
  // group_norm of a bfloat16/float16 input normalises with its mean and 1/std rounded to that
  // dtype (torch's CUDA kernel up to 2.11) instead of keeping them in float32
  FX_GROUP_NORM_ROUNDS_STATS = 1
};

enum FxOutKind : int32_t {
  FX_OUT_ROWS = 0,         // (M, out_width(N)): the GEMM output's shape unless a pooling narrows the
                           // rows (written in place or to out)
  FX_OUT_REDUCED = 1,      // (M,): one value per row
  FX_OUT_REDUCED_KEEP = 2  // (M, 1)
};

struct FxParam {
  const void* ptr;  // 1 value, N values, M x N or P x N values (FxParamKind); contiguous, 16-byte aligned
  int32_t dtype;    // FxDtype
  int32_t rows;     // a head table's rows P (FX_PARAM_HEAD), a full operand's P rows (FX_PARAM_FULL,
                    // broadcast along the leading dims), else 0
};

struct FxLaunch {
  const void* y;          // (m, n) row-major GEMM output, dtype of the module
  void* out;              // out_dtype; FX_OUT_ROWS: (m, out_width(n)), may equal y when of its dtype
                          // and width; else (m,)
  void* kept;             // (m, n) row-major, kept_dtype: the keep() stage's value; null without one
  float* stats;           // (2, n) float32 [mean, unbiased var] of a training BatchNorm, else null
  float* workspace;       // workspace_floats(m, n, sm_count) floats, else null when that is 0
  const FxParam* params;  // num_params entries, in program order
  int64_t m;
  int64_t n;
  int32_t num_params;
  int32_t sm_count;
  int32_t smem_optin;     // the device's opt-in shared memory per block, bytes
  int32_t flags;          // FxFlags
};

// The backward kernel of a pointwise, norm or reduction program: dy = the GEMM output's gradient,
// and column sums.
struct FxGradLaunch {
  const void* y;          // (m, n) row-major saved GEMM output, dtype of the module
  const void* g;          // row-major gradient of the op's output, of the output's dtype and shape
                          // ((m, n), or one value a row for a reduction)
  void* dy;               // (m, n) row-major gradient of the GEMM output, written
  float* partial;         // [1 + num_params][grad_chunks(m, n, sm_count)][n] float32 workspace:
                          // per chunk of rows, the sums of dy and of each parameter's gradient
                          // (unused, may be null, when grad_chunks is 1)
  float* sums;            // [1 + num_params][n] float32, written: the column sums of dy and of
                          // each parameter's gradient (the chunks added in order)
  const FxParam* params;  // num_params entries, in program order
  int64_t m;
  int64_t n;
  int32_t num_params;
  int32_t sm_count;
  int32_t flags;          // FxFlags (a norm program's backward recomputes the forward's statistics)
};

struct FxProgramInfo {
  int32_t abi_version;
  int32_t dtype;           // FxDtype of x, weight and the GEMM output
  int32_t out_dtype;       // FxDtype of the output: dtype, or FX_F32 for a chain that widens
  int32_t out_kind;        // FxOutKind
  int32_t kept_dtype;      // FxDtype of the keep() stage's value (a second (m, n) output), -1: none
  int32_t batch_train;     // 1 when the program returns (2, N) batch statistics
  int32_t channels_dim1;   // 1 with a batch or group norm: torch takes dim 1 as channels, so the
                           // kernels (channels = last dim) only cover 2-D x
  int32_t num_params;
  const int32_t* param_kinds;  // num_params FxParamKind codes
  // 0 when this (m, n) is outside what the kernels handle (the caller falls back to the reference)
  int32_t (*supports)(int64_t m, int64_t n, int32_t smem_optin);
  int64_t (*workspace_floats)(int64_t m, int64_t n, int32_t sm_count);
  // Enqueues the kernels on `stream` (a cudaStream_t); returns null or an error message.
  const char* (*launch)(const FxLaunch* args, void* stream);
  int32_t has_grad;  // 1 when the module carries the program's backward kernel (codegen.py says which)
  // chunks of rows of the backward's column sums; -1 where the kernel does not cover (m, n)
  int64_t (*grad_chunks)(int64_t m, int64_t n, int32_t sm_count);
  const char* (*launch_grad)(const FxGradLaunch* args, void* stream);
  // the output rows' width for GEMM rows of n (n, or what a pooling along the features leaves)
  int64_t (*out_width)(int64_t n);
};

// The in-GEMM back end (csrc/gemm_epilogue.cuh): a GEMM module computes x @ weight.T (+ bias) and
// the program's epilogue on the accumulators, writing the output once. Built per program, dtype
// and parameter dtypes, with several GEMM configurations; the runtime runs the one measured
// fastest for the call's shape bucket.
struct FxGemmLaunch {
  const void* x;          // (m, k) row-major, 16-byte aligned
  const void* weight;     // (n, k) row-major, 16-byte aligned; a gated module's: the interleaved
                          // (2 * round_up(n, gated_block), k) weight of its two GEMMs
  const void* bias;       // n values of x's dtype, or null without a bias
  void* out;              // (m, n) row-major output, 16-byte aligned; (m,) for FX_OUT_REDUCED(_KEEP)
  const FxParam* params;  // num_params entries, in program order, of the module's param_dtypes
  void* workspace;        // workspace(m, n, k, sm_count, config) bytes, else null
  float* stats;           // (2, n) float32 [mean, unbiased var] of a training BatchNorm, else null
  int64_t m;
  int64_t n;
  int64_t k;
  int32_t num_params;
  int32_t sm_count;
  int32_t device;
  int32_t config;         // index into the module's configurations
};

struct FxGemmInfo {
  int32_t abi_version;
  int32_t dtype;                // FxDtype of x and weight (and the bias)
  int32_t out_dtype;            // FxDtype of the output
  int32_t out_kind;             // FxOutKind: (m, n) rows, or one value a row (a row reduction)
  int32_t batch_train;          // 1 when the program returns (2, N) batch statistics
  int32_t channels_dim1;        // 1 with a batch or group norm: the module covers 2-D x only
  int32_t num_params;
  const int32_t* param_kinds;   // num_params FxParamKind codes (scalar, column, full or second GEMM)
  const int32_t* param_dtypes;  // num_params FxDtype codes the module reads its parameters as
  // 0, or (a module with a gated kernel: its second GEMM runs in the same kernel) the rows of each
  // block of the weight and the second GEMM's weight interleaved: gate block 0, up block 0, gate
  // block 1, ...; configurations from first_gated_config on run that kernel.
  int32_t gated_block;
  int32_t first_gated_config;
  int32_t num_configs;
  const char* const* config_names;
  // 1 when configuration `config` computes an (m, n, k) problem (sizes and alignment)
  int32_t (*supports)(int64_t m, int64_t n, int64_t k, int32_t config);
  int64_t (*workspace)(int64_t m, int64_t n, int64_t k, int32_t sm_count, int32_t config);
  // Enqueues the GEMM on `stream` (a cudaStream_t); returns null or an error message.
  const char* (*launch)(const FxGemmLaunch* args, void* stream);
};
