// The row kernel template: one pass over the GEMM output that applies a whole epilogue program.
//
// A generated program module defines `struct Prog` (its stages as calls on a Row, see
// fxfuse/cuda/codegen.py) and instantiates FX_DEFINE_PROGRAM(Prog, T, entry). Everything that does
// not depend on the program (layout, loads and stores, statistics, launch plans) lives here once.
//
// Layout. A row of N values is split into chunks of VEC elements (16 bytes of T); the `rt` threads
// of a row own chunks lt, lt + rt, lt + 2 rt, ... (ITEMS of them), so every load instruction of a
// warp is contiguous and coalesced. Rows live in registers from load to store: v[ITEMS][VEC].
// A block holds `rpc` rows (several when a row needs fewer than 256 threads) and walks the rows
// with a block-uniform stride, so every barrier is reached by every thread; rows past M are
// "inactive": they load nothing, store nothing, and still take part in barriers. A row-local
// program (no statistic wider than a warp: pointwise chains, group norms of small groups, batch
// norms) cuts wide rows into `segs` segments of a few chunks a thread instead: many small blocks.
//
// Statistics are fp32: warp shuffles, then one slot a warp in shared memory, summed in a fixed
// order (deterministic). Group norms of up to 32 values follow eager's own Welford tree, bit for
// bit; larger groups whose chunks sit in a power of two of threads sum by shuffles, others write
// per-chunk partial sums of their row to shared memory and let one thread a group add them in
// order. BatchNorm training runs three kernels: column
// moments per chunk of rows (Welford, on the values the preceding stages produce), a fixed-order
// Chan combine per column, then the row kernel.
#pragma once

#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "epilogue_ops.cuh"
#include "fx_abi.h"
#include "fx_port.cuh"

#if !defined(FX_EMULATE)
#include <cuda_runtime.h>
#endif

namespace fx {

// ---------------------------------------------------------------------------------------------
// Element types and memory access

template <typename T>
struct DType;
template <>
struct DType<float> {
  static constexpr int kVec = 4;
  static constexpr int32_t kCode = FX_F32;
};
template <>
struct DType<__nv_bfloat16> {
  static constexpr int kVec = 8;
  static constexpr int32_t kCode = FX_BF16;
};
template <>
struct DType<__half> {
  static constexpr int kVec = 8;
  static constexpr int32_t kCode = FX_F16;
};

// x rounded to T and back: what a norm of a T input sees and returns (eager's dtype arithmetic)
template <typename T>
FX_DEVICE float round_to(float x) {
  if constexpr (DType<T>::kCode == FX_BF16) {
    return fx_round_bf16(x);
  } else if constexpr (DType<T>::kCode == FX_F16) {
    return fx_round_fp16(x);
  } else {
    return x;
  }
}

FX_DEVICE float bf16_bits_to_float(uint32_t h) { return bits_to_float(h << 16); }
FX_DEVICE float f16_bits_to_float(uint32_t h) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
FX_DEVICE uint32_t float_to_bf16_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
FX_DEVICE uint32_t float_to_f16_bits(float f) { return __half_as_ushort(__float2half_rn(f)); }

// encode_rounded(f): the bits of an f that is already a value of the type (round_to<T>'s
// result). bfloat16 is the high half of the float -- no second conversion instruction, which
// runs at a quarter of the arithmetic rate.
struct Bf16Codec {
  static FX_DEVICE float decode(uint32_t h) { return bf16_bits_to_float(h); }
  static FX_DEVICE uint32_t encode(float f) { return float_to_bf16_bits(f); }
  static FX_DEVICE uint32_t encode_rounded(float f) { return float_to_bits(f) >> 16; }
};
struct F16Codec {
  static FX_DEVICE float decode(uint32_t h) { return f16_bits_to_float(h); }
  static FX_DEVICE uint32_t encode(float f) { return float_to_f16_bits(f); }
  static FX_DEVICE uint32_t encode_rounded(float f) { return float_to_f16_bits(f); }
};

// Loads and stores of one element or one 16-byte chunk; `i` counts elements.
template <typename T>
struct Mem;

template <>
struct Mem<float> {
  static FX_DEVICE float load(const void* base, int64_t i) { return static_cast<const float*>(base)[i]; }
  static FX_DEVICE void store(void* base, int64_t i, float v) { static_cast<float*>(base)[i] = v; }
  static FX_DEVICE void load_vec(const void* base, int64_t i, float* v) {
    const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
  }
  static FX_DEVICE void store_vec(void* base, int64_t i, const float* v) {
    float4 q;
    q.x = v[0];
    q.y = v[1];
    q.z = v[2];
    q.w = v[3];
    *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = q;
  }
  static FX_DEVICE void store_rounded(void* base, int64_t i, float v) { store(base, i, v); }
  static FX_DEVICE void store_vec_rounded(void* base, int64_t i, const float* v) { store_vec(base, i, v); }
  template <int VEC>
  static FX_DEVICE void store_chunk_rounded(void* base, int64_t i, const float* v) {
    static_assert(VEC == 4, "a chunk of float is 16 bytes");
    store_vec(base, i, v);
  }
};

template <class Codec>
struct Mem16 {
  static FX_DEVICE float load(const void* base, int64_t i) {
    return Codec::decode(static_cast<const uint16_t*>(base)[i]);
  }
  static FX_DEVICE void store(void* base, int64_t i, float v) {
    static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(Codec::encode(v));
  }
  static FX_DEVICE void load_vec(const void* base, int64_t i, float* v) {
    const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = Codec::decode(w[k] & 0xffffu);
      v[2 * k + 1] = Codec::decode(w[k] >> 16);
    }
  }
  // 4 values (8 bytes): a chunk of a chain that widens to float32 (chunk_elements)
  static FX_DEVICE void load_vec4(const void* base, int64_t i, float* v) {
    const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t w[2] = {q.x, q.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      v[2 * k] = Codec::decode(w[k] & 0xffffu);
      v[2 * k + 1] = Codec::decode(w[k] >> 16);
    }
  }
  static FX_DEVICE void store_vec(void* base, int64_t i, const float* v) { store_bits<false>(base, i, v); }
  // stores of values already rounded to the type (Codec::encode_rounded)
  static FX_DEVICE void store_rounded(void* base, int64_t i, float v) {
    static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(Codec::encode_rounded(v));
  }
  static FX_DEVICE void store_vec_rounded(void* base, int64_t i, const float* v) { store_bits<true>(base, i, v); }
  // a chunk of VEC rounded values: 16 bytes, or 8 (a chain that widens: chunk_elements)
  template <int VEC>
  static FX_DEVICE void store_chunk_rounded(void* base, int64_t i, const float* v) {
    static_assert(VEC == 8 || VEC == 4, "a chunk is 8 or 4 values");
    if constexpr (VEC == 8) {
      store_bits<true>(base, i, v);
    } else {
      uint2 q;
      q.x = encode<true>(v[0]) | (encode<true>(v[1]) << 16);
      q.y = encode<true>(v[2]) | (encode<true>(v[3]) << 16);
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i) = q;
    }
  }

  template <bool kRounded>
  static FX_DEVICE uint32_t encode(float f) {
    return kRounded ? Codec::encode_rounded(f) : Codec::encode(f);
  }
  template <bool kRounded>
  static FX_DEVICE void store_bits(void* base, int64_t i, const float* v) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = encode<kRounded>(v[2 * k]) | (encode<kRounded>(v[2 * k + 1]) << 16);
    uint4 q;
    q.x = w[0];
    q.y = w[1];
    q.z = w[2];
    q.w = w[3];
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i) = q;
  }
};

template <>
struct Mem<__nv_bfloat16> : Mem16<Bf16Codec> {};
template <>
struct Mem<__half> : Mem16<F16Codec> {};

// Elements a chunk of a program's rows, the code generator's choice (Prog::kVec): 16 bytes of T,
// or for a bf16/fp16 chain that widens to a float output, 16 bytes of float (8-byte loads, one
// whole 16-byte store a chunk) or still 16 bytes of T (two stores a chunk).
template <class Prog, typename T>
constexpr int chunk_elements() {
  static_assert(Prog::kVec == DType<T>::kVec || Prog::kVec == DType<typename Prog::Out>::kVec, "a chunk is 16 bytes");
  return Prog::kVec;
}

// A program parameter: float32, bfloat16 or float16, converted exactly to float.
FX_DEVICE float load_param(const void* p, int32_t dtype, int64_t i) {
  if (dtype == FX_BF16) return bf16_bits_to_float(load_ro(static_cast<const unsigned short*>(p) + i));
  if (dtype == FX_F16) return f16_bits_to_float(load_ro(static_cast<const unsigned short*>(p) + i));
  return load_ro(static_cast<const float*>(p) + i);
}

// VEC values of a parameter from element c on (c a multiple of VEC; the pointer 16-byte aligned):
// one or two 16-byte loads instead of VEC scalar ones.
template <int VEC>
FX_DEVICE void load_param_vec(const void* p, int32_t dtype, int64_t c, float* out) {
  if (dtype == FX_F32) {
    const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + c);
#pragma unroll
    for (int j = 0; j < VEC / 4; ++j) {
      const float4 f = load_ro(q + j);
      out[4 * j] = f.x;
      out[4 * j + 1] = f.y;
      out[4 * j + 2] = f.z;
      out[4 * j + 3] = f.w;
    }
    return;
  }
  const unsigned short* h = static_cast<const unsigned short*>(p) + c;
  uint32_t w[VEC / 2];
  if constexpr (VEC == 8) {
    const uint4 q = load_ro(reinterpret_cast<const uint4*>(h));
    w[0] = q.x;
    w[1] = q.y;
    w[2] = q.z;
    w[3] = q.w;
  } else {
    const uint2 q = load_ro(reinterpret_cast<const uint2*>(h));
    w[0] = q.x;
    w[1] = q.y;
  }
  const bool bf16 = dtype == FX_BF16;
#pragma unroll
  for (int k = 0; k < VEC / 2; ++k) {
    out[2 * k] = bf16 ? bf16_bits_to_float(w[k] & 0xffffu) : f16_bits_to_float(w[k] & 0xffffu);
    out[2 * k + 1] = bf16 ? bf16_bits_to_float(w[k] >> 16) : f16_bits_to_float(w[k] >> 16);
  }
}

// n / d for any 32-bit n by a divisor fixed for the launch: a multiply-high, an add and a shift
// (Granlund-Montgomery) instead of a division routine in every thread.
struct FastDiv {
  uint32_t magic;
  int32_t shift;
  static FastDiv of(uint32_t d) {  // host side; d >= 1
    int32_t l = 0;
    while ((uint64_t{1} << l) < d) ++l;
    const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << l) - d)) / d + 1;
    return FastDiv{static_cast<uint32_t>(m), l};
  }
  static FX_HOST_DEVICE uint32_t div(uint32_t n, uint32_t magic, int32_t shift) {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(magic, n);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(magic) * n) >> 32);
#endif
    return static_cast<uint32_t>((static_cast<uint64_t>(hi) + n) >> shift);
  }
};

// Whether each group of a group norm over n columns is whole 16-byte chunks held by a power of two
// of at most 32 consecutive threads of a row (any plan's threads a row are a multiple of that
// count): its statistics take warp shuffles only.
FX_HOST_DEVICE bool group_in_lanes(int64_t n, int64_t groups, int vec) {
  const int64_t gs = n / groups;
  const int64_t lanes = gs / vec;
  return gs % vec == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0;
}

// ---------------------------------------------------------------------------------------------
// Kernel arguments (one struct for every kernel of a program; passed by value)

template <int P>
struct Args {
  const void* y;
  void* out;
  float* stats;
  float* bn_mean;        // BatchNorm training: per-column mean and 1/sqrt(var + eps)
  float* bn_rstd;
  float* part_mean;      // BatchNorm training: per-chunk column moments, [chunks][n]
  float* part_m2;
  const void* pptr[P];
  int32_t pdtype[P];
  int64_t m;
  int64_t chunks;
  int32_t n;
  int32_t rt;            // threads a row (a row segment)
  int32_t rpc;           // rows (row segments) a block
  int32_t segs;          // segments a row: 1, or more where a row-local program splits wide rows
  uint32_t segs_magic;   // unit / segs as a multiply-high and a shift (units < 2^32): FastDiv
  int32_t segs_shift;
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

// ---------------------------------------------------------------------------------------------
// One row in registers, and the stages a program applies to it

template <class Prog, typename T, int ITEMS, bool ALIGNED>
struct Row {
  static constexpr int VEC = chunk_elements<Prog, T>();
  using A = Args<Prog::kParamSlots>;

  const A& a;
  const Thread& t;
  float* red;      // FX_RED_FLOATS floats of shared memory for cross-warp reductions
  float* scratch;  // this row's scratch_stride floats of dynamic shared memory
  int lt;          // thread index within the row (segment)
  int lr;          // row (segment) index within the block
  int64_t row;
  int first;       // the segment's first column
  bool active;
  float v[ITEMS][VEC];

  // Unit `unit` of the grid's walk: row unit / segs, segment unit % segs (a segment is rt threads
  // of ITEMS chunks: whole groups of a row-local program, see Launcher::apply_plan).
  FX_DEVICE Row(const A& a_, const Thread& t_, float* red_, float* scratch_, int lt_, int lr_, int64_t unit)
      : a(a_), t(t_), red(red_), scratch(scratch_), lt(lt_), lr(lr_) {
    if (a.segs == 1) {
      row = unit;
      first = 0;
    } else {  // segmented plans keep m * segs below 2^32
      const uint32_t u = static_cast<uint32_t>(unit);
      const uint32_t q = FastDiv::div(u, a.segs_magic, a.segs_shift);
      row = q;
      first = static_cast<int>(u - q * static_cast<uint32_t>(a.segs)) * a.rt * ITEMS * VEC;
    }
    active = row < a.m;
  }

  FX_DEVICE int col(int i, int e) const { return first + (i * a.rt + lt) * VEC + e; }

  // Become `o` (a row of the same slot loaded ahead: for_each_row's prefetch)
  FX_DEVICE void take(const Row& o) {
    row = o.row;
    first = o.first;
    active = o.active;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[i][e] = o.v[i][e];
  }

  FX_DEVICE void load() {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) load_chunk(i, v[i]);
  }

  // chunk i of the row's GEMM output (zeros past the row's end and for inactive rows)
  FX_DEVICE void load_chunk(int i, float (&out)[VEC]) const {
    const int64_t base = row * a.n;
    const int c0 = col(i, 0);
    if constexpr (ALIGNED) {
      if (active && c0 < a.n) {
        if constexpr (VEC == DType<T>::kVec) {
          Mem<T>::load_vec(a.y, base + c0, out);
        } else {
          Mem<T>::load_vec4(a.y, base + c0, out);
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[e] = 0.0f;
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) out[e] = (active && c0 + e < a.n) ? Mem<T>::load(a.y, base + c0 + e) : 0.0f;
    }
  }

  // The output is of the program's type Out: T, or float for a chain that widened; a chunk of it
  // is one 16-byte vector, or two (chunk_elements).
  using Out = typename Prog::Out;
  static constexpr int OUT_VEC = DType<Out>::kVec;
  static_assert(VEC % OUT_VEC == 0, "the output type is T or float");

  FX_DEVICE void store_rows() const {
    if (!active) return;
    const int64_t base = row * a.n;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = col(i, 0);
      if constexpr (ALIGNED) {
        if (c0 < a.n)
#pragma unroll
          for (int k = 0; k < VEC; k += OUT_VEC) Mem<Out>::store_vec(a.out, base + c0 + k, v[i] + k);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (c0 + e < a.n) Mem<Out>::store(a.out, base + c0 + e, v[i][e]);
      }
    }
  }

  FX_DEVICE void store_scalar(float s) const {
    if (active && lt == 0) Mem<Out>::store(a.out, row, s);
  }

  template <int K>
  FX_DEVICE float scalar_param() const {
    return load_param(a.pptr[K], a.pdtype[K], 0);
  }

  // Column parameter K at chunk i's VEC columns, clamped to the row like map()'s columns: one or
  // two 16-byte loads when the row is aligned (the runtime aligns parameters to 16 bytes).
  template <int K>
  FX_DEVICE void col_chunk(int i, float (&p)[VEC]) const {
    chunk_of(a.pptr[K], a.pdtype[K], i, p);
  }

  FX_DEVICE void chunk_of(const void* ptr, int32_t dtype, int i, float (&p)[VEC]) const {
    const int c0 = col(i, 0);
    if constexpr (ALIGNED) {
      load_param_vec<VEC>(ptr, dtype, c0 < a.n ? c0 : a.n - VEC, p);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int c = c0 + e;
        p[e] = load_param(ptr, dtype, c < a.n ? c : a.n - 1);
      }
    }
  }

  // f(chunk i's VEC values, i) for every chunk: the generated pointwise stages, which load each
  // column parameter once a chunk
  template <class F>
  FX_DEVICE void map_chunks(F f) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) f(v[i], i);
  }

  // v = f(v, column) on every element slot. Slots past the row's end (and rows past M) compute on
  // don't-care values that are never stored or reduced; their column is clamped to n - 1 so that
  // f only reads in bounds. No predicates: the common case is branch-free.
  template <class F>
  FX_DEVICE void map(F f) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int c = col(i, e);
        v[i][e] = f(v[i][e], c < a.n ? c : a.n - 1);
      }
  }

  // op over the row, the same value in every thread of the row
  template <class Op>
  FX_DEVICE float allreduce(float x, Op op) const {
    const int width = a.rt < 32 ? a.rt : 32;
    for (int off = width >> 1; off > 0; off >>= 1) x = op(x, t.shfl_xor(x, off));
    if (a.rt <= 32) return x;
    const int wpr = a.rt >> 5;
    if ((t.tid() & 31) == 0) red[t.tid() >> 5] = x;
    t.sync();
    const int first = lr * wpr;
    float r = red[first];
    for (int w = 1; w < wpr; ++w) r = op(r, red[first + w]);
    t.sync();
    return r;
  }

  // op over f(element) of the row, from `init`
  template <class Op, class F>
  FX_DEVICE float reduce(float init, Op op, F f) const {
    float acc = init;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (active && col(i, e) < a.n) acc = op(acc, f(v[i][e]));
    return allreduce(acc, op);
  }

  FX_DEVICE float reduce_sum() const { return reduce(0.0f, OpAdd(), [](float x) { return x; }); }
  FX_DEVICE float reduce_mean() const { return reduce_sum() / static_cast<float>(a.n); }
  FX_DEVICE float reduce_max() const { return reduce(-INFINITY, OpMax(), [](float x) { return x; }); }
  FX_DEVICE float reduce_min() const { return reduce(INFINITY, OpMin(), [](float x) { return x; }); }

  // torch.logsumexp: the max is replaced by 0 where it is infinite
  FX_DEVICE float reduce_logsumexp() const {
    float m = reduce_max();
    if (fabsf(m) == INFINITY) m = 0.0f;
    const float s = reduce(0.0f, OpAdd(), [m](float x) { return expf(x - m); });
    return logf(s) + m;
  }

  FX_DEVICE void softmax() {
    const float m = reduce_max();
    map([m](float x, int) { return expf(x - m); });
    const float s = reduce_sum();
    map([s](float x, int) { return x / s; });
  }

  FX_DEVICE void log_softmax() {
    const float m = reduce_max();
    const float s = reduce(0.0f, OpAdd(), [m](float x) { return expf(x - m); });
    const float log_s = logf(s);
    map([m, log_s](float x, int) { return (x - m) - log_s; });
  }

  // Every norm ends here: v = (v - shift) * scale * w + b (the last two as one fma, as eager's CUDA
  // norms compile), rounded to U as eager's norm of a U input returns it. U, every norm's first
  // template argument, is the dtype the norm computes for: T, or float once the chain widened
  // (a float32 norm of autocast or type promotion). `shift_scale(i, shift, scale)` fills chunk
  // i's VEC shifts and scales.
  template <typename U, int W, int B, class F>
  FX_DEVICE void normalise(F shift_scale) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float shift[VEC], scale[VEC], w[VEC], b[VEC];
      shift_scale(i, shift, scale);
      if constexpr (W >= 0) col_chunk<W>(i, w);
      if constexpr (B >= 0) col_chunk<B>(i, b);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float y = (v[i][e] - shift[e]) * scale[e];
        if constexpr (W >= 0 && B >= 0) {
          y = fx_fma(y, w[e], b[e]);  // eager: (x - mean) * rstd * w + b, contracted
        } else if constexpr (W >= 0) {
          y = y * w[e];
        } else if constexpr (B >= 0) {
          y = y + b[e];
        }
        v[i][e] = round_to<U>(y);
      }
    }
  }

  // shift and scale the same for a whole chunk
  template <typename U, int W, int B, class F>
  FX_DEVICE void normalise_by_chunk(F shift_scale_of_chunk) {
    normalise<U, W, B>([&](int i, float* shift, float* scale) {
      float sh, sc;
      shift_scale_of_chunk(i, sh, sc);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        shift[e] = sh;
        scale[e] = sc;
      }
    });
  }

  // A norm's input: the value rounded to T (eager's norm sees a T tensor). The code generator
  // calls it before a norm whose input is not already a T value (fxfuse/cuda/codegen.py).
  FX_DEVICE void round_input() {
    if constexpr (DType<T>::kCode != FX_F32) map([](float x, int) { return round_to<T>(x); });
  }

  // The row's mean and 1/sqrt(biased variance + eps), two passes (layer_norm and its backward)
  FX_DEVICE void layer_moments(float eps, float& mean, float& rstd) const {
    const float n = static_cast<float>(a.n);
    mean = reduce_sum() / n;
    const float m = mean;
    const float var = reduce(0.0f, OpAdd(), [m](float x) { return (x - m) * (x - m); }) / n;
    rstd = fx_rsqrt(var + eps);
  }

  // 1/sqrt(mean(x^2) + eps) of the row (rms_norm and its backward)
  FX_DEVICE float rms_scale(float eps) const {
    const float ms = reduce(0.0f, OpAdd(), [](float x) { return x * x; }) / static_cast<float>(a.n);
    return fx_rsqrt(ms + eps);
  }

  // F.layer_norm over the row: biased variance (two-pass), (x - mean) * rstd * w + b
  template <typename U, int W, int B>
  FX_DEVICE void layer_norm(float eps) {
    float mean, rstd;
    layer_moments(eps, mean, rstd);
    normalise_by_chunk<U, W, B>([mean, rstd](int, float& sh, float& sc) {
      sh = mean;
      sc = rstd;
    });
  }

  // F.rms_norm: x * rsqrt(mean(x^2) + eps) * w
  template <typename U, int W>
  FX_DEVICE void rms_norm(float eps) {
    const float r = rms_scale(eps);
    normalise_by_chunk<U, W, -1>([r](int, float& sh, float& sc) {
      sh = 0.0f;
      sc = r;
    });
  }

  // Group norm over groups of n/G consecutive columns of the row, two passes (mean, then the mean
  // of squared deviations) in fp32 like eager's CUDA kernel, whose eps is a T and which (up to
  // torch 2.11) normalises with mean and 1/std rounded to T: FX_GROUP_NORM_ROUNDS_STATS.
  //  - a group of `lanes` whole chunks held by consecutive threads (lanes a power of two dividing
  //    the row's threads; every suite shape): shuffle sums, no shared memory;
  //  - other whole-chunk groups: per-chunk partial sums in shared memory, one thread a group;
  //  - a group size that is not a multiple of 16 bytes of T: the row staged in shared memory.
  template <typename U, int G, int W, int B>
  FX_DEVICE void group_norm(float eps) {
    const float eps_t = round_to<U>(eps);
    const int gs = a.n / G;
    const int lanes = gs / VEC;
    if (group_in_lanes(a.n, G, VEC) || (gs % VEC == 0 && (lanes & (lanes - 1)) == 0 && a.rt % lanes == 0)) {
      group_norm_by_lanes<U, W, B>(eps_t, gs, lanes);
    } else if (gs % VEC == 0) {
      group_norm_by_chunk<U, G, W, B>(eps_t, gs);
    } else {
      group_norm_staged<U, G, W, B>(eps_t, gs);
    }
  }

  template <typename U>
  FX_DEVICE void group_stats(float& mean, float& rstd) const {
    if (a.flags & FX_GROUP_NORM_ROUNDS_STATS) {
      mean = round_to<U>(mean);
      rstd = round_to<U>(rstd);
    }
  }

  // s[i] = the sum of s[i] over the `lanes` consecutive threads holding chunk i's group (lanes a
  // power of two; above 32, whole warps through shared memory), in a fixed order.
  FX_DEVICE void group_sums(float (&s)[ITEMS], int lanes) const {
    const int width = lanes < 32 ? lanes : 32;
    for (int off = width >> 1; off > 0; off >>= 1)
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) s[i] += t.shfl_xor(s[i], off);
    if (lanes <= 32) return;
    const int warps = t.bdim() >> 5;
    const int warp = t.tid() >> 5;
    if ((t.tid() & 31) == 0)
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) red[i * warps + warp] = s[i];
    t.sync();
    const int per = lanes >> 5;
    const int first = warp / per * per;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float r = red[i * warps + first];
      for (int w = 1; w < per; ++w) r += red[i * warps + first + w];
      s[i] = r;
    }
    t.sync();
  }

  template <typename U, int W, int B>
  FX_DEVICE void group_norm_by_lanes(float eps, int gs, int lanes) {
    float mean[ITEMS], rstd[ITEMS];
    group_moments_by_lanes<U>(eps, gs, lanes, mean, rstd);
    normalise_by_chunk<U, W, B>([&](int i, float& sh, float& sc) {
      sh = mean[i];
      sc = rstd[i];
    });
  }

  // mean[i] and rstd[i] of chunk i's group, the group's chunks held by `lanes` consecutive
  // threads (group_norm and its backward): eager's Welford tree for groups of up to 32 values,
  // else two shuffle-summed passes; rounded where eager rounds them (group_stats).
  template <typename U>
  FX_DEVICE void group_moments_by_lanes(float eps, int gs, int lanes, float (&mean)[ITEMS], float (&rstd)[ITEMS]) const {
    if (gs <= 32) {
      group_moments_as_eager_warp<U>(eps, gs, lanes, mean, rstd);
      return;
    }
    const float count = static_cast<float>(gs);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += v[i][e];
      mean[i] = col(i, 0) < a.n ? s : 0.0f;  // whole groups lie past the end (n % gs == 0)
    }
    group_sums(mean, lanes);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      mean[i] /= count;
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += (v[i][e] - mean[i]) * (v[i][e] - mean[i]);
      rstd[i] = col(i, 0) < a.n ? s : 0.0f;
    }
    group_sums(rstd, lanes);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      rstd[i] = fx_rsqrt(rstd[i] / count + eps);
      group_stats<U>(mean[i], rstd[i]);
    }
  }

  // Eager's own statistics for a group of at most 32 values (torch's CUDA group norm, a group of
  // fewer than 512 values: one warp, value j in lane j, lanes past the group empty): Welford
  // states combined by a shuffle-down tree, offsets 16 ... 1, lane 0's result. Here value j of a
  // group sits in thread j / VEC, slot j % VEC: the tree's levels of offset >= VEC are butterflies
  // between threads, the rest run in registers, and every thread of the group ends with lane 0's
  // state bit for bit (the lower side of each pair is combined first, as lane 0 combines). Levels
  // at or above the group size only meet empty lanes (no-ops). A one-ulp difference in a statistic
  // rounded to bf16 can grow past 1e-2 through a bf16 chain (S04), so the order is eager's.
  template <typename U>
  FX_DEVICE void group_moments_as_eager_warp(float eps, int gs, int lanes, float (&mean)[ITEMS],
                                             float (&rstd)[ITEMS]) const {
    const int r = lt % lanes;  // this thread's place in its group
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float m[VEC], s[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) welford_leaf(v[i][e], m[e], s[e]);
      float count = 1.0f;  // values behind each side of the next combine (a power of two)
      for (int lx = lanes >> 1; lx >= 1; lx >>= 1, count *= 2.0f) {
        const bool lower = (r & lx) == 0;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {  // selects, not branches: the pair's halves differ
          const float om = t.shfl_xor(m[e], lx);
          const float os = t.shfl_xor(s[e], lx);
          float am = lower ? m[e] : om, as = lower ? s[e] : os;
          welford_combine(am, as, lower ? om : m[e], lower ? os : s[e], count);
          m[e] = am;
          s[e] = as;
        }
      }
#pragma unroll
      for (int off = VEC >> 1; off >= 1; off >>= 1, count *= 2.0f)
#pragma unroll
        for (int e = 0; e < off; ++e) welford_combine(m[e], s[e], m[e + off], s[e + off], count);
      mean[i] = m[0];
      rstd[i] = fx_rsqrt(s[0] / static_cast<float>(gs) + eps);
      group_stats<U>(mean[i], rstd[i]);
    }
  }

  // WelfordOps::reduce of one value into the empty state, as torch compiles it
  static FX_DEVICE void welford_leaf(float x, float& mean, float& m2) {
    mean = 0.0f + x;
    m2 = fx_fma(x, x - mean, 0.0f);
  }

  // WelfordOps::combine of (mean, m2) with (mb, m2b), both sides holding `count` values, as torch
  // compiles it: nb / n is exactly 0.5 and a.nf a power of two, so the two contracted
  // multiply-adds are  mean + delta * 0.5  and  (m2 + m2b) + (delta * delta * count) * 0.5.
  static FX_DEVICE void welford_combine(float& mean, float& m2, float mb, float m2b, float count) {
    const float delta = mb - mean;
    m2 = fx_fma(delta * delta * count, 0.5f, m2 + m2b);
    mean = fx_fma(delta, 0.5f, mean);
  }

  template <typename U, int G, int W, int B>
  FX_DEVICE void group_norm_by_chunk(float eps, int gs) {
    const int per_group = gs / VEC;
    const float count = static_cast<float>(gs);
    float mean[ITEMS], rstd[ITEMS];
    chunk_partials([](float x, int) { return x; });
    t.sync();
    chunk_combine<G>(per_group, [count](float s) { return s / count; });
    t.sync();
    chunk_group_values(gs, per_group, mean);
    t.sync();
    chunk_partials([&mean](float x, int i) { return (x - mean[i]) * (x - mean[i]); });
    t.sync();
    chunk_combine<G>(per_group, [count, eps](float s) { return fx_rsqrt(s / count + eps); });
    t.sync();
    chunk_group_values(gs, per_group, rstd);
    t.sync();
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) group_stats<U>(mean[i], rstd[i]);
    normalise_by_chunk<U, W, B>([&](int i, float& sh, float& sc) {
      sh = mean[i];
      sc = rstd[i];
    });
  }

  template <class F>
  FX_DEVICE void chunk_partials(F f) {
    if (!active) return;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = col(i, 0);
      if (c0 < a.n) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) s += f(v[i][e], i);
        scratch[c0 / VEC] = s;
      }
    }
  }

  template <int G, class F>
  FX_DEVICE void chunk_combine(int per_group, F finish) {
    if (!active) return;
    for (int g = lt; g < G; g += a.rt) {
      float s = 0.0f;
      for (int k = 0; k < per_group; ++k) s += scratch[g * per_group + k];
      scratch[g * per_group] = finish(s);
    }
  }

  // out[i] = the value chunk_combine left for chunk i's group; chunks past the end use the last
  // chunk's group (n % VEC == 0 here), as map() clamps columns
  FX_DEVICE void chunk_group_values(int gs, int per_group, float (&out)[ITEMS]) const {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = col(i, 0) < a.n ? col(i, 0) : a.n - VEC;
      out[i] = scratch[(c0 / gs) * per_group];
    }
  }

  template <typename U, int G, int W, int B>
  FX_DEVICE void group_norm_staged(float eps, int gs) {
    if (active) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (col(i, e) < a.n) scratch[col(i, e)] = v[i][e];
    }
    t.sync();
    if (active) {
      const float count = static_cast<float>(gs);
      for (int g = lt; g < G; g += a.rt) {
        float* x = scratch + g * gs;
        float s = 0.0f;
        for (int k = 0; k < gs; ++k) s += x[k];
        float mean = s / count;
        float ss = 0.0f;
        for (int k = 0; k < gs; ++k) ss += (x[k] - mean) * (x[k] - mean);
        float rstd = fx_rsqrt(ss / count + eps);
        group_stats<U>(mean, rstd);
        for (int k = 0; k < gs; ++k) x[k] = (x[k] - mean) * rstd;
      }
    }
    t.sync();
    map([this](float, int c) { return scratch[c]; });
    t.sync();
    normalise_by_chunk<U, W, B>([](int, float& sh, float& sc) {
      sh = 0.0f;
      sc = 1.0f;
    });
  }

  // BatchNorm with running statistics: (x - rm) / sqrt(rv + eps) * w + b
  template <typename U, int W, int B, int RM, int RV>
  FX_DEVICE void batch_norm_eval(float eps) {
    normalise<U, W, B>([this, eps](int i, auto& shift, auto& scale) {
      running_shift_scale<RM, RV>(i, eps, shift, scale);
    });
  }

  // An eval BatchNorm's shift and scale at chunk i: the running mean and 1 / sqrt(rv + eps)
  // (the forward's, and the backward's: row_grad.cuh's norm_dv)
  template <int RM, int RV>
  FX_DEVICE void running_shift_scale(int i, float eps, float (&shift)[VEC], float (&scale)[VEC]) const {
    float rv[VEC];
    col_chunk<RM>(i, shift);
    col_chunk<RV>(i, rv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) scale[e] = 1.0f / sqrtf(rv[e] + eps);
  }

  // BatchNorm with the batch statistics of the combine kernel
  template <typename U, int W, int B>
  FX_DEVICE void batch_norm_train() {
    normalise<U, W, B>([this](int i, float* shift, float* scale) {
      float m[VEC], r[VEC];
      chunk_of(a.bn_mean, FX_F32, i, m);
      chunk_of(a.bn_rstd, FX_F32, i, r);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        shift[e] = m[e];
        scale[e] = r[e];
      }
    });
  }
};

// ---------------------------------------------------------------------------------------------
// Kernel bodies (shared by the CUDA kernels and the emulator)

// Walks the rows (row segments) of this block; `f(row)` sees every slot, active or not. With
// PREFETCH the next row's loads are issued before f works on the current one (a block that walks
// many rows: the statistics kernel).
template <class Prog, typename T, int ITEMS, bool ALIGNED, bool PREFETCH = false, class F>
FX_DEVICE void for_each_row(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red, F f) {
  using R = Row<Prog, T, ITEMS, ALIGNED>;
  const int lt = t.tid() % a.rt;
  const int lr = t.tid() / a.rt;
  float* scratch = dyn + static_cast<int64_t>(lr) * a.scratch_stride;
  const int64_t units = a.m * a.segs;
  const int64_t stride = static_cast<int64_t>(t.gdim()) * a.rpc;
  int64_t base = static_cast<int64_t>(t.bid()) * a.rpc;
  if constexpr (!PREFETCH) {
    for (; base < units; base += stride) {
      R r(a, t, red, scratch, lt, lr, base + lr);
      r.load();
      f(r);
    }
  } else {
    if (base >= units) return;
    R r(a, t, red, scratch, lt, lr, base + lr);
    r.load();
    for (; base < units; base += stride) {
      R next(a, t, red, scratch, lt, lr, base + stride + lr);  // past the end: inactive, loads nothing
      next.load();
      f(r);
      r.take(next);
    }
  }
}

template <class Prog, typename T, int ITEMS, bool ALIGNED>
FX_DEVICE void apply_body(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red) {
  for_each_row<Prog, T, ITEMS, ALIGNED>(a, t, dyn, red, [](Row<Prog, T, ITEMS, ALIGNED>& r) {
    Prog::prefix(r);
    Prog::rest(r);
  });
}

// Column moments (Welford) of the values entering the BatchNorm stage (rounded to T like the
// normalisation's input; for float32 exactly the reference's), over the rows of one chunk:
// chunk k = block * rpc + lr holds rows k, k + chunks, k + 2 chunks, ...
template <class Prog, typename T, int ITEMS, bool ALIGNED>
FX_DEVICE void stats_body(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red) {
  constexpr int VEC = chunk_elements<Prog, T>();
  float mean[ITEMS][VEC];
  float m2[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) mean[i][e] = m2[i][e] = 0.0f;
  int count = 0;
  constexpr bool kPrefetch = ITEMS * VEC <= 16;  // a second row in registers: only for short ones
  for_each_row<Prog, T, ITEMS, ALIGNED, kPrefetch>(a, t, dyn, red, [&](Row<Prog, T, ITEMS, ALIGNED>& r) {
    Prog::prefix(r);  // ends with the BatchNorm's input, as batch_norm_train() sees it
    if (!r.active) return;
    ++count;
    const float inv = 1.0f / static_cast<float>(count);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float x = r.v[i][e];
        const float d = x - mean[i][e];
        mean[i][e] += d * inv;
        m2[i][e] += d * (x - mean[i][e]);
      }
  });
  const int lt = t.tid() % a.rt;
  const int64_t chunk = static_cast<int64_t>(t.bid()) * a.rpc + t.tid() / a.rt;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int c = (i * a.rt + lt) * VEC + e;
      if (c < a.n) {
        a.part_mean[chunk * a.n + c] = mean[i][e];
        a.part_m2[chunk * a.n + c] = m2[i][e];
      }
    }
}

// Column moments of a set of rows: count, mean, sum of squared deviations.
struct Moments {
  int64_t n;
  float mean;
  float m2;
};

// acc += (nb, mb, m2b) (Chan et al.); order-dependent, so callers merge in a fixed order
FX_DEVICE void merge(Moments& acc, int64_t nb, float mb, float m2b) {
  if (nb == 0) return;
  if (acc.n == 0) {
    acc = Moments{nb, mb, m2b};
    return;
  }
  const int64_t total = acc.n + nb;
  const float wb = static_cast<float>(nb) / static_cast<float>(total);
  const float d = mb - acc.mean;
  acc.mean += d * wb;
  acc.m2 += m2b + d * d * (static_cast<float>(acc.n) * wb);
  acc.n = total;
}

constexpr int kCombineColumns = 32;  // a block: 32 columns x (block / 32) ranges of chunks
constexpr int kCombineBlock = 512;

// Per column: merge the chunks' moments in order, in kCombineBlock / 32 fixed consecutive ranges
// then the ranges in order; write the (2, n) stats output [mean, unbiased var] and the mean and
// 1 / sqrt(var + eps) the row kernel normalises with. Shared memory: kCombineBlock Moments.
template <class Prog>
FX_DEVICE void combine_body(const Args<Prog::kParamSlots>& a, const Thread& t, Moments* parts) {
  const int lane = t.tid() % kCombineColumns;
  const int part = t.tid() / kCombineColumns;
  const int nparts = t.bdim() / kCombineColumns;
  const int64_t c = static_cast<int64_t>(t.bid()) * kCombineColumns + lane;
  const int64_t used = a.chunks < a.m ? a.chunks : a.m;  // chunks that hold rows
  const int64_t per = (used + nparts - 1) / nparts;
  const int64_t k0 = part * per;
  const int64_t k1 = k0 + per < used ? k0 + per : used;
  Moments acc{0, 0.0f, 0.0f};
  if (c < a.n) {
    constexpr int kDepth = 4;  // loads in flight a thread: the merges wait on memory otherwise
    for (int64_t k = k0; k < k1; k += kDepth) {
      float mb[kDepth], m2b[kDepth];
#pragma unroll
      for (int j = 0; j < kDepth; ++j) {
        mb[j] = k + j < k1 ? a.part_mean[(k + j) * a.n + c] : 0.0f;
        m2b[j] = k + j < k1 ? a.part_m2[(k + j) * a.n + c] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kDepth; ++j)
        if (k + j < k1) merge(acc, (a.m - 1 - (k + j)) / a.chunks + 1, mb[j], m2b[j]);
    }
  }
  parts[t.tid()] = acc;
  t.sync();
  if (part != 0 || c >= a.n) return;
  Moments total{0, 0.0f, 0.0f};
  for (int p = 0; p < nparts; ++p) {
    const Moments& q = parts[p * kCombineColumns + lane];
    merge(total, q.n, q.mean, q.m2);
  }
  const float m = static_cast<float>(a.m);
  a.stats[c] = total.mean;
  a.stats[a.n + c] = total.m2 / (m - 1.0f);
  a.bn_mean[c] = total.mean;
  a.bn_rstd[c] = 1.0f / sqrtf(total.m2 / m + Prog::kBatchEps);
}

// ---------------------------------------------------------------------------------------------
// Launching. Kernels of one chunk count (ITEMS) are compiled in their own translation unit
// (FX_ITEMS_UNIT, see codegen) so that a module's units build in parallel; the main unit holds
// the plan, the combine kernel and the exported entry points.

// Threads a block at most: rows wider than 256 chunks take 512 threads (N = 32768 at 64 floats a
// thread); the bound gives the compiler 128 registers a thread.
constexpr int kMaxBlock = 512;

#if !defined(FX_EMULATE)
extern __shared__ float fx_dynamic_smem[];

// Blocks of kMaxBlock threads an SM must fit: two for the kernels of one 16-byte chunk a thread
// (at most 64 registers a thread), one above (128 registers for up to 64 floats a thread).
template <int ITEMS, int VEC>
constexpr int min_blocks() { return ITEMS * VEC <= 8 ? 2 : 1; }

template <class Prog, typename T, int ITEMS, bool ALIGNED>
__global__ void __launch_bounds__(kMaxBlock, min_blocks<ITEMS, chunk_elements<Prog, T>()>())
    apply_kernel(const __grid_constant__ Args<Prog::kParamSlots> a) {
  __shared__ float red[FX_RED_FLOATS];
  const Thread t;
  apply_body<Prog, T, ITEMS, ALIGNED>(a, t, fx_dynamic_smem, red);
}

template <class Prog, typename T, int ITEMS, bool ALIGNED>
__global__ void __launch_bounds__(kMaxBlock, min_blocks<ITEMS, chunk_elements<Prog, T>()>())
    stats_kernel(const __grid_constant__ Args<Prog::kParamSlots> a) {
  __shared__ float red[FX_RED_FLOATS];
  const Thread t;
  stats_body<Prog, T, ITEMS, ALIGNED>(a, t, fx_dynamic_smem, red);
}

template <class Prog>
__global__ void __launch_bounds__(kCombineBlock) combine_kernel(const __grid_constant__ Args<Prog::kParamSlots> a) {
  __shared__ Moments parts[kCombineBlock];
  const Thread t;
  combine_body<Prog>(a, t, parts);
}

// kernel<<<grid, block, smem, stream>>>(args), opting in to more than 48 KiB of shared memory
template <typename A>
inline const char* launch_kernel(void (*kernel)(A), int64_t grid, int block, size_t smem, void* stream,
                                 const A& args) {
  if (grid <= 0) return nullptr;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return cudaGetErrorString(e);
  }
  kernel<<<static_cast<unsigned>(grid), block, smem, static_cast<cudaStream_t>(stream)>>>(args);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}
#else
// The emulator's launch: body(thread, dynamic smem, static smem) for every thread of the grid
template <class Body>
inline const char* emulate_kernel(int64_t grid, int block, size_t smem, const Body& body) {
  static thread_local std::string message;
  if (grid <= 0) return nullptr;
  try {
    emulate_launch(grid, block, smem, body);
  } catch (const std::exception& e) {
    message = e.what();
    return message.c_str();
  }
  return nullptr;
}
#endif

}  // namespace fx

#include "row_grad.cuh"

namespace fx {

struct Launch {  // one kernel launch's geometry
  int64_t grid;
  int block;
  size_t smem;
  void* stream;
};

// The row kernels of one ITEMS value; defined only in that value's translation unit.
template <class Prog, typename T, int ITEMS>
struct ItemsUnit {
  using A = Args<Prog::kParamSlots>;
  static const char* stats(const A& a, bool aligned, const Launch& l);
  static const char* apply(const A& a, bool aligned, const Launch& l);
  static const char* grad_rows(const A& a, bool aligned, const Launch& l);  // row programs' backward
};

#if defined(FX_ITEMS_UNIT)
template <class Prog, typename T, int ITEMS>
const char* ItemsUnit<Prog, T, ITEMS>::stats(const A& a, bool aligned, const Launch& l) {
  if constexpr (!Prog::kBatchTrain) {
    return "fxfuse: statistics kernel of a program without a training BatchNorm";
  } else {
#if !defined(FX_EMULATE)
    return aligned ? launch_kernel(&stats_kernel<Prog, T, ITEMS, true>, l.grid, l.block, l.smem, l.stream, a)
                   : launch_kernel(&stats_kernel<Prog, T, ITEMS, false>, l.grid, l.block, l.smem, l.stream, a);
#else
    return aligned ? emulate_kernel(l.grid, l.block, l.smem,
                                    [&a](const Thread& t, float* dyn, float* red) {
                                      stats_body<Prog, T, ITEMS, true>(a, t, dyn, red);
                                    })
                   : emulate_kernel(l.grid, l.block, l.smem, [&a](const Thread& t, float* dyn, float* red) {
                       stats_body<Prog, T, ITEMS, false>(a, t, dyn, red);
                     });
#endif
  }
}

template <class Prog, typename T, int ITEMS>
const char* ItemsUnit<Prog, T, ITEMS>::apply(const A& a, bool aligned, const Launch& l) {
#if !defined(FX_EMULATE)
  return aligned ? launch_kernel(&apply_kernel<Prog, T, ITEMS, true>, l.grid, l.block, l.smem, l.stream, a)
                 : launch_kernel(&apply_kernel<Prog, T, ITEMS, false>, l.grid, l.block, l.smem, l.stream, a);
#else
  return aligned ? emulate_kernel(l.grid, l.block, l.smem,
                                  [&a](const Thread& t, float* dyn, float* red) {
                                    apply_body<Prog, T, ITEMS, true>(a, t, dyn, red);
                                  })
                 : emulate_kernel(l.grid, l.block, l.smem, [&a](const Thread& t, float* dyn, float* red) {
                     apply_body<Prog, T, ITEMS, false>(a, t, dyn, red);
                   });
#endif
}

template <class Prog, typename T, int ITEMS>
const char* ItemsUnit<Prog, T, ITEMS>::grad_rows(const A& a, bool aligned, const Launch& l) {
  if constexpr (!has_row_grad<Prog>()) {
    return "fxfuse: row backward kernel of a program without one";
  } else {
#if !defined(FX_EMULATE)
    return aligned ? launch_kernel(&row_grad_kernel<Prog, T, ITEMS, true>, l.grid, l.block, l.smem, l.stream, a)
                   : launch_kernel(&row_grad_kernel<Prog, T, ITEMS, false>, l.grid, l.block, l.smem, l.stream, a);
#else
    return aligned ? emulate_kernel(l.grid, l.block, l.smem,
                                    [&a](const Thread& t, float* dyn, float* red) {
                                      row_grad_body<Prog, T, ITEMS, true>(a, t, dyn, red);
                                    })
                   : emulate_kernel(l.grid, l.block, l.smem, [&a](const Thread& t, float* dyn, float* red) {
                       row_grad_body<Prog, T, ITEMS, false>(a, t, dyn, red);
                     });
#endif
  }
}
#endif  // FX_ITEMS_UNIT

struct Plan {
  int items;  // 16-byte chunks a thread
  int rt;     // threads a row (a row segment)
  int rpc;    // rows (row segments) a block
  int block;  // threads a block
  int segs;   // segments a row
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Shared-memory floats a row needs for a group norm of `groups` groups (the max over stages)
inline int64_t group_norm_scratch(int64_t so_far, int64_t n, int vec, int64_t groups) {
  const int64_t gs = groups > 0 ? n / groups : 0;
  const int64_t need = group_in_lanes(n, groups, vec) ? 0 : (gs % vec == 0) ? ceil_div(n, vec) : n;
  return need > so_far ? need : so_far;
}

// The chunk counts a thread that a program's units cover: 1, 2, 4, ... 64 / VEC.
template <class Prog, typename T>
constexpr int max_items() { return 64 / chunk_elements<Prog, T>(); }

template <class Prog, typename T>
struct Launcher {
  static constexpr int VEC = chunk_elements<Prog, T>();
  static constexpr int kMaxItems = max_items<Prog, T>();
  using A = Args<Prog::kParamSlots>;

  // Whole rows: the fewest chunks a thread that keep a row within 256 threads; failing that,
  // within kMaxBlock threads (programs with row statistics: fewer warps a row, cheaper barriers).
  // The statistics kernel has no row statistics and goes straight to kMaxBlock (`wide`).
  static bool row_plan(int64_t n, Plan* p, bool wide = false) {
    if (n < 1 || n > FX_MAX_N) return false;
    const int64_t chunks = ceil_div(n, VEC);
    for (int pass = wide ? 1 : 0; pass < 2; ++pass) {
      for (int items = 1; items <= kMaxItems; items *= 2) {
        const int64_t need = ceil_div(chunks, items);
        const int64_t rt = threads_for(need);
        const int64_t limit = pass == 0 ? 256 : kMaxBlock;
        if (rt > limit) continue;
        *p = Plan{items, static_cast<int>(rt), rt >= 256 ? 1 : static_cast<int>(256 / rt), 0, 1};
        p->block = p->rt * p->rpc;
        return true;
      }
    }
    return false;
  }

  // The apply kernel's plan. A row-local program (no statistic wider than a warp) is an
  // elementwise pass in all but name: Prog::kLocalItems chunks a thread (the tuning flag may say
  // otherwise) and rows cut into segments of up to 256 threads (a power of two, or a multiple of
  // 32: whole groups), so that many small blocks keep loads in flight and registers few; whole
  // rows would hold 16-64 values a thread.
  static bool apply_plan(int64_t m, int64_t n, Plan* p, int32_t flags = 0) {
    if (!Prog::row_local(n, VEC)) return row_plan(n, p);
    if (n < 1 || n > FX_MAX_N) return false;
    const int64_t chunks = ceil_div(n, VEC);
    const int tuned = (flags & FX_PLAN_ITEMS_MASK) >> FX_PLAN_ITEMS_SHIFT;
    int items = tuned ? tuned : Prog::kLocalItems;
    // a power of two the units cover, and whole warps a segment (so whole groups a segment)
    if (items > kMaxItems || (items & (items - 1)) || ceil_div(chunks, items) < 32) items = 1;
    const int64_t need = ceil_div(chunks, items);
    const int64_t rt = need >= 256 ? 256 : threads_for(need);
    const int64_t segs = ceil_div(chunks, rt * items);
    if (segs > 1 && m * segs >= (int64_t{1} << 32)) return row_plan(n, p);  // Row's 32-bit FastDiv
    *p = Plan{items, static_cast<int>(rt), rt >= 256 ? 1 : static_cast<int>(256 / rt), 0, static_cast<int>(segs)};
    p->block = p->rt * p->rpc;
    return true;
  }

  // Threads for `need` chunks of a row: a power of two up to a warp, else whole warps.
  static int64_t threads_for(int64_t need) {
    int64_t rt = 1;
    if (need <= 32) {
      while (rt < need) rt *= 2;
      return rt;
    }
    return ceil_div(need, 32) * 32;
  }

  static int64_t apply_grid(int64_t m, const Plan& p) {
    const int64_t g = ceil_div(m * p.segs, p.rpc);
    return g < (int64_t{1} << 30) ? g : (int64_t{1} << 30);
  }

  // Enough blocks to fill the device once; each block's rows form fixed chunks.
  static int64_t stats_grid(int64_t m, const Plan& p, int32_t sm_count) {
    const int64_t per_sm = 2048 / p.block > 0 ? 2048 / p.block : 1;
    const int64_t cap = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * per_sm;
    const int64_t g = apply_grid(m, p);
    return g < cap ? g : cap;
  }

  static size_t smem_bytes(int64_t n, const Plan& p) {
    return static_cast<size_t>(p.rpc) * static_cast<size_t>(Prog::scratch_floats(n, VEC)) * sizeof(float);
  }

  static int32_t supports(int64_t m, int64_t n, int32_t smem_optin) {
    Plan rows, apply;
    if (m < 1 || !row_plan(n, &rows, true) || !apply_plan(m, n, &apply)) return 0;
    if (Prog::kBatchTrain && m < 2) return 0;
    if (!Prog::groups_ok(n)) return 0;
    const size_t smem = smem_bytes(n, apply) > smem_bytes(n, rows) ? smem_bytes(n, apply) : smem_bytes(n, rows);
    if (smem > static_cast<size_t>(smem_optin)) return 0;
    return 1;
  }

  static int64_t workspace_floats(int64_t m, int64_t n, int32_t sm_count) {
    Plan p;
    if (!Prog::kBatchTrain || !row_plan(n, &p, true)) return 0;
    const int64_t chunks = stats_grid(m, p, sm_count) * p.rpc;
    return 2 * chunks * n + 2 * n;
  }

  static const char* launch(const FxLaunch* L, void* stream) {
    Plan rows, apply;
    if (!row_plan(L->n, &rows, true) || !apply_plan(L->m, L->n, &apply, L->flags)) {
      return "fxfuse: row width outside the kernel's range";
    }
    if (L->num_params != Prog::kNumParams) return "fxfuse: wrong number of parameters";
    A a = {};
    a.y = L->y;
    a.out = L->out;
    a.stats = L->stats;
    set_params<Prog>(a, L->params);
    a.m = L->m;
    a.n = static_cast<int32_t>(L->n);
    a.scratch_stride = static_cast<int32_t>(Prog::scratch_floats(L->n, VEC));
    a.flags = L->flags;
    const bool out_vec = Prog::kOutKind != FX_OUT_ROWS || reinterpret_cast<uintptr_t>(L->out) % 16 == 0;
    const bool aligned = L->n % VEC == 0 && reinterpret_cast<uintptr_t>(L->y) % 16 == 0 && out_vec;
    if constexpr (Prog::kBatchTrain) {
      const int64_t grid = stats_grid(L->m, rows, L->sm_count);
      with_plan(a, rows);
      a.chunks = grid * rows.rpc;
      float* ws = L->workspace;
      a.part_mean = ws;
      a.part_m2 = ws + a.chunks * L->n;
      a.bn_mean = ws + 2 * a.chunks * L->n;
      a.bn_rstd = ws + 2 * a.chunks * L->n + L->n;
      const Launch l{grid, rows.block, smem_bytes(L->n, rows), stream};
      if (const char* err = with_items(rows.items, [&](auto items) {
            return ItemsUnit<Prog, T, decltype(items)::value>::stats(a, aligned, l);
          }))
        return err;
      if (const char* err = combine(a, Launch{ceil_div(L->n, kCombineColumns), kCombineBlock, 0, stream})) return err;
    }
    with_plan(a, apply);
    const Launch l{apply_grid(L->m, apply), apply.block, smem_bytes(L->n, apply), stream};
    return with_items(apply.items, [&](auto items) {
      return ItemsUnit<Prog, T, decltype(items)::value>::apply(a, aligned, l);
    });
  }

  static void with_plan(A& a, const Plan& p) {
    a.rt = p.rt;
    a.rpc = p.rpc;
    a.segs = p.segs;
    const FastDiv d = FastDiv::of(static_cast<uint32_t>(p.segs));
    a.segs_magic = d.magic;
    a.segs_shift = d.shift;
  }

  // f(std::integral_constant<int, items>) for a chunk count this element type's units cover
  template <class F>
  static const char* with_items(int items, F f) {
    switch (items) {
      case 1: return f(std::integral_constant<int, 1>{});
      case 2: return f(std::integral_constant<int, 2>{});
      case 4: return f(std::integral_constant<int, 4>{});
      case 8: return f(std::integral_constant<int, 8>{});
      case 16:
        if constexpr (kMaxItems >= 16) return f(std::integral_constant<int, 16>{});
        return "fxfuse: bad launch plan";
      default: return "fxfuse: bad launch plan";
    }
  }

  static const char* combine(const A& a, const Launch& l) {
#if !defined(FX_EMULATE)
    return launch_kernel(&combine_kernel<Prog>, l.grid, l.block, l.smem, l.stream, a);
#else
    const size_t smem = kCombineBlock * sizeof(Moments);
    return emulate_kernel(l.grid, l.block, smem, [&a](const Thread& t, float* dyn, float*) {
      combine_body<Prog>(a, t, reinterpret_cast<Moments*>(dyn));
    });
#endif
  }
};

}  // namespace fx

#include "grad_epilogue.cuh"

#if defined(_WIN32)
#define FX_EXPORT __declspec(dllexport)
#else
#define FX_EXPORT __attribute__((visibility("default")))
#endif

// In the main unit: `extern "C" const FxProgramInfo* ENTRY()` for program PROG on element type T.
#define FX_DEFINE_PROGRAM(PROG, T, ENTRY)                                                              \
  extern "C" FX_EXPORT const FxProgramInfo* ENTRY() {                                                \
    static const FxProgramInfo info = {FX_ABI_VERSION,                                               \
                                       fx::DType<T>::kCode,                                          \
                                       fx::DType<typename PROG::Out>::kCode,                         \
                                       PROG::kOutKind,                                               \
                                       PROG::kBatchTrain ? 1 : 0,                                    \
                                       PROG::kChannelsDim1 ? 1 : 0,                                  \
                                       PROG::kNumParams,                                             \
                                       PROG::kParamIsCol,                                            \
                                       &fx::Launcher<PROG, T>::supports,                             \
                                       &fx::Launcher<PROG, T>::workspace_floats,                     \
                                       &fx::Launcher<PROG, T>::launch,                               \
                                       PROG::kGradKind != fx::kNoGrad ? 1 : 0,                       \
                                       &fx::GradLauncher<PROG, T>::chunks,                           \
                                       &fx::GradLauncher<PROG, T>::launch};                          \
    return &info;                                                                                    \
  }

// In the unit of ITEMS (compiled with FX_ITEMS_UNIT defined): that unit's kernels.
#define FX_DEFINE_ITEMS_UNIT(PROG, T, ITEMS) template struct fx::ItemsUnit<PROG, T, ITEMS>;
